"""The asyncio side shared by the engines whose steps run on one background thread (TorchEngine,
MegakernelEngine): validation at the call, a stream per request that follows the yield rule,
queueing by priority, health, and the request record the step thread works on.

A subclass sets `vocab_size`, `max_context`, `eos_ids`, `coalesce` and `metrics` (its
EngineMetrics, whose step records are also health's sign of progress), calls
`_start_step_thread(name)` last in its constructor, and implements `_step_loop` (returns once the
queue is closed; streams each new token through `_deliver`), `_running_items` and `_release`. A
step that raises ends the engine: the streams end with ABORT and the error, later requests get
EngineDeadError with it, and health turns unhealthy so that Serve replaces the replica.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from ..protocol import (
    ENGINE_SHUT_DOWN,
    CoalescePolicy,
    Engine,
    EngineDeadError,
    EngineHealth,
    FinishReason,
    GenerateRequest,
    StepOutput,
    TokenLogprob,
)
from .engine_metrics import EngineMetrics
from .stream import RequestQueue, StreamOutbox, TokenStream

logger = logging.getLogger(__name__)
# A running request with no step finished for this long means the step thread is wedged (a hung
# kernel, a device sync that never returns): health turns unhealthy, so Serve replaces the replica
# instead of counting its slot forever. Far above any one step: a GPU prefill of a whole context
# takes seconds, a decode step milliseconds.
STALL_SECONDS = 120.0


@dataclass(eq=False)
class Admission:
    """A request's life inside an engine."""

    request: GenerateRequest
    stream: TokenStream
    stop_ids: frozenset[int]  # stop token ids, eos included unless ignore_eos
    slot: int = -1  # KV-cache row while running
    generated: int = 0

    @property
    def next_position(self) -> int:
        """Where the newest token goes when it is fed back: prompt positions are 0..P-1."""
        return len(self.request.prompt_token_ids) + self.generated - 1


class StepThreadEngine(Engine):
    eos_ids: frozenset[int]
    coalesce: CoalescePolicy
    metrics: EngineMetrics

    def _start_step_thread(self, name: str) -> None:
        self._queue: RequestQueue[Admission] = RequestQueue()
        self._failure: str | None = None  # set by the step thread when a step raised
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self._step_loop()
        except Exception as exc:
            logger.exception("%s: engine step failed", type(self).__name__)
            self._failure = f"engine step failed: {type(exc).__name__}: {exc}"
            self._queue.close(self._failure)  # the first close's reason is what later requests are told
        finally:
            self._abort_all()

    @abc.abstractmethod
    def _step_loop(self) -> None:
        """Run steps on the engine thread until the queue is closed."""

    @abc.abstractmethod
    def _running_items(self) -> list[Admission]:
        """Requests being generated now."""

    @abc.abstractmethod
    def _release(self, item: Admission) -> None:
        """Free what `item` holds (its KV slot) and count it ended; nothing if already released."""

    def _running_count(self) -> int:
        return len(self._running_items())

    def _deliver(self, item: Admission, token: int, seconds: float, outbox: StreamOutbox,
                 logprob: TokenLogprob | None = None) -> bool:
        """Stream `item`'s newest token (with its logprob, where the request asked); True when it
        ends the generation (a stop id, or max_tokens), which then finishes the stream and releases
        the item before `outbox` is flushed, so that a new request finds the engine free once the
        client sees the end."""
        item.generated += 1
        outbox.token(item.stream, token, seconds, logprob)
        if token in item.stop_ids:
            reason = FinishReason.STOP
        elif item.generated >= item.request.sampling.max_tokens:
            reason = FinishReason.LENGTH
        else:
            return False
        outbox.finish(item.stream, reason)
        self._release(item)
        return True

    def _abort_all(self) -> None:
        """End every stream, running or waiting, with ABORT (and `_failure`, if any): shutdown or a
        failed step."""
        self._queue.close()
        outbox = StreamOutbox()
        for item in self._running_items():
            outbox.finish(item.stream, FinishReason.ABORT, self._failure)
            self._release(item)
        for item in self._queue.drain():
            outbox.finish(item.stream, FinishReason.ABORT, self._failure)
        outbox.flush()

    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Validate now (EngineError at the call, EngineDeadError once a step failed or after
        shutdown), queue when iteration starts."""
        if self._queue.closed:
            raise EngineDeadError(self._queue.closed_because)
        self.validate(request)
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        stream = TokenStream(len(request.prompt_token_ids), self.coalesce, asyncio.get_running_loop())
        sampling = request.sampling
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_ids)
        self._queue.put(Admission(request, stream, stop_ids), request.priority)
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                yield output

    async def health(self) -> EngineHealth:
        alive = self._thread.is_alive()
        stalled = self.metrics.seconds_without_progress()
        detail = self._failure or ("" if alive else ENGINE_SHUT_DOWN)
        if stalled > STALL_SECONDS and not detail:
            detail = f"no step finished for {stalled:.0f} s with {self._running_count()} request(s) running"
        return EngineHealth(
            healthy=not detail, detail=detail,
            running_requests=self._running_count(),
            # a request whose client left stays queued until a slot pops it: it is not waiting
            waiting_requests=self._queue.count(lambda item: not item.stream.cancelled),
        )

    async def _stop_step_thread(self) -> None:
        """Close the queue and wait for the step thread, which aborts what it still holds."""
        self._queue.close()
        await asyncio.to_thread(self._thread.join)
