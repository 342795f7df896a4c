// How a warp reads the KV cache: each lane's slice of a head_dim row as one 4-, 8- or 16-byte
// word, blocks of kKeysPerIter keys per iteration, and copies into shared memory that hold no
// registers while they are in flight.
#pragma once
#include "common.cuh"

namespace megakernel {

constexpr int kKvRowBytesPerIter = 1024;  // bytes of one warp's K (and as many of V) loads per iteration

// Pointers into one layer's KV cache row of this sequence: [kv_heads, max_seq, head_dim] each.
struct LayerCache {
  bf16* k;
  bf16* v;
};

// A lane's slice of a head_dim row: kPerLane consecutive bf16 in one 4-, 8- or 16-byte word;
// pack rounds kPerLane floats to it (round to nearest even, as the reference's casts).
template <int kPerLane>
struct RowSlice;
template <>
struct RowSlice<2> {
  using Raw = unsigned;
  static __device__ __forceinline__ Raw pack(const float* x) { return float2_to_bf16x2(x[0], x[1]); }
};
template <>
struct RowSlice<4> {
  using Raw = uint2;
  static __device__ __forceinline__ Raw pack(const float* x) {
    return make_uint2(float2_to_bf16x2(x[0], x[1]), float2_to_bf16x2(x[2], x[3]));
  }
};
template <>
struct RowSlice<8> {
  using Raw = uint4;
  static __device__ __forceinline__ Raw pack(const float* x) {
    return make_uint4(float2_to_bf16x2(x[0], x[1]), float2_to_bf16x2(x[2], x[3]), float2_to_bf16x2(x[4], x[5]),
                      float2_to_bf16x2(x[6], x[7]));
  }
};

// Read from L2: the cache row may have been appended earlier in this launch.
template <int kPerLane>
__device__ __forceinline__ typename RowSlice<kPerLane>::Raw load_slice(const bf16* p) {
  return __ldcg(reinterpret_cast<const typename RowSlice<kPerLane>::Raw*>(p));
}

template <int kPerLane>
__device__ __forceinline__ void unpack_slice(const typename RowSlice<kPerLane>::Raw& raw, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}

template <int kPerLane>
__device__ __forceinline__ void load_row_slice(const bf16* p, float* out) {
  unpack_slice<kPerLane>(load_slice<kPerLane>(p), out);
}

// How a warp walks its keys: kKeysPerIter keys per iteration (kKvRowBytesPerIter of K rows, and at
// most one score slot per lane), as kPerLane channels per lane of each K and V row.
template <class S>
struct KeyTiling {
  static constexpr int kPerLane = S::head_dim / kWarpSize;
  static constexpr int kKeysByBytes = kKvRowBytesPerIter / (S::head_dim * 2);
  static constexpr int kKeysBySlots = pow2_floor(kWarpSize / S::group);
  static constexpr int kKeysPerIter = kKeysByBytes < kKeysBySlots ? kKeysByBytes : kKeysBySlots;
  static constexpr int kMinKeysPerSplit = kWarps * kKeysPerIter;
  using Raw = typename RowSlice<kPerLane>::Raw;
};

// Where a lane's slice of key t's K (or V) row starts, in elements of the layer's cache.
template <class S>
__device__ __forceinline__ size_t key_slice(size_t head_offset, int t, int lane) {
  return head_offset + static_cast<size_t>(t) * S::head_dim + lane * KeyTiling<S>::kPerLane;
}

// One iteration's keys of one warp: the lane's slices of kKeysPerIter K and V rows.
template <class S>
struct KeyBlock {
  typename KeyTiling<S>::Raw k[KeyTiling<S>::kKeysPerIter], v[KeyTiling<S>::kKeysPerIter];
};

// Keys [t0, t0 + kKeysPerIter) of a KV head, those before `end`: their K and V rows. Read from L2:
// the row of the new position is appended earlier in the same launch.
template <class S>
__device__ __forceinline__ void load_key_block(const LayerCache& cache, size_t head_offset, int t0, int end, int lane,
                                               KeyBlock<S>& block) {
  using T = KeyTiling<S>;
#pragma unroll
  for (int u = 0; u < T::kKeysPerIter; ++u) {
    if (t0 + u < end) {
      const size_t row = key_slice<S>(head_offset, t0 + u, lane);
      block.k[u] = load_slice<T::kPerLane>(cache.k + row);
      block.v[u] = load_slice<T::kPerLane>(cache.v + row);
    }
  }
}

// sizeof(Raw) bytes (4, 8 or 16) from global to shared memory without passing through registers
// (cp.async.ca: .cg, which skips L1, copies only 16 bytes; no line these copies cache is written
// in the launch except the new position's, whose copied row is replaced by the appended one);
// complete for this thread after wait_async_copies.
template <class Raw>
__device__ __forceinline__ void copy_async(Raw* dst, const Raw* src) {
  static_assert(sizeof(Raw) == 4 || sizeof(Raw) == 8 || sizeof(Raw) == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst_shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst_shared), "l"(src), "n"(sizeof(Raw)) : "memory");
}

__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace megakernel
