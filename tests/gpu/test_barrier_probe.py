"""The grid-barrier probe on a real GPU: a positive per-barrier cost of the order of microseconds,
and the counter back at a phase boundary (every CTA took every barrier); a barrier with a stretch
of code after it costs more than the barrier, and more for a longer stretch."""

from __future__ import annotations

import torch

from megaserve.kernels.barrier_probe import (
    MAX_LOOKAHEAD_BYTES,
    StreamEdge,
    StreamStage,
    cluster_grid,
    time_barrier_after_code,
    time_grid_barrier,
    time_streaming_ring,
    time_streaming_step,
    xor_of_words,
)
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


# Stages of sizes that leave partial chunks and slices (vectors per stage not a multiple of the
# grid's threads), a stage smaller than one vector per CTA, and 300 MB in all (several times L2).
STREAM_STAGES_BYTES = (12_582_912 + 48, 16, 8_388_608 + 1_000, 100_663_296 + 16 * 7, 160_000_000)


def _stages(barriers: bool, edge: StreamEdge = StreamEdge.GRID) -> list[StreamStage]:
    """STREAM_STAGES_BYTES with `edge` after every stage but the last (if `barriers`), and a grid
    barrier after the third whatever `edge` is, as a layer's O stage has."""
    def edge_after(i: int) -> StreamEdge:
        if not barriers or i + 1 == len(STREAM_STAGES_BYTES):
            return StreamEdge.NONE
        return StreamEdge.GRID if i == 2 else edge

    return [StreamStage(f"s{i}", size, edge_after(i)) for i, size in enumerate(STREAM_STAGES_BYTES)]


def test_the_streaming_probe_reads_every_vector_once_and_its_barriers_cost_time(kernel_cache):
    """time_streaming_step raises when the kernel's XOR of the words it loaded is not the data's (a
    vector skipped or read twice) or a CTA missed a barrier; here with and without barriers, and
    with and without reading ahead at a barrier, into registers and into shared memory. (How fast is the bench's business: these bounds
    only catch a timing that is not of this launch.)"""
    device = torch.device("cuda")
    read_bytes = sum(STREAM_STAGES_BYTES)
    # lookahead: none, a few vectors (less than the 16-byte stage), one full-size shared memory
    variants = ((_stages(False), 8, 0), (_stages(True), 8, 0), (_stages(True), 0, 0), (_stages(True), 16, 0),
                (_stages(True), 8, 16 * 4), (_stages(True), 0, MAX_LOOKAHEAD_BYTES))
    for stages, ahead_warps, lookahead_bytes in variants:
        seconds = time_streaming_step(kernel_cache, device, stages, ahead_warps, lookahead_bytes)
        # 300 MB at an HBM3e rate, between 1 and 6 TB/s, plus four barriers
        assert read_bytes / 6e12 < seconds < read_bytes / 1e12 + 4 * PLAUSIBLE_SECONDS[1]


def test_clusters_fill_at_most_the_gpu_and_at_least_one_cluster(kernel_cache):
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert cluster_grid(kernel_cache, device, 1) == sms
    for size in (2, 8, 16):
        ctas = cluster_grid(kernel_cache, device, size)
        assert ctas % size == 0 and size <= ctas <= sms


def test_group_and_cluster_edges_hand_every_payload_on(kernel_cache):
    """time_streaming_step raises when a payload was read before it was handed on (the sum of those
    received is wrong) or a group's counter is off a phase boundary; here over groups that do and do
    not divide the grid, one group of the whole grid (more payload vectors than a CTA has threads),
    clusters of 1, 2, 8 and 16 CTAs (16: non-portable), and group and cluster edges mixed."""
    device = torch.device("cuda")
    read_bytes = sum(STREAM_STAGES_BYTES)
    variants = ((StreamEdge.GROUP, 16, 1), (StreamEdge.GROUP, 7, 1), (StreamEdge.GROUP, 1024, 1),
                (StreamEdge.GROUP, 8, 8),
                (StreamEdge.CLUSTER, 1, 1), (StreamEdge.CLUSTER, 1, 2), (StreamEdge.CLUSTER, 1, 8),
                (StreamEdge.CLUSTER, 1, 16))
    # a group edge, a cluster edge over fewer CTAs, then a group edge again: the group's mailboxes
    # alternate by group edge, whatever cluster edge comes between
    mixed = [StreamStage(f"s{i}", size, edge) for i, (size, edge) in enumerate(zip(
        STREAM_STAGES_BYTES, (StreamEdge.GROUP, StreamEdge.CLUSTER, StreamEdge.GRID, StreamEdge.GROUP, StreamEdge.NONE),
        strict=True))]
    runs = [(_stages(True, edge), group_ctas, cluster_ctas) for edge, group_ctas, cluster_ctas in variants]
    for stages, group_ctas, cluster_ctas in [*runs, (mixed, 16, 8)]:
        seconds = time_streaming_step(kernel_cache, device, stages, group_ctas=group_ctas, cluster_ctas=cluster_ctas)
        # 300 MB between 0.5 and 6 TB/s (a grid of clusters may hold fewer CTAs than SMs), plus four edges
        assert read_bytes / 6e12 < seconds < read_bytes / 0.5e12 + 4 * PLAUSIBLE_SECONDS[1]


def test_the_ring_probe_reads_every_vector_once_whatever_its_slots(kernel_cache):
    """time_streaming_ring raises as time_streaming_step does; here with and without barriers, with
    slices of one vector or none (the 16-byte stage) and of many slots, a ring of two 1 KB slots that
    the loader waits on at almost every chunk, and a full-size ring of many slots."""
    device = torch.device("cuda")
    read_bytes = sum(STREAM_STAGES_BYTES)
    variants = ((_stages(False), 64 * 1024, 4), (_stages(True), 64 * 1024, 4), (_stages(True), 2 * 1024, 2),
                (_stages(True), 32 * 1024, 2), (_stages(True), MAX_LOOKAHEAD_BYTES, 16))
    for stages, ring_bytes, ring_slots in variants:
        seconds = time_streaming_ring(kernel_cache, device, stages, ring_bytes, ring_slots)
        # 1 KB slots stream slowly (2 KB in flight per SM): only an upper bound of 10 µs a MB
        assert read_bytes / 6e12 < seconds < read_bytes / 1e8


def test_the_data_s_xor_is_that_of_its_words_on_the_gpu():
    data = torch.randint(-(2**31), 2**31, (1001,), dtype=torch.int32, device="cuda")
    assert xor_of_words(data) == xor_of_words(data.cpu())
