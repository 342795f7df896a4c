"""The grid-barrier probe on a real GPU: a positive per-barrier cost of the order of microseconds,
and the counter back at a phase boundary (every CTA took every barrier); a barrier with a stretch
of code after it costs more than the barrier, and more for a longer stretch."""

from __future__ import annotations

import torch

from megaserve.kernels.barrier_probe import time_barrier_after_code, time_grid_barrier
from megaserve.kernels.shape import WARP_SIZE

# A grid barrier is a few L2 round trips (~0.5-1 µs each on Hopper): anything outside this range
# means the timing or the subtraction of the empty launch is wrong.
PLAUSIBLE_SECONDS = (1e-7, 2e-5)


def test_one_barrier_costs_microseconds(kernel_cache):
    seconds = time_grid_barrier(kernel_cache, torch.device("cuda"), rounds=500)
    assert PLAUSIBLE_SECONDS[0] < seconds < PLAUSIBLE_SECONDS[1]


def test_a_longer_stretch_of_code_costs_more_per_round(kernel_cache):
    device = torch.device("cuda")
    barrier = time_grid_barrier(kernel_cache, device, rounds=500)
    for threads in (WARP_SIZE, 16 * WARP_SIZE):
        short = time_barrier_after_code(kernel_cache, device, 64, threads, rounds=100)
        long = time_barrier_after_code(kernel_cache, device, 1024, threads, rounds=100)
        assert short.code_bytes < long.code_bytes and short.threads == long.threads == threads
        # 16x the instructions: at least a few times the time, never more than a few hundred µs
        assert barrier / 2 < short.seconds < long.seconds < PLAUSIBLE_SECONDS[1] * 20
