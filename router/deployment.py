"""The router as a Ray Serve ingress deployment: the FastAPI app of `app.py` over two handles.

Each tier is a `DeploymentHandle` to replicas whose `generate(request)` is an async generator of
`StepOutput`s. `ServeBackend` calls it with `stream=True` and cancels the call when the router
closes the stream (stop string, client gone), so Ray cancels the replica-side generator and a
batch-1 replica stops decoding at its next step. Serve's own refusals become OpenAI errors:
BackPressureError (the replicas' queues are full) -> 429, no replica to take the call -> 503, and
so is a call that no replica has taken yet while the tier has no RUNNING replica.
A replica's EngineError (a refused request) and EngineDeadError (an engine that failed or was shut
down, whose replica Serve has yet to replace) reach the app as themselves: a 400 and a 503. A
replica actor that dies is a dead engine too (503 with Retry-After: the request was fine, a retry
finds the replacement), and the tier's replica count is read again at the next admission. Any
other failure of a call ends the request with an OpenAI server error (a 500, or an error event on a
stream that already started), never a broken connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from megaserve.monitoring.exporter import start_node_exporter
from megaserve.monitoring.metrics import start_router_series
from megaserve.replicas.protocol import EngineDeadError, EngineError, GenerateRequest, StepOutput, Tier
from megaserve.router.app import create_app
from megaserve.router.backend import Backend
from megaserve.router.errors import GenerationFailed, busy
from megaserve.router.policy import single_router
from megaserve.router.settings import RouterSettings

HEALTH_CACHE_SECONDS = 2.0  # serve.status() asks the controller: once per interval, not per request
# A count of none is renewed this much sooner: a tier that has just come up (or back) is served,
# and /health says so, within this of its replicas' start, not up to HEALTH_CACHE_SECONDS later.
# The cost, while a tier is down and requests come: at most 1 / this controller reads a second per
# router, each awaited by the requests it finds (refused or spilled over by the count they replace).
HEALTH_ZERO_RECHECK_SECONDS = 0.25
# How long a caller that the cached count would refuse (no healthy replica) waits for the read
# that renews it; the controller may be slow or restarting.
HEALTH_READ_WAIT_SECONDS = 2.0
RUNNING = "RUNNING"  # the ReplicaState of a replica that takes requests
# The future of a Serve call's assignment to a replica (ray.serve.handle._DeploymentResponseBase)
ASSIGNMENT_ATTRIBUTE = "_replica_result_future"
# Requests a router replica holds beyond the tiers' slots it may admit: latency requests waiting
# for a slot, refusals on their way out, /health and /v1/models. Each is a cheap coroutine.
ROUTER_SPARE_REQUESTS = 1000

log = logging.getLogger(__name__)


class ServeBackend:
    """A tier's replicas, reached through a streaming DeploymentHandle."""

    def __init__(self, handle: DeploymentHandle, retry_after_seconds: int) -> None:
        self.handle = handle
        self.retry_after_seconds = retry_after_seconds
        self._stream = handle.options(stream=True)
        self._healthy = 1  # until the first status answer: let Serve's own errors speak
        self._checked_at = float("-inf")  # -inf: never read, or a replica died since
        self._deaths = 0  # replica deaths seen by calls: a read begun before one does not renew the count
        self._reading: asyncio.Task[None] | None = None  # the status read in flight

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        response = self._stream.generate.remote(request)
        finished = False
        try:
            outputs = aiter(response)
            output = await self._first_output(response, outputs)
            while True:
                finished = output.finish_reason is not None
                yield output
                output = await anext(outputs)
        except StopAsyncIteration:
            return
        except BackPressureError as error:
            raise busy(f"the replicas' queues are full: {error}", self.retry_after_seconds,
                       unavailable=False) from None
        except DeploymentUnavailableError as error:
            raise busy(str(error), self.retry_after_seconds, unavailable=True) from None
        except RayTaskError as error:
            if isinstance(error.cause, EngineError):
                raise EngineError(str(error.cause)) from None
            if isinstance(error.cause, EngineDeadError):
                raise EngineDeadError(str(error.cause)) from None
            raise GenerationFailed(f"the {self.handle.deployment_name} replica failed: {error.cause!r}") from None
        except RayActorError as error:
            self._deaths += 1
            self._checked_at = float("-inf")  # a replica is gone: the next admission counts afresh
            raise EngineDeadError(f"the {self.handle.deployment_name} replica died: {_first_line(error)}") from None
        except RayError as error:  # a crashed worker, a lost object: Ray lost the call
            raise GenerationFailed(f"the call to the {self.handle.deployment_name} replica failed: "
                                   f"{type(error).__name__}: {_first_line(error)}") from None
        finally:
            if not finished:
                response.cancel()

    async def _first_output(self, response: Any, outputs: AsyncIterator[StepOutput]) -> StepOutput:
        """The call's first output. Serve holds a call that no replica can take until one can: while
        the call is not on a replica and the tier has no RUNNING replica (every one restarting, or
        stopping with the app), the wait ends as a 503 instead, once the count says so, rather than
        lasting until a replacement is up or the router is stopped. A call that a replica has taken
        is left to it, even one that is stopping: it finishes what it took."""
        first = asyncio.ensure_future(anext(outputs))
        try:
            while not (await asyncio.wait({first}, timeout=HEALTH_CACHE_SECONDS))[0]:
                if _on_a_replica(response):
                    return await first
                if await self.healthy_replicas() == 0 and not first.done() and not _on_a_replica(response):
                    raise busy(f"no {self.handle.deployment_name} replica is running to take the request",
                               self.retry_after_seconds, unavailable=True)
            return first.result()
        finally:
            if not first.done():
                first.cancel()
                # Once the call is cancelled too (stream's finally), Ray ends the task with
                # RequestCancelledError, not a cancellation: read, so that nothing logs it as lost.
                first.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def healthy_replicas(self) -> int:
        """The count of at most HEALTH_CACHE_SECONDS ago, renewed by one read at a time. A caller
        that the cached count would refuse (0), or that finds no count (never read, or a replica
        died since), waits up to HEALTH_READ_WAIT_SECONDS for that read: a tier that has just come
        up serves the burst that finds it. Others go on with the cached count meanwhile. A count of
        none is at most HEALTH_ZERO_RECHECK_SECONDS old."""
        interval = HEALTH_CACHE_SECONDS if self._healthy else HEALTH_ZERO_RECHECK_SECONDS
        if time.monotonic() - self._checked_at > interval and not self._read_in_flight():
            self._reading = asyncio.ensure_future(self._read_healthy(self._deaths))
        if (self._healthy == 0 or self._checked_at == float("-inf")) and self._read_in_flight():
            with contextlib.suppress(asyncio.TimeoutError):  # a caller that leaves: the read goes on
                await asyncio.wait_for(asyncio.shield(self._reading), HEALTH_READ_WAIT_SECONDS)
        return self._healthy

    def _read_in_flight(self) -> bool:
        reading = self._reading
        return reading is not None and not reading.done() and reading.get_loop() is asyncio.get_running_loop()

    async def _read_healthy(self, deaths: int) -> None:
        try:
            self._healthy = await asyncio.to_thread(self._running_replicas)
        except Exception:  # noqa: BLE001 - the controller may be restarting; keep the last count
            log.warning("could not read the replica states of %s", self.handle.deployment_name, exc_info=True)
        if self._deaths == deaths:  # else the count may predate a death: the next caller reads again
            self._checked_at = time.monotonic()

    def _running_replicas(self) -> int:
        """RUNNING replicas of the tier; none once its app or deployment is gone (being deleted)."""
        application = serve.status().applications.get(self.handle.app_name)
        deployment = application.deployments.get(self.handle.deployment_name) if application else None
        if deployment is None:
            return 0
        return sum(count for state, count in deployment.replica_states.items() if state == RUNNING)


def serve_router_position() -> tuple[int, int]:
    """This router replica's (rank, replicas), read afresh at every use: Serve renumbers ranks once
    a replaced replica has stopped, and changes num_replicas in place. A rank past the count (a
    replacement started while the replica it replaces drains) shares like rank - count until then;
    an autoscaled router, whose count is not fixed, admits like a single one."""
    replica = serve.get_replica_context()
    routers = replica.world_size
    if not isinstance(routers, int) or routers < 1:
        return single_router()
    return replica.rank.rank % routers, routers


def router_max_ongoing_requests(settings: RouterSettings) -> int:
    """Serve's limit for one router replica: every slot of both tiers (a router's share is at most
    all of them: an autoscaled router admits like a single one) plus the spare. Below that, Serve
    would hold requests that the router admits in its proxy's queue, which has no bound and answers
    no 429; the tiers are guarded by the router's own slot counts, not by this."""
    return settings.latency_capacity + settings.throughput_capacity + ROUTER_SPARE_REQUESTS


def _on_a_replica(response: Any) -> bool:
    """Whether Serve has assigned the call to a replica (a DeploymentResponseGenerator's assignment
    future is done). A Ray without that attribute: taken as assigned, so that no call is given up."""
    assignment = getattr(response, ASSIGNMENT_ATTRIBUTE, None)
    return assignment is None or assignment.done()


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


@serve.deployment(max_ongoing_requests=ROUTER_SPARE_REQUESTS)
@serve.ingress()
class RouterDeployment:
    """HTTP ingress; `latency` / `throughput` are None when that tier is disabled."""

    def __init__(
        self,
        settings: RouterSettings,
        latency: DeploymentHandle | None,
        throughput: DeploymentHandle | None,
        metrics_host: str,
        metrics_port: int,
    ) -> None:
        start_node_exporter(metrics_host, metrics_port)
        self.settings = settings
        self.backends: dict[Tier, Backend] = {
            tier: ServeBackend(handle, settings.retry_after_seconds)
            for tier, handle in ((Tier.LATENCY, latency), (Tier.THROUGHPUT, throughput))
            if handle is not None
        }
        start_router_series(settings.model_name, tuple(tier.value for tier in self.backends))

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve relays a body that its client stops sending as a cancelled task.
        return create_app(self.settings, self.backends, position=serve_router_position,
                          disconnect_errors=(TaskCancelledError,))
