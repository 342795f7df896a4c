"""Count the kernels a piece of GPU work launches, with torch.profiler (CUPTI sees the kernel
nodes of a replayed CUDA graph one by one, so a graph replay counts what it really runs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

COPY_PREFIXES = ("memcpy", "memset")  # copies and fills are not kernel launches


def count_kernel_launches(work: Callable[[], object]) -> int:
    """Kernels on the GPU during one call of `work` (after one untimed call to warm it up)."""
    work()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return sum(
        1
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.lower().startswith(COPY_PREFIXES)
    )
