// Batch-1 GEMV building blocks: an activation vector RMS-normed into shared memory and every warp
// of the grid streaming pairs of weight rows against it, or a CTA's slice of an input against the
// rows of a transposed weight, added to fp32 sums.
#pragma once
#include "common.cuh"

namespace megakernel {

// 16-byte loads per row per lane issued before the first FMA: 16 warps x 32 lanes x 2 rows x 4
// loads x 16 B keeps 64 KB of weights in flight per SM. (Measured on H200: 8 loads for the stages
// with about one row pair per warp, plus L2 prefetch of the next stage's first rows before each
// barrier, made the 8B step 3% slower, so neither is used; loading the first chunk into registers
// between arriving at the barrier and waiting on it, prefetch_weights, made 1B 4% faster.)
constexpr int kLoadsInFlight = 4;

// Two weight rows that one warp streams together. Usually two rows of the matrix against the same
// input; for one row split into halves, w1 is its second half and reads x from x1_offset on.
struct RowPair {
  const bf16* w0;
  const bf16* w1;
  int x1_offset = 0;  // in 16-byte vectors of x
};

// Contiguous slices of N items: slice i of count is [i * N / count, (i + 1) * N / count).
struct CtaSlice {
  int first, rows;
};

template <int N>
__device__ __forceinline__ CtaSlice slice_of(int index, int count) {
  const int first = index * N / count;
  return CtaSlice{first, (index + 1) * N / count - first};
}

// This CTA's slice of N items, one slice per CTA of the grid.
template <int N>
__device__ __forceinline__ CtaSlice cta_slice() {
  return slice_of<N>(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

// The residual stream after kProjections projections, in order: bf16(bf16(residual +
// bf16(p0)) + bf16(p1)), as Hugging Face rounds each projection and then each sum. The
// projections arrive as fp32 sums that every CTA added its share to (gemv_transposed_rows):
// down's, then O's. Vector i = elements [8i, 8i + 8).
__device__ __forceinline__ float add_projection(float residual, float projection) {
  return bf16_round(residual + bf16_round(projection));
}

template <int kProjections>
struct ResidualPlusProjections {
  const bf16* residual;
  const float* sums[kProjections];
  __device__ uint4 operator()(int i) const {
    const uint4 r = load_activations16(residual + i * kVecElems);
    float4 lo[kProjections], hi[kProjections];
#pragma unroll
    for (int p = 0; p < kProjections; ++p) {  // every load issued before the first add
      lo[p] = __ldcg(reinterpret_cast<const float4*>(sums[p]) + 2 * i);
      hi[p] = __ldcg(reinterpret_cast<const float4*>(sums[p]) + 2 * i + 1);
    }
    unsigned sum[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = bf16x2_to_float2(word(r, j));
#pragma unroll
      for (int p = 0; p < kProjections; ++p) {
        const float o[kVecElems] = {lo[p].x, lo[p].y, lo[p].z, lo[p].w, hi[p].x, hi[p].y, hi[p].z, hi[p].w};
        f = make_float2(add_projection(f.x, o[2 * j]), add_projection(f.y, o[2 * j + 1]));
      }
      sum[j] = float2_to_bf16x2(f.x, f.y);
    }
    return make_uint4(sum[0], sum[1], sum[2], sum[3]);
  }
};

// What rms_norm_to_shared does with its input vectors besides norming them: nothing, or (KeepSlice)
// store the vectors [slice.first, slice.first + slice.rows) to out, this CTA's slice of a vector
// that the next stages read whole.
struct DropInput {
  __device__ void operator()(int, const uint4&) const {}
};

struct KeepSlice {
  bf16* out;
  CtaSlice slice;  // in 16-byte vectors
  __device__ void operator()(int i, const uint4& v) const {
    if (i >= slice.first && i < slice.first + slice.rows) reinterpret_cast<uint4*>(out)[i] = v;
  }
};

// out (shared, bf16 [N]) = weight * bf16(x * rsqrt(mean(x^2) + eps)), Hugging Face's RMSNorm:
// statistics in fp32, the normalised value rounded to bf16 before the weight multiplies it. x(i)
// loads x's 16-byte vector i (ResidualPlusProjections), which keep(i, vector) may also store; x
// and the weight are both loaded before the reduction, so the stage pays one load latency, not two.
template <int N, class Vectors, class Keep = DropInput>
__device__ __forceinline__ void rms_norm_to_shared(Vectors x, const bf16* weight, float eps, bf16* out,
                                                   float* scratch, Keep keep = {}) {
  static_assert(N % kVecElems == 0, "vector length must be a multiple of 8");
  constexpr int kVecs = N / kVecElems;
  constexpr int kPerThread = (kVecs + kThreads - 1) / kThreads;
  uint4 xs[kPerThread], ws[kPerThread];
  float sum_squares = 0.f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kThreads;
    xs[k] = ws[k] = make_uint4(0, 0, 0, 0);
    if (i < kVecs) {
      xs[k] = x(i);
      ws[k] = __ldg(reinterpret_cast<const uint4*>(weight) + i);
      keep(i, xs[k]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = bf16x2_to_float2(word(xs[k], j));
      sum_squares = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_squares));
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / N + eps);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kThreads;
    unsigned normed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = bf16x2_to_float2(word(xs[k], j));
      const float2 g = bf16x2_to_float2(word(ws[k], j));
      normed[j] = float2_to_bf16x2(g.x * bf16_round(f.x * inv_rms), g.y * bf16_round(f.y * inv_rms));
    }
    if (i < kVecs) reinterpret_cast<uint4*>(out)[i] = make_uint4(normed[0], normed[1], normed[2], normed[3]);
  }
  __syncthreads();
}

// How many warps share one row pair, each reading a 1/split slice of K: only when whole rows would
// leave at least half of the streaming warps idle (Llama-3.2-1B's O: 1,024 pairs for 2,112
// warps on 132 SMs), the largest power of 2 with split * pairs <= warps. Each slice keeps
// kLoadsInFlight loads per lane and row, and split divides the CTA's warps. (Measured on H200:
// splitting to even out a last partial round - 8B QKV's 1.45 rounds, gate/up's 6.8, the LM head's
// 30.4 - was slower, up to 2.6x on 8B gate/up: the per-round __syncthreads and the shorter slices
// cost more than the idle warps.)
template <int K>
__device__ __forceinline__ int k_split(int num_pairs, int streaming_warps) {
  constexpr int kVecs = K / kVecElems;
  int split = 1;
  while (2 * split <= kWarps && 2 * split * num_pairs <= streaming_warps &&
         kVecs % (2 * split * kWarpSize * kLoadsInFlight) == 0)
    split *= 2;
  return split;
}

// The CTAs that stream a GEMV's rows: this CTA is number `index` of `count`. Usually the whole
// grid; the QKV projection gives each KV head's rows to a group of CTAs of their own.
struct CtaRange {
  int index, count;
};

__device__ __forceinline__ CtaRange whole_grid() {
  return CtaRange{static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)};
}

// A warp's share of a GEMV: row pairs first_pair, first_pair + pair_stride, ..., each over the
// 16-byte vectors [begin, end) of K, with `split` warps of one CTA on every pair.
struct WarpShare {
  int split, first_pair, pair_stride, begin, end;
};

template <int K>
__device__ __forceinline__ WarpShare warp_share(int num_pairs, CtaRange ctas) {
  constexpr int kVecs = K / kVecElems;
  const int warp = threadIdx.x / kWarpSize;
  const int split = k_split<K>(num_pairs, ctas.count * kWarps);
  const int pairs_per_cta = kWarps / split, slice = warp % split, slice_vecs = kVecs / split;
  return WarpShare{split, ctas.index * pairs_per_cta + warp / split, ctas.count * pairs_per_cta, slice * slice_vecs,
                   (slice + 1) * slice_vecs};
}

// kLoadsInFlight 16-byte loads per lane from each row of a pair, starting at vector `base`.
struct WeightChunk {
  uint4 r0[kLoadsInFlight], r1[kLoadsInFlight];
  // The chunk as 2 x kLoadsInFlight loads in a row (gemv_transposed_rows); u is a compile-time constant.
  __device__ __forceinline__ uint4& load(int u) { return u < kLoadsInFlight ? r0[u] : r1[u - kLoadsInFlight]; }
};

__device__ __forceinline__ void load_chunk(const RowPair& pair, int base, int end, int lane, WeightChunk& chunk) {
#pragma unroll
  for (int u = 0; u < kLoadsInFlight; ++u) {
    const int v = base + u * kWarpSize + lane;
    chunk.r0[u] = chunk.r1[u] = make_uint4(0, 0, 0, 0);
    if (v < end) {
      chunk.r0[u] = load_weights16(pair.w0 + v * kVecElems);
      chunk.r1[u] = load_weights16(pair.w1 + v * kVecElems);
    }
  }
}

// The first chunk of this warp's first row pair in a GEMV, loaded before the grid barrier that
// precedes it: weights never depend on activations, so their HBM latency runs under the barrier
// wait and the staging of the input vector instead of after them. Only the CTA's first
// kAheadWarps warps do (the others' chunks are empty and they load theirs after the barrier;
// gemv_row_pairs takes the same count):
// every warp's chunk, 8.4 MB over the grid, reached HBM as one burst that the barrier's own
// polls queued behind (measured on H200, run 42: half the warps made the 8B step 1.2% faster
// and Qwen3-8B 1.8%, 1B the same; none of them, run 31, slower). (A warp with no pair in this
// GEMV loads the last pair's chunk, which that pair's warp reads too, and never uses it.)
constexpr int kPrefetchWarps = kWarps / 2;

template <int K, int kAheadWarps = kPrefetchWarps, class Rows>
__device__ __forceinline__ WeightChunk prefetch_weights(int num_pairs, CtaRange ctas, Rows rows) {
  static_assert(kAheadWarps > 0 && kAheadWarps <= kWarps, "a CTA has kWarps warps");
  const WarpShare share = warp_share<K>(num_pairs, ctas);
  const bool prefetches = static_cast<int>(threadIdx.x) / kWarpSize < kAheadWarps;
  WeightChunk chunk;  // an empty range of vectors for the other warps: every load masked
  load_chunk(rows(min(share.first_pair, num_pairs - 1)), share.begin, prefetches ? share.end : share.begin,
             threadIdx.x % kWarpSize, chunk);
  return chunk;
}

// The rest of this warp's share of a GEMV, what prefetch_weights leaves in HBM (every pair, less
// the first chunk of the first pair where the warp prefetched it), fetched into L2 by the TMA:
// lane 0 issues one bulk prefetch per row of a pair.
template <int K, int kAheadWarps = kPrefetchWarps, class Rows>
__device__ __forceinline__ void prefetch_rest_to_l2(int num_pairs, CtaRange ctas, Rows rows) {
  constexpr int kChunkVecs = kWarpSize * kLoadsInFlight;
  const WarpShare share = warp_share<K>(num_pairs, ctas);
  if (threadIdx.x % kWarpSize != 0) return;
  const bool prefetched_first = static_cast<int>(threadIdx.x) / kWarpSize < kAheadWarps;
  for (int p = share.first_pair; p < num_pairs; p += share.pair_stride) {
    const int begin = share.begin + (p == share.first_pair && prefetched_first ? kChunkVecs : 0);
    if (begin >= share.end) continue;
    const RowPair pair = rows(p);
    const unsigned bytes = static_cast<unsigned>(share.end - begin) * kVecElems * sizeof(bf16);
    prefetch_to_l2(pair.w0 + begin * kVecElems, bytes);
    prefetch_to_l2(pair.w1 + begin * kVecElems, bytes);
  }
}

// (w0 . x, w1 . x) over the 16-byte vectors [begin, end) of two weight rows and x (shared, bf16);
// every lane gets both. With use_ahead, `ahead` holds the first chunk, already loaded.
__device__ __forceinline__ float2 dot_rows2(const RowPair& pair, const bf16* x, int lane, int begin, int end,
                                            const WeightChunk& ahead, bool use_ahead) {
  constexpr int kStride = kWarpSize * kLoadsInFlight;
  const uint4* x_vec = reinterpret_cast<const uint4*>(x);
  float acc0 = 0.f, acc1 = 0.f;
  for (int base = begin; base < end; base += kStride) {
    WeightChunk chunk;
    if (use_ahead && base == begin)
      chunk = ahead;
    else
      load_chunk(pair, base, end, lane, chunk);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int v = base + u * kWarpSize + lane;
      if (v < end) {
        acc0 = dot8(chunk.r0[u], x_vec[v], acc0);
        acc1 = dot8(chunk.r1[u], x_vec[v + pair.x1_offset], acc1);
      }
    }
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

// Every warp of the CTAs `ctas` takes pairs of rows in turn. rows(p) -> {w0, w1} gives pair p's two rows
// (each K long); lane 0 of one warp then calls epilogue(p, dot0, dot1, operand(p)), where
// operand(p) (e.g. the residual the result adds to) is loaded before the pair's dot product, so its
// latency runs under the weights'. `ahead` is this warp's prefetch_weights<K, kAheadWarps> for the
// same GEMV. When warps share a pair (k_split), they are warps of one CTA and add their slices
// through split_sums (shared, [kWarps]).
template <int K, int kAheadWarps = kPrefetchWarps, class Rows, class Operand, class Epilogue>
__device__ __forceinline__ void gemv_row_pairs(int num_pairs, CtaRange ctas, const bf16* x, Rows rows,
                                               float2* split_sums, const WeightChunk& ahead, Operand operand,
                                               Epilogue epilogue) {
  static_assert(K % kVecElems == 0, "row length must be a multiple of 8");
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const WarpShare share = warp_share<K>(num_pairs, ctas);
  if (share.split == 1) {
    for (int p = share.first_pair; p < num_pairs; p += share.pair_stride) {
      const auto value = operand(p);
      const float2 d = dot_rows2(rows(p), x, lane, share.begin, share.end, ahead,
                                 p == share.first_pair && warp < kAheadWarps);
      if (lane == 0) epilogue(p, d.x, d.y, value);
    }
    return;
  }
  const int lead = warp / share.split;  // this warp's pair among the CTA's pairs of a round
  // p - lead is the CTA's first pair of the round: the loop condition is the same for the whole
  // CTA, so its __syncthreads are reached by every thread.
  for (int p = share.first_pair; p - lead < num_pairs; p += share.pair_stride) {
    const bool mine = p < num_pairs && warp % share.split == 0;  // this warp finishes pair p
    const auto value = operand(mine ? p : 0);
    if (p < num_pairs) {
      const float2 d = dot_rows2(rows(p), x, lane, share.begin, share.end, ahead,
                                 p == share.first_pair && warp < kAheadWarps);
      if (lane == 0) split_sums[warp] = d;
    }
    __syncthreads();
    if (mine && lane == 0) {
      float2 d = split_sums[warp];
      for (int i = 1; i < share.split; ++i) d.x += split_sums[warp + i].x, d.y += split_sums[warp + i].y;
      epilogue(p, d.x, d.y, value);
    }
    __syncthreads();  // split_sums is rewritten by the next round
  }
}

// The same for an epilogue that needs no operand: epilogue(p, dot0, dot1).
template <int K, class Rows, class Epilogue>
__device__ __forceinline__ void gemv_row_pairs(int num_pairs, CtaRange ctas, const bf16* x, Rows rows,
                                               float2* split_sums, const WeightChunk& ahead, Epilogue epilogue) {
  gemv_row_pairs<K>(num_pairs, ctas, x, rows, split_sums, ahead, [](int) { return 0; },
                    [&](int p, float d0, float d1, int) { epilogue(p, d0, d1); });
}

// sums (global fp32, [N]) += x . wt over the CTA's `rows` rows: wt is [rows, N], rows kRowStride
// elements apart (a GEMV's weight stored transposed, the CTA's rows of it, or N columns of them
// where the CTA adds to a group of the outputs, as O's do) and x (shared, [rows]) their inputs, so
// sums[n] += sum_r x[r] * wt[r, n], added atomically: each CTA adds the share of every output that
// its slice of the input contributes. The down projection runs this way on the slice of the MLP
// activation that the CTA computed itself, so no grid barrier separates gate/up from down.
// Warp w owns the N / kWarps columns [w * N / kWarps, (w + 1) * N / kWarps) of every row, a lane
// 16-byte vectors of them; a chunk is kRowGroups x kVecsPerLane loads per lane, as many as a row
// pair's chunk, over kRowsPerChunk rows. (8B: 256 columns per warp, a vector per lane, 8 rows per
// chunk; Llama-3.2-1B: 128 columns, 16 lanes per row, 16 rows per chunk.)
template <int N>
struct TransposedTiling {
  static constexpr int kSlabVecs = N / kWarps / kVecElems;  // one warp's 16-byte vectors of a row
  static constexpr int kLanesPerRow = kSlabVecs < kWarpSize ? pow2_ceil(kSlabVecs) : kWarpSize;
  static constexpr int kVecsPerLane = (kSlabVecs + kLanesPerRow - 1) / kLanesPerRow;
  static constexpr int kRowsPerLoad = kWarpSize / kLanesPerRow;  // rows one warp-wide load covers
  static constexpr int kRowGroups = 2 * kLoadsInFlight / kVecsPerLane;
  static constexpr int kRowsPerChunk = kRowGroups * kRowsPerLoad;
  static_assert(N % (kWarps * kVecElems) == 0, "the output length must be a multiple of 128");
  static_assert(kRowGroups >= 1, "a lane holds its vectors of a row in one chunk: at most 32,768 outputs");
};

// Chunk c of the rows (rows [c * kRowsPerChunk, (c + 1) * kRowsPerChunk)), this lane's loads: load
// u is row group u / kVecsPerLane, the lane's vector u % kVecsPerLane of that row. Rows are
// kRowStride elements apart (N, or the whole row where the CTA adds to N of its columns).
template <int N, int kRowStride = N>
__device__ __forceinline__ void load_transposed_chunk(const bf16* wt, int rows, int c, WeightChunk& chunk) {
  using T = TransposedTiling<N>;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int row0 = c * T::kRowsPerChunk + lane / T::kLanesPerRow;
#pragma unroll
  for (int u = 0; u < T::kRowGroups * T::kVecsPerLane; ++u) {
    const int row = row0 + (u / T::kVecsPerLane) * T::kRowsPerLoad;
    const int vec = lane % T::kLanesPerRow + (u % T::kVecsPerLane) * T::kLanesPerRow;
    chunk.load(u) = make_uint4(0, 0, 0, 0);
    if (row < rows && vec < T::kSlabVecs)
      chunk.load(u) = load_weights16(wt + static_cast<size_t>(row) * kRowStride + (warp * T::kSlabVecs + vec) * kVecElems);
  }
}

// The first chunk, loaded before x is ready (weights never depend on activations), by the CTA's
// first ahead_warps warps (the others load theirs in gemv_transposed_rows, which takes the same
// count).
template <int N, int kRowStride = N>
__device__ __forceinline__ WeightChunk prefetch_transposed(const bf16* wt, int rows, int ahead_warps = kWarps) {
  WeightChunk chunk;
  const bool prefetches = static_cast<int>(threadIdx.x) / kWarpSize < ahead_warps;
  load_transposed_chunk<N, kRowStride>(wt, prefetches ? rows : 0, 0, chunk);
  return chunk;
}

template <int N, int kRowStride = N>
__device__ __forceinline__ void gemv_transposed_rows(const bf16* wt, int rows, const float* x,
                                                     const WeightChunk& ahead, float* sums,
                                                     int ahead_warps = kWarps) {
  using T = TransposedTiling<N>;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  float acc[T::kVecsPerLane][kVecElems] = {};
  const int chunks = (rows + T::kRowsPerChunk - 1) / T::kRowsPerChunk;
  for (int c = 0; c < chunks; ++c) {
    WeightChunk chunk;
    if (c == 0 && warp < ahead_warps)
      chunk = ahead;
    else
      load_transposed_chunk<N, kRowStride>(wt, rows, c, chunk);
#pragma unroll
    for (int group = 0; group < T::kRowGroups; ++group) {
      const int row = c * T::kRowsPerChunk + group * T::kRowsPerLoad + lane / T::kLanesPerRow;
      const float xr = row < rows ? x[row] : 0.f;
#pragma unroll
      for (int k = 0; k < T::kVecsPerLane; ++k) {
        const uint4 w = chunk.load(group * T::kVecsPerLane + k);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = bf16x2_to_float2(word(w, j));
          acc[k][2 * j] = fmaf(xr, f.x, acc[k][2 * j]);
          acc[k][2 * j + 1] = fmaf(xr, f.y, acc[k][2 * j + 1]);
        }
      }
    }
  }
  // Lanes that hold the same columns of different rows add up, then one of them adds to sums.
#pragma unroll
  for (int k = 0; k < T::kVecsPerLane; ++k)
#pragma unroll
    for (int e = 0; e < kVecElems; ++e)
#pragma unroll
      for (int offset = T::kLanesPerRow; offset < kWarpSize; offset *= 2)
        acc[k][e] += __shfl_xor_sync(kFullMask, acc[k][e], offset);
  if (lane < T::kLanesPerRow) {
#pragma unroll
    for (int k = 0; k < T::kVecsPerLane; ++k) {
      const int vec = lane + k * T::kLanesPerRow;
      if (vec < T::kSlabVecs) {
        float* out = sums + (warp * T::kSlabVecs + vec) * kVecElems;
        add_to_global4(out, make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]));
        add_to_global4(out + 4, make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]));
      }
    }
  }
}

}  // namespace megakernel
