"""Count the kernels a piece of GPU work launches, with torch.profiler (CUPTI sees the kernel
nodes of a replayed CUDA graph one by one, so a graph replay counts what it really runs)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

COPY_PREFIXES = ("memcpy", "memset")  # copies and fills are not kernel launches

# torch.profiler runs one session per process: a second one started meanwhile (two engines built on
# two threads of one process) crashed it ("External init callback must run in same thread as
# registerClient", then a segfault, in 3 runs of 4).
_ONE_SESSION = threading.Lock()


@contextmanager
def profiling(activities: Sequence[ProfilerActivity]) -> Iterator[profile]:
    """A torch.profiler session, after any other of this process has ended."""
    with _ONE_SESSION, profile(activities=list(activities)) as session:
        yield session


def count_kernel_launches(work: Callable[[], object]) -> int:
    """Kernels on the GPU during one call of `work` (after one untimed call to warm it up)."""
    work()
    torch.cuda.synchronize()
    with profiling([ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return sum(
        1
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.lower().startswith(COPY_PREFIXES)
    )
