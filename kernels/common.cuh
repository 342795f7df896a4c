// Shared device helpers of the decode megakernel: bf16 vectors, loads with the right cache policy,
// warp/block reductions, the grid-wide barrier and the stage timer.
#pragma once
#include <cuda/std/limits>
#include <cuda_bf16.h>

namespace megakernel {

using bf16 = __nv_bfloat16;

constexpr int kWarpSize = 32;
constexpr int kThreads = 512;  // one CTA per SM; 16 warps keep ~64 KB of weight loads in flight
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kVecElems = 8;  // bf16 per 16-byte load
constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kBarrierFlipBit = 0x80000000u;

// Weights are read exactly once per step: stream them past L1 through the non-coherent path.
__device__ __forceinline__ uint4 load_weights16(const bf16* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Has the TMA fetch `bytes` (a multiple of 16) at `p` (16-byte aligned) from HBM into L2: nothing
// lands in the SM, and the issuing thread goes on at once. For weights that a later stage reads
// after a grid barrier, fetched while HBM would otherwise idle, so that its loads hit L2.
__device__ __forceinline__ void prefetch_to_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Activations are written by other CTAs earlier in the same launch: read them from L2 (never a
// possibly stale L1 line, never the non-coherent path).
__device__ __forceinline__ uint4 load_activations16(const bf16* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}

// Powers of 2 around n (n >= 1), for tile sizes fixed at compile time.
__host__ __device__ constexpr int pow2_floor(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

__host__ __device__ constexpr int pow2_ceil(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// sums[0..3] += v with one vector atomic at L2 (sm_90: red.global.add.v4.f32; sums 16-byte aligned).
__device__ __forceinline__ void add_to_global4(float* sums, float4 v) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(sums), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
}

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The four 32-bit words of a 16-byte vector, each two bf16 (element 0 in the low half). Working on
// words by value, never through a pointer into the vector, keeps the vector in registers: a
// pointer cast put RMSNorm's vectors on the stack, in local memory (a round trip to L1, or to L2
// once shared memory takes most of L1).
__device__ __forceinline__ unsigned word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

__device__ __forceinline__ float2 bf16x2_to_float2(unsigned w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

__device__ __forceinline__ unsigned float2_to_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return static_cast<unsigned>(__bfloat16_as_ushort(h.x)) | (static_cast<unsigned>(__bfloat16_as_ushort(h.y)) << 16);
}

// dot of 8 bf16 weights with 8 bf16 activations, fp32 accumulation
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 wf = __bfloat1622float2(w2[i]);
    const float2 xf = __bfloat1622float2(x2[i]);
    acc = fmaf(wf.x, xf.x, acc);
    acc = fmaf(wf.y, xf.y, acc);
  }
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const unsigned long long other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Sum over the CTA; every thread gets the total. scratch: [kWarps] floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused at once
  return total;
}

// The threads of a CTA that take part in its side of a grid barrier or count: all of them, or, in a
// kernel whose last warps never wait on other CTAs (a loader that only fills shared memory), the
// first kCount threads on named hardware barrier kId (0 is __syncthreads' own). Thread 0 is always
// one of them.
struct WholeCta {
  __device__ __forceinline__ static void sync() { __syncthreads(); }
};

template <unsigned kId, unsigned kCount>
struct FirstThreads {
  static_assert(kId > 0 && kCount % kWarpSize == 0, "a named barrier other than 0, over whole warps");
  __device__ __forceinline__ static void sync() { asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kCount) : "memory"); }
};

// Thread 0 makes the CTA's writes visible, then adds `value` to `counter`; returns the count before
// the add (meaningful in thread 0).
template <class Cta = WholeCta>
__device__ __forceinline__ unsigned publish_and_add(unsigned* counter, unsigned value) {
  Cta::sync();
  unsigned before = 0;
  if (threadIdx.x == 0) {
    __threadfence();  // this CTA's writes are visible before its arrival is
    before = atomicAdd(counter, value);
  }
  return before;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* counter) {
  unsigned now;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
  return now;
}

// Grid-wide barrier on one zero-initialised counter in global memory. Every CTA adds 1 except CTA 0,
// which adds 2^31 - (grid - 1): the counter's top bit flips exactly when the last CTA arrives and its
// low bits return to zero, so the same counter serves every barrier of every launch without a reset.
// Needs all CTAs co-resident (cooperative launch).
//
// Split in arrive and wait so that a CTA can issue loads that need nothing from this stage (the
// next GEMV's weights) in between. No fence follows the wait: a fence would stall thread 0 until
// those loads return. Thread 0's acquire load orders its later reads, __syncthreads extends that to
// the CTA, and every read of another CTA's data goes to L2 (ld.cg / ld.acquire), never to a
// possibly stale L1 line.
template <class Cta = WholeCta>
__device__ __forceinline__ unsigned grid_arrive(unsigned* counter) {
  return publish_and_add<Cta>(counter, blockIdx.x == 0 ? kBarrierFlipBit - (gridDim.x - 1) : 1u);
}

template <class Cta = WholeCta>
__device__ __forceinline__ void grid_wait(const unsigned* counter, unsigned before) {
  if (threadIdx.x == 0) {
    while (((before ^ load_acquire(counter)) & kBarrierFlipBit) == 0) {
    }
  }
  Cta::sync();
}

// `between` runs after this CTA arrives and before it waits: independent work only.
template <class Between>
__device__ __forceinline__ void grid_barrier(unsigned* counter, Between between) {
  const unsigned before = grid_arrive(counter);
  between();
  grid_wait(counter, before);
}

__device__ __forceinline__ void grid_barrier(unsigned* counter) {
  grid_wait(counter, grid_arrive(counter));
}

// A wait finer than the grid barrier: a counter that a known set of CTAs each bump once per round
// after their writes (publish_and_add(counter, 1)), and that a reader of those writes waits on
// until the round's count. It only grows within a launch; the launch's last CTA zeroes it.
// wait_for_counts waits on counters [first, end) at once: thread 0 polls them in turn, then one
// CTA barrier.
__device__ __forceinline__ void wait_for_counts(const unsigned* counters, int first, int end, unsigned target) {
  if (threadIdx.x == 0) {
    for (int i = first; i < end; ++i) {
      while (load_acquire(counters + i) < target) {
      }
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void wait_for_count(const unsigned* counter, unsigned target) {
  wait_for_counts(counter, 0, 1, target);
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Per-stage timestamps, written by CTA 0 after each grid barrier, and every CTA's arrival at each
// barrier (arrivals[barrier * grid + cta]); compiles to nothing when off. With both, a stage splits
// into the work until its last CTA arrives, the spread of the arrivals, and the barrier's release
// (from the last arrival to CTA 0 passing it).
template <bool kEnabled>
struct StageTimer {
  unsigned long long* stamps;
  unsigned long long* arrivals;
  int next = 0;
  __device__ __forceinline__ void mark() {
    if constexpr (kEnabled) {
      if (blockIdx.x == 0 && threadIdx.x == 0) stamps[next] = global_timer_ns();
      ++next;
    }
  }
  // Before the barrier that ends the current stage: this CTA is done with it.
  __device__ __forceinline__ void arrive() {
    if constexpr (kEnabled) {
      __syncthreads();
      if (threadIdx.x == 0) arrivals[static_cast<size_t>(next - 1) * gridDim.x + blockIdx.x] = global_timer_ns();
    }
  }
};

// A float that orders like its value as an unsigned integer (for max-reductions on packed keys).
__device__ __forceinline__ unsigned orderable(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (logit, index) packed so that a larger key is a larger logit, ties going to the smaller index
// (torch.argmax returns the first maximum).
__device__ __forceinline__ unsigned long long argmax_key(float logit, int index) {
  return (static_cast<unsigned long long>(orderable(logit)) << 32) | (0xffffffffu - static_cast<unsigned>(index));
}

__device__ __forceinline__ int argmax_key_index(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}

}  // namespace megakernel
