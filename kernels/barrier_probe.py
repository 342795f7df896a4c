"""The stage edges' floor on this GPU, from barrier_probe.cu launched on the decode step's grid (one
CTA of THREADS per SM, cooperative): the grid barrier's own cost, timed with CUDA events for
`rounds` barriers and for none (the difference over `rounds` is one barrier; the decode step has
four per layer), and the cost of fetching instructions (`barrier_after_code`): a barrier and then
a stretch of straight-line code per round, for stretches from a few KB to more than the decode
step's whole code. While a stretch fits the SM's instruction caches its cost per KB stays flat;
where it stops fitting, the rise per KB is what re-fetching a stage's code from L2 at every layer
would cost the decode step (whose size is `KernelCache.decode_step(...).code_bytes`).
`python -m megaserve.kernels.barrier_probe` prints both probes.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

import numpy as np
import torch
from cuda.core import Device, LaunchConfig, launch

from .build import KernelCache, arch_for
from .shape import THREADS, WARP_SIZE

DEFAULT_ROUNDS = 2000
CODE_ROUNDS = 200  # rounds of a barrier and a stretch of code (up to ~15 µs each)
REPEATS = 5  # median of this many timings of each launch
PHASE_BIT = 1 << 31  # the counter's top bit flips once per barrier; its low bits return to zero
# Stretches of barrier_after_code, in steps of 8 instructions (128 bytes): 8 KB to 256 KB.
CODE_STEPS = (64, 256, 512, 768, 896, 1024, 1152, 1280, 1536, 2048)


@dataclass(frozen=True)
class CodeRound:
    """One round of barrier_after_code: its code size and the seconds of a barrier plus the stretch."""

    steps: int
    code_bytes: int
    threads: int
    seconds: float


def _cuda_device(device: torch.device) -> Device:
    cuda_device = Device(device.index if device.index is not None else torch.cuda.current_device())
    cuda_device.set_current()
    return cuda_device


class _Probe:
    """Launches of one probe kernel on `device`'s whole grid, timed with CUDA events."""

    def __init__(self, compiled, device: torch.device, threads: int = THREADS) -> None:
        self.cuda_device = _cuda_device(device)
        self.kernel = compiled.object_code().get_kernel(compiled.name_expression)
        self.grid = self.cuda_device.properties.multiprocessor_count
        self.config = LaunchConfig(grid=self.grid, block=threads, is_cooperative=True)
        self.stream = self.cuda_device.create_stream(torch.cuda.current_stream(device))

    def seconds(self, *args) -> float:
        samples = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(self.stream, self.config, self.kernel, *args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(samples)


def _check_counter(counter: torch.Tensor) -> None:
    if int(counter.item()) % PHASE_BIT != 0:
        raise RuntimeError(f"the barrier counter ended at {int(counter.item()):#x}: a CTA missed a barrier")


def _check_rounds(rounds: int) -> None:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")


def time_grid_barrier(kernel_cache: KernelCache, device: torch.device, rounds: int = DEFAULT_ROUNDS) -> float:
    """Seconds per grid barrier on `device`."""
    _check_rounds(rounds)
    probe = _Probe(kernel_cache.barrier_probe(arch_for(_cuda_device(device).compute_capability)), device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)  # uint32 in the kernel; 8 bytes keep it aligned
    probe.seconds(counter.data_ptr(), np.int32(rounds))  # warm-up: module load, first launch
    per_barrier = probe.seconds(counter.data_ptr(), np.int32(rounds)) - probe.seconds(counter.data_ptr(), np.int32(0))
    _check_counter(counter)
    return per_barrier / rounds


def time_barrier_after_code(kernel_cache: KernelCache, device: torch.device, steps: int, threads: int = THREADS,
                            rounds: int = CODE_ROUNDS) -> CodeRound:
    """One round of a grid barrier and `steps` steps of straight-line code, on CTAs of `threads`."""
    _check_rounds(rounds)
    if threads % WARP_SIZE or not 0 < threads <= THREADS:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE} up to {THREADS}, got {threads}")
    compiled = kernel_cache.code_probe(arch_for(_cuda_device(device).compute_capability), steps)
    probe = _Probe(compiled, device, threads)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    sink = torch.empty(probe.grid * threads, dtype=torch.int32, device=device)
    args = (counter.data_ptr(), sink.data_ptr())
    probe.seconds(args[0], np.int32(rounds), args[1])
    per_round = probe.seconds(args[0], np.int32(rounds), args[1]) - probe.seconds(args[0], np.int32(0), args[1])
    _check_counter(counter)
    return CodeRound(steps, compiled.code_bytes, threads, per_round / rounds)


def main() -> int:
    """Prints the barrier's cost, then µs per round and ns per KB of code for each stretch, with all
    of a CTA's warps running it and with one warp."""
    if not torch.cuda.is_available():
        print("the probes need a CUDA GPU", file=sys.stderr)
        return 2
    import tempfile

    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as directory:
        cache = KernelCache(directory)
        barrier = time_grid_barrier(cache, device)
        print(f"grid barrier: {barrier * 1e6:.3f} µs")
        print(f"{'code KB':>8} {'warps':>5} {'µs/round':>9} {'ns per KB over the barrier':>27}")
        for threads in (THREADS, WARP_SIZE):
            for steps in CODE_STEPS:
                r = time_barrier_after_code(cache, device, steps, threads)
                per_kb = (r.seconds - barrier) / (r.code_bytes / 1024) * 1e9
                print(f"{r.code_bytes / 1024:>8.1f} {threads // WARP_SIZE:>5} {r.seconds * 1e6:>9.3f} {per_kb:>27.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
