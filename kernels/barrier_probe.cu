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
// Between arriving and waiting, the CTA reads ahead into the next stage (in shared memory by the
// copy engine, and in registers as prefetch_weights does). Timed with the step's own edges and
// with none, it shows what the edges alone cost a step that streams at the loads' rate, with no
// dependent work at all.
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

__device__ __forceinline__ unsigned fold_words(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// The CTA's slice of stage s: [first, end) of data's vectors.
struct StreamSlice {
  long long first, end;
};

__device__ __forceinline__ StreamSlice stream_slice(const long long* stage_ends, int s) {
  const long long begin = s == 0 ? 0 : stage_ends[s - 1], count = stage_ends[s] - begin;
  return StreamSlice{begin + count * blockIdx.x / gridDim.x, begin + count * (blockIdx.x + 1) / gridDim.x};
}

// The bulk copy engine (TMA) filling shared memory, completing on an mbarrier: the lookahead of
// stream_stages, which holds no registers and no load slots of the SM's warps while it is in flight.
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A phase of `barrier` completes after `arrivals` arrivals (and the bytes they expect, if any).
__device__ __forceinline__ void mbarrier_init(unsigned long long* barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}

// Thread 0: bytes (a multiple of 16) at src into dst (both 16-byte aligned), completing the
// mbarrier's current phase. The fence orders the CTA's earlier reads of dst (before a
// __syncthreads) before the copy engine's writes.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    unsigned long long* barrier) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(barrier))
               : "memory");
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long* barrier, unsigned phase) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(shared_address(barrier)), "r"(phase)
                 : "memory");
  }
}

// At each barrier the CTA reads ahead into the next stage: thread 0 has the copy engine bring its
// first `lookahead_vecs` vectors (the dynamic shared memory, 16 bytes each) and the first
// `ahead_warps` warps load their first chunk of the rest into registers, as prefetch_weights does.
__global__ void __launch_bounds__(kThreads, 1)
    stream_stages(unsigned* counter, int stages, const uint4* __restrict__ data, const long long* __restrict__ stage_ends,
                  const int* __restrict__ edge_after, int ahead_warps, int lookahead_vecs, unsigned* checksum) {
  extern __shared__ uint4 lookahead[];  // [lookahead_vecs]
  __shared__ unsigned long long lookahead_landed;
  if (threadIdx.x == 0) mbarrier_init(&lookahead_landed, 1);
  __syncthreads();
  const bool loads_ahead = static_cast<int>(threadIdx.x) / kWarpSize < ahead_warps;
  unsigned folded = 0, phase = 0;
  StreamChunk ahead;
  bool have_ahead = false;  // `ahead` holds this thread's first chunk of the stage's register part
  long long copied = 0;     // the stage's first vectors of the CTA's slice, in `lookahead`
  for (int s = 0; s < stages; ++s) {
    const StreamSlice slice = stream_slice(stage_ends, s);
    if (copied > 0) {
      mbarrier_wait(&lookahead_landed, phase);
      phase ^= 1;
      for (long long i = threadIdx.x; i < copied; i += kThreads) folded ^= fold_words(lookahead[i]);
    }
    for (long long base = slice.first + copied; base < slice.end; base += kChunkLoads * kThreads) {
      StreamChunk chunk;
      if (base == slice.first + copied && have_ahead)
        chunk = ahead;
      else
        load_stream_chunk(data, base, slice.end, chunk);
#pragma unroll
      for (int u = 0; u < kChunkLoads; ++u) folded ^= fold_words(chunk.vec[u]);
    }
    have_ahead = false;
    copied = 0;
    if (edge_after[s]) {
      const unsigned before = grid_arrive(counter);  // its __syncthreads: every read of `lookahead` is done
      if (s + 1 < stages) {
        const StreamSlice next = stream_slice(stage_ends, s + 1);
        copied = min(static_cast<long long>(lookahead_vecs), next.end - next.first);
        if (threadIdx.x == 0 && copied > 0)
          bulk_copy_to_shared(lookahead, data + next.first, static_cast<unsigned>(copied * sizeof(uint4)),
                              &lookahead_landed);
        if (loads_ahead) {
          load_stream_chunk(data, next.first + copied, next.end, ahead);
          have_ahead = true;
        }
      }
      grid_wait(counter, before);
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) folded ^= __shfl_xor_sync(kFullMask, folded, offset);
  if (threadIdx.x % kWarpSize == 0) atomicXor(checksum, folded);
}

// stream_stages_ring streams the same slices with the loads taken off the edges, as a megakernel
// with a loader warp per SM would: the CTA's last warp only has the copy engine bring its slices
// of every stage, in order, into a ring of kRingSlots slots of shared memory (slot_vecs vectors
// each), and waits for nothing but a free slot; the other warps fold the slots in the same order
// and alone cross the grid barriers. While they wait at one, the loader's copies of the next
// stage's bytes keep HBM busy until the ring is full.
constexpr int kLoaderWarp = kWarps - 1;
constexpr int kRingConsumers = kLoaderWarp * kWarpSize;  // the threads that fold and cross the barriers
constexpr unsigned kRingConsumersBarrier = 1;  // a named hardware barrier of theirs (0 is __syncthreads')
using RingConsumers = FirstThreads<kRingConsumersBarrier, kRingConsumers>;

// The CTA's slices of all stages, cut into chunks of at most slot_vecs vectors: chunk k fills slot
// k % kRingSlots for the (k / kRingSlots)-th time. The loader and the consumers walk it alike.
struct RingChunk {
  long long first, count, index;
};

template <class Visit>
__device__ __forceinline__ void for_each_ring_chunk(const long long* stage_ends, int s, int slot_vecs,
                                                    long long& index, Visit visit) {
  const StreamSlice slice = stream_slice(stage_ends, s);
  for (long long v = slice.first; v < slice.end; v += slot_vecs, ++index)
    visit(RingChunk{v, min(static_cast<long long>(slot_vecs), slice.end - v), index});
}

template <int kRingSlots>
__global__ void __launch_bounds__(kThreads, 1)
    stream_stages_ring(unsigned* counter, int stages, const uint4* __restrict__ data,
                       const long long* __restrict__ stage_ends, const int* __restrict__ edge_after, int slot_vecs,
                       unsigned* checksum) {
  static_assert(kRingSlots >= 2, "one slot filling while another is folded");
  extern __shared__ uint4 ring[];  // [kRingSlots][slot_vecs]
  __shared__ unsigned long long slot_full[kRingSlots], slot_free[kRingSlots];
  if (threadIdx.x == 0) {
    for (int i = 0; i < kRingSlots; ++i) {
      mbarrier_init(&slot_full[i], 1);                           // the loader's expect_tx arrival
      mbarrier_init(&slot_free[i], kRingConsumers / kWarpSize);  // one arrival per consumer warp
    }
  }
  __syncthreads();
  long long index = 0;
  if (threadIdx.x / kWarpSize == kLoaderWarp) {
    if (threadIdx.x % kWarpSize == 0) {
      for (int s = 0; s < stages; ++s)
        for_each_ring_chunk(stage_ends, s, slot_vecs, index, [&](const RingChunk& chunk) {
          const int slot = chunk.index % kRingSlots;
          const long long fill = chunk.index / kRingSlots;
          if (fill > 0) mbarrier_wait(&slot_free[slot], (fill - 1) & 1);  // its previous fill folded
          bulk_copy_to_shared(ring + static_cast<long long>(slot) * slot_vecs, data + chunk.first,
                              static_cast<unsigned>(chunk.count * sizeof(uint4)), &slot_full[slot]);
        });
    }
    return;  // never at a barrier: the consumers' named barrier counts only their own warps
  }
  unsigned folded = 0;
  for (int s = 0; s < stages; ++s) {
    for_each_ring_chunk(stage_ends, s, slot_vecs, index, [&](const RingChunk& chunk) {
      const int slot = chunk.index % kRingSlots;
      mbarrier_wait(&slot_full[slot], (chunk.index / kRingSlots) & 1);
      const uint4* landed = ring + static_cast<long long>(slot) * slot_vecs;
      for (long long i = threadIdx.x; i < chunk.count; i += kRingConsumers) folded ^= fold_words(landed[i]);
      __syncwarp();
      if (threadIdx.x % kWarpSize == 0) mbarrier_arrive(&slot_free[slot]);
    });
    if (edge_after[s]) grid_wait<RingConsumers>(counter, grid_arrive<RingConsumers>(counter));
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) folded ^= __shfl_xor_sync(kFullMask, folded, offset);
  if (threadIdx.x % kWarpSize == 0) atomicXor(checksum, folded);
}

}  // namespace megakernel
