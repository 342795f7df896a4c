"""The streaming probe's host side on the CPU: its checksum and its refusals (the kernels need a GPU:
tests/gpu/test_barrier_probe.py)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from megaserve.kernels.barrier_probe import StreamStage, time_streaming_ring, time_streaming_step, xor_of_words

WORD_MASK = 0xFFFFFFFF


@pytest.mark.parametrize("words", [1, 2, 7, 1001])
def test_the_xor_of_words_is_that_of_every_32_bit_word(words):
    data = torch.randint(-(2**31), 2**31, (words,), dtype=torch.int32, generator=torch.Generator().manual_seed(words))
    expected = functools.reduce(operator.xor, (word & WORD_MASK for word in data.tolist()))
    assert xor_of_words(data) == expected
    assert xor_of_words(data.view(torch.uint8)) == expected  # any dtype: its bytes as words


ONE_STAGE = [StreamStage("qkv", 16, True)]


@pytest.mark.parametrize(("stages", "ahead_warps", "lookahead_bytes", "message"), [
    ([], 8, 0, "at least one stage"),
    ([StreamStage("empty", 0, False)], 8, 0, "at least one byte"),
    (ONE_STAGE, 17, 0, "ahead_warps must be between 0 and 16"),
    (ONE_STAGE, -1, 0, "ahead_warps must be between 0 and 16"),
    (ONE_STAGE, 8, 8, "lookahead_bytes must be a multiple of 16 between 0 and 231424"),
    (ONE_STAGE, 8, -16, "lookahead_bytes must be a multiple of 16"),
    (ONE_STAGE, 8, 227 * 1024, "lookahead_bytes must be a multiple of 16"),
])
def test_bad_stages_are_refused_before_any_launch(stages, ahead_warps, lookahead_bytes, message):
    with pytest.raises(ValueError, match=message):
        time_streaming_step(None, torch.device("cpu"), stages, ahead_warps, lookahead_bytes)


@pytest.mark.parametrize(("stages", "ring_bytes", "ring_slots", "message"), [
    ([], 1024, 4, "at least one stage"),
    (ONE_STAGE, 1024, 1, "ring_slots must be at least 2"),
    (ONE_STAGE, 1000, 3, "ring_bytes must be at most 231424 and 3 slots of a multiple of 16 bytes"),  # not equal slots
    (ONE_STAGE, 16, 2, "ring_bytes must be"),  # slots of 8 bytes
    (ONE_STAGE, 1040, 4, "ring_bytes must be"),  # 4 equal slots of 260 bytes: not whole vectors
    (ONE_STAGE, 232 * 1024, 8, "ring_bytes must be at most 231424"),
])
def test_bad_rings_are_refused_before_any_launch(stages, ring_bytes, ring_slots, message):
    with pytest.raises(ValueError, match=message):
        time_streaming_ring(None, torch.device("cpu"), stages, ring_bytes, ring_slots)
