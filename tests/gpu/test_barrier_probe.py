"""The grid-barrier probe on a real GPU: a positive per-barrier cost of the order of microseconds,
and the counter back at a phase boundary (every CTA took every barrier)."""

from __future__ import annotations

import torch

from megaserve.kernels.barrier_probe import time_grid_barrier

# A grid barrier is a few L2 round trips (~0.5-1 µs each on Hopper): anything outside this range
# means the timing or the subtraction of the empty launch is wrong.
PLAUSIBLE_SECONDS = (1e-7, 2e-5)


def test_one_barrier_costs_microseconds(kernel_cache):
    seconds = time_grid_barrier(kernel_cache, torch.device("cuda"), rounds=500)
    assert PLAUSIBLE_SECONDS[0] < seconds < PLAUSIBLE_SECONDS[1]
