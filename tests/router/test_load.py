"""Capacity under load, over real HTTP: waiting, spillover, 429 / 503 with Retry-After, and a
client that leaves closes the replica stream at once (streamed, non-streamed, or still queued)."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from megaserve.monitoring.metrics import FINISHED_REQUESTS, QUEUE_DEPTH, REJECTED_REQUESTS
from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.protocol import Tier
from megaserve.router.app import SPILLOVER_PRIORITY, create_app
from megaserve.router.backend import EngineBackend

from .conftest import (
    MODEL,
    POLL_SECONDS,
    HoldingEngine,
    RecordingEngineBackend,
    router_settings,
    running_requests,
    wait_until,
)

LONG = {"max_tokens": 1000, "ignore_eos": True}
PRIORITY = {"model": MODEL, "prompt": "hold", "service_tier": "priority"}


class HeldStream:
    """A streamed request whose first chunk has arrived; the connection stays open until close()."""

    def __init__(self, url: str, body: dict) -> None:
        self.client = httpx.Client(timeout=30)
        self.response = self.client.send(self.client.build_request("POST", url + "/v1/completions",
                                                                   json={**body, "stream": True}), stream=True)
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()
        self.first = next(line for line in self.lines if line.startswith("data: "))

    @property
    def tier(self) -> str:
        return self.response.headers["x-megaserve-tier"]

    def close(self) -> None:
        self.response.close()
        self.client.close()


@pytest.fixture
def holding(engines):
    """Both tiers as HoldingEngines over the real engines; released at the end."""
    made = {tier: HoldingEngine(engine) for tier, engine in engines.items()}
    yield made
    for engine in made.values():
        engine.release()


def test_concurrent_latency_requests_spill_over_while_the_latency_tier_is_busy(serve_router, holding, engines):
    throughput = RecordingEngineBackend(engines[Tier.THROUGHPUT])
    url = serve_router({Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]), Tier.THROUGHPUT: throughput})
    held = HeldStream(url, {**PRIORITY, **LONG})
    assert held.tier == "latency"

    def ask(_):
        response = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        return response.status_code, response.headers["x-megaserve-tier"], response.headers[
            "x-megaserve-route-reason"], response.json()["service_tier"]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert answers == [(200, "throughput", "spillover", "default")] * 4
    # work that asked for latency goes ahead of bulk work in the throughput engine's queue
    assert [r.priority for r in throughput.requests] == [SPILLOVER_PRIORITY] * 4 and SPILLOVER_PRIORITY > 0
    bulk = httpx.post(url + "/v1/completions", json={**PRIORITY, "service_tier": "default", "max_tokens": 1})
    assert bulk.headers["x-megaserve-route-reason"] == "requested"
    assert throughput.requests[-1].priority == 0
    held.close()


def test_a_slot_freed_within_the_wait_keeps_the_request_on_latency(serve_router, holding, engines):
    url = serve_router({Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]),
                        Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])}, latency_wait_seconds=30)
    held = HeldStream(url, {**PRIORITY, "max_tokens": 3})
    depth = QUEUE_DEPTH.labels(tier="latency", model=MODEL)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, url + "/v1/completions", json={**PRIORITY, "max_tokens": 2}, timeout=30)
        wait_until(lambda: depth._value.get() == 1)
        holding[Tier.LATENCY].release()
        held.close()
        response = waiting.result()
    assert response.headers["x-megaserve-tier"] == "latency"
    assert response.headers["x-megaserve-route-reason"] == "requested"
    assert depth._value.get() == 0


def test_both_tiers_saturated_is_429_with_retry_after_then_served_again(serve_router, holding):
    url = serve_router({tier: EngineBackend(engine) for tier, engine in holding.items()},
                       throughput_capacity=1)
    held = [HeldStream(url, {**PRIORITY, **LONG}), HeldStream(url, {**PRIORITY, **LONG})]
    assert [h.tier for h in held] == ["latency", "throughput"]
    saturated = REJECTED_REQUESTS.labels(model=MODEL, reason="saturated")
    before = saturated._value.get()
    refused = httpx.post(url + "/v1/completions", json={**PRIORITY, "max_tokens": 1})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert saturated._value.get() == before + 1
    for stream in held:
        stream.close()
    wait_until(lambda: httpx.get(url + "/health").json()["tiers"]["throughput"]["in_flight"] == 0)
    assert httpx.post(url + "/v1/completions", json={**PRIORITY, "max_tokens": 1}).status_code == 200


def test_no_healthy_replica_is_503_with_retry_after(serve_router, demo_model_dir, engines):
    stopped = TorchEngine(demo_model_dir)
    asyncio.run(stopped.shutdown())
    url = serve_router({Tier.LATENCY: EngineBackend(engines[Tier.LATENCY]), Tier.THROUGHPUT: EngineBackend(stopped)})
    refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "service_tier": "default"})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "no_healthy_replicas"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["tiers"]["throughput"]["healthy"] is False
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                     "service_tier": "priority"}).status_code == 200


def test_disconnect_mid_stream_closes_the_replica_stream_at_once(serve_router, holding, engines):
    url = serve_router({Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]),
                        Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])})
    cancelled = FINISHED_REQUESTS.labels(tier="latency", model=MODEL, finish_reason="cancelled")
    before = cancelled._value.get()
    held = HeldStream(url, {**PRIORITY, **LONG})
    assert holding[Tier.LATENCY].closed == 0
    held.close()  # the replica is waiting for its next step, not writing: only a listener notices
    wait_until(lambda: holding[Tier.LATENCY].closed == 1)
    wait_until(lambda: running_requests(engines[Tier.LATENCY]) == 0)
    assert httpx.get(url + "/health").json()["tiers"]["latency"]["in_flight"] == 0
    assert cancelled._value.get() == before + 1


def test_disconnect_stops_a_real_engine_decoding(router_url, engines):
    engine = engines[Tier.LATENCY]
    held = HeldStream(router_url, {**PRIORITY, "max_tokens": 2000, "ignore_eos": True})
    assert json.loads(held.first.removeprefix("data: "))["choices"][0]["text"]  # the first token's text
    assert running_requests(engine) == 1
    held.close()
    wait_until(lambda: running_requests(engine) == 0)


def test_disconnect_of_a_non_streamed_request_closes_the_replica_stream(serve_router, holding, engines):
    url = serve_router({Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]),
                        Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])})
    with pytest.raises(httpx.ReadTimeout):  # the engine holds the generation: no answer comes
        httpx.post(url + "/v1/completions", json={**PRIORITY, **LONG}, timeout=httpx.Timeout(30, read=2))
    wait_until(lambda: holding[Tier.LATENCY].started == 1)
    wait_until(lambda: holding[Tier.LATENCY].closed == 1)


def test_disconnect_while_queued_gives_up_the_place_in_the_queue(serve_router, holding, engines):
    url = serve_router({Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]),
                        Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])}, latency_wait_seconds=30)
    held = HeldStream(url, {**PRIORITY, **LONG})
    depth = QUEUE_DEPTH.labels(tier="latency", model=MODEL)
    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(httpx.post, url + "/v1/completions", json=PRIORITY, timeout=httpx.Timeout(30, read=0.3))
        wait_until(lambda: depth._value.get() == 1)
        with pytest.raises(httpx.ReadTimeout):  # here, not in the thread, where a failure would be lost
            gone.result()
    wait_until(lambda: depth._value.get() == 0)
    held.close()
    wait_until(lambda: httpx.get(url + "/health").json()["tiers"]["latency"]["in_flight"] == 0)
    assert holding[Tier.LATENCY].started == 1  # the one that left never reached the replica


async def test_a_cancelled_request_task_gives_back_its_slot(demo_model_dir, tokenizer, holding, engines):
    """Ray Serve cancels the task of a request whose client left (or that ran past its timeout)
    rather than sending `http.disconnect`: the slot must come back and the replica stream close."""
    app = create_app(router_settings(demo_model_dir), {Tier.LATENCY: EngineBackend(holding[Tier.LATENCY]),
                                                        Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])},
                     tokenizer)
    body = json.dumps({**PRIORITY, **LONG}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client never says it left: the task is cancelled instead

    async def send(message: dict) -> None:
        pass

    served = asyncio.create_task(app(scope, receive, send))
    while holding[Tier.LATENCY].started == 0:
        await asyncio.sleep(POLL_SECONDS)
    served.cancel()
    with pytest.raises(asyncio.CancelledError):
        await served
    assert app.state.router.admission.slots[Tier.LATENCY].in_flight == 0
    assert holding[Tier.LATENCY].closed == 1


class CleanupFailingBackend(EngineBackend):
    """A real engine whose first stream raises while being closed (a broken replica connection)."""

    failed = False

    async def stream(self, request):
        try:
            async for output in super().stream(request):
                yield output
        finally:
            if not self.failed:
                self.failed = True
                raise RuntimeError("the backend failed while closing its stream")


@pytest.mark.parametrize("stream", [True, False])
def test_a_backend_failing_at_close_still_gives_the_slot_back(serve_router, engines, stream):
    failing = CleanupFailingBackend(engines[Tier.LATENCY])
    url = serve_router({Tier.LATENCY: failing, Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])})
    # The client leaves mid-generation, so the router closes the backend stream while it is
    # suspended, and that close raises.
    body = {**PRIORITY, **LONG, "stream": stream}
    if stream:
        HeldStream(url, body).close()
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_until(lambda: running_requests(engines[Tier.LATENCY]) == 0)
    wait_until(lambda: failing.failed)  # the close did raise
    follow_up = httpx.post(url + "/v1/completions", json={**PRIORITY, "max_tokens": 1}, timeout=30)
    assert follow_up.headers["x-megaserve-tier"] == "latency"  # not spilled: the slot came back
