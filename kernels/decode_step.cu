// The batch-1 decode megakernel: one persistent cooperative launch runs a whole decode step of a
// Llama 3 / Qwen3 dense model, from the embedding lookup to the greedy argmax.
//
// Per layer, four stages separated by grid barriers (every stage needs all of the previous one),
// except that attention on a KV head waits only for that head's q, k and v rows (HeadRows):
//   1. residual + down, RMSNorm (recomputed per CTA into shared memory) + QKV GEMV -> qkv
//   2. q/k norm (Qwen3) + RoPE + KV-cache append + split attention + combine       -> attn_out
//      (kFoldSplitsInO shapes: the splits' partials, which stage 3 folds as it stages its input)
//      (RoPE's cos/sin are computed once per step into shared memory: the same for every layer)
//   3. O-proj GEMV + residual + down                                              -> hidden
//   4. RMSNorm + gate/up GEMV + SiLU * up of the CTA's slice of the intermediate rows (in shared
//      memory), then down over that slice: fp32 sums over the CTAs                -> down_sums
//      (the next layer's stages 1 and 3 add them to the residual stream)
// then final RMSNorm + LM head (logits out, for a sampler) + argmax: block partials, and the last
// CTA to finish reduces them and advances the step state. Position and input token are read from
// device memory, so one captured CUDA graph of this launch replays for every step.
// Weights need nothing from the stage before them, so each GEMV's first weight chunk per warp is
// loaded while its CTA waits at the grid barrier in front of it (prefetch_weights), and so is the
// first block of keys and values of each warp's attention while the CTA waits for its head's QKV
// rows (issue_first_block: a split's keys come from earlier steps); a residual
// that an epilogue adds is loaded before the dot product it waits for (gemv_row_pairs' operand).
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
// attention's split counts (one per KV head), then the counts of CTAs that have written each KV
// head's QKV rows (kCounterHeadRows, one per KV head; zeroed by the step's last CTA).
enum CounterSlot { kCounterBarrier = 0, kCounterArgmaxDone = 1, kCounterSplits = 2 };
template <class S>
constexpr int kCounterHeadRows = kCounterSplits + S::kv_heads;

// One layer's weights (row-major bf16) and KV cache row, as a table in device memory.
struct LayerWeights {
  const bf16* attn_norm;  // [H]
  const bf16* wq;         // [heads * head_dim, H]
  const bf16* wk;         // [kv_heads * head_dim, H]
  const bf16* wv;         // [kv_heads * head_dim, H]
  const bf16* q_norm;     // [head_dim] (Qwen3) or null
  const bf16* k_norm;     // [head_dim] (Qwen3) or null
  const bf16* wo;         // [H, heads * head_dim]
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
struct OProjRows {
  const bf16* wo;
  __device__ RowPair operator()(int p) const {
    const bf16* base = wo + static_cast<size_t>(2 * p) * S::q_dim;
    return RowPair{base, base + S::q_dim};
  }
};

template <class S>
struct GateUpRows {  // pair i = (gate row i, up row i): one warp produces SiLU(gate) * up at once
  LayerWeights w;
  __device__ RowPair operator()(int i) const {
    const size_t row = static_cast<size_t>(i) * S::hidden;
    return RowPair{w.w_gate + row, w.w_up + row};
  }
};

// The MLP's intermediate rows are split over the CTAs in contiguous slices, [c * I / grid,
// (c + 1) * I / grid) for CTA c; a slice's activations stay in shared memory, sized for a grid of
// at least kMinCtas (the launcher checks). (Recomputed where needed: a value kept live through
// attention costs a register there.)
constexpr int kMinCtas = 96;
constexpr int kMlpRowsAlign = 4;  // a 16-byte multiple of floats: no padding after the array
template <class S>
constexpr int kMaxMlpRowsPerCta =
    ((S::intermediate + kMinCtas - 1) / kMinCtas + kMlpRowsAlign - 1) / kMlpRowsAlign * kMlpRowsAlign;

struct MlpSlice {
  int first, rows;
};

template <class S>
__device__ __forceinline__ MlpSlice mlp_slice() {
  const int first = static_cast<int>(blockIdx.x * S::intermediate / gridDim.x);
  return MlpSlice{first, static_cast<int>((blockIdx.x + 1) * S::intermediate / gridDim.x) - first};
}

template <class S>
struct GateUpSliceRows {  // pair p = the slice's gate and up row p
  LayerWeights w;
  int first;
  __device__ RowPair operator()(int p) const { return GateUpRows<S>{w}(first + p); }
};

// A row pair's residual and the previous layer's down sums, loaded before O's dot product.
struct ResidualAndProjection {
  __nv_bfloat162 residual;
  float2 down;
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
  float act[kMaxMlpRowsPerCta<S>];  // SiLU(gate) * up of the CTA's intermediate rows
  RopeTable<S> rope;
  float reduce[kWarps];
  unsigned long long best[kWarps];
  float2 split_sums[kWarps];  // per-warp partial dots of a row pair shared by warps (gemv_row_pairs)
};

// Warps per CTA that prefetch the O projection's first chunks at the barrier after attention: all
// of them where O folds the attention splits (kFoldSplitsInO), since attention's arrival tail is
// short there (1 µs per layer on Llama-3.2-1B) and O's weights would land after the barrier (run 50:
// 1B 0.7-1.5% faster); kPrefetchWarps elsewhere, where a larger burst meets the last attention CTAs'
// round trips (8B shapes 0.1-0.7% slower with all 16).
template <class S>
constexpr int kAheadWarpsBeforeO = kFoldSplitsInO<S> ? kWarps : kPrefetchWarps;

// The QKV rows that prefetch_qkv leaves in HBM are fetched into L2 by the TMA (prefetch_rest_to_l2)
// at the MLP's closing barrier, while the MLP's last CTAs leave HBM partly idle, on shapes whose
// whole QKV projection is small beside L2 (Llama-3.2-1B: 12.6 MB; the 8B shapes' 50 MB would
// evict one another): QKV's loads after the barrier then wait on L2, not HBM. (Measured on H200,
// run 57: 1B's QKV 0.7 µs per layer shorter, its MLP 0.7 longer, the step 0.4% faster at 1,024.)
constexpr size_t kQkvToL2MaxBytes = 16u << 20;
template <class S>
constexpr bool kQkvRowsToL2 = static_cast<size_t>(S::qkv_dim) * S::hidden * sizeof(bf16) <= kQkvToL2MaxBytes;

constexpr int kStaticSharedLimit = 48 * 1024;
constexpr int kStagesPerLayer = 4;  // each ends at a grid barrier (QKV: at its KV head's counts)

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
                bf16* attn_out, float* down_sums, float* attn_partials, float* logits,
                unsigned long long* argmax_partials, unsigned long long* stage_stamps, float rms_eps, int max_seq,
                int greedy) {
  static_assert(sizeof(SharedStorage<S>) <= kStaticSharedLimit, "shape needs more than 48 KB of shared memory");
  constexpr int kHeadPairs = HeadRows<S>::kRows / 2, kOPairs = S::hidden / 2, kLmHeadPairs = (S::vocab + 1) / 2;
  __shared__ SharedStorage<S> sh;
  // stage_stamps: kStamps stamps of CTA 0, then kBarriers x grid arrivals (see StageTimer)
  constexpr int kBarriers = kStagesPerLayer * S::layers, kStamps = kBarriers + 2;
  StageTimer<kTiming> timer{stage_stamps, stage_stamps + kStamps};
  timer.mark();

  const int token = __ldcg(state + kStateToken);
  const int pos = __ldcg(state + kStatePos);
  const bf16* embed_row = embed + static_cast<size_t>(token) * S::hidden;
  sh.rope.fill(rope_inv_freq, pos);  // published by layer 0's RMSNorm's __syncthreads
  unsigned* barrier = counters + kCounterBarrier;
  unsigned* head_rows_done = counters + kCounterHeadRows<S>;
  const HeadRows<S> head_rows = HeadRows<S>::of_this_cta();
  // down_sums: [3][hidden] fp32: zeros (layer 0's previous down), then layer l's down sums in
  // buffer 1 + l % 2, zeroed by every CTA (a slice each) in layer l's O stage: after the grid
  // barrier that ends their last reads (layer l - 1's O stage) and before the one in front of
  // layer l's MLP stage, whose CTAs add to them.
  const auto down_sums_of = [&](int layer) { return down_sums + (1 + layer % 2) * S::hidden; };
  // The residual stream before layer l is residual + bf16(previous_down_of(l)): layer 0 reads the
  // embedding in place and adds zeros.
  const auto previous_down_of = [&](int l) -> const float* { return l == 0 ? down_sums : down_sums_of(l - 1); };
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
    const bf16* residual = l == 0 ? embed_row : hidden;

    rms_norm_to_shared<S::hidden>(ResidualPlusProjection{residual, previous_down_of(l)}, w.attn_norm, rms_eps, sh.x,
                                  sh.reduce);
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
      // No attention item: the CTA's O prefetch at the next barrier waits until every head's QKV
      // rows are written, so that its loads do not meet the last QKV CTAs' (run 57: the 8B step
      // 0.7% faster, 1B's and Qwen3-8B's the same).
      for (int g = 0; g < S::kv_heads; ++g) wait_for_count(head_rows_done + g, qkv_done);
    }
    timer.mark();

    attention_stage<S>(qkv, cache, w.q_norm, w.k_norm, sh.rope, pos, max_seq, rms_eps, attn_partials,
                       counters + kCounterSplits, attn_out, sh.attention);
    end_stage(timer, barrier, [&] {
      ahead = prefetch_weights<S::q_dim, kAheadWarpsBeforeO<S>>(kOPairs, whole_grid(), OProjRows<S>{w.wo});
    });

    if constexpr (kFoldSplitsInO<S>)
      fold_splits_to_shared<S>(attn_partials, key_splits<S>(pos).splits, sh.x);
    else
      stage_to_shared<S::q_dim>(attn_out, sh.x);
    // The residual (with the previous layer's down added exactly as the QKV RMSNorm did) plus O.
    const float* previous_down = previous_down_of(l);
    const auto residual_and_down = [&](int p) {
      return ResidualAndProjection{__ldcg(reinterpret_cast<const __nv_bfloat162*>(residual) + p),
                                   __ldcg(reinterpret_cast<const float2*>(previous_down) + p)};
    };
    gemv_row_pairs<S::q_dim, kAheadWarpsBeforeO<S>>(kOPairs, whole_grid(), sh.x, OProjRows<S>{w.wo}, sh.split_sums,
                                                    ahead, residual_and_down,
                                                    [&](int p, float d0, float d1, ResidualAndProjection in) {
      const float2 res = __bfloat1622float2(in.residual);
      const float h0 = add_projection(res.x, in.down.x), h1 = add_projection(res.y, in.down.y);
      reinterpret_cast<__nv_bfloat162*>(hidden)[p] = __floats2bfloat162_rn(h0 + bf16_round(d0), h1 + bf16_round(d1));
    });
    float* layer_down = down_sums_of(l);  // zeroed for this layer's MLP (see down_sums above)
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < S::hidden; i += gridDim.x * kThreads) layer_down[i] = 0.f;
    end_stage(timer, barrier, [&] {
      const MlpSlice slice = mlp_slice<S>();
      ahead = prefetch_weights<S::hidden>(slice.rows, CtaRange{0, 1}, GateUpSliceRows<S>{w, slice.first});
    });

    // The CTA's slice of the MLP: gate/up rows into shared memory, then down over them.
    rms_norm_to_shared<S::hidden>(Activations{hidden}, w.mlp_norm, rms_eps, sh.x, sh.reduce);
    const MlpSlice slice = mlp_slice<S>();
    gemv_row_pairs<S::hidden>(slice.rows, CtaRange{0, 1}, sh.x, GateUpSliceRows<S>{w, slice.first}, sh.split_sums, ahead,
                              [&](int i, float gate, float up) {
      const float g = bf16_round(gate);
      const float silu = bf16_round(g / (1.f + __expf(-g)));
      sh.act[i] = bf16_round(silu * bf16_round(up));
    });
    const bf16* down_rows = w.w_down_t + static_cast<size_t>(slice.first) * S::hidden;
    ahead = prefetch_transposed<S::hidden>(down_rows, slice.rows);
    __syncthreads();  // sh.act is complete
    gemv_transposed_rows<S::hidden>(down_rows, slice.rows, sh.act, ahead, down_sums_of(l));
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
  rms_norm_to_shared<S::hidden>(ResidualPlusProjection{hidden, down_sums_of(S::layers - 1)}, final_norm, rms_eps,
                                sh.x, sh.reduce);
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
    for (int g = lane; g < S::kv_heads; g += kWarpSize) head_rows_done[g] = 0;
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
