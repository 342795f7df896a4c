"""The bridge between an engine's own thread (or task) and the asyncio consumers of its streams.

An engine that owns the device from a background thread (TorchEngine, MegakernelEngine) uses
all three pieces; an engine that lives on the event loop (SGLangEngine) uses `TokenStream` alone.

  RequestQueue   consumers -> engine thread. Waiting requests, highest `priority` first and FIFO
                 within a priority; `put` from any thread, `pop`/`wait` on the engine thread.
  StreamOutbox   engine thread -> consumers. Collects what one step produced for every stream and
                 hands it over with one `call_soon_threadsafe` per event loop per step, so a step
                 of a 64-row batch wakes the loop once, not 64 times.
  TokenStream    one request's channel. `outputs()` is the async generator the consumer iterates;
                 it applies the yield rule of `replicas.protocol` (first token alone, then
                 coalesced by time and count, finish_reason on the last item) with a real timer,
                 so pending tokens go out after `CoalescePolicy.seconds` even if the engine is
                 slow to produce the next one. When the consumer closes the generator (aclose,
                 or the CancelledError Ray raises on client disconnect), `cancelled` becomes True
                 and `on_cancel` runs; the engine drops the request at its next step boundary.

Usage from an engine thread, per step:

    outbox = StreamOutbox()
    for seq in running:
        if seq.stream.cancelled: ...free its slot...
        outbox.token(seq.stream, token_id, step_seconds)
        if done: outbox.finish(seq.stream, FinishReason.STOP)
    outbox.flush()
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..protocol import ENGINE_SHUT_DOWN, CoalescePolicy, EngineDeadError, FinishReason, StepOutput, TokenLogprob

Item = TypeVar("Item")


@dataclass
class Chunk:
    """What a producer hands a stream at once: new tokens, and possibly the end."""

    token_ids: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, where the request asked


class TokenStream:
    """One request's stream of tokens, produced by an engine and consumed through `outputs()`."""

    def __init__(
        self,
        prompt_tokens: int,
        policy: CoalescePolicy,
        loop: asyncio.AbstractEventLoop,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.policy = policy
        self.loop = loop
        self.on_cancel = on_cancel
        self.cancelled = False  # set on the loop thread, read by the engine thread (a plain bool)
        self._chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self._getter: asyncio.Task[Chunk] | None = None  # a get() that outlived a coalescing deadline

    def put(self, chunk: Chunk) -> None:
        """Hand over a chunk; call on the stream's event loop (threads go through StreamOutbox)."""
        self._chunks.put_nowait(chunk)

    async def outputs(self) -> AsyncIterator[StepOutput]:
        """The consumer's side: StepOutputs that follow the yield rule, until the last one."""
        pending = Chunk()  # tokens received and not yet yielded
        first = True
        last_yield = time.monotonic()
        finished = False
        try:
            while True:
                timeout = None if not pending.token_ids else last_yield + self.policy.seconds - time.monotonic()
                chunk = await self._next(timeout)
                if chunk is None:  # the coalescing deadline passed with tokens pending
                    yield self._item(pending, len(pending.token_ids))
                    last_yield = time.monotonic()
                    continue
                pending.token_ids += chunk.token_ids
                pending.step_seconds += chunk.step_seconds
                pending.logprobs += chunk.logprobs
                if chunk.finish_reason is not None:
                    finished = True
                    yield self._item(pending, len(pending.token_ids), chunk.finish_reason, chunk.error)
                    return
                if first and pending.token_ids:
                    first = False
                    yield self._item(pending, 1)
                    last_yield = time.monotonic()
                while len(pending.token_ids) >= self.policy.tokens:
                    yield self._item(pending, self.policy.tokens)
                    last_yield = time.monotonic()
        finally:
            if not finished:
                if self._getter is not None:  # nobody will take its chunk now
                    self._getter.cancel()
                self.cancelled = True
                if self.on_cancel is not None:
                    self.on_cancel()

    async def _next(self, timeout: float | None) -> Chunk | None:
        """The next chunk, or None once `timeout` seconds pass without one."""
        if self._getter is None:
            if timeout is None or not self._chunks.empty():
                return await self._chunks.get()
            if timeout <= 0:
                return None
            self._getter = asyncio.create_task(self._chunks.get())
        # Not asyncio.wait_for: before Python 3.12 it swallows this task's cancellation when the
        # get() completes in the same loop turn (gh-86296), and Ray cancels a stream only once.
        # asyncio.wait always lets the CancelledError through and leaves the getter running on a
        # timeout, so a chunk that arrives as the deadline passes waits in it for the next call.
        done, _ = await asyncio.wait((self._getter,), timeout=timeout)
        if not done:
            return None
        getter, self._getter = self._getter, None
        return getter.result()

    def _item(
        self,
        pending: Chunk,
        count: int,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
    ) -> StepOutput:
        """The first `count` pending tokens as an item, taken out of `pending`."""
        logprobs = pending.logprobs[:count] or None  # a request without logprobs has none
        item = StepOutput(
            token_ids=pending.token_ids[:count], step_seconds=pending.step_seconds[:count],
            finish_reason=finish_reason, prompt_tokens=self.prompt_tokens, error=error, logprobs=logprobs,
        )
        del pending.token_ids[:count], pending.step_seconds[:count], pending.logprobs[:count]
        return item


class StreamOutbox:
    """Chunks for many streams collected on an engine thread, delivered once per step."""

    def __init__(self) -> None:
        self._chunks: dict[TokenStream, Chunk] = {}

    def token(self, stream: TokenStream, token_id: int, step_seconds: float,
              logprob: TokenLogprob | None = None) -> None:
        chunk = self._chunks.setdefault(stream, Chunk())
        chunk.token_ids.append(token_id)
        chunk.step_seconds.append(step_seconds)
        if logprob is not None:
            chunk.logprobs.append(logprob)

    def finish(self, stream: TokenStream, reason: FinishReason, error: str | None = None) -> None:
        chunk = self._chunks.setdefault(stream, Chunk())
        chunk.finish_reason = reason
        chunk.error = error

    def flush(self) -> None:
        """Deliver everything collected since the last flush, one callback per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TokenStream, Chunk]]] = {}
        for stream, chunk in self._chunks.items():
            by_loop.setdefault(stream.loop, []).append((stream, chunk))
        self._chunks = {}
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for stream, _ in deliveries:
                    stream.cancelled = True


def _deliver(deliveries: list[tuple[TokenStream, Chunk]]) -> None:
    for stream, chunk in deliveries:
        stream.put(chunk)


class RequestQueue(Generic[Item]):
    """Items waiting for an engine thread: larger priority first, FIFO within a priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Item]] = []
        self._arrivals = itertools.count()
        self._condition = threading.Condition()
        self.closed = False
        self.closed_because = ""  # EngineDeadError's message for every put after close

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, item: Item, priority: int = 0) -> None:
        """Queue `item` (any thread); raises EngineDeadError once the queue is closed."""
        with self._condition:
            if self.closed:
                raise EngineDeadError(self.closed_because)
            heapq.heappush(self._heap, (-priority, next(self._arrivals), item))
            self._condition.notify()

    def count(self, keep: Callable[[Item], bool]) -> int:
        """How many waiting items satisfy `keep` (e.g. whose client is still there)."""
        with self._condition:
            return sum(1 for entry in self._heap if keep(entry[2]))

    def pop(self) -> Item | None:
        """The next item, or None if none waits."""
        with self._condition:
            return heapq.heappop(self._heap)[2] if self._heap else None

    def wait(self) -> bool:
        """Block until an item waits (True) or the queue is closed (False)."""
        with self._condition:
            self._condition.wait_for(lambda: self._heap or self.closed)
            return not self.closed

    def close(self, because: str = ENGINE_SHUT_DOWN) -> None:
        """Refuse further items, saying `because` (the first close's reason stays: a failed step
        outranks the shutdown that follows it), and wake the waiting engine thread."""
        with self._condition:
            if not self.closed:
                self.closed_because = because
            self.closed = True
            self._condition.notify_all()

    def drain(self) -> list[Item]:
        """Remove and return every waiting item (after close, to end their streams)."""
        with self._condition:
            items = [entry[2] for entry in sorted(self._heap)]
            self._heap.clear()
            return items
