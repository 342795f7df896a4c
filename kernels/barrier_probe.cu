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
#include "common.cuh"

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

}  // namespace megakernel
