// Batch-1 GEMV building blocks: an activation vector staged in shared memory (optionally RMS-normed
// on the way), and every warp of the grid streaming pairs of weight rows against it.
#pragma once
#include "common.cuh"

namespace megakernel {

// 16-byte loads per row per lane issued before the first FMA: 16 warps x 32 lanes x 2 rows x 4
// loads x 16 B keeps 64 KB of weights in flight per SM. (Measured on H200: 8 loads for the stages
// with about one row pair per warp, plus L2 prefetch of the next stage's first rows before each
// barrier, made the 8B step 3% slower, so neither is used.)
constexpr int kLoadsInFlight = 4;

struct RowPair {
  const bf16* w0;
  const bf16* w1;
};

// out (shared, bf16 [N]) = x (global, bf16 [N]) staged as is.
template <int N>
__device__ __forceinline__ void stage_to_shared(const bf16* x, bf16* out) {
  static_assert(N % kVecElems == 0, "vector length must be a multiple of 8");
  for (int i = threadIdx.x; i < N / kVecElems; i += kThreads)
    reinterpret_cast<uint4*>(out)[i] = load_activations16(x + i * kVecElems);
  __syncthreads();
}

// out (shared, bf16 [N]) = weight * bf16(x * rsqrt(mean(x^2) + eps)), Hugging Face's RMSNorm:
// statistics in fp32, the normalised value rounded to bf16 before the weight multiplies it.
template <int N>
__device__ __forceinline__ void rms_norm_to_shared(const bf16* x, const bf16* weight, float eps, bf16* out,
                                                   float* scratch) {
  static_assert(N % kVecElems == 0, "vector length must be a multiple of 8");
  constexpr int kVecs = N / kVecElems;
  float sum_squares = 0.f;
  for (int i = threadIdx.x; i < kVecs; i += kThreads) {
    const uint4 v = load_activations16(x + i * kVecElems);
    reinterpret_cast<uint4*>(out)[i] = v;
    const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(v2[j]);
      sum_squares = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_squares));
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / N + eps);  // block_sum also syncs `out`
  for (int i = threadIdx.x; i < kVecs; i += kThreads) {
    uint4 v = reinterpret_cast<uint4*>(out)[i];
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(weight) + i);
    __nv_bfloat162* v2 = reinterpret_cast<__nv_bfloat162*>(&v);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(v2[j]);
      const float2 g = __bfloat1622float2(w2[j]);
      v2[j] = __floats2bfloat162_rn(g.x * bf16_round(f.x * inv_rms), g.y * bf16_round(f.y * inv_rms));
    }
    reinterpret_cast<uint4*>(out)[i] = v;
  }
  __syncthreads();
}

// (w0 . x, w1 . x) over the 16-byte vectors [first, end) of two weight rows and x (shared, bf16);
// every lane gets both. Inlined with constant bounds when a warp reads whole rows.
__device__ __forceinline__ float2 dot_rows2(const bf16* w0, const bf16* w1, const bf16* x, int lane, int first,
                                            int end) {
  constexpr int kStride = kWarpSize * kLoadsInFlight;
  const uint4* x_vec = reinterpret_cast<const uint4*>(x);
  float acc0 = 0.f, acc1 = 0.f;
  for (int base = first; base < end; base += kStride) {
    uint4 r0[kLoadsInFlight], r1[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int v = base + u * kWarpSize + lane;
      r0[u] = r1[u] = make_uint4(0, 0, 0, 0);
      if (v < end) {
        r0[u] = load_weights16(w0 + v * kVecElems);
        r1[u] = load_weights16(w1 + v * kVecElems);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int v = base + u * kWarpSize + lane;
      if (v < end) {
        const uint4 xv = x_vec[v];
        acc0 = dot8(r0[u], xv, acc0);
        acc1 = dot8(r1[u], xv, acc1);
      }
    }
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

// How many warps share one row pair, each reading a 1/split slice of K: only when whole rows would
// leave at least half of the grid's warps idle (Llama-3.2-1B's O and down: 1,024 pairs for 2,112
// warps on 132 SMs), the largest power of 2 with split * pairs <= warps. Each slice keeps
// kLoadsInFlight loads per lane and row, and split divides the CTA's warps. (Measured on H200:
// splitting to even out a last partial round - 8B QKV's 1.45 rounds, gate/up's 6.8, the LM head's
// 30.4 - was slower, up to 2.6x on 8B gate/up: the per-round __syncthreads and the shorter slices
// cost more than the idle warps.)
template <int K>
__device__ __forceinline__ int k_split(int num_pairs, int grid_warps) {
  constexpr int kVecs = K / kVecElems;
  int split = 1;
  while (2 * split <= kWarps && 2 * split * num_pairs <= grid_warps &&
         kVecs % (2 * split * kWarpSize * kLoadsInFlight) == 0)
    split *= 2;
  return split;
}

// Every warp of the grid takes pairs of rows in turn. rows(p) -> {w0, w1} gives pair p's two rows
// (each K long); lane 0 of one warp then calls epilogue(p, dot0, dot1). When warps share a pair
// (k_split), they are warps of one CTA and add their slices through split_sums (shared, [kWarps]).
template <int K, class Rows, class Epilogue>
__device__ __forceinline__ void gemv_row_pairs(int num_pairs, const bf16* x, Rows rows, float2* split_sums,
                                               Epilogue epilogue) {
  static_assert(K % kVecElems == 0, "row length must be a multiple of 8");
  constexpr int kVecs = K / kVecElems;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int grid_warps = gridDim.x * kWarps;
  const int split = k_split<K>(num_pairs, grid_warps);
  if (split == 1) {
    for (int p = blockIdx.x * kWarps + warp; p < num_pairs; p += grid_warps) {
      const RowPair pair = rows(p);
      const float2 d = dot_rows2(pair.w0, pair.w1, x, lane, 0, kVecs);
      if (lane == 0) epilogue(p, d.x, d.y);
    }
    return;
  }
  const int pairs_per_cta = kWarps / split, slice = warp % split, slice_vecs = kVecs / split;
  // The loop condition is the same for the whole CTA: its __syncthreads are reached by every thread.
  for (int first = blockIdx.x * pairs_per_cta; first < num_pairs; first += gridDim.x * pairs_per_cta) {
    const int p = first + warp / split;
    if (p < num_pairs) {
      const RowPair pair = rows(p);
      const float2 d = dot_rows2(pair.w0, pair.w1, x, lane, slice * slice_vecs, (slice + 1) * slice_vecs);
      if (lane == 0) split_sums[warp] = d;
    }
    __syncthreads();
    if (p < num_pairs && slice == 0 && lane == 0) {
      float2 d = split_sums[warp];
      for (int i = 1; i < split; ++i) d.x += split_sums[warp + i].x, d.y += split_sums[warp + i].y;
      epilogue(p, d.x, d.y);
    }
    __syncthreads();  // split_sums is rewritten by the next round
  }
}

}  // namespace megakernel
