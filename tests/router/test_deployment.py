"""ServeBackend's translation of what a DeploymentHandle raises, with a stand-in handle (the real
ones run in tests/deploy/test_app.py): a Ray failure of a call ends the generation as
GenerationFailed, which the router reports as an OpenAI server error, and the call is cancelled; an
engine's own EngineError and EngineDeadError come through as themselves, and a dead replica actor
as EngineDeadError (a 503 to retry). Its count of healthy replicas, from a stand-in serve.status().
And router replicas on the live stack's Serve: each admits its own share of the tiers."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from types import SimpleNamespace

from ray.exceptions import ActorDiedError, ObjectLostError, RayTaskError, WorkerCrashedError

from megaserve.replicas.models.demo import ensure_demo_model
from megaserve.replicas.protocol import EngineDeadError, EngineError, FinishReason, GenerateRequest, StepOutput
from megaserve.router import deployment
from megaserve.router.deployment import HEALTH_CACHE_SECONDS, RouterDeployment, ServeBackend
from megaserve.router.errors import APIError
from megaserve.router.generation import GenerationFailed
from megaserve.router.settings import RouterSettings

SHARES_SEEN_SECONDS = 60  # Serve's proxy picks a router per request: both answer well within this


class FailingResponse:
    """A streaming response that yields one output and then raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.cancelled = False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        yield StepOutput([5], [0.001])
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Stands in for `DeploymentHandle`: options(stream=True).generate.remote(request)."""

    app_name = "megaserve"
    deployment_name = "LatencyReplica"

    def __init__(self, response: FailingResponse) -> None:
        self.generate = self
        self.response = response

    def options(self, stream: bool) -> "Handle":
        return self

    def remote(self, request: GenerateRequest) -> FailingResponse:
        return self.response


@pytest.mark.parametrize("error", [WorkerCrashedError(), ObjectLostError("abc", "owner", "call site")])
def test_a_ray_failure_of_the_call_is_a_failed_generation(error):
    response = FailingResponse(error)
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    expected = f"the call to the LatencyReplica replica failed: {type(error).__name__}"
    with pytest.raises(GenerationFailed, match=expected):
        asyncio.run(consume())
    assert response.cancelled


@pytest.mark.parametrize("engine_error", [EngineError("the prompt is empty"),
                                          EngineDeadError("engine step failed: RuntimeError: boom")])
def test_an_engine_s_own_errors_come_through_the_handle_as_themselves(engine_error):
    """Ray raises what a replica's generate raised wrapped in a RayTaskError; the app tells a
    refused request (400) from a dead engine (503) by the class."""
    response = FailingResponse(RayTaskError("generate", "Traceback ...", engine_error).as_instanceof_cause())
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    with pytest.raises(type(engine_error)) as raised:
        asyncio.run(consume())
    assert type(raised.value) is type(engine_error) and str(raised.value) == str(engine_error)
    assert response.cancelled


def test_a_replica_actor_that_dies_is_a_dead_engine_and_the_tier_is_counted_again():
    response = FailingResponse(ActorDiedError())
    backend = ServeBackend(Handle(response), retry_after_seconds=1)
    backend._checked_at = time.monotonic()  # a fresh count, as while the replica was up

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    with pytest.raises(EngineDeadError, match="the LatencyReplica replica died"):
        asyncio.run(consume())
    assert response.cancelled
    assert backend._checked_at == float("-inf")


def serve_status(applications: dict) -> SimpleNamespace:
    return SimpleNamespace(applications=applications)


def replicas(**states: int) -> SimpleNamespace:
    return SimpleNamespace(replica_states=states)


@pytest.mark.parametrize("applications, healthy", [
    ({"megaserve": SimpleNamespace(deployments={"LatencyReplica": replicas(RUNNING=2, STARTING=1)})}, 2),
    ({"megaserve": SimpleNamespace(deployments={"LatencyReplica": replicas(STOPPING=2)})}, 0),
    ({"megaserve": SimpleNamespace(deployments={})}, 0),  # the app is being deleted
    ({}, 0),
], ids=["running", "stopping", "deployment gone", "app gone"])
def test_the_healthy_count_is_the_running_replicas_and_none_once_the_tier_is_gone(monkeypatch, applications, healthy):
    monkeypatch.setattr(deployment.serve, "status", lambda: serve_status(applications))
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    assert asyncio.run(backend.healthy_replicas()) == healthy


def test_callers_that_find_the_count_old_all_wait_for_one_read_of_it(monkeypatch):
    """A tier that has just come up: every request of a burst sees it, not only the first."""
    reads = []

    def status() -> SimpleNamespace:
        reads.append(time.monotonic())
        time.sleep(0.2)
        return serve_status({"megaserve": SimpleNamespace(deployments={"LatencyReplica": replicas(RUNNING=3)})})

    monkeypatch.setattr(deployment.serve, "status", status)
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    backend._healthy = 0  # as read while the tier was starting

    async def burst() -> list[int]:
        return await asyncio.gather(*(backend.healthy_replicas() for _ in range(8)))

    assert asyncio.run(burst()) == [3] * 8
    assert len(reads) == 1
    backend._checked_at -= HEALTH_CACHE_SECONDS + 1
    assert asyncio.run(backend.healthy_replicas()) == 3 and len(reads) == 2


class SlowResponse:
    """A streaming response whose one output comes after `delay` seconds (never, for None)."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay
        self.cancelled = False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        await asyncio.sleep(self.delay if self.delay is not None else 3600)
        yield StepOutput([5], [0.001], FinishReason.LENGTH)

    def cancel(self) -> None:
        self.cancelled = True


def running(count: int):
    return lambda: serve_status({"megaserve": SimpleNamespace(deployments={"LatencyReplica": replicas(RUNNING=count)})})


def test_a_call_waiting_for_a_tier_with_no_running_replica_ends_as_a_503(monkeypatch):
    """Every replica restarting, or stopping with the app: the call is not held until one is up."""
    monkeypatch.setattr(deployment, "HEALTH_CACHE_SECONDS", 0.05)
    monkeypatch.setattr(deployment.serve, "status", running(0))
    response = SlowResponse(None)
    backend = ServeBackend(Handle(response), retry_after_seconds=7)

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    with pytest.raises(APIError) as raised:
        asyncio.run(asyncio.wait_for(consume(), timeout=10))  # without the check: a TimeoutError
    assert raised.value.status == 503 and raised.value.headers == {"Retry-After": "7"}
    assert "no LatencyReplica replica is running" in raised.value.message
    assert response.cancelled


def test_a_call_that_waits_for_its_first_output_on_a_running_tier_is_served(monkeypatch):
    monkeypatch.setattr(deployment, "HEALTH_CACHE_SECONDS", 0.05)
    monkeypatch.setattr(deployment.serve, "status", running(1))
    response = SlowResponse(0.5)  # ten health intervals: a long prefill, say
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    [output] = asyncio.run(consume())
    assert output.token_ids == [5] and output.finish_reason is FinishReason.LENGTH
    assert not response.cancelled


@pytest.mark.integration
def test_two_router_replicas_each_admit_their_own_share_of_the_tiers(live_stack):
    """3 latency slots and 5 throughput slots over 2 routers: 2 + 1 and 3 + 2, never 2 + 2 (which
    would send a second request to a busy batch-1 replica instead of spilling it over)."""
    from ray import serve

    whole = RouterSettings(model_name="megaserve-demo", model_dir=str(ensure_demo_model(live_stack.home)),
                           max_context=1024, latency_capacity=3, throughput_capacity=5)
    tiers = [serve.get_deployment_handle(name, app_name="megaserve")
             for name in ("LatencyReplica", "ThroughputReplica")]
    app = RouterDeployment.options(num_replicas=2).bind(whole, *tiers, "127.0.0.1", live_stack.metrics_port)
    serve.run(app, name="two-routers", route_prefix="/two-routers")
    try:
        seen: set[tuple[int, int]] = set()
        deadline = time.monotonic() + SHARES_SEEN_SECONDS
        while len(seen) < 2 and time.monotonic() < deadline:
            with urllib.request.urlopen(live_stack.base_url + "/two-routers/health", timeout=10) as response:
                health = json.load(response)["tiers"]
            seen.add((health["latency"]["capacity"], health["throughput"]["capacity"]))
    finally:
        serve.delete("two-routers")
    assert seen == {(2, 3), (1, 2)}
