"""ServeBackend's translation of what a DeploymentHandle raises, with a stand-in handle (the real
ones run in tests/deploy/test_app.py): a Ray failure of a call ends the generation as
GenerationFailed, which the router reports as an OpenAI server error, and the call is cancelled; an
engine's own EngineError and EngineDeadError come through as themselves, and a dead replica actor
as EngineDeadError (a 503 to retry). Its count of healthy replicas, from a stand-in serve.status().
And router replicas on the live stack's Serve: each admits its own share of the tiers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import inspect
import json
import threading
import time
import urllib.request

import pytest
from types import SimpleNamespace

from ray.exceptions import ActorDiedError, ObjectLostError, RayTaskError, WorkerCrashedError
from ray.serve._private.common import RequestMetadata
from ray.serve.handle import DeploymentResponseGenerator, _DeploymentResponseBase

from megaserve.replicas.models.demo import ensure_demo_model
from megaserve.replicas.protocol import EngineDeadError, EngineError, FinishReason, GenerateRequest, StepOutput
from megaserve.router import deployment
from megaserve.router.deployment import (
    HEALTH_CACHE_SECONDS,
    HEALTH_ZERO_RECHECK_SECONDS,
    RouterDeployment,
    ServeBackend,
)
from megaserve.router.errors import APIError, GenerationFailed
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


async def all_outputs(backend: ServeBackend) -> list[StepOutput]:
    return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]


@pytest.mark.parametrize("error", [WorkerCrashedError(), ObjectLostError("abc", "owner", "call site")])
def test_a_ray_failure_of_the_call_is_a_failed_generation(error):
    response = FailingResponse(error)
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    expected = f"the call to the LatencyReplica replica failed: {type(error).__name__}"
    with pytest.raises(GenerationFailed, match=expected):
        asyncio.run(all_outputs(backend))
    assert response.cancelled


@pytest.mark.parametrize("engine_error", [EngineError("the prompt is empty"),
                                          EngineDeadError("engine step failed: RuntimeError: boom")])
def test_an_engine_s_own_errors_come_through_the_handle_as_themselves(engine_error):
    """Ray raises what a replica's generate raised wrapped in a RayTaskError; the app tells a
    refused request (400) from a dead engine (503) by the class."""
    response = FailingResponse(RayTaskError("generate", "Traceback ...", engine_error).as_instanceof_cause())
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    with pytest.raises(type(engine_error)) as raised:
        asyncio.run(all_outputs(backend))
    assert type(raised.value) is type(engine_error) and str(raised.value) == str(engine_error)
    assert response.cancelled


def test_a_replica_actor_that_dies_is_a_dead_engine_and_the_tier_is_counted_again():
    response = FailingResponse(ActorDiedError())
    backend = ServeBackend(Handle(response), retry_after_seconds=1)
    backend._checked_at = time.monotonic()  # a fresh count, as while the replica was up

    with pytest.raises(EngineDeadError, match="the LatencyReplica replica died"):
        asyncio.run(all_outputs(backend))
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


def running(count: int):
    return lambda: serve_status({"megaserve": SimpleNamespace(deployments={"LatencyReplica": replicas(RUNNING=count)})})


def test_callers_that_the_old_count_would_refuse_all_wait_for_one_read_of_it(monkeypatch):
    """A tier that has just come up: every request of a burst sees it, not only the first."""
    reads = []

    def status() -> SimpleNamespace:
        reads.append(time.monotonic())
        time.sleep(0.2)
        return running(3)()

    monkeypatch.setattr(deployment.serve, "status", status)
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    backend._healthy, backend._checked_at = 0, time.monotonic() - HEALTH_CACHE_SECONDS - 1  # read while starting

    async def burst() -> list[int]:
        return await asyncio.gather(*(backend.healthy_replicas() for _ in range(8)))

    assert asyncio.run(burst()) == [3] * 8
    assert len(reads) == 1


def test_a_count_of_none_is_renewed_sooner_than_a_healthy_one(monkeypatch):
    """/health agrees within HEALTH_ZERO_RECHECK_SECONDS once a tier comes up; a healthy count is
    read once per HEALTH_CACHE_SECONDS."""
    counts = iter([0, 2, 0])
    monkeypatch.setattr(deployment.serve, "status", lambda: running(next(counts))())
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)

    async def across_the_recheck() -> list[int]:
        seen = [await backend.healthy_replicas()]  # the first read: none yet
        seen.append(await backend.healthy_replicas())  # within the recheck: the cached none
        await asyncio.sleep(HEALTH_ZERO_RECHECK_SECONDS * 1.5)
        seen.append(await backend.healthy_replicas())  # past it: read again, and up
        await asyncio.sleep(HEALTH_ZERO_RECHECK_SECONDS * 1.5)
        seen.append(await backend.healthy_replicas())  # a healthy count stays for HEALTH_CACHE_SECONDS
        return seen

    assert asyncio.run(across_the_recheck()) == [0, 0, 2, 2]
    assert HEALTH_ZERO_RECHECK_SECONDS * 3 < HEALTH_CACHE_SECONDS


class BlockedStatus:
    """serve.status() that answers `count` RUNNING replicas once released."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.release = threading.Event()
        self.reads = 0

    def __call__(self) -> SimpleNamespace:
        self.reads += 1
        self.release.wait(10)
        return running(self.count)()


def test_a_caller_with_a_cached_healthy_count_does_not_wait_for_the_read_that_renews_it(monkeypatch):
    status = BlockedStatus(5)
    monkeypatch.setattr(deployment.serve, "status", status)
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    backend._healthy, backend._checked_at = 2, time.monotonic() - HEALTH_CACHE_SECONDS - 1

    async def call_then_release() -> tuple[int, int]:
        cached = await backend.healthy_replicas()  # the read is blocked: only the cached count can answer
        status.release.set()
        await backend._reading
        return cached, await backend.healthy_replicas()

    assert asyncio.run(call_then_release()) == (2, 5)
    assert status.reads == 1


def test_a_caller_that_waits_for_a_slow_read_gives_up_after_a_bound(monkeypatch):
    monkeypatch.setattr(deployment, "HEALTH_READ_WAIT_SECONDS", 0.1)
    status = BlockedStatus(5)
    monkeypatch.setattr(deployment.serve, "status", status)
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    backend._healthy = 0

    async def call_then_release() -> int:
        try:
            return await asyncio.wait_for(backend.healthy_replicas(), timeout=5)  # the controller hangs
        finally:
            status.release.set()

    assert asyncio.run(call_then_release()) == 0


def test_a_read_begun_before_a_replica_died_does_not_renew_the_count(monkeypatch):
    monkeypatch.setattr(deployment.serve, "status", running(1))
    backend = ServeBackend(Handle(FailingResponse(RuntimeError())), retry_after_seconds=1)
    before_the_death = backend._deaths
    backend._deaths += 1  # as stream() does on RayActorError
    asyncio.run(backend._read_healthy(before_the_death))
    assert backend._healthy == 1 and backend._checked_at == float("-inf")  # the next caller reads again
    asyncio.run(backend._read_healthy(backend._deaths))
    assert backend._checked_at > float("-inf")


class SlowResponse:
    """A streaming response whose one output comes after `delay` seconds, and whose assignment to a
    replica is done or not, as a DeploymentResponseGenerator's."""

    def __init__(self, delay: float, assigned: bool) -> None:
        self.delay = delay
        self.cancelled = False
        self._replica_result_future = concurrent.futures.Future()
        if assigned:
            self._replica_result_future.set_result(None)

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        await asyncio.sleep(self.delay)
        yield StepOutput([5], [0.001], FinishReason.LENGTH)

    def cancel(self) -> None:
        self.cancelled = True


def unassigned_call() -> DeploymentResponseGenerator:
    """Serve's own streaming response to a call that no replica has taken (its assignment pending)."""
    return DeploymentResponseGenerator(concurrent.futures.Future(), RequestMetadata("r", "r"),
                                       _is_router_running_in_separate_loop=True)


def test_ray_keeps_the_assignment_future_that_the_first_output_wait_reads():
    init = inspect.getsource(_DeploymentResponseBase.__init__)
    assert f"self.{deployment.ASSIGNMENT_ATTRIBUTE} = replica_result_future" in init


def test_a_call_waiting_for_a_tier_with_no_running_replica_ends_as_a_503(monkeypatch):
    """Every replica restarting, or stopping with the app: the call is not held until one is up."""
    monkeypatch.setattr(deployment, "HEALTH_CACHE_SECONDS", 0.05)
    monkeypatch.setattr(deployment.serve, "status", running(0))
    response = unassigned_call()
    backend = ServeBackend(Handle(response), retry_after_seconds=7)
    unhandled = []

    async def consume() -> list[StepOutput]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        try:
            return await all_outputs(backend)
        finally:
            await asyncio.sleep(0.1)  # the abandoned first-output task ends

    with pytest.raises(APIError) as raised:
        asyncio.run(asyncio.wait_for(consume(), timeout=10))  # without the check: a TimeoutError
    error = raised.value
    assert error.status == 503 and error.headers == {"Retry-After": "7"}
    assert "no LatencyReplica replica is running" in error.message
    assert response.cancelled()
    del raised, error  # their traceback holds the abandoned task
    gc.collect()  # which, if unread, reports its exception as it goes
    # Ray ends the abandoned wait with RequestCancelledError: read, not "never retrieved"
    assert not unhandled, unhandled


@pytest.mark.parametrize("count, assigned", [(1, False), (0, True)],
                         ids=["running tier", "call on a stopping replica"])
def test_a_call_that_waits_for_its_first_output_is_served(monkeypatch, count, assigned):
    """A long prefill, say; or the last calls of a replica that stops with the app, which it finishes."""
    monkeypatch.setattr(deployment, "HEALTH_CACHE_SECONDS", 0.05)
    monkeypatch.setattr(deployment.serve, "status", running(count))
    response = SlowResponse(0.5, assigned=assigned)  # ten health intervals
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    [output] = asyncio.run(all_outputs(backend))
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
