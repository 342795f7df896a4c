"""The stage edges' floor on this GPU, from barrier_probe.cu launched on the decode step's grid (one
CTA of THREADS per SM, cooperative): the grid barrier's own cost, timed with CUDA events for
`rounds` barriers and for none (the difference over `rounds` is one barrier; the decode step has
four per layer), and the cost of fetching instructions (`barrier_after_code`): a barrier and then
a stretch of straight-line code per round, for stretches from a few KB to more than the decode
step's whole code. While a stretch fits the SM's instruction caches its cost per KB stays flat;
where it stops fitting, the rise per KB is what re-fetching a stage's code from L2 at every layer
would cost the decode step (whose size is `KernelCache.decode_step(...).code_bytes`).
`python -m megaserve.kernels.barrier_probe` prints both probes.

`time_streaming_step` (stream_stages) is the decode step reduced to its bytes and its edges: the
grid streams each stage's bytes as the GEMVs stream weights and crosses a grid barrier where the
step has one. Timed with the step's edges and with none, on the same bytes, it gives what the edges
alone cost a step with no dependent work, and so the fastest that a kernel with those edges could
be (the bench prints it per model and context). `time_streaming_ring` (stream_stages_ring) streams
the same stages with the loads taken off the edges: a loader warp per SM has the copy engine fill a
ring of shared memory and never waits at a barrier, which only the other warps cross; it shows
whether loads that run past the edges would hide them.

An edge of stream_stages need not be a grid barrier (StreamEdge): it may be a barrier over groups of
consecutive CTAs (a count in global memory, as the megakernel's wait for a KV head's QKV rows is) or
over each cluster of a grid launched in clusters (`cluster_ctas`: the hardware's cluster barrier),
each CTA handing the others of its group a few vectors, through L2 or into their shared memory. On
the grid that clusters of a size can fill (`cluster_grid`: what the GPU can hold at once, which may
be fewer CTAs than SMs), it shows what the layer's inner edges would cost as cluster barriers.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from cuda.bindings import driver
from cuda.core import Device, LaunchConfig, launch

from .build import CompiledKernel, KernelCache, arch_for
from .shape import THREADS, WARP_SIZE, WARPS

DEFAULT_ROUNDS = 2000
CODE_ROUNDS = 200  # rounds of a barrier and a stretch of code (up to ~15 µs each)
REPEATS = 5  # median of this many timings of each launch
STREAM_LAUNCHES = 20  # stream_stages launches back to back per timing, as a step's graph replays are
VECTOR_BYTES = 16  # stream_stages loads 16-byte vectors
AHEAD_WARPS = WARPS // 2  # kPrefetchWarps of gemv.cuh: warps that load the next stage's first chunk at a barrier
WORD_MASK = (1 << 32) - 1
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024  # what a kernel may take without raising its attribute
# Of the 227 KB a CTA may take on Hopper and Blackwell, 3 KB are left for the kernel's own (stream_stages'
# inbox of cluster payloads: 2 KB).
MAX_LOOKAHEAD_BYTES = 224 * 1024
# stream_stages_ring's default ring: 64 KB per SM in 4 slots of 16 KB, each one bulk copy, its
# fastest on the H200 (run 77: smaller slots cost the consumers a wait per slot, more slots or bytes
# streamed slower).
RING_BYTES = 64 * 1024
RING_SLOTS = 4
PHASE_BIT = 1 << 31  # the counter's top bit flips once per barrier; its low bits return to zero
PAYLOAD_VECS = 4  # kPayloadVecs of barrier_probe.cu: the vectors a CTA hands each CTA of its group at an edge
MAILBOXES = 2  # kMailboxes: a CTA's payload slots (in global memory, and its inbox) alternate by edge of a kind
MAX_CLUSTER_CTAS = 16  # kMaxClusterCtas: the largest cluster Hopper and Blackwell launch (non-portable)
PORTABLE_CLUSTER_CTAS = 8  # larger clusters need the kernel's non-portable attribute
# Stretches of barrier_after_code, in steps of 8 instructions (128 bytes): 8 KB to 256 KB.
CODE_STEPS = (64, 256, 512, 768, 896, 1024, 1152, 1280, 1536, 2048)


@dataclass(frozen=True)
class CodeRound:
    """One round of barrier_after_code: its code size and the seconds of a barrier plus the stretch."""

    steps: int
    code_bytes: int
    threads: int
    seconds: float


class _Probe:
    """One probe kernel (compiled by `build(arch)` for `device`) on the device's whole grid: its
    rounds timed with CUDA events, less a launch of none, and its barrier counter checked."""

    def __init__(self, build: Callable[[str], CompiledKernel], device: torch.device, threads: int = THREADS,
                 dynamic_shared_bytes: int = 0, cluster_ctas: int = 1) -> None:
        self.cuda_device = Device(device.index if device.index is not None else torch.cuda.current_device())
        self.cuda_device.set_current()
        self.compiled = build(arch_for(self.cuda_device.compute_capability))
        self.kernel = self.compiled.object_code().get_kernel(self.compiled.name_expression)
        if dynamic_shared_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT:
            _allow_dynamic_shared(self.kernel, self.cuda_device.device_id, dynamic_shared_bytes)
        self.stream = self.cuda_device.create_stream(torch.cuda.current_stream(device))
        sms = self.cuda_device.properties.multiprocessor_count
        if cluster_ctas == 1:
            self.grid = sms
            self.config = LaunchConfig(grid=sms, block=threads, shmem_size=dynamic_shared_bytes, is_cooperative=True)
        else:
            if cluster_ctas > PORTABLE_CLUSTER_CTAS:
                _set_kernel_attribute(self.kernel, self.cuda_device.device_id, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED", 1)
            # As many clusters as the GPU holds at once: the barriers need every CTA resident.
            clusters = self.kernel.occupancy.max_active_clusters(
                LaunchConfig(grid=sms // cluster_ctas, cluster=cluster_ctas, block=threads,
                             shmem_size=dynamic_shared_bytes), stream=self.stream)
            if clusters < 1:
                raise RuntimeError(f"this GPU cannot hold a cluster of {cluster_ctas} CTAs of the probe")
            self.grid = clusters * cluster_ctas
            self.config = LaunchConfig(grid=clusters, cluster=cluster_ctas, block=threads,
                                       shmem_size=dynamic_shared_bytes, is_cooperative=True)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # uint32 in the kernel; 8 bytes keep it aligned

    def seconds_per_round(self, rounds: int, *extra_args) -> float:
        """Seconds of one of `rounds` rounds; the kernel takes (counter, rounds, *extra_args)."""
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        self.seconds_per_launch(rounds, extra_args)  # warm-up: module load, first launch
        per_round = (self.seconds_per_launch(rounds, extra_args) - self.seconds_per_launch(0, extra_args)) / rounds
        self.check_counter()
        return per_round

    def check_counter(self, counters: torch.Tensor | None = None) -> None:
        """Every CTA took every barrier: the counter (or each of `counters`, uint32 words) is back at a
        phase boundary."""
        words = self.counter[:1] if counters is None else counters.view(torch.int32)
        for value in words.tolist():
            if (value & WORD_MASK) % PHASE_BIT:
                raise RuntimeError(f"a barrier counter ended at {value & WORD_MASK:#x}: a CTA missed a barrier")

    def launch(self, rounds: int, extra_args: tuple) -> None:
        launch(self.stream, self.config, self.kernel, self.counter.data_ptr(), np.int32(rounds), *extra_args)

    def seconds_per_launch(self, rounds: int, extra_args: tuple, launches: int = 1) -> float:
        """Seconds per launch: the median of REPEATS timings of `launches` launches back to back."""
        samples = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                self.launch(rounds, extra_args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3 / launches)
        return statistics.median(samples)


def _set_kernel_attribute(kernel, device_id: int, name: str, value: int) -> None:
    """Set the driver's CU_FUNC_ATTRIBUTE_<name> of `kernel` (cuda.core's kernel attributes are
    read-only: the driver's call, on the library kernel)."""
    attribute = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
    (result,) = driver.cuKernelSetAttribute(attribute, value, kernel.handle, driver.CUdevice(device_id))
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"the driver refused {name} = {value} for the probe: {result.name}")


def _allow_dynamic_shared(kernel, device_id: int, size: int) -> None:
    """Let `kernel` take `size` bytes of dynamic shared memory, past the 48 KB every kernel may take."""
    _set_kernel_attribute(kernel, device_id, "MAX_DYNAMIC_SHARED_SIZE_BYTES", size)


class StreamEdge(IntEnum):
    """The edge after a stage of stream_stages (its StreamEdge): none, the grid barrier, a barrier over
    each group of consecutive CTAs (a count in global memory), or over each cluster."""

    NONE = 0
    GRID = 1
    GROUP = 2
    CLUSTER = 3


@dataclass(frozen=True)
class StreamStage:
    """A stage of stream_stages: the bytes it reads (rounded up to 16-byte vectors) and the edge that
    follows it."""

    name: str
    read_bytes: int
    edge_after: StreamEdge


def xor_of_words(data: torch.Tensor) -> int:
    """The XOR of every 32-bit word of `data` (contiguous), as stream_stages folds them; on data's device."""
    words = data.view(torch.int32).flatten()
    while words.numel() > 1:
        if words.numel() % 2:
            words = torch.cat([words, words.new_zeros(1)])
        half = words.numel() // 2
        words = words[:half] ^ words[half:]
    return int(words.item()) & WORD_MASK


class _StreamedBytes:
    """The bytes of `stages` laid out one after another in a buffer of random words on `device`, with
    the stage ends (in 16-byte vectors) and edges that the streaming kernels take, and the word their
    XOR must fold to."""

    def __init__(self, stages: Sequence[StreamStage], device: torch.device) -> None:
        if not stages or any(stage.read_bytes < 1 for stage in stages):
            raise ValueError("stream_stages needs at least one stage, each reading at least one byte")
        ends = torch.tensor([-(-stage.read_bytes // VECTOR_BYTES) for stage in stages], dtype=torch.int64).cumsum(0)
        self.stages = len(stages)
        self.data = torch.randint(-(2**31), 2**31, (int(ends[-1]) * VECTOR_BYTES // 4,), dtype=torch.int32,
                                  device=device)
        self.stage_ends = ends.to(device)
        self.edges = [StreamEdge(stage.edge_after) for stage in stages]
        self.edge_after = torch.tensor(self.edges, dtype=torch.int32, device=device)
        self.checksum = torch.zeros(2, dtype=torch.int32, device=device)  # the words' XOR, the payloads' sum

    def seconds_per_launch(self, probe: _Probe, args: tuple, launches: int, received: int = 0,
                           group_counts: torch.Tensor | None = None, mailboxes: torch.Tensor | None = None) -> float:
        """Seconds per launch of `probe` (which takes (counter, stages, *args), args holding the checksum's
        address), once its XOR of every word read, the sum of the payloads it handed on (`received`)
        and its barrier counters are checked. `mailboxes` are zeroed before the checked launch, so
        that a payload read before it was handed on cannot pass for the same one of the launch before."""
        probe.launch(self.stages, args)  # module load, first launch
        self.checksum.zero_()
        if mailboxes is not None:
            mailboxes.zero_()
        probe.launch(self.stages, args)
        expected, folded = xor_of_words(self.data), int(self.checksum[0].item()) & WORD_MASK
        if folded != expected:
            raise RuntimeError(f"{probe.compiled.name_expression} folded {folded:#010x}, the data's XOR is "
                               f"{expected:#010x}: a vector was skipped or read twice")
        if int(self.checksum[1].item()) & WORD_MASK != received:
            raise RuntimeError(f"the payloads received sum to {int(self.checksum[1].item()) & WORD_MASK:#x}, "
                               f"not {received:#x}: a CTA read a payload before it was handed on")
        probe.check_counter()
        if group_counts is not None:
            probe.check_counter(group_counts)
        return probe.seconds_per_launch(self.stages, args, launches)

    def received_sum(self, grid: int, group_ctas: int, cluster_ctas: int) -> int:
        """What stream_stages' payload sum must be (mod 2**32): at its e-th group or cluster edge, each
        CTA receives from each CTA p of its group vectors v < PAYLOAD_VECS with x + y + z = p + 1 + e + v."""
        total, mailed = 0, 0
        for edge in self.edges:
            if edge in (StreamEdge.GROUP, StreamEdge.CLUSTER):
                size = group_ctas if edge == StreamEdge.GROUP else cluster_ctas
                for first in range(0, grid, size):
                    members = range(first, min(first + size, grid))
                    per_receiver = sum(p + 1 + mailed + v for p in members for v in range(PAYLOAD_VECS))
                    total += len(members) * per_receiver
                mailed += 1
        return total & WORD_MASK


def time_streaming_step(kernel_cache: KernelCache, device: torch.device, stages: Sequence[StreamStage],
                        ahead_warps: int = AHEAD_WARPS, lookahead_bytes: int = 0,
                        launches: int = STREAM_LAUNCHES, group_ctas: int = 1, cluster_ctas: int = 1) -> float:
    """Seconds per launch of stream_stages over `stages` (the kernel takes (counter, stages, data,
    stage_ends, edge_after, ahead_warps, lookahead_vecs, group_counts, group_ctas, exchange,
    checksum)), their bytes read once per launch; the kernel's XOR of every word and sum of the
    payloads handed on are checked first. At each edge every CTA reads ahead into the next stage:
    `lookahead_bytes` of its slice into shared memory by the copy engine, and a chunk per lane of
    `ahead_warps` warps. GROUP edges are over `group_ctas` consecutive CTAs; with `cluster_ctas` > 1
    the grid is as many clusters of that many CTAs as the GPU holds at once (cluster_grid), and
    CLUSTER edges are over each."""
    if not 1 <= cluster_ctas <= MAX_CLUSTER_CTAS:
        raise ValueError(f"cluster_ctas must be between 1 and {MAX_CLUSTER_CTAS}, got {cluster_ctas}")
    if group_ctas < 1:
        raise ValueError(f"group_ctas must be at least 1, got {group_ctas}")
    if not 0 <= ahead_warps <= WARPS:
        raise ValueError(f"ahead_warps must be between 0 and {WARPS}, got {ahead_warps}")
    if lookahead_bytes % VECTOR_BYTES or not 0 <= lookahead_bytes <= MAX_LOOKAHEAD_BYTES:
        raise ValueError(f"lookahead_bytes must be a multiple of {VECTOR_BYTES} between 0 and {MAX_LOOKAHEAD_BYTES}, "
                         f"got {lookahead_bytes}")
    streamed = _StreamedBytes(stages, device)
    probe = _Probe(kernel_cache.stream_probe, device, dynamic_shared_bytes=lookahead_bytes, cluster_ctas=cluster_ctas)
    group_counts = torch.zeros(-(-probe.grid // group_ctas), dtype=torch.int32, device=device)
    exchange = torch.zeros(probe.grid * MAILBOXES * PAYLOAD_VECS * VECTOR_BYTES // 4, dtype=torch.int32, device=device)
    args = (streamed.data.data_ptr(), streamed.stage_ends.data_ptr(), streamed.edge_after.data_ptr(),
            np.int32(ahead_warps), np.int32(lookahead_bytes // VECTOR_BYTES), group_counts.data_ptr(),
            np.int32(group_ctas), exchange.data_ptr(), streamed.checksum.data_ptr())
    received = streamed.received_sum(probe.grid, group_ctas, cluster_ctas)
    return streamed.seconds_per_launch(probe, args, launches, received, group_counts, exchange)


def cluster_grid(kernel_cache: KernelCache, device: torch.device, cluster_ctas: int) -> int:
    """CTAs of stream_stages (one per SM, with no lookahead in shared memory) that `device` holds at
    once in clusters of `cluster_ctas`: the grid that time_streaming_step launches in such clusters
    without lookahead."""
    if not 1 <= cluster_ctas <= MAX_CLUSTER_CTAS:
        raise ValueError(f"cluster_ctas must be between 1 and {MAX_CLUSTER_CTAS}, got {cluster_ctas}")
    return _Probe(kernel_cache.stream_probe, device, cluster_ctas=cluster_ctas).grid


def time_streaming_ring(kernel_cache: KernelCache, device: torch.device, stages: Sequence[StreamStage],
                        ring_bytes: int = RING_BYTES, ring_slots: int = RING_SLOTS,
                        launches: int = STREAM_LAUNCHES) -> float:
    """Seconds per launch of stream_stages_ring<ring_slots> over `stages` (the kernel takes (counter,
    stages, data, stage_ends, edge_after, slot_vecs, checksum)): the same bytes, loaded by each CTA's
    loader warp into a ring of `ring_bytes` of shared memory in `ring_slots` equal slots, whatever the
    grid barriers, which only the other warps cross."""
    if ring_slots < 2:
        raise ValueError(f"ring_slots must be at least 2, got {ring_slots}")
    if any(stage.edge_after not in (StreamEdge.NONE, StreamEdge.GRID) for stage in stages):
        raise ValueError("the ring probe crosses grid barriers only: its stages' edges must be NONE or GRID")
    slot_bytes = ring_bytes // ring_slots
    if ring_bytes > MAX_LOOKAHEAD_BYTES or slot_bytes < VECTOR_BYTES or ring_bytes != slot_bytes * ring_slots \
            or slot_bytes % VECTOR_BYTES:
        raise ValueError(f"ring_bytes must be at most {MAX_LOOKAHEAD_BYTES} and {ring_slots} slots of a multiple of "
                         f"{VECTOR_BYTES} bytes, got {ring_bytes}")
    streamed = _StreamedBytes(stages, device)
    probe = _Probe(lambda arch: kernel_cache.stream_ring_probe(arch, ring_slots), device,
                   dynamic_shared_bytes=ring_bytes)
    args = (streamed.data.data_ptr(), streamed.stage_ends.data_ptr(), streamed.edge_after.data_ptr(),
            np.int32(slot_bytes // VECTOR_BYTES), streamed.checksum.data_ptr())
    return streamed.seconds_per_launch(probe, args, launches)


def time_grid_barrier(kernel_cache: KernelCache, device: torch.device, rounds: int = DEFAULT_ROUNDS) -> float:
    """Seconds per grid barrier on `device`."""
    return _Probe(kernel_cache.barrier_probe, device).seconds_per_round(rounds)


def time_barrier_after_code(kernel_cache: KernelCache, device: torch.device, steps: int, threads: int = THREADS,
                            rounds: int = CODE_ROUNDS) -> CodeRound:
    """One round of a grid barrier and `steps` steps of straight-line code, on CTAs of `threads`."""
    if threads % WARP_SIZE or not 0 < threads <= THREADS:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE} up to {THREADS}, got {threads}")
    probe = _Probe(lambda arch: kernel_cache.code_probe(arch, steps), device, threads)
    sink = torch.empty(probe.grid * threads, dtype=torch.int32, device=device)
    seconds = probe.seconds_per_round(rounds, sink.data_ptr())
    return CodeRound(steps, probe.compiled.code_bytes, threads, seconds)


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
