// Times the decode megakernel's grid barrier on its own: `rounds` barriers back to back with
// nothing between them, on the same grid (one CTA of kThreads per SM, cooperative launch). The
// launcher subtracts a launch with zero rounds, which leaves the cost of one barrier.
#include "common.cuh"

namespace megakernel {

__global__ void __launch_bounds__(kThreads, 1) barrier_probe(unsigned* counter, int rounds) {
  for (int i = 0; i < rounds; ++i) grid_barrier(counter);
}

}  // namespace megakernel
