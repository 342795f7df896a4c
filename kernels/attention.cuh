// Decode attention for one new token over the KV cache, split over CTAs flash-decoding style.
//
// Work item (g, s): KV head g (with its `group` query heads, GQA) over key positions of split s.
// Each warp runs an online softmax over its share of the split's keys; the CTA merges its warps in
// shared memory and writes one partial (acc[head_dim], max, sum) per query head. No CTA combines
// the splits: once a KV head's splits have counted their partials written, each CTA of the O
// projection on that head's channels folds the splits of just the attention channels it multiplies
// (fold_channels_to_shared), so the stage ends at its partials' stores and a count, with no
// combine round trips on its path.
// The splits cover the keys of earlier steps, [0, pos). The last split's CTA also RMS-norms
// (Qwen3), rotates and appends the new key and value to the cache, with a warp that prepares no
// query head (or the fewest), and that warp folds the new key into its own softmax state from
// registers. So no warp reads the new position from the cache, every warp's first block can be
// loaded before the QKV rows exist, and a split never spills one key into a second block (n =
// 1,025 keys over 16 splits of 65 gave one warp of every CTA a second load round trip).
#pragma once
#include "kv_rows.cuh"
#include "online_softmax.cuh"

namespace megakernel {

constexpr int kMaxSplits = 64;       // partial results per query head
// A split's partial of one query head, in floats: acc[head_dim], then max, sum and 2 floats of
// padding that keep every partial 16 bytes aligned (the launcher sizes the buffer with the same
// stride: shape.PARTIAL_EXTRA_FLOATS).
constexpr int kPartialExtraFloats = 4;
template <class S>
constexpr int kPartialStride = S::head_dim + kPartialExtraFloats;
// Shared memory for the warps' accumulators in one round of the CTA merge: 32 KB holds all 16
// warps' at group 4 x head_dim 128 and leaves room in the 48 KB of static shared memory for q,
// the new row, the RoPE table and the reductions; larger groups merge in more rounds.
constexpr int kMergeAccBytes = 32 * 1024;
constexpr float kLog2e = 1.4426950408889634f;

// cos and sin of the new position's rotary angles (inv_freq[i] * pos), rounded to bf16 as the
// reference's are. The same for every layer: filled once per step, so the attention stages pay no
// sincosf (and the per-layer code carries none).
template <class S>
struct RopeTable {
  float cos[S::head_dim / 2];
  float sin[S::head_dim / 2];

  // The CTA fills it; visible to the CTA after its next __syncthreads.
  __device__ __forceinline__ void fill(const float* inv_freq, int pos) {
    for (int i = threadIdx.x; i < S::head_dim / 2; i += kThreads) {
      float sin_a, cos_a;
      sincosf(static_cast<float>(pos) * inv_freq[i], &sin_a, &cos_a);
      cos[i] = bf16_round(cos_a), sin[i] = bf16_round(sin_a);
    }
  }
};

// One head (a warp): load its raw projection from qkv, RMS-norm it (Qwen3) rounding to bf16 where
// the reference does, rotate it (Hugging Face rotate_half: channel d pairs with d + head_dim/2, which
// sits in lane + 16) in fp32 and round the result once; the reference rounds both products and their
// sum, so the kernel's rotation is the closer to exact of the two. Returns the lane's slice.
template <class S>
__device__ __forceinline__ void prepare_head(const bf16* raw, const bf16* norm_weight, const RopeTable<S>& rope,
                                             float eps, int lane, float* x) {
  constexpr int kPerLane = S::head_dim / kWarpSize;
  constexpr int kHalfLanes = kWarpSize / 2;
  load_row_slice<kPerLane>(raw + lane * kPerLane, x);
  if constexpr (S::qk_norm) {
    float sum_squares = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sum_squares = fmaf(x[j], x[j], sum_squares);
    const float inv_rms = rsqrtf(warp_sum(sum_squares) / S::head_dim + eps);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      x[j] = bf16_round(__bfloat162float(norm_weight[lane * kPerLane + j]) * bf16_round(x[j] * inv_rms));
  }
  const bool first_half = lane < kHalfLanes;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float partner = __shfl_xor_sync(kFullMask, x[j], kHalfLanes);
    const int i = (lane % kHalfLanes) * kPerLane + j;
    const float c = rope.cos[i], s = rope.sin[i];
    x[j] = bf16_round(first_half ? x[j] * c - partner * s : x[j] * c + partner * s);
  }
}

// The CTA merge of its warps' states: kSlots warps' states per round, as many as kMergeAccBytes
// holds (a power of 2 that divides kWarps); a thread per output channel (h, d) of the group, or
// kChannelsPerThread of them.
template <class S>
struct MergeTiling {
  static constexpr int kChannels = S::group * S::head_dim;
  static constexpr int kFit = pow2_floor(kMergeAccBytes / (kChannels * static_cast<int>(sizeof(float))));
  static constexpr int kSlots = kFit < kWarps ? kFit : kWarps;
  static constexpr int kRounds = kWarps / kSlots;
  static constexpr int kChannelsPerThread = (kChannels + kThreads - 1) / kThreads;
  static_assert(kFit >= 1, "one warp's accumulators fit in kMergeAccBytes");
};

template <class S>
struct AttentionShared {
  static constexpr int kMergeSlots = MergeTiling<S>::kSlots;
  float q[S::group][S::head_dim];  // the group's query heads, normed and rotated (bf16-exact values)
  union {
    // Each lane's K and V slices of its warp's first block of keys, copied while waiting for the
    // QKV rows before attention (issue_first_block); read before the stage's first __syncthreads,
    // so the merge, which comes after it, may reuse the space.
    struct {
      typename KeyTiling<S>::Raw k[kWarps][KeyTiling<S>::kKeysPerIter][kWarpSize];
      typename KeyTiling<S>::Raw v[kWarps][KeyTiling<S>::kKeysPerIter][kWarpSize];
    } first_block;
    struct {
      float max[kMergeSlots][S::group];
      float sum[kMergeSlots][S::group];
      float acc[kMergeSlots][S::group][S::head_dim];
    } merge;
  };
};

// The step's split of the pos keys of earlier steps: `splits` splits of `chunk` keys per KV head
// (the last may be shorter; at pos = 0 there is one, empty), as many as the grid holds, at least
// kMinKeysPerSplit keys each.
struct KeySplits {
  int splits, chunk;
};

template <class S>
__device__ __forceinline__ KeySplits key_splits(int pos) {
  constexpr int kMinKeys = KeyTiling<S>::kMinKeysPerSplit;
  int splits = max(1, min(kMaxSplits, static_cast<int>(gridDim.x) / S::kv_heads));
  splits = max(1, min(splits, (pos + kMinKeys - 1) / kMinKeys));
  const int chunk = max(1, (pos + splits - 1) / splits);
  return KeySplits{max(1, (pos + chunk - 1) / chunk), chunk};
}

// This CTA's work item: KV head g, split `split` of `splits`, keys [begin, end) of head g, whose cache
// rows start at head_offset elements into the layer's K and V. One item per CTA at most (splits <=
// grid / kv_heads; the launcher ensures grid >= kv_heads); g < 0 when the CTA has none.
struct WorkItem {
  int g, split, splits, begin, end;
  size_t head_offset;
  __device__ bool valid() const { return g >= 0; }
  __device__ bool holds_new_key() const { return split == splits - 1; }  // appends and folds position pos
};

template <class S>
__device__ __forceinline__ WorkItem cta_work_item(int pos, int max_seq) {
  const KeySplits plan = key_splits<S>(pos);
  const int item = blockIdx.x;
  if (item >= S::kv_heads * plan.splits) return WorkItem{-1, 0, 0, 0, 0, 0};
  const int g = item / plan.splits, split = item % plan.splits, begin = split * plan.chunk;
  const size_t head_offset = static_cast<size_t>(g) * max_seq * S::head_dim;
  return WorkItem{g, split, plan.splits, begin, min(pos, begin + plan.chunk), head_offset};
}

// The K and V rows of this warp's first block of keys, copied into sh.first_block while the CTA
// waits for the QKV rows before attention: the split's keys were written by earlier steps, so
// their HBM latency runs under the wait. Asynchronous copies, not loads: a block held in registers
// across the wait spilled on 8B. sh.first_block shares the union with the GEMV input, which the CTA
// is done with once it has written its QKV rows.
template <class S>
__device__ __forceinline__ void issue_first_block(const LayerCache& cache, int pos, int max_seq, AttentionShared<S>& sh) {
  using T = KeyTiling<S>;
  const WorkItem work = cta_work_item<S>(pos, max_seq);
  if (!work.valid()) return;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int first_key = work.begin + warp * T::kKeysPerIter;
  using Raw = typename T::Raw;
#pragma unroll
  for (int u = 0; u < T::kKeysPerIter; ++u) {
    if (first_key + u < work.end) {
      const size_t row = key_slice<S>(work.head_offset, first_key + u, lane);
      copy_async(&sh.first_block.k[warp][u][lane], reinterpret_cast<const Raw*>(cache.k + row));
      copy_async(&sh.first_block.v[warp][u][lane], reinterpret_cast<const Raw*>(cache.v + row));
    }
  }
}

// The CTA's issue_first_block ran before the stage, and its item's q, k and v rows are written.
template <class S>
__device__ void attention_stage(const bf16* qkv, const LayerCache cache, const bf16* q_norm, const bf16* k_norm,
                                const RopeTable<S>& rope, int pos, int max_seq, float eps, float* partials,
                                AttentionShared<S>& sh) {
  using T = KeyTiling<S>;
  constexpr int G = S::group;
  constexpr int HD = S::head_dim;
  constexpr int kPerLane = T::kPerLane;
  static_assert(G <= kWarpSize, "at most 32 query heads per KV head");
  constexpr int kKeysPerIter = T::kKeysPerIter;
  constexpr int kSlots = pow2_ceil(G * kKeysPerIter);  // (head, key) scores of one iteration, padded
  constexpr int kLanesPerSlot = kWarpSize / kSlots;
  constexpr int kLanesPerHead = kKeysPerIter * kLanesPerSlot;
  constexpr int kAppendWarp = kWarps - 1;  // prepares query heads only when G >= kWarps
  const float score_scale = rsqrtf(static_cast<float>(HD)) * kLog2e;  // softmax in base 2
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;

  const WorkItem work = cta_work_item<S>(pos, max_seq);
  if (!work.valid()) return;
  const int g = work.g, split = work.split, splits = work.splits, begin = work.begin, end = work.end;
  const size_t head_offset = work.head_offset;

  // The warp's first block of keys has been in flight since before the stage, so its HBM latency
  // ran under the wait.
  const auto load_block = [&](int t0, KeyBlock<S>& block) { load_key_block<S>(cache, head_offset, t0, end, lane, block); };
  const int first_key = begin + warp * kKeysPerIter;
  KeyBlock<S> current = {}, next = {};
  wait_async_copies();  // this lane's own copies: no CTA barrier needed to read them
#pragma unroll
  for (int u = 0; u < kKeysPerIter; ++u) {
    if (first_key + u < end) current.k[u] = sh.first_block.k[warp][u][lane], current.v[u] = sh.first_block.v[warp][u][lane];
  }

  for (int h = warp; h < G; h += kWarps) {
    float x[kPerLane];
    prepare_head<S>(qkv + (g * G + h) * HD, q_norm, rope, eps, lane, x);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sh.q[h][lane * kPerLane + j] = x[j];
  }
  // The new position's key and value stay in the registers of the warp that appends them (as key 0
  // of a block), which folds them into its own state.
  const bool folds_new_key = work.holds_new_key() && warp == kAppendWarp;
  KeyBlock<S> new_key = {};
  if (folds_new_key) {
    using Raw = typename T::Raw;
    // The value's load is issued with the key's: one L2 round trip for both.
    const Raw value = load_slice<kPerLane>(qkv + S::q_dim + S::kv_dim + g * HD + lane * kPerLane);
    float k[kPerLane];
    prepare_head<S>(qkv + S::q_dim + g * HD, k_norm, rope, eps, lane, k);
    const Raw key = RowSlice<kPerLane>::pack(k);
    const size_t row = key_slice<S>(head_offset, pos, lane);
    *reinterpret_cast<Raw*>(cache.k + row) = key;
    *reinterpret_cast<Raw*>(cache.v + row) = value;
    new_key.k[0] = key, new_key.v[0] = value;
  }
  __syncthreads();

  float q[G][kPerLane];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) q[h][j] = sh.q[h][lane * kPerLane + j];

  // Keys in blocks of kKeysPerIter per warp; the next block's loads are issued before the current
  // block is computed, so two blocks per warp are in flight. The block's G x kKeysPerIter scores
  // are slots of one warp_reduce_scatter: lane l owns slot l / kLanesPerSlot = (head, key), so
  // the softmax's max, exp and running sum are done once per slot, by its lanes, and each lane
  // then gathers the probabilities it needs for its head_dim slice of the output.
  const int slot = lane / kLanesPerSlot;
  const int slot_head = slot / kKeysPerIter, slot_key = slot % kKeysPerIter;  // slot_head >= G: padding
  const bool counts_sum = slot_head < G && lane % kLanesPerSlot == 0;  // one lane per slot adds to the sum
  float slot_max = kNegInf, slot_sum = 0.f;  // running max and sum of the slot's head, over this lane's keys

  SoftmaxState<S> state;
  state.reset();
  // Folds keys [t0, t0 + kKeysPerIter) of the head, those before block_end, held in `block`.
  const auto fold_block = [&](const KeyBlock<S>& block, int t0, int block_end) {
    float k[kKeysPerIter][kPerLane], v[kKeysPerIter][kPerLane];
#pragma unroll
    for (int u = 0; u < kKeysPerIter; ++u) unpack_slice<kPerLane>(block.k[u], k[u]), unpack_slice<kPerLane>(block.v[u], v[u]);
    float partial[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      partial[i] = 0.f;
      if (i < G * kKeysPerIter) {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) partial[i] = fmaf(q[i / kKeysPerIter][j], k[i % kKeysPerIter][j], partial[i]);
      }
    }
    const float dot = warp_reduce_scatter<kSlots>(partial, lane);
    const float score = slot_head < G && t0 + slot_key < block_end ? dot * score_scale : kNegInf;
    float block_max = score;  // over the slot's head: kLanesPerHead aligned lanes
#pragma unroll
    for (int offset = kLanesPerHead / 2; offset > 0; offset /= 2)
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, offset));
    const float new_slot_max = fmaxf(slot_max, block_max);  // finite for real heads: key t0 is valid
    const float p = score == kNegInf ? 0.f : exp2f(score - new_slot_max);
    slot_sum = (slot_max == kNegInf ? 0.f : slot_sum * exp2f(slot_max - new_slot_max)) + (counts_sum ? p : 0.f);
    slot_max = new_slot_max;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float new_max = __shfl_sync(kFullMask, new_slot_max, h * kLanesPerHead);
      const float correction = exp2f(state.max[h] - new_max);
      state.max[h] = new_max;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) state.acc[h][j] *= correction;
#pragma unroll
      for (int u = 0; u < kKeysPerIter; ++u) {
        const float p_hu = __shfl_sync(kFullMask, p, (h * kKeysPerIter + u) * kLanesPerSlot);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) state.acc[h][j] = fmaf(p_hu, v[u][j], state.acc[h][j]);
      }
    }
  };
  if (folds_new_key) fold_block(new_key, pos, pos + 1);  // before the loop: its registers are free for it
  constexpr int kWarpStride = kWarps * kKeysPerIter;
  for (int t0 = first_key; t0 < end; t0 += kWarpStride) {
    if (t0 + kWarpStride < end) load_block(t0 + kWarpStride, next);
    fold_block(current, t0, end);
    current = next;
  }
  // Each head's sum: over its slots' counting lanes.
#pragma unroll
  for (int offset = kLanesPerHead / 2; offset > 0; offset /= 2) slot_sum += __shfl_xor_sync(kFullMask, slot_sum, offset);
#pragma unroll
  for (int h = 0; h < G; ++h) state.sum[h] = __shfl_sync(kFullMask, slot_sum, h * kLanesPerHead);

  // Merge the warps' states: each round, kSlots warps write theirs to shared memory and every
  // thread folds them into its channels' running softmax (one CTA barrier per round, where a
  // pairwise tree takes two per level); the threads then write the CTA's partial.
  using M = MergeTiling<S>;
  ChannelSoftmax channel[M::kChannelsPerThread];
  for (int round = 0; round < M::kRounds; ++round) {
    const int merge_slot = warp - round * M::kSlots;
    if (merge_slot >= 0 && merge_slot < M::kSlots) {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        if (lane == 0) sh.merge.max[merge_slot][h] = state.max[h], sh.merge.sum[merge_slot][h] = state.sum[h];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) sh.merge.acc[merge_slot][h][lane * kPerLane + j] = state.acc[h][j];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < M::kChannelsPerThread; ++i) {
      const int c = threadIdx.x + i * kThreads, h = c / HD, d = c % HD;
      if (c < M::kChannels) {
        float m[M::kSlots], l[M::kSlots], a[M::kSlots];
#pragma unroll
        for (int w = 0; w < M::kSlots; ++w) m[w] = sh.merge.max[w][h], l[w] = sh.merge.sum[w][h], a[w] = sh.merge.acc[w][h][d];
        channel[i].fold(m, l, a);
      }
    }
    if (round + 1 < M::kRounds) __syncthreads();  // the next round overwrites the slots
  }
#pragma unroll
  for (int i = 0; i < M::kChannelsPerThread; ++i) {
    const int c = threadIdx.x + i * kThreads, h = c / HD, d = c % HD;
    if (c < M::kChannels) {
      float* out = partials + (static_cast<size_t>(g * G + h) * kMaxSplits + split) * kPartialStride<S>;
      out[d] = channel[i].acc;
      if (d == 0) out[HD] = channel[i].max, out[HD + 1] = channel[i].sum;
    }
  }
}

// out (shared, fp32 [rows]) = the attention output's channels [first, first + rows) of the q_dim
// (channel c = query head c / head_dim, dim c % head_dim), each folded from its head's split
// partials and rounded to bf16 as the reference's attention output is. kFoldLanes lanes per
// channel, so that a round covers kThreads / kFoldLanes channels: lane i loads splits i,
// i + kFoldLanes, ... kFoldBatch at a time (one L2 round trip for up to kFoldLanes x kFoldBatch
// splits), folds them, and the channel's lanes then fold their states with shuffles. (A thread
// holding 16 splits' loads at once spilled beside the O weights that the CTA prefetched while it
// waited.) The counts of the channels' KV heads' splits (wait_for_attention) have published the partials.
constexpr int kFoldLanes = 4;
constexpr int kFoldBatch = 4;

template <class S>
__device__ __forceinline__ void fold_channels_to_shared(const float* partials, int splits, int first, int rows,
                                                        float* out) {
  constexpr int kChannelsPerRound = kThreads / kFoldLanes;
  const int split_lane = threadIdx.x % kFoldLanes;
  for (int round = 0; round < rows; round += kChannelsPerRound) {  // the same trip count for every thread
    const int t = round + static_cast<int>(threadIdx.x) / kFoldLanes, c = first + t;
    const float* part = partials + static_cast<size_t>(c / S::head_dim) * kMaxSplits * kPartialStride<S>;
    ChannelSoftmax run;
    for (int s0 = 0; t < rows && s0 < splits; s0 += kFoldLanes * kFoldBatch) {
      float m[kFoldBatch], l[kFoldBatch], a[kFoldBatch];
#pragma unroll
      for (int j = 0; j < kFoldBatch; ++j) {
        const int s = s0 + j * kFoldLanes + split_lane;
        const float* split_part = part + s * kPartialStride<S>;
        m[j] = s < splits ? __ldcg(split_part + S::head_dim) : kNegInf;
        l[j] = s < splits ? __ldcg(split_part + S::head_dim + 1) : 0.f;
        a[j] = s < splits ? __ldcg(split_part + c % S::head_dim) : 0.f;
      }
      run.fold(m, l, a);
    }
    float channel_max = run.max;
#pragma unroll
    for (int offset = kFoldLanes / 2; offset > 0; offset /= 2)
      channel_max = fmaxf(channel_max, __shfl_xor_sync(kFullMask, channel_max, offset));
    const float weight = run.max == kNegInf ? 0.f : exp2f(run.max - channel_max);
    float sum = run.sum * weight, acc = run.acc * weight;
#pragma unroll
    for (int offset = kFoldLanes / 2; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(kFullMask, sum, offset);
      acc += __shfl_xor_sync(kFullMask, acc, offset);
    }
    if (t < rows && split_lane == 0) out[t] = bf16_round(acc / sum);
  }
  __syncthreads();
}

}  // namespace megakernel
