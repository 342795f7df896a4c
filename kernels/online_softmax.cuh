// Online softmax pieces of decode attention: the warp's reduce-scatter of dot products, the
// per-warp state over a group's heads, and the fold of states into one output channel.
#pragma once
#include "common.cuh"

namespace megakernel {

constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();

// One level of warp_reduce_scatter: kCount slots remain; keep half, hand the other half to the
// lane kOffset away and add what it hands back. Templated so every index is a constant (registers).
template <int kCount, int kOffset, int kSlots>
__device__ __forceinline__ void reduce_scatter_level(float (&partial)[kSlots], int lane) {
  if constexpr (kCount > 1) {
    const bool upper = lane & kOffset;  // this lane keeps the upper half of the remaining slots
#pragma unroll
    for (int i = 0; i < kCount / 2; ++i) {
      const float give = upper ? partial[i] : partial[i + kCount / 2];
      const float keep = upper ? partial[i + kCount / 2] : partial[i];
      partial[i] = keep + __shfl_xor_sync(kFullMask, give, kOffset);
    }
    reduce_scatter_level<kCount / 2, kOffset / 2>(partial, lane);
  }
}

// Reduce-scatter over the warp: every lane holds kSlots partial sums; afterwards lane l holds the
// full sum of slot l / (kWarpSize / kSlots). Each level hands half of the remaining slots to the
// partner lane, so kSlots dot products cost kSlots - 1 + log2(kWarpSize / kSlots) shuffles instead
// of kSlots * log2(kWarpSize) for one warp_sum each.
template <int kSlots>
__device__ __forceinline__ float warp_reduce_scatter(float (&partial)[kSlots], int lane) {
  static_assert(kSlots >= 1 && kSlots <= kWarpSize && (kSlots & (kSlots - 1)) == 0, "slots: a power of 2 <= 32");
  reduce_scatter_level<kSlots, kWarpSize / 2>(partial, lane);
  float total = partial[0];
#pragma unroll
  for (int offset = kWarpSize / kSlots / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(kFullMask, total, offset);
  return total;
}

// Online softmax of one output channel over states (max m, sum l, channel value a), folded a chunk
// at a time: a chunk's loads are all issued before the first use, so it costs one round trip.
struct ChannelSoftmax {
  float max = kNegInf, sum = 0.f, acc = 0.f;

  template <int kCount>
  __device__ __forceinline__ void fold(const float (&m)[kCount], const float (&l)[kCount], const float (&a)[kCount]) {
    float chunk_max = max;  // finite once a state with a key is folded: every split, and warp 0, has one
#pragma unroll
    for (int i = 0; i < kCount; ++i) chunk_max = fmaxf(chunk_max, m[i]);
    const float rescale = max == kNegInf ? 0.f : exp2f(max - chunk_max);
    sum *= rescale, acc *= rescale;
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const float w = m[i] == kNegInf ? 0.f : exp2f(m[i] - chunk_max);
      sum = fmaf(l[i], w, sum);
      acc = fmaf(a[i], w, acc);
    }
    max = chunk_max;
  }
};

// Online-softmax state of one warp for the group's heads; acc holds the lane's head_dim slice.
template <class S>
struct SoftmaxState {
  static constexpr int kPerLane = S::head_dim / kWarpSize;
  float max[S::group];
  float sum[S::group];
  float acc[S::group][kPerLane];

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int h = 0; h < S::group; ++h) {
      max[h] = kNegInf, sum[h] = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) acc[h][j] = 0.f;
    }
  }
};

}  // namespace megakernel
