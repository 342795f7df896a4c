// The batch-1 decode megakernel: one persistent cooperative launch runs a whole decode step of a
// Llama 3 / Qwen3 dense model, from the embedding lookup to the greedy argmax.
//
// Per layer, four stages. Two end at grid barriers (each RMSNorm needs the whole residual stream);
// attention on a KV head waits only for that head's q, k and v rows (HeadRows), and O on a slice
// of the attention channels only for the attention of the KV heads those channels belong to:
//   1. residual + down, RMSNorm (recomputed per CTA into shared memory) + QKV GEMV -> qkv
//   2. q/k norm (Qwen3) + RoPE + KV-cache append + split attention                -> partials
//      (RoPE's cos/sin are computed once per step into shared memory: the same for every layer)
//   3. the CTA's slice of the attention channels, folded from the splits' partials, then O over
//      that slice (O's weight transposed): fp32 sums over the CTAs                  -> o_sums
//   4. residual + down + O (each CTA writes its slice of the new residual stream, hidden), RMSNorm
//      + gate/up GEMV + SiLU * up of the CTA's slice of the intermediate rows (in shared memory),
//      then down over that slice: fp32 sums over the CTAs                         -> down_sums
//      (the next layer's stages 1 and 4 add them to the residual stream)
// then final RMSNorm + LM head (logits out, for a sampler) + argmax: block partials, and the last
// CTA to finish reduces them and advances the step state. Position and input token are read from
// device memory, so one captured CUDA graph of this launch replays for every step.
// Weights need nothing from the stage before them, so each GEMV's first weight chunk per warp is
// loaded while its CTA waits at the grid barrier or the counts in front of it (prefetch_weights,
// prefetch_transposed), and so is the first block of keys and values of each warp's attention
// while the CTA waits for its head's QKV rows (issue_first_block: a split's keys come from earlier
// steps); a residual that an epilogue adds is loaded before the dot product it waits for
// (gemv_row_pairs' operand).
// Where the QKV projection is small beside L2, the rest of the next layer's QKV rows is fetched
// into L2 at the MLP's closing barrier (kQkvRowsToL2).
#include "attention.cuh"
#include "common.cuh"
#include "gemv.cuh"

namespace megakernel {

// Model dimensions as compile-time constants: every loop bound and buffer size below is static.
template <int kHidden, int kHeads, int kKvHeads, int kHeadDim, int kIntermediate, int kVocab, int kLayers,
          bool kQkNorm>
struct ModelShape {
  static constexpr int hidden = kHidden;
  static constexpr int heads = kHeads;
  static constexpr int kv_heads = kKvHeads;
  static constexpr int head_dim = kHeadDim;
  static constexpr int intermediate = kIntermediate;
  static constexpr int vocab = kVocab;
  static constexpr int layers = kLayers;
  static constexpr bool qk_norm = kQkNorm;
  static constexpr int group = kHeads / kKvHeads;
  static constexpr int q_dim = kHeads * kHeadDim;
  static constexpr int kv_dim = kKvHeads * kHeadDim;
  static constexpr int qkv_dim = q_dim + 2 * kv_dim;
  static constexpr int max_input = kHidden > q_dim ? kHidden : q_dim;  // RMSNorm output or attention output
  static_assert(kHeads % kKvHeads == 0, "heads must be a multiple of kv_heads");
  static_assert(kHidden % kVecElems == 0 && kIntermediate % kVecElems == 0, "dims must be multiples of 8");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim must be 64, 128 or 256");
};

// Step state in device memory (int32 each).
enum StateSlot { kStateToken = 0, kStatePos = 1, kStateArgmax = 2, kStateSlots = 4 };
// Counters in device memory (uint32, zero-initialised once): the grid barrier, the argmax's count,
// then the counts of CTAs that have written each KV head's QKV rows, then of the attention splits
// that have written each KV head's partials (kv_heads each; zeroed by the step's last CTA).
enum CounterSlot { kCounterBarrier = 0, kCounterArgmaxDone = 1, kCounterHeadRows = 2 };

// One layer's weights (bf16, row-major; wo and w_down as their transposes) and KV cache row, as a
// table in device memory.
struct LayerWeights {
  const bf16* attn_norm;  // [H]
  const bf16* wq;         // [heads * head_dim, H]
  const bf16* wk;         // [kv_heads * head_dim, H]
  const bf16* wv;         // [kv_heads * head_dim, H]
  const bf16* q_norm;     // [head_dim] (Qwen3) or null
  const bf16* k_norm;     // [head_dim] (Qwen3) or null
  const bf16* wo_t;       // [heads * head_dim, H]: the O projection's weight, transposed
  const bf16* mlp_norm;   // [H]
  const bf16* w_gate;     // [I, H]
  const bf16* w_up;       // [I, H]
  const bf16* w_down_t;   // [I, H]: the down projection's weight, transposed
  bf16* k_cache;          // [kv_heads, max_seq, head_dim] of this sequence's cache row
  bf16* v_cache;
};

// The weight rows of each GEMV, as pairs (see gemv_row_pairs).

// Row r of the q, k and v projections stacked: rows [0, q_dim), then k, then v.
template <class S>
__device__ __forceinline__ const bf16* qkv_row(const LayerWeights& w, int r) {
  return r < S::q_dim               ? w.wq + static_cast<size_t>(r) * S::hidden
         : r < S::q_dim + S::kv_dim ? w.wk + static_cast<size_t>(r - S::q_dim) * S::hidden
                                    : w.wv + static_cast<size_t>(r - S::q_dim - S::kv_dim) * S::hidden;
}

// KV head g's rows of the QKV projection - its group's query heads, its key, its value - are
// computed by CTAs [g * P, (g + 1) * P) of the grid, P = grid / kv_heads (the grid % kv_heads
// left-over CTAs run the stage with no rows), which then count themselves on g's counter:
// attention on head g waits for P counts per layer instead of a grid barrier, so it starts as soon
// as its own P CTAs are done. Needs grid >= kv_heads (the launcher checks).
template <class S>
struct HeadRows {
  static constexpr int kRows = (S::group + 2) * S::head_dim;
  int head;       // the KV head whose rows this CTA computes
  CtaRange ctas;  // this CTA's place among the head's P CTAs

  __device__ static HeadRows of_this_cta() {
    const int per_head = static_cast<int>(gridDim.x) / S::kv_heads, cta = blockIdx.x, head = cta / per_head;
    if (head < S::kv_heads) return HeadRows{head, CtaRange{cta % per_head, per_head}};
    // A left-over CTA: a place past every row, so it streams none (and prefetches a row that the
    // last head's CTAs read anyway). A branch-free stage: skipping it made the kernel spill.
    return HeadRows{S::kv_heads - 1, CtaRange{kRows, per_head}};
  }
  __device__ bool computes_rows() const { return ctas.index < ctas.count; }
  // The head's row i (of kRows) as a row of the stacked q, k and v projection (and of qkv).
  __device__ int stacked(int i) const {
    constexpr int kQueryRows = S::group * S::head_dim;
    if (i < kQueryRows) return head * kQueryRows + i;
    i -= kQueryRows;
    return S::q_dim + (i < S::head_dim ? 0 : S::kv_dim - S::head_dim) + head * S::head_dim + i;
  }
};

template <class S>
struct QkvRows {  // pair p = the head's rows 2p and 2p + 1
  LayerWeights w;
  HeadRows<S> rows;
  __device__ RowPair operator()(int p) const {
    const bf16* base = qkv_row<S>(w, rows.stacked(2 * p));  // head_dim is even: a pair never straddles two matrices
    return RowPair{base, base + S::hidden};
  }
};

template <class S>
struct QkvRowHalves {  // unit r = the head's row r as its two halves, each against its half of x
  LayerWeights w;
  HeadRows<S> rows;
  __device__ RowPair operator()(int r) const {
    const bf16* base = qkv_row<S>(w, rows.stacked(r));
    return RowPair{base, base + S::hidden / 2, S::hidden / 2 / kVecElems};
  }
};

// The QKV GEMV hands out single rows (as two half-row streams, kQkvByRows) instead of row pairs
// when a half row is whole chunks of loads: then a row costs half a pair, and rows fill a last
// round that pairs leave partial. Llama-3.1-8B on 132 SMs: a head's 384 pairs for its 16 CTAs'
// 256 warps take 2 rounds of 4 chunks per warp, its 768 rows take 3 rounds of 2. (Decided at
// compile time: choosing at run time keeps both variants' registers live and spills.)
template <class S>
constexpr bool kQkvByRows = S::hidden % (2 * kVecElems * kWarpSize * kLoadsInFlight) == 0;

template <class S>
struct GateUpRows {  // pair i = (gate row i, up row i): one warp produces SiLU(gate) * up at once
  LayerWeights w;
  __device__ RowPair operator()(int i) const {
    const size_t row = static_cast<size_t>(i) * S::hidden;
    return RowPair{w.w_gate + row, w.w_up + row};
  }
};

// The inputs of the two transposed GEMVs - O's attention channels (q_dim) and the MLP's
// intermediate rows - are split over the CTAs in contiguous slices (cta_slice); a slice's inputs
// stay in shared memory, sized for a grid of at least kMinCtas (the launcher checks). (Slices are
// recomputed where needed: a value kept live through attention costs a register there.)
constexpr int kMinCtas = 96;
constexpr int kSliceRowsAlign = 4;  // a 16-byte multiple of floats: no padding after the array

// O's output columns are split in kOColumnGroups groups of whole 16-byte vectors per warp (4 where
// hidden allows): CTA c adds to group c % groups, over a slice of the q_dim channels shared with
// the other CTAs of its group. Each output then takes a vector atomic from grid / groups CTAs, not
// from all of them: the CTAs end O within a microsecond of each other, and their atomics, all at
// once, queued at L2 behind the grid barrier's fence.
template <class S>
constexpr int kOColumnGroups = S::hidden % (4 * kWarps * kVecElems) == 0   ? 4
                               : S::hidden % (2 * kWarps * kVecElems) == 0 ? 2
                                                                           : 1;
struct OTile {
  CtaSlice channels;  // rows of wo_t
  int column;         // the first output column of the CTA's group
};

template <class S>
__device__ __forceinline__ OTile o_tile() {
  constexpr int kGroups = kOColumnGroups<S>;
  const int group = blockIdx.x % kGroups, index = blockIdx.x / kGroups;
  const int count = (static_cast<int>(gridDim.x) - group + kGroups - 1) / kGroups;  // the group's CTAs
  return OTile{slice_of<S::q_dim>(index, count), group * (S::hidden / kGroups)};
}

// O on a tile waits for the attention of the KV heads its channels belong to (a KV head's group
// of query heads is group * head_dim consecutive channels): one or two heads on the 8B and 1B
// shapes, none for an empty slice. `attended` counts each head's splits that have written their
// partials.
template <class S>
__device__ __forceinline__ void wait_for_attention(const unsigned* attended, const OTile& tile, unsigned target) {
  constexpr int kHeadChannels = S::group * S::head_dim;
  const int first = tile.channels.first / kHeadChannels;
  const int end = tile.channels.rows == 0 ? first : (tile.channels.first + tile.channels.rows - 1) / kHeadChannels + 1;
  wait_for_counts(attended, first, end, target);
}

template <class S>
constexpr int kSlicedInputs =
    S::intermediate > S::q_dim * kOColumnGroups<S> ? S::intermediate : S::q_dim * kOColumnGroups<S>;
template <class S>
constexpr int kMaxSliceRows =
    ((kSlicedInputs<S> + kMinCtas - 1) / kMinCtas + kSliceRowsAlign - 1) / kSliceRowsAlign * kSliceRowsAlign;

// Warps per CTA that load their first chunk of O's rows while it waits for its KV heads'
// attention: all of them where that chunk is the CTA's whole share of O (Llama-3.2-1B on 132 SMs:
// 62 rows of 64), so that after the wait O waits for nothing but the fold (measured on H200, run
// 82: 1B 1.3-2.2% faster than with half); half of them where O has more chunks, as before the
// other GEMVs (prefetch_weights): all 16 warps' chunks, 8.4 MB over the grid, reach HBM as one
// burst that the waits' polls queue behind (run 82, behind a grid barrier: the 8B shapes up to 1.6%
// slower with all 16 in 3 cases of 4; run 85, behind per-head counts: O shorter and attention as
// much longer, within 0.2%).
template <class S>
__device__ __forceinline__ int o_ahead_warps(const OTile& tile) {
  return tile.channels.rows <= TransposedTiling<S::hidden / kOColumnGroups<S>>::kRowsPerChunk ? kWarps
                                                                                              : kPrefetchWarps;
}

template <class S>
struct GateUpSliceRows {  // pair p = the slice's gate and up row p
  LayerWeights w;
  int first;
  __device__ RowPair operator()(int p) const { return GateUpRows<S>{w}(first + p); }
};

template <class S>
struct LmHeadRows {
  const bf16* lm_head;
  __device__ RowPair operator()(int p) const {
    const int r0 = 2 * p, r1 = min(2 * p + 1, S::vocab - 1);  // an odd vocab repeats its last row
    return RowPair{lm_head + static_cast<size_t>(r0) * S::hidden, lm_head + static_cast<size_t>(r1) * S::hidden};
  }
};

template <class S>
struct SharedStorage {
  union {
    alignas(16) bf16 x[S::max_input];  // the GEMV input vector of the current stage
    AttentionShared<S> attention;
  };
  float slice_in[kMaxSliceRows<S>];  // a transposed GEMV's inputs: O's attention channels, SiLU(gate) * up
  RopeTable<S> rope;
  float reduce[kWarps];
  unsigned long long best[kWarps];
  float2 split_sums[kWarps];  // per-warp partial dots of a row pair shared by warps (gemv_row_pairs)
};

// The QKV rows that prefetch_qkv leaves in HBM are fetched into L2 by the TMA (prefetch_rest_to_l2)
// at the MLP's closing barrier, while the MLP's last CTAs leave HBM partly idle, on shapes whose
// whole QKV projection is small beside L2 (Llama-3.2-1B: 12.6 MB; the 8B shapes' 50 MB would
// evict one another): QKV's loads after the barrier then wait on L2, not HBM. (Measured on H200,
// run 57: 1B's QKV 0.7 µs per layer shorter, its MLP 0.7 longer, the step 0.4% faster at 1,024.)
constexpr size_t kQkvToL2MaxBytes = 16u << 20;
template <class S>
constexpr bool kQkvRowsToL2 = static_cast<size_t>(S::qkv_dim) * S::hidden * sizeof(bf16) <= kQkvToL2MaxBytes;

constexpr int kStaticSharedLimit = 48 * 1024;
constexpr int kStagesPerLayer = 4;  // O and the MLP end at grid barriers, QKV and attention at per-head counts

// A stage ends with every CTA arriving at the grid barrier; `between` runs after this CTA arrives and
// before it waits (loads that need nothing from the stage), then CTA 0 stamps the next start. (A
// function, not a generic lambda in the kernel: NVRTC 13.0 compiles a generic lambda as host code.)
template <bool kTiming, class Between>
__device__ __forceinline__ void end_stage(StageTimer<kTiming>& timer, unsigned* barrier, Between between) {
  timer.arrive();
  grid_barrier(barrier, between);
  timer.mark();
}

template <class S, bool kTiming>
__global__ void __launch_bounds__(kThreads, 1)
    decode_step(const LayerWeights* __restrict__ layers, const bf16* __restrict__ embed,
                const bf16* __restrict__ final_norm, const bf16* __restrict__ lm_head,
                const float* __restrict__ rope_inv_freq, int* state, unsigned* counters, bf16* hidden, bf16* qkv,
                float* projection_sums, float* attn_partials, float* logits,
                unsigned long long* argmax_partials, unsigned long long* stage_stamps, float rms_eps, int max_seq,
                int greedy) {
  static_assert(sizeof(SharedStorage<S>) <= kStaticSharedLimit, "shape needs more than 48 KB of shared memory");
  constexpr int kHeadPairs = HeadRows<S>::kRows / 2, kLmHeadPairs = (S::vocab + 1) / 2;
  __shared__ SharedStorage<S> sh;
  // stage_stamps: kStamps stamps of CTA 0, then kBarriers x grid arrivals (see StageTimer)
  constexpr int kBarriers = kStagesPerLayer * S::layers, kStamps = kBarriers + 2;
  StageTimer<kTiming> timer{stage_stamps, stage_stamps + kStamps};
  timer.mark();

  const int token = __ldcg(state + kStateToken);
  const int pos = __ldcg(state + kStatePos);
  // Each replay advances the position on the device, where the host's checks (set_position, the
  // engine's context limit) do not see it: a replay at max_seq would write its key and value into
  // the next KV head's rows, or past the cache. Every thread reads the same values, so the whole
  // grid stops here; the step then fails on the host instead of corrupting the cache in silence.
  if (pos < 0 || pos >= max_seq || token < 0 || token >= S::vocab) __trap();
  const bf16* embed_row = embed + static_cast<size_t>(token) * S::hidden;
  sh.rope.fill(rope_inv_freq, pos);  // published by layer 0's RMSNorm's __syncthreads
  unsigned* barrier = counters + kCounterBarrier;
  unsigned* head_rows_done = counters + kCounterHeadRows;
  unsigned* head_attended = head_rows_done + S::kv_heads;
  const HeadRows<S> head_rows = HeadRows<S>::of_this_cta();
  // projection_sums: [5][hidden] fp32: zeros (layer 0's previous down), layer l's down sums in
  // row 1 + l % 2, its O sums in row 3 + l % 2. Each CTA zeroes a slice of a row before the stage
  // that adds to it, and after the grid barrier that ends the reads of the values before: in layer
  // l's O stage, layer l's down row (its last reads, as the previous down, were in layer l - 1's
  // MLP stage) and layer l + 1's O row (read last in layer l - 1's MLP stage; layer l + 1's O adds
  // come after layer l's barrier before the MLP, where a zeroing in layer l + 1's own QKV stage
  // would be ordered before them by no barrier). The next step's layer 0 O row: at the LM head.
  const auto down_sums_of = [&](int layer) { return projection_sums + (1 + layer % 2) * S::hidden; };
  const auto previous_down_of = [&](int l) -> const float* { return l == 0 ? projection_sums : down_sums_of(l - 1); };
  const auto o_sums_of = [&](int layer) { return projection_sums + (3 + layer % 2) * S::hidden; };
  const auto zero_slice = [&](float* sums) {
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < S::hidden; i += gridDim.x * kThreads) sums[i] = 0.f;
  };
  // hidden: [2][hidden] bf16, the residual stream after layer l's attention in row l % 2, written
  // by layer l's MLP stage (each CTA its slice) while every CTA reads the row of layer l - 1; the
  // stream before layer l is that row plus bf16(previous_down_of(l)) (layer 0: the embedding).
  constexpr int kOColumns = S::hidden / kOColumnGroups<S>;
  const auto o_rows_of = [](const LayerWeights& w, OTile tile) {
    return w.wo_t + static_cast<size_t>(tile.channels.first) * S::hidden + tile.column;
  };
  const auto residual_of = [&](int l) -> const bf16* { return l == 0 ? embed_row : hidden + ((l - 1) % 2) * S::hidden; };
  // Each GEMV's first weight chunk per warp, loaded between arriving at the grid barrier before the
  // GEMV and waiting on it (layer 0's QKV: before its RMSNorm).
  const auto prefetch_qkv = [&](const LayerWeights& w) {
    if constexpr (kQkvByRows<S>)
      return prefetch_weights<S::hidden / 2>(HeadRows<S>::kRows, head_rows.ctas, QkvRowHalves<S>{w, head_rows});
    else
      return prefetch_weights<S::hidden>(kHeadPairs, head_rows.ctas, QkvRows<S>{w, head_rows});
  };
  const auto prefetch_qkv_rest_to_l2 = [&](const LayerWeights& w) {
    if constexpr (kQkvByRows<S>)
      prefetch_rest_to_l2<S::hidden / 2>(HeadRows<S>::kRows, head_rows.ctas, QkvRowHalves<S>{w, head_rows});
    else
      prefetch_rest_to_l2<S::hidden>(kHeadPairs, head_rows.ctas, QkvRows<S>{w, head_rows});
  };
  WeightChunk ahead = prefetch_qkv(layers[0]);

  for (int l = 0; l < S::layers; ++l) {
    const LayerWeights w = layers[l];

    rms_norm_to_shared<S::hidden>(ResidualPlusProjections<1>{residual_of(l), {previous_down_of(l)}}, w.attn_norm, rms_eps,
                                  sh.x, sh.reduce);
    if constexpr (kQkvByRows<S>)
      gemv_row_pairs<S::hidden / 2>(HeadRows<S>::kRows, head_rows.ctas, sh.x, QkvRowHalves<S>{w, head_rows},
                                    sh.split_sums, ahead, [&](int r, float d0, float d1) {
        qkv[head_rows.stacked(r)] = __float2bfloat16(d0 + d1);
      });
    else
      gemv_row_pairs<S::hidden>(kHeadPairs, head_rows.ctas, sh.x, QkvRows<S>{w, head_rows}, sh.split_sums, ahead,
                                [&](int p, float d0, float d1) {
        reinterpret_cast<__nv_bfloat162*>(qkv)[head_rows.stacked(2 * p) / 2] = __floats2bfloat162_rn(d0, d1);
      });
    const LayerCache cache{w.k_cache, w.v_cache};
    timer.arrive();
    if (head_rows.computes_rows()) publish_and_add(head_rows_done + head_rows.head, 1u);
    // Attention waits for its KV head's P CTAs only; its first key block is copied meanwhile.
    issue_first_block<S>(cache, pos, max_seq, sh.attention);
    const WorkItem item = cta_work_item<S>(pos, max_seq);
    const unsigned qkv_done = (l + 1) * head_rows.ctas.count;
    if (item.valid()) {
      wait_for_count(head_rows_done + item.g, qkv_done);
    } else {
      // No attention item: the CTA's O prefetch waits until every head's QKV rows are written, so
      // that its loads do not meet the last QKV CTAs' (run 57: the 8B step 0.7% faster, 1B's and
      // Qwen3-8B's the same).
      wait_for_counts(head_rows_done, 0, S::kv_heads, qkv_done);
    }
    timer.mark();

    attention_stage<S>(qkv, cache, w.q_norm, w.k_norm, sh.rope, pos, max_seq, rms_eps, attn_partials, sh.attention);
    // O on the CTA's slice of the attention channels waits for its KV heads' splits only; its
    // first weight chunk is loaded meanwhile.
    timer.arrive();
    if (item.valid()) publish_and_add(head_attended + item.g, 1u);
    const OTile tile = o_tile<S>();
    ahead = prefetch_transposed<kOColumns, S::hidden>(o_rows_of(w, tile), tile.channels.rows, o_ahead_warps<S>(tile));
    wait_for_attention<S>(head_attended, tile, (l + 1) * key_splits<S>(pos).splits);
    timer.mark();

    // O over the CTA's slice of the attention channels, folded from the splits' partials.
    fold_channels_to_shared<S>(attn_partials, key_splits<S>(pos).splits, tile.channels.first, tile.channels.rows,
                               sh.slice_in);
    gemv_transposed_rows<kOColumns, S::hidden>(o_rows_of(w, tile), tile.channels.rows, sh.slice_in, ahead,
                                               o_sums_of(l) + tile.column, o_ahead_warps<S>(tile));
    zero_slice(down_sums_of(l));
    if (l + 1 < S::layers) zero_slice(o_sums_of(l + 1));
    end_stage(timer, barrier, [&] {
      const CtaSlice slice = cta_slice<S::intermediate>();
      ahead = prefetch_weights<S::hidden>(slice.rows, CtaRange{0, 1}, GateUpSliceRows<S>{w, slice.first});
    });

    // The residual stream after attention (each CTA writes its slice of it), RMS-normed; then the
    // CTA's slice of the MLP: gate/up rows into shared memory, then down over them.
    bf16* attended = hidden + (l % 2) * S::hidden;
    rms_norm_to_shared<S::hidden>(ResidualPlusProjections<2>{residual_of(l), {previous_down_of(l), o_sums_of(l)}}, w.mlp_norm,
                                  rms_eps, sh.x, sh.reduce, KeepSlice{attended, cta_slice<S::hidden / kVecElems>()});
    const CtaSlice slice = cta_slice<S::intermediate>();
    gemv_row_pairs<S::hidden>(slice.rows, CtaRange{0, 1}, sh.x, GateUpSliceRows<S>{w, slice.first}, sh.split_sums, ahead,
                              [&](int i, float gate, float up) {
      const float g = bf16_round(gate);
      const float silu = bf16_round(g / (1.f + __expf(-g)));
      sh.slice_in[i] = bf16_round(silu * bf16_round(up));
    });
    const bf16* down_rows = w.w_down_t + static_cast<size_t>(slice.first) * S::hidden;
    ahead = prefetch_transposed<S::hidden>(down_rows, slice.rows);
    __syncthreads();  // sh.slice_in is complete
    gemv_transposed_rows<S::hidden>(down_rows, slice.rows, sh.slice_in, ahead, down_sums_of(l));
    end_stage(timer, barrier, [&] {
      if (l + 1 < S::layers) {
        ahead = prefetch_qkv(layers[l + 1]);
        if constexpr (kQkvRowsToL2<S>) prefetch_qkv_rest_to_l2(layers[l + 1]);
      } else
        ahead = prefetch_weights<S::hidden>(kLmHeadPairs, whole_grid(), LmHeadRows<S>{lm_head});
    });
  }

  // Final norm + LM head; logits rounded to bf16 as the reference's bf16 matmul does, so that the
  // argmax (first maximum on ties) matches it.
  rms_norm_to_shared<S::hidden>(ResidualPlusProjections<1>{residual_of(S::layers), {down_sums_of(S::layers - 1)}},
                                final_norm, rms_eps, sh.x, sh.reduce);
  zero_slice(o_sums_of(0));
  unsigned long long best = 0;
  gemv_row_pairs<S::hidden>(kLmHeadPairs, whole_grid(), sh.x, LmHeadRows<S>{lm_head}, sh.split_sums, ahead,
                            [&](int p, float d0, float d1) {
    const float l0 = bf16_round(d0), l1 = bf16_round(d1);
    logits[2 * p] = l0;
    const unsigned long long k0 = argmax_key(l0, 2 * p);
    best = k0 > best ? k0 : best;
    if (2 * p + 1 < S::vocab) {
      logits[2 * p + 1] = l1;
      const unsigned long long k1 = argmax_key(l1, 2 * p + 1);
      best = k1 > best ? k1 : best;
    }
  });
  // Lane 0 of each warp holds its warp's best; reduce over the CTA, then over the grid.
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) sh.best[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long block_best = 0;
    for (int i = 0; i < kWarps; ++i) block_best = sh.best[i] > block_best ? sh.best[i] : block_best;
    argmax_partials[blockIdx.x] = block_best;
    __threadfence();
    const bool last = atomicAdd(counters + kCounterArgmaxDone, 1u) == gridDim.x - 1;
    sh.reduce[0] = last ? 1.f : 0.f;
    __threadfence();
  }
  __syncthreads();
  if (sh.reduce[0] != 0.f && warp == 0) {  // the last CTA: every other CTA has read token, pos and the counts
    unsigned long long grid_best = 0;
    for (int i = lane; i < static_cast<int>(gridDim.x); i += kWarpSize) {
      const unsigned long long k = __ldcg(argmax_partials + i);
      grid_best = k > grid_best ? k : grid_best;
    }
    grid_best = warp_max(grid_best);
    for (int g = lane; g < 2 * S::kv_heads; g += kWarpSize) head_rows_done[g] = 0;  // and head_attended
    if (lane == 0) {
      const int next = argmax_key_index(grid_best);
      state[kStateArgmax] = next;
      if (greedy) state[kStateToken] = next;
      state[kStatePos] = pos + 1;
      counters[kCounterArgmaxDone] = 0;
      if constexpr (kTiming) stage_stamps[timer.next] = global_timer_ns();
    }
  }
}

}  // namespace megakernel
