// Times the decode megakernel's grid barrier on its own: `rounds` barriers back to back with
// nothing between them, on the same grid (one CTA of kThreads per SM, cooperative launch). The
// launcher subtracts a launch with zero rounds, which leaves the cost of one barrier.
//
// barrier_after_code runs a stretch of straight-line code after each barrier: kCodeSteps steps of
// four mixing chains (a rotate by a data-dependent amount and an xor with a constant of its own per
// step, so that nothing folds or repeats), whose results go to `sink` so that nothing is dropped.
// Every round fetches the whole stretch again; the launcher compares stretches of several sizes
// (the cubin's .text size), so that the cost per KB of instructions shows whether a stage's code
// that no longer fits the SM's instruction caches costs fetches from L2 at every layer.
//
// stream_stages is the decode step with nothing but its bytes and its edges: the grid streams
// `stages` consecutive ranges of `data` (stage s: the 16-byte vectors [ends[s - 1], ends[s]), a
// contiguous slice per CTA), loading as the GEMVs load weights (load_weights16, kChunkLoads loads
// per thread in flight), and crosses a grid barrier after each stage whose edge_after[s] is set.
// Between arriving and waiting, the CTA's first `ahead_warps` warps load their first chunk of the
// next stage, as prefetch_weights does. Timed with the step's own edges and with none, it shows
// what the edges alone cost a step that streams at the loads' rate, with no dependent work at all.
// Every word loaded is folded into an XOR (atomicXor into *checksum), so that no load is dropped
// and the launcher can check that each vector was read exactly once.
#include "common.cuh"
#include "gemv.cuh"

namespace megakernel {

__global__ void __launch_bounds__(kThreads, 1) barrier_probe(unsigned* counter, int rounds) {
  for (int i = 0; i < rounds; ++i) grid_barrier(counter);
}

constexpr unsigned kGoldenRatio = 0x9e3779b9u;  // the step constants: distinct odd multiples of it

template <int kCodeSteps>
__global__ void __launch_bounds__(kThreads, 1) barrier_after_code(unsigned* counter, int rounds, unsigned* sink) {
  unsigned a = threadIdx.x, b = blockIdx.x, c = ~a, d = ~b;
  for (int i = 0; i < rounds; ++i) {
    grid_barrier(counter);
#pragma unroll
    for (int k = 0; k < kCodeSteps; ++k) {
      a = __funnelshift_l(a, a, b) ^ (kGoldenRatio * (8u * k + 1u));
      b = __funnelshift_l(b, b, c) ^ (kGoldenRatio * (8u * k + 3u));
      c = __funnelshift_l(c, c, d) ^ (kGoldenRatio * (8u * k + 5u));
      d = __funnelshift_l(d, d, a) ^ (kGoldenRatio * (8u * k + 7u));
    }
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = a ^ b ^ c ^ d;
}

constexpr int kChunkLoads = 2 * kLoadsInFlight;  // a row pair's chunk: the GEMVs' loads in flight per lane

struct StreamChunk {
  uint4 vec[kChunkLoads];
};

// Vectors [base, base + kChunkLoads * kThreads) of the CTA's slice, those before `end`; vector
// base + u * kThreads + threadIdx.x is this thread's load u (a warp's 32 lanes read 512 bytes in a row).
__device__ __forceinline__ void load_stream_chunk(const uint4* data, long long base, long long end, StreamChunk& chunk) {
#pragma unroll
  for (int u = 0; u < kChunkLoads; ++u) {
    const long long v = base + u * kThreads + threadIdx.x;
    chunk.vec[u] = v < end ? load_weights16(reinterpret_cast<const bf16*>(data + v)) : make_uint4(0, 0, 0, 0);
  }
}

// The CTA's slice of stage s: [first, end) of data's vectors.
struct StreamSlice {
  long long first, end;
};

__device__ __forceinline__ StreamSlice stream_slice(const long long* stage_ends, int s) {
  const long long begin = s == 0 ? 0 : stage_ends[s - 1], count = stage_ends[s] - begin;
  return StreamSlice{begin + count * blockIdx.x / gridDim.x, begin + count * (blockIdx.x + 1) / gridDim.x};
}

__global__ void __launch_bounds__(kThreads, 1)
    stream_stages(unsigned* counter, int stages, const uint4* __restrict__ data, const long long* __restrict__ stage_ends,
                  const int* __restrict__ edge_after, int ahead_warps, unsigned* checksum) {
  const bool loads_ahead = static_cast<int>(threadIdx.x) / kWarpSize < ahead_warps;
  unsigned folded = 0;
  StreamChunk ahead;
  bool have_ahead = false;  // `ahead` holds this thread's first chunk of stage s
  for (int s = 0; s < stages; ++s) {
    const StreamSlice slice = stream_slice(stage_ends, s);
    for (long long base = slice.first; base < slice.end; base += kChunkLoads * kThreads) {
      StreamChunk chunk;
      if (base == slice.first && have_ahead)
        chunk = ahead;
      else
        load_stream_chunk(data, base, slice.end, chunk);
#pragma unroll
      for (int u = 0; u < kChunkLoads; ++u) folded ^= chunk.vec[u].x ^ chunk.vec[u].y ^ chunk.vec[u].z ^ chunk.vec[u].w;
    }
    have_ahead = false;
    if (edge_after[s]) {
      const unsigned before = grid_arrive(counter);
      if (s + 1 < stages && loads_ahead) {
        const StreamSlice next = stream_slice(stage_ends, s + 1);
        load_stream_chunk(data, next.first, next.end, ahead);
        have_ahead = true;
      }
      grid_wait(counter, before);
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) folded ^= __shfl_xor_sync(kFullMask, folded, offset);
  if (threadIdx.x % kWarpSize == 0) atomicXor(checksum, folded);
}

}  // namespace megakernel
