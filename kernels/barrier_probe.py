"""The grid barrier's own cost on this GPU: barrier_probe.cu, launched on the decode step's grid
(one CTA of THREADS per SM, cooperative), timed with CUDA events for `rounds` barriers and for none;
the difference over `rounds` is one barrier. The decode step has five per layer, so this is the
floor of what the stage edges cost."""

from __future__ import annotations

import statistics

import numpy as np
import torch
from cuda.core import Device, LaunchConfig, launch

from .build import KernelCache, arch_for
from .shape import THREADS

DEFAULT_ROUNDS = 2000
REPEATS = 5  # median of this many timings of each launch
PHASE_BIT = 1 << 31  # the counter's top bit flips once per barrier; its low bits return to zero


def time_grid_barrier(kernel_cache: KernelCache, device: torch.device, rounds: int = DEFAULT_ROUNDS) -> float:
    """Seconds per grid barrier on `device`."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    cuda_device = Device(device.index if device.index is not None else torch.cuda.current_device())
    cuda_device.set_current()
    compiled = kernel_cache.barrier_probe(arch_for(cuda_device.compute_capability))
    kernel = compiled.object_code().get_kernel(compiled.name_expression)
    config = LaunchConfig(grid=cuda_device.properties.multiprocessor_count, block=THREADS, is_cooperative=True)
    counter = torch.zeros(1, dtype=torch.int64, device=device)  # uint32 in the kernel; 8 bytes keep it aligned
    stream = cuda_device.create_stream(torch.cuda.current_stream(device))

    def seconds(count: int) -> float:
        samples = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(stream, config, kernel, counter.data_ptr(), np.int32(count))
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(samples)

    seconds(rounds)  # warm-up: module load, first launch
    per_barrier = (seconds(rounds) - seconds(0)) / rounds
    if int(counter.item()) % PHASE_BIT != 0:
        raise RuntimeError(f"the barrier counter ended at {int(counter.item()):#x}: a CTA missed a barrier")
    return per_barrier
