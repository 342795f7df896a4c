"""MegakernelEngine's request control flow without a GPU: its three GPU operations (prefill, start
decoding, one decode step) are replaced by a counter, everything else is the engine's own code.
The kernel's tokens themselves are checked on CUDA in tests/gpu/test_megakernel_engine.py."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from megaserve.replicas.engines.engine_metrics import EngineMetrics
from megaserve.replicas.engines.megakernel_engine import MegakernelEngine
from megaserve.replicas.protocol import CoalescePolicy, FinishReason, GenerateRequest, SamplingParams, TokenLogprob

VOCAB = 1000
MAX_CONTEXT = 100_000
FIRST_TOKEN = 7  # the stand-in's prefill token; each decode step adds one
STEP_SECONDS = 0.001
PROMPT = (1, 2, 3)
_names = itertools.count()


class CountingMegakernel(MegakernelEngine):
    """The engine with a counter for a GPU; `fail_at` makes that decode step raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.vocab_size, self.eos_ids, self.max_context = VOCAB, frozenset(), MAX_CONTEXT
        self.model_name, self.tier = f"counting-{next(_names)}", "latency"
        self.coalesce = CoalescePolicy(seconds=0.0, tokens=1)
        self.device = torch.device("cpu")
        self.metrics = EngineMetrics(self.tier, self.model_name)
        self.fail_at = fail_at
        self.steps = 0
        self._token = FIRST_TOKEN
        self._running = None
        self._start_step_thread(self.model_name)

    def _prefill(self, prompt, rows, top):
        return FIRST_TOKEN, _logprob(FIRST_TOKEN, top)

    def _begin_decode(self, token: int, position: int, greedy: bool) -> None:
        self._token = token

    def _decode_step(self, rows, top):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("the kernel faulted")
        time.sleep(STEP_SECONDS)
        self._token += 1
        return self._token, _logprob(self._token, top)


def _logprob(token: int, top: int | None) -> TokenLogprob | None:
    """The stand-in's logprob of `token`: a value that names it, and `top` alternatives."""
    return None if top is None else TokenLogprob(-token / 100, tuple((token + k, -k / 10) for k in range(top)))


@pytest.fixture(autouse=True)
def no_cuda_device_binding(monkeypatch):
    """The step thread binds its CUDA device first; there is none here."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def _request(max_tokens: int, **sampling) -> GenerateRequest:
    return GenerateRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, **sampling))


async def _collect(engine, request):
    return [item async for item in engine.generate(request)]


async def test_length_and_stop_end_the_stream_and_free_the_engine():
    engine = CountingMegakernel()
    try:
        by_length = await asyncio.wait_for(_collect(engine, _request(4)), 10)
        stop = FIRST_TOKEN + 2
        by_stop = await asyncio.wait_for(_collect(engine, _request(50, stop_token_ids=(stop,))), 10)
        health = await engine.health()
    finally:
        await engine.shutdown()
    assert [t for item in by_length for t in item.token_ids] == [7, 8, 9, 10]
    assert by_length[-1].finish_reason == FinishReason.LENGTH
    assert [t for item in by_stop for t in item.token_ids] == [7, 8, 9]
    assert by_stop[-1].finish_reason == FinishReason.STOP
    assert health.healthy and health.running_requests == 0


async def test_each_token_streams_with_its_logprob_when_asked_and_none_else():
    engine = CountingMegakernel()
    try:
        asked = await asyncio.wait_for(_collect(engine, _request(3, logprobs=2)), 10)
        unasked = await asyncio.wait_for(_collect(engine, _request(3)), 10)
    finally:
        await engine.shutdown()
    for item in asked:
        assert item.logprobs == [_logprob(token, 2) for token in item.token_ids]
    assert [t for item in asked for t in item.token_ids] == [7, 8, 9]
    assert all(item.logprobs is None for item in unasked)


async def test_a_failed_step_aborts_the_running_stream_with_the_error():
    engine = CountingMegakernel(fail_at=3)
    try:
        items = await asyncio.wait_for(_collect(engine, _request(20)), 10)
        health = await engine.health()
    finally:
        await engine.shutdown()
    assert [t for item in items for t in item.token_ids] == [7, 8, 9]
    assert items[-1].finish_reason == FinishReason.ABORT and "the kernel faulted" in items[-1].error
    assert not health.healthy and "the kernel faulted" in health.detail
    assert health.running_requests == 0


async def test_shutdown_aborts_the_running_generation_at_once():
    engine = CountingMegakernel()
    stream = engine.generate(_request(MAX_CONTEXT - len(PROMPT)))  # ~100 s of steps
    await anext(stream)
    await asyncio.wait_for(engine.shutdown(), 5)
    rest = await asyncio.wait_for(_collect_rest(stream), 5)
    assert rest[-1].finish_reason == FinishReason.ABORT
    assert engine.steps < 5 / STEP_SECONDS


async def _collect_rest(stream):
    return [item async for item in stream]
