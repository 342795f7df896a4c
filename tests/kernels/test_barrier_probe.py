"""The streaming probe's host side on the CPU: its checksum and its refusals (the kernels need a GPU:
tests/gpu/test_barrier_probe.py)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from megaserve.kernels.barrier_probe import (
    PAYLOAD_VECS,
    StreamEdge,
    StreamStage,
    _StreamedBytes,
    cluster_grid,
    time_streaming_ring,
    time_streaming_step,
    xor_of_words,
)

WORD_MASK = 0xFFFFFFFF


@pytest.mark.parametrize("words", [1, 2, 7, 1001])
def test_the_xor_of_words_is_that_of_every_32_bit_word(words):
    data = torch.randint(-(2**31), 2**31, (words,), dtype=torch.int32, generator=torch.Generator().manual_seed(words))
    expected = functools.reduce(operator.xor, (word & WORD_MASK for word in data.tolist()))
    assert xor_of_words(data) == expected
    assert xor_of_words(data.view(torch.uint8)) == expected  # any dtype: its bytes as words


ONE_STAGE = [StreamStage("qkv", 16, StreamEdge.GRID)]


@pytest.mark.parametrize(("stages", "ahead_warps", "lookahead_bytes", "message"), [
    ([], 8, 0, "at least one stage"),
    ([StreamStage("empty", 0, StreamEdge.NONE)], 8, 0, "at least one byte"),
    ([StreamStage("qkv", 16, 7)], 8, 0, "7 is not a valid StreamEdge"),
    (ONE_STAGE, 17, 0, "ahead_warps must be between 0 and 16"),
    (ONE_STAGE, -1, 0, "ahead_warps must be between 0 and 16"),
    (ONE_STAGE, 8, 8, "lookahead_bytes must be a multiple of 16 between 0 and 229376"),
    (ONE_STAGE, 8, -16, "lookahead_bytes must be a multiple of 16"),
    (ONE_STAGE, 8, 227 * 1024, "lookahead_bytes must be a multiple of 16"),
])
def test_bad_stages_are_refused_before_any_launch(stages, ahead_warps, lookahead_bytes, message):
    with pytest.raises(ValueError, match=message):
        time_streaming_step(None, torch.device("cpu"), stages, ahead_warps, lookahead_bytes)


@pytest.mark.parametrize(("stages", "ring_bytes", "ring_slots", "message"), [
    ([], 1024, 4, "at least one stage"),
    (ONE_STAGE, 1024, 1, "ring_slots must be at least 2"),
    (ONE_STAGE, 1000, 3, "ring_bytes must be at most 229376 and 3 slots of a multiple of 16 bytes"),  # not equal slots
    (ONE_STAGE, 16, 2, "ring_bytes must be"),  # slots of 8 bytes
    (ONE_STAGE, 1040, 4, "ring_bytes must be"),  # 4 equal slots of 260 bytes: not whole vectors
    (ONE_STAGE, 232 * 1024, 8, "ring_bytes must be at most 229376"),
    ([StreamStage("qkv", 16, StreamEdge.CLUSTER)], 1024, 4, "the ring probe crosses grid barriers only"),
    ([StreamStage("qkv", 16, StreamEdge.GROUP)], 1024, 4, "the ring probe crosses grid barriers only"),
])
def test_bad_rings_are_refused_before_any_launch(stages, ring_bytes, ring_slots, message):
    with pytest.raises(ValueError, match=message):
        time_streaming_ring(None, torch.device("cpu"), stages, ring_bytes, ring_slots)


@pytest.mark.parametrize(("group_ctas", "cluster_ctas", "message"), [
    (0, 1, "group_ctas must be at least 1, got 0"),
    (1, 0, "cluster_ctas must be between 1 and 16, got 0"),
    (1, 17, "cluster_ctas must be between 1 and 16, got 17"),
])
def test_bad_groups_and_clusters_are_refused_before_any_launch(group_ctas, cluster_ctas, message):
    with pytest.raises(ValueError, match=message):
        time_streaming_step(None, torch.device("cpu"), ONE_STAGE, group_ctas=group_ctas, cluster_ctas=cluster_ctas)
    if message.startswith("cluster_ctas"):  # cluster_grid takes no group
        with pytest.raises(ValueError, match=message):
            cluster_grid(None, torch.device("cpu"), cluster_ctas)


def test_the_payloads_sum_counts_each_group_s_senders_for_each_of_its_receivers():
    """Worked by hand for 4 vectors per payload: CTA p's vectors add up to 4 (p + 1 + e) + 6 at its
    e-th group or cluster edge, and each CTA of a group receives every member's."""
    assert PAYLOAD_VECS == 4
    one_group_edge = _StreamedBytes([StreamStage("qkv", 16, StreamEdge.GROUP)], torch.device("cpu"))
    # groups {0, 1} and {2, 3}: 2 receivers x (10 + 14) + 2 receivers x (18 + 22)
    assert one_group_edge.received_sum(grid=4, group_ctas=2, cluster_ctas=1) == 128
    # a last group of one, {4}: + 26
    assert one_group_edge.received_sum(grid=5, group_ctas=2, cluster_ctas=1) == 154
    # grid and other edges count nothing; the second edge (e = 1) is a cluster edge over {0..3}:
    # each of 4 receivers gets 4 x (1 + 2 + 3 + 4 + 4) + 4 x 6 = 80
    stages = [StreamStage("qkv", 16, StreamEdge.GROUP), StreamStage("attention", 16, StreamEdge.GRID),
              StreamStage("o_proj", 16, StreamEdge.CLUSTER), StreamStage("mlp", 16, StreamEdge.NONE)]
    mixed = _StreamedBytes(stages, torch.device("cpu"))
    assert mixed.received_sum(grid=4, group_ctas=2, cluster_ctas=4) == 128 + 4 * 80
