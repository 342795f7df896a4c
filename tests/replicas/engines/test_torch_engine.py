"""TorchEngine on a tiny real model: greedy and sampled tokens, continuous batching, stops, the
yield rule, cancellation, queueing, validation, metrics and shutdown."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from megaserve.replicas.engines import create_engine
from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.protocol import (
    CoalescePolicy,
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    StepOutput,
)
from tests.model_factory import make_tiny_model

VOCAB = 512  # tests.model_factory's tiny shape
ONE_BY_ONE = CoalescePolicy(seconds=0.0, tokens=1)  # every token its own item: easy to read
SLOW_STEP_SECONDS = 0.05  # a step far slower than the event loop takes to pass a token on


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB) for _ in range(length))


def _request(prompt, request_id="r", priority=0, **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(request_id, tuple(prompt), SamplingParams(**sampling), priority)


async def _collect(engine, request) -> list[StepOutput]:
    return [item async for item in engine.generate(request)]


def _tokens(items: list[StepOutput]) -> list[int]:
    return [token for item in items for token in item.token_ids]


async def test_batch_one_greedy_equals_the_reference_loop(make_engine, reference_greedy):
    engine = make_engine(max_batch=1)
    prompt = _prompt(11, seed=1)
    items = await _collect(engine, _request(prompt, max_tokens=12))
    assert _tokens(items) == reference_greedy(list(prompt), 12)
    assert items[-1].finish_reason == FinishReason.LENGTH


async def test_continuous_batching_gives_each_request_its_solo_tokens(make_engine, reference_greedy):
    engine = make_engine(max_batch=3)
    prompts = [_prompt(length, seed) for seed, length in enumerate((5, 17, 9, 3, 12))]
    lengths = (20, 6, 14, 9, 11)

    async def run(index: int) -> list[int]:
        await asyncio.sleep(0.01 * index)  # arrive at different times, join a running batch
        request = _request(prompts[index], f"r{index}", max_tokens=lengths[index])
        return _tokens(await _collect(engine, request))

    most_running = 0

    async def watch() -> None:
        nonlocal most_running
        while True:
            most_running = max(most_running, (await engine.health()).running_requests)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    watcher.cancel()
    assert most_running >= 2  # the requests really shared decode steps
    for prompt, length, tokens in zip(prompts, lengths, results, strict=True):
        assert tokens == reference_greedy(list(prompt), length)


async def test_seeded_sampling_is_reproducible_and_ignores_batch_neighbours(make_engine):
    engine = make_engine(max_batch=4)
    seeded = _request(_prompt(6, 2), "seeded", max_tokens=16, temperature=1.0, seed=42)
    alone = _tokens(await _collect(engine, seeded))
    again = _tokens(await _collect(engine, seeded))
    neighbours = [_request(_prompt(4 + i, 10 + i), f"n{i}", max_tokens=16, temperature=1.0) for i in range(3)]
    together = await asyncio.gather(_collect(engine, seeded), *(_collect(engine, n) for n in neighbours))
    assert alone == again == _tokens(together[0])
    other_seed = _request(_prompt(6, 2), "other", max_tokens=16, temperature=1.0, seed=43)
    assert _tokens(await _collect(engine, other_seed)) != alone


# Engine and reference both run float32 on the CPU; batched rows sum in another order than a solo
# run, so logprobs (values near -6 for a vocabulary of 512) agree to ~1e-6, not exactly.
LOGPROB_TOLERANCE = 1e-4


async def test_logprobs_are_the_raw_model_distribution_per_row_of_a_batch(make_engine, reference_logits):
    """Each token's logprob and top alternatives are the log-softmax of the reference's logits,
    before temperature (a sampled row's too); a row that did not ask has none beside them."""
    engine = make_engine(max_batch=3, coalesce=ONE_BY_ONE)
    greedy = _request(_prompt(7, 20), "greedy", max_tokens=6, logprobs=3)
    sampled = _request(_prompt(5, 21), "sampled", max_tokens=6, logprobs=0, temperature=0.5, seed=7)
    plain = _request(_prompt(9, 22), "plain", max_tokens=6)
    results = await asyncio.gather(*(_collect(engine, r) for r in (greedy, sampled, plain)))
    for request, items, top in zip((greedy, sampled), results, (3, 0)):
        tokens = list(request.prompt_token_ids)
        for item in items:
            assert len(item.logprobs) == len(item.token_ids)
            for token, logprob in zip(item.token_ids, item.logprobs):
                expected = torch.log_softmax(reference_logits(tokens), dim=-1)
                assert abs(logprob.logprob - expected[token].item()) < LOGPROB_TOLERANCE
                values, ids = expected.topk(top)
                assert [i for i, _ in logprob.top] == ids.tolist()
                assert all(abs(v - e) < LOGPROB_TOLERANCE for (_, v), e in zip(logprob.top, values.tolist()))
                tokens.append(token)
    assert all(item.logprobs is None for item in results[2])
    # greedy picks the most likely token, so it heads its own alternatives
    assert all(lp.top[0][0] == t for item in results[0] for t, lp in zip(item.token_ids, item.logprobs))


async def test_top_k_one_and_tiny_top_p_equal_greedy(make_engine, reference_greedy):
    engine = make_engine(max_batch=2)
    prompt = _prompt(8, 4)
    expected = reference_greedy(list(prompt), 10)
    top_k = _request(prompt, max_tokens=10, temperature=2.0, top_k=1)
    top_p = _request(prompt, max_tokens=10, temperature=2.0, top_p=1e-9)
    assert [_tokens(items) for items in await asyncio.gather(_collect(engine, top_k), _collect(engine, top_p))] == [
        expected, expected
    ]


async def test_stop_token_ids_end_the_stream_with_stop(make_engine, reference_greedy):
    engine = make_engine(max_batch=1)
    prompt = _prompt(7, 5)
    greedy = reference_greedy(list(prompt), 10)
    stop = greedy[4]
    expected = greedy[: greedy.index(stop) + 1]  # the stop token itself is streamed
    items = await _collect(engine, _request(prompt, max_tokens=10, stop_token_ids=(stop,)))
    assert _tokens(items) == expected
    assert items[-1].finish_reason == FinishReason.STOP


async def test_eos_stops_unless_ignored(tmp_path, reference_greedy):
    prompt = _prompt(7, 6)
    greedy = reference_greedy(list(prompt), 10)
    # The same weights (same seed) with the fourth greedy token declared end-of-sequence.
    model_dir = make_tiny_model(tmp_path, "llama", seed=3, eos_token_id=greedy[3])
    engine = TorchEngine(model_dir, model_name="tiny-eos")
    try:
        stopped = await _collect(engine, _request(prompt, max_tokens=10, ignore_eos=False))
        ignored = await _collect(engine, _request(prompt, max_tokens=10, ignore_eos=True))
    finally:
        await engine.shutdown()
    assert _tokens(stopped) == greedy[: greedy.index(greedy[3]) + 1]
    assert stopped[-1].finish_reason == FinishReason.STOP
    assert _tokens(ignored) == greedy and ignored[-1].finish_reason == FinishReason.LENGTH


async def test_max_tokens_of_one_is_a_single_final_item(make_engine):
    engine = make_engine()
    items = await _collect(engine, _request(_prompt(5, 7), max_tokens=1))
    assert len(items) == 1
    assert len(items[0].token_ids) == 1 and items[0].finish_reason == FinishReason.LENGTH


async def test_yield_rule_first_alone_then_by_count_then_finish(make_engine):
    engine = make_engine(coalesce=CoalescePolicy(seconds=60.0, tokens=4))
    prompt = _prompt(9, 8)
    items = await _collect(engine, _request(prompt, max_tokens=11))
    assert [len(item.token_ids) for item in items] == [1, 4, 4, 2]
    assert [item.finish_reason for item in items] == [None, None, None, FinishReason.LENGTH]
    for item in items:
        assert len(item.step_seconds) == len(item.token_ids)
        assert all(seconds > 0 for seconds in item.step_seconds)
        assert item.prompt_tokens == len(prompt)


def _make_steps_slow(engine: TorchEngine, monkeypatch) -> None:
    """Every forward sleeps first, on the engine's thread: the tiny model alone steps in well under
    a millisecond, faster than a loaded event loop may hand a token on or a test read a gauge."""
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(SLOW_STEP_SECONDS)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", slow_forward)


async def test_yield_rule_by_time_sends_every_token_when_steps_are_slow(make_engine, monkeypatch):
    engine = make_engine(coalesce=CoalescePolicy(seconds=0.0, tokens=100))
    _make_steps_slow(engine, monkeypatch)
    items = await _collect(engine, _request(_prompt(4, 9), max_tokens=5))
    assert [len(item.token_ids) for item in items[:-1]] == [1, 1, 1, 1]
    assert len(items[-1].token_ids) <= 1 and items[-1].finish_reason == FinishReason.LENGTH


async def test_closing_the_stream_frees_the_slot_for_the_next_request(make_engine, reference_greedy):
    engine = make_engine(max_batch=1, coalesce=ONE_BY_ONE)
    endless = engine.generate(_request(_prompt(5, 10), "endless", max_tokens=400))
    first = await anext(endless)
    assert len(first.token_ids) == 1
    await endless.aclose()  # what Ray does when the client goes away
    prompt = _prompt(6, 11)
    tokens = _tokens(await asyncio.wait_for(_collect(engine, _request(prompt, max_tokens=5)), 10))
    assert tokens == reference_greedy(list(prompt), 5)
    health = await engine.health()
    assert health.running_requests == 0 and health.healthy


async def test_cancelling_the_consumer_task_frees_running_and_waiting_requests(make_engine):
    engine = make_engine(max_batch=1, coalesce=ONE_BY_ONE)
    started = asyncio.Event()

    async def consume(request):
        async for _ in engine.generate(request):
            started.set()

    running = asyncio.create_task(consume(_request(_prompt(5, 12), "running", max_tokens=400)))
    await started.wait()
    waiting = asyncio.create_task(consume(_request(_prompt(5, 13), "waiting", max_tokens=400)))
    await asyncio.sleep(0.05)
    assert (await engine.health()).waiting_requests == 1
    for task in (waiting, running):
        task.cancel()
    await asyncio.gather(running, waiting, return_exceptions=True)
    items = await asyncio.wait_for(_collect(engine, _request(_prompt(3, 14), "after", max_tokens=3)), 10)
    assert len(_tokens(items)) == 3
    health = await engine.health()
    assert (health.running_requests, health.waiting_requests) == (0, 0)


async def test_a_waiting_request_whose_client_left_is_not_counted_as_waiting(make_engine):
    engine = make_engine(max_batch=1, coalesce=ONE_BY_ONE)
    running = engine.generate(_request(_prompt(5, 17), "running", max_tokens=400))
    await anext(running)
    waiting = asyncio.create_task(_collect(engine, _request(_prompt(5, 18), "waiting", max_tokens=4)))
    await asyncio.sleep(0.05)
    assert (await engine.health()).waiting_requests == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    health = await engine.health()  # the running request still holds the only slot
    assert (health.running_requests, health.waiting_requests) == (1, 0)
    await running.aclose()


async def test_waiting_requests_are_admitted_by_priority_then_arrival(make_engine):
    engine = make_engine(max_batch=1, coalesce=ONE_BY_ONE)
    blocker = engine.generate(_request(_prompt(5, 15), "blocker", max_tokens=400))
    await anext(blocker)
    order: list[str] = []

    async def run(name: str, priority: int) -> None:
        async for _ in engine.generate(_request(_prompt(3, 16), name, priority, max_tokens=2)):
            if name not in order:
                order.append(name)

    tasks = []
    for name, priority in (("low-1", 0), ("high", 5), ("low-2", 0), ("mid", 2)):
        tasks.append(asyncio.create_task(run(name, priority)))
        await asyncio.sleep(0.01)  # queued in this order
    await blocker.aclose()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == ["high", "mid", "low-1", "low-2"]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ((), 4, "empty"),
        ((1, VOCAB), 4, "outside the vocabulary"),
        ((1, -1), 4, "outside the vocabulary"),
        ((1,) * 60, 5, "maximum context length is 64 tokens, but 65 were requested"),
        ((1,) * 64, 1, "context is 64"),
        ((1, 2.0), 4, "prompt token id 2.0 is not an integer"),
        ((1, True), 4, "prompt token id True is not an integer"),
    ],
)
async def test_bad_requests_are_refused_at_the_call(make_engine, prompt, max_tokens, message):
    engine = make_engine(max_seq=64)
    with pytest.raises(EngineError, match=message):
        engine.generate(GenerateRequest("bad", prompt, SamplingParams(max_tokens=max_tokens)))


@pytest.mark.parametrize(("prompt", "sampling"), [
    ((1, 2), {"seed": 1.5}),
    ((1, 2), {"top_k": 2.0}),
    ((1, 2), {"max_tokens": 2.5}),
    ((1, 2), {"stop_token_ids": (7.0,)}),
    ((1, 2.0), {}),
])
async def test_a_request_of_the_wrong_types_is_refused_and_the_engine_serves_on(make_engine, prompt, sampling):
    """Such a request passes the range checks and would fail on the step thread, ending every
    stream on the replica: it must be refused as a bad request instead."""
    engine = make_engine()
    with pytest.raises(EngineError, match="integer"):
        await _collect(engine, _request(prompt, **({"max_tokens": 4, "temperature": 1.0} | sampling)))
    items = await _collect(engine, _request(_prompt(5, seed=1), max_tokens=4, temperature=1.0, seed=7))
    assert items[-1].finish_reason == FinishReason.LENGTH and len(_tokens(items)) == 4


async def test_max_seq_is_clamped_to_the_model_positions(make_engine):
    assert make_engine(max_seq=10**6).max_context == 512


def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_step_durations_and_load_gauges_are_recorded(make_engine, monkeypatch):
    engine = make_engine(max_batch=2, tier="throughput", coalesce=ONE_BY_ONE)
    _make_steps_slow(engine, monkeypatch)  # still running when the gauges are read after its first token
    labels = {"tier": "throughput", "model": engine.model_name}
    stream = engine.generate(_request(_prompt(5, 17), max_tokens=6))
    await anext(stream)
    assert _sample("megaserve_running_requests", labels) == 1
    assert _sample("megaserve_busy_replicas", labels) == 1
    rest = [item async for item in stream]
    assert rest[-1].finish_reason == FinishReason.LENGTH
    await asyncio.sleep(0.01)
    assert _sample("megaserve_step_duration_seconds_count", labels | {"phase": "prefill"}) == 1
    assert _sample("megaserve_step_duration_seconds_count", labels | {"phase": "decode"}) == 5
    assert _sample("megaserve_step_duration_seconds_sum", labels | {"phase": "decode"}) > 0
    assert _sample("megaserve_running_requests", labels) == 0
    assert _sample("megaserve_busy_replicas", labels) == 0


async def test_shutdown_aborts_pending_streams_and_refuses_new_ones(make_engine):
    engine = make_engine(max_batch=1, coalesce=ONE_BY_ONE)
    running = engine.generate(_request(_prompt(5, 18), "running", max_tokens=400))
    await anext(running)
    waiting_items: list[StepOutput] = []

    async def wait_in_queue():
        waiting_items.extend([item async for item in engine.generate(_request(_prompt(3, 19), "waiting"))])

    waiting = asyncio.create_task(wait_in_queue())
    await asyncio.sleep(0.05)
    await engine.shutdown()
    last = [item async for item in running][-1]
    await waiting
    assert last.finish_reason == FinishReason.ABORT
    assert waiting_items[-1].finish_reason == FinishReason.ABORT and waiting_items[-1].token_ids == []
    assert not (await engine.health()).healthy
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.generate(_request(_prompt(3, 20)))


async def test_a_shutdown_during_a_prefill_admits_nothing_more(make_engine, monkeypatch):
    engine = make_engine(max_batch=4, coalesce=ONE_BY_ONE)
    forwards = []
    forward = engine.model.forward

    def forward_until_shut_down(*args, **kwargs):  # on the engine's thread: the shutdown lands mid-step
        forwards.append(args[0].shape)
        while not engine._queue.closed:
            time.sleep(0.001)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward_until_shut_down)

    async def collect(seed: int) -> list[StepOutput]:
        return [item async for item in engine.generate(_request(_prompt(3, seed), f"r{seed}", max_tokens=50))]

    streams = [asyncio.create_task(collect(seed)) for seed in range(30, 34)]  # room for all four
    while not forwards:
        await asyncio.sleep(0.001)  # the first prefill has begun
    await engine.shutdown()
    outputs = await asyncio.gather(*streams)
    # The prefill under way finishes; no other request is prefilled, and no decode step runs.
    assert forwards == [(1, 3)]
    assert all(items[-1].finish_reason == FinishReason.ABORT for items in outputs)
    assert sorted(sum(len(item.token_ids) for item in items) for items in outputs) == [0, 0, 0, 1]


async def test_create_engine_builds_a_torch_engine_from_plain_settings(tiny_model_dir):
    engine = create_engine(
        "torch", model_dir=tiny_model_dir, max_batch=2, coalesce_seconds=0.01, coalesce_tokens=8,
        tier="throughput", model_name="tiny-factory",
    )
    try:
        assert isinstance(engine, TorchEngine)
        assert engine.coalesce == CoalescePolicy(seconds=0.01, tokens=8)
        assert engine.max_batch == 2 and engine.tier == "throughput"
    finally:
        await engine.shutdown()
    with pytest.raises(ValueError, match="unknown engine kind 'tensorrt'"):
        create_engine("tensorrt", model_dir=tiny_model_dir)


async def test_a_failed_step_aborts_with_the_error_and_reports_unhealthy(make_engine):
    engine = make_engine()
    engine.cache.k[0] = None  # break the cache: the next forward fails inside the step thread
    items = await asyncio.wait_for(_collect(engine, _request(_prompt(4, 21), max_tokens=3)), 10)
    assert items[-1].finish_reason == FinishReason.ABORT and "engine step failed" in items[-1].error
    health = await engine.health()
    assert not health.healthy and "engine step failed" in health.detail


async def test_after_a_failed_step_requests_are_refused_as_a_dead_engine_not_as_bad_requests(make_engine):
    """The router answers EngineError with a final 400 and EngineDeadError with a 503 to retry: a
    request that reaches a replica before Serve replaces it was fine, and must be retried."""
    engine = make_engine()
    engine.cache.k[0] = None  # break the cache: the next forward fails inside the step thread
    await asyncio.wait_for(_collect(engine, _request(_prompt(4, 22), max_tokens=3)), 10)
    with pytest.raises(EngineDeadError, match="^engine step failed: AttributeError: ") as refused:
        engine.generate(_request(_prompt(3, 23)))
    assert not isinstance(refused.value, EngineError)
    await engine.shutdown()  # the shutdown that follows keeps the failure as the reason
    with pytest.raises(EngineDeadError, match="^engine step failed: "):
        engine.generate(_request(_prompt(3, 23)))


async def test_a_wedged_step_reports_unhealthy_until_steps_move_again(make_engine, monkeypatch):
    from megaserve.replicas.engines import threaded

    monkeypatch.setattr(threaded, "STALL_SECONDS", 0.2)
    engine = make_engine()
    forward, entered, wedged = engine.model.forward, threading.Event(), threading.Event()

    def hanging_forward(*args, **kwargs):  # a kernel that never returns, until the test lets it
        entered.set()
        wedged.wait()
        return forward(*args, **kwargs)

    engine.model.forward = hanging_forward
    generation = asyncio.ensure_future(_collect(engine, _request(_prompt(4, 22), max_tokens=3)))
    try:
        assert await asyncio.to_thread(entered.wait, 10)  # the step thread is inside the forward
        deadline = time.monotonic() + 10
        while (health := await engine.health()).healthy:
            assert time.monotonic() < deadline, "still healthy with a step wedged"
            await asyncio.sleep(0.05)
        assert "no step finished for" in health.detail and "1 request(s) running" in health.detail
    finally:
        wedged.set()  # whatever failed above, the step thread must not stay blocked
    items = await asyncio.wait_for(generation, 10)
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert (await engine.health()).healthy  # idle: nothing is waiting on a step


async def test_launches_per_step_are_measured_and_grow_with_depth(make_engine, tmp_path):
    engine = make_engine()
    labels = {"tier": "latency", "model": engine.model_name, "engine": "torch"}
    assert _sample("megaserve_kernel_launches_per_step", labels) == engine.launches_per_step > 0
    layers = engine.model.config.num_layers
    deeper_dir = make_tiny_model(tmp_path / "deeper", "llama", seed=3, num_hidden_layers=2 * layers)
    deeper = TorchEngine(deeper_dir, model_name="tiny-deeper")
    try:
        # Every decoder layer dispatches the same operators: doubling the layers adds exactly
        # one more copy of the per-layer count.
        per_layer, remainder = divmod(deeper.launches_per_step - engine.launches_per_step, layers)
        assert per_layer > 0 and remainder == 0
    finally:
        await deeper.shutdown()


async def test_engines_built_on_two_threads_at_once_both_measure_their_launches(make_engine):
    """Each engine's constructor runs a profiler session; two at once in one process crashed it
    (one replica process may host several engines: Serve places replicas by resources). Without
    the lock, one round crashed in 4 runs of 5: three rounds leave a crash-free pass at ~1%."""
    built: list[TorchEngine] = []
    ready = threading.Barrier(2)

    def build() -> None:
        ready.wait()  # both constructors start together
        built.append(make_engine())

    for _ in range(3):
        threads = [threading.Thread(target=build) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(built) == 6 and len({engine.launches_per_step for engine in built}) == 1
    assert built[0].launches_per_step > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine runs there")
def test_a_cuda_device_without_a_gpu_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="TorchEngine on 'cuda:0' needs a CUDA GPU, and this torch sees none"):
        TorchEngine(tiny_model_dir, device="cuda:0")
