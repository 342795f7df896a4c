"""The streaming probe's host side on the CPU: its checksum and its refusals (the kernels need a GPU:
tests/gpu/test_barrier_probe.py)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from megaserve.kernels.barrier_probe import StreamStage, time_streaming_step, xor_of_words

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
