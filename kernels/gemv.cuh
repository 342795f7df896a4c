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

// (w0 . x, w1 . x) for two weight rows of length K and x (shared, bf16 [K]); every lane gets both.
template <int K>
__device__ __forceinline__ float2 dot_rows2(const bf16* w0, const bf16* w1, const bf16* x, int lane) {
  static_assert(K % kVecElems == 0, "row length must be a multiple of 8");
  constexpr int kVecs = K / kVecElems;
  constexpr int kStride = kWarpSize * kLoadsInFlight;
  const uint4* x_vec = reinterpret_cast<const uint4*>(x);
  float acc0 = 0.f, acc1 = 0.f;
  for (int base = 0; base < kVecs; base += kStride) {
    uint4 r0[kLoadsInFlight], r1[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int v = base + u * kWarpSize + lane;
      r0[u] = r1[u] = make_uint4(0, 0, 0, 0);
      if (kVecs % kStride == 0 || v < kVecs) {
        r0[u] = load_weights16(w0 + v * kVecElems);
        r1[u] = load_weights16(w1 + v * kVecElems);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int v = base + u * kWarpSize + lane;
      if (kVecs % kStride == 0 || v < kVecs) {
        const uint4 xv = x_vec[v];
        acc0 = dot8(r0[u], xv, acc0);
        acc1 = dot8(r1[u], xv, acc1);
      }
    }
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

// Every warp of the grid takes pairs of rows in turn. rows(p) -> {w0, w1} gives pair p's two rows
// (each K long); lane 0 of the warp then calls epilogue(p, dot0, dot1).
template <int K, class Rows, class Epilogue>
__device__ __forceinline__ void gemv_row_pairs(int num_pairs, const bf16* x, Rows rows, Epilogue epilogue) {
  const int lane = threadIdx.x % kWarpSize;
  const int grid_warps = gridDim.x * kWarps;
  for (int p = blockIdx.x * kWarps + threadIdx.x / kWarpSize; p < num_pairs; p += grid_warps) {
    const RowPair pair = rows(p);
    const float2 d = dot_rows2<K>(pair.w0, pair.w1, x, lane);
    if (lane == 0) epilogue(p, d.x, d.y);
  }
}

}  // namespace megakernel
