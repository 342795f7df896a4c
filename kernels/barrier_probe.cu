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
// per thread in flight), and crosses the edge that edge_after[s] names after each stage: a grid
// barrier, or a barrier over the CTA's group or cluster that hands a payload on (StreamEdge).
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

// The edge after a stage of stream_stages (StreamEdge in barrier_probe.py): none, the grid barrier,
// a barrier over the CTA's group of group_ctas consecutive CTAs (a count in global memory, as the
// megakernel's wait for a KV head's QKV rows is), or over the CTA's cluster (the hardware's cluster
// barrier). At a group or cluster edge each CTA hands every CTA of its group kPayloadVecs vectors,
// as the megakernel hands on QKV rows and attention partials: through global memory (L2) to its
// group, into the shared memory of each CTA of its cluster.
enum StreamEdge { kEdgeNone = 0, kEdgeGrid = 1, kEdgeGroup = 2, kEdgeCluster = 3 };
// 64 bytes: a CTA's QKV rows are 3 vectors on Llama-3.2-1B (24 bf16 rows), 6 on the 8B shapes.
constexpr int kPayloadVecs = 4;
constexpr int kMaxClusterCtas = 16;  // the largest cluster Hopper and Blackwell allow (non-portable)
constexpr int kMailboxes = 2;        // a payload's mailbox alternates by edge of its kind (see stream_stages)

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ unsigned cluster_ctas() {
  unsigned count;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(count));
  return count;
}
// v into the same address as `local` in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ void store_to_cluster_cta(const void* local, unsigned rank, uint4 v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// Payload vector v of CTA `from` at its mailed-th group or cluster edge; w carries a word of what
// the thread has read, so that it is stored only once the stage's loads are in (as a GEMV's
// outputs are). The launcher checks the sum of the received x + y + z.
__device__ __forceinline__ uint4 payload(unsigned from, unsigned mailed, unsigned v, unsigned folded) {
  return make_uint4(from + 1, mailed, v, folded);
}
__device__ __forceinline__ unsigned payload_sum(uint4 p) { return p.x + p.y + p.z; }

// At each edge the CTA reads ahead into the next stage between arriving and waiting: thread 0 has
// the copy engine bring its first `lookahead_vecs` vectors (the dynamic shared memory, 16 bytes
// each) and the first `ahead_warps` warps load their first chunk of the rest into registers, as
// prefetch_weights does. group_counts: a barrier counter per group (as `counter`, back at a phase
// boundary after every launch); exchange: [grid][kMailboxes][kPayloadVecs] vectors. checksum:
// the XOR of every word read, then the sum of the payloads received.
__global__ void __launch_bounds__(kThreads, 1)
    stream_stages(unsigned* counter, int stages, const uint4* __restrict__ data, const long long* __restrict__ stage_ends,
                  const int* __restrict__ edge_after, int ahead_warps, int lookahead_vecs, unsigned* group_counts,
                  int group_ctas, uint4* exchange, unsigned* checksum) {
  extern __shared__ uint4 lookahead[];  // [lookahead_vecs]
  __shared__ unsigned long long lookahead_landed;
  __shared__ uint4 inbox[kMailboxes][kMaxClusterCtas][kPayloadVecs];  // from each CTA of the cluster
  if (threadIdx.x == 0) mbarrier_init(&lookahead_landed, 1);
  // Zeros in the inbox, so that a payload read before it was handed on cannot pass for one of the
  // last launch; then every CTA of the cluster has started (and zeroed) before any writes into it.
  for (int i = threadIdx.x; i < kMailboxes * kMaxClusterCtas * kPayloadVecs; i += kThreads)
    (&inbox[0][0][0])[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  cluster_arrive();  // release: the zeros come before any peer's payload
  cluster_wait();
  const bool loads_ahead = static_cast<int>(threadIdx.x) / kWarpSize < ahead_warps;
  const int group = blockIdx.x / group_ctas, group_first = group * group_ctas;
  const int group_members = min(group_ctas, static_cast<int>(gridDim.x) - group_first);
  const unsigned rank = cluster_rank(), cluster_size = cluster_ctas();
  unsigned folded = 0, received = 0, phase = 0;
  unsigned mailed = 0;                         // group and cluster edges so far: the payloads' y
  unsigned group_edges = 0, cluster_edges = 0;  // of each kind: their mailboxes alternate
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
    const int edge = edge_after[s];
    if (edge == kEdgeNone) continue;
    // Called after a CTA barrier (every read of `lookahead` is done) and before the edge's wait.
    const auto read_ahead = [&] {
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
    };
    // A mailbox written at this edge is read before its readers arrive at their next edge of the
    // same kind, and written again only at the edge of that kind after it, which no CTA of the
    // group passes before all have arrived. (Counted over both kinds, an edge of the other kind
    // between them, over other CTAs, would order nothing.)
    const int t = threadIdx.x;
    if (edge == kEdgeGrid) {
      const unsigned before = grid_arrive(counter);  // its __syncthreads: every read of `lookahead` is done
      read_ahead();
      grid_wait(counter, before);
    } else if (edge == kEdgeGroup) {
      const int mailbox = group_edges++ % kMailboxes;
      if (t < kPayloadVecs)
        exchange[(blockIdx.x * kMailboxes + mailbox) * kPayloadVecs + t] = payload(blockIdx.x, mailed, t, folded);
      const unsigned before = publish_and_add(group_counts + group,
                                              blockIdx.x == group_first ? kBarrierFlipBit - (group_members - 1) : 1u);
      read_ahead();
      grid_wait(group_counts + group, before);
      for (int i = t; i < group_members * kPayloadVecs; i += kThreads) {  // a group may be larger than the CTA
        const int from = group_first + i / kPayloadVecs;
        received += payload_sum(__ldcg(exchange + (from * kMailboxes + mailbox) * kPayloadVecs + i % kPayloadVecs));
      }
    } else {
      const int mailbox = cluster_edges++ % kMailboxes;
      static_assert(kMaxClusterCtas * kPayloadVecs <= kThreads, "a thread per payload vector of the cluster");
      if (t < static_cast<int>(cluster_size) * kPayloadVecs)
        store_to_cluster_cta(&inbox[mailbox][rank][t % kPayloadVecs], t / kPayloadVecs,
                             payload(blockIdx.x, mailed, t % kPayloadVecs, folded));
      __syncthreads();
      cluster_arrive();
      read_ahead();
      cluster_wait();
      if (t < static_cast<int>(cluster_size) * kPayloadVecs)
        received += payload_sum(inbox[mailbox][t / kPayloadVecs][t % kPayloadVecs]);
    }
    if (edge != kEdgeGrid) ++mailed;
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) folded ^= __shfl_xor_sync(kFullMask, folded, offset);
  received = __reduce_add_sync(kFullMask, received);
  if (threadIdx.x % kWarpSize == 0) {
    atomicXor(checksum, folded);
    atomicAdd(checksum + 1, received);
  }
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
