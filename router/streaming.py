"""Noticing that a client went away, at once, and stopping the work done for it.

Starlette's own StreamingResponse notices a disconnect only when its next write fails (ASGI 2.4
servers), which for a request still in prefill, or queued, may be seconds later: a batch-1
replica would keep decoding for nobody. Here the ASGI `receive` channel is watched the whole time
(after the body has been read, the only message left on it is `http.disconnect`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


DISCONNECT_MESSAGE = {"type": "http.disconnect"}


def disconnect_aware(receive: Receive, disconnect_errors: tuple[type[Exception], ...]) -> Receive:
    """`receive`, with `disconnect_errors` read as the `http.disconnect` message: what the channel
    raises where its client has left instead of sending that message (Ray Serve's proxy cancels
    the replica's pending receive: TaskCancelledError). A client leaving is no server error."""
    if not disconnect_errors:
        return receive

    async def receive_or_disconnect():
        try:
            return await receive()
        except disconnect_errors:
            return DISCONNECT_MESSAGE

    return receive_or_disconnect


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != DISCONNECT_MESSAGE["type"]:
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T],
                              discard: Callable[[T], object] | None = None) -> T:
    """The result of `work`, or ClientDisconnected after cancelling `work` if the client leaves.

    `work` has ended whenever this returns or raises, also when the caller itself is cancelled
    (Ray Serve cancels a request's task when its client leaves): the caller may then close the
    generators `work` was running. If this raises although `work` produced a result (it finished in
    the same event-loop step as the disconnect or the cancellation, or finished anyway once
    cancelled), `discard(result)` gets it: e.g. an admission lease that nobody else would release.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected
        return task.result()
    except BaseException:
        if discard is not None and task.done() and not task.cancelled() and task.exception() is None:
            discard(task.result())
        raise
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)  # let it close its streams
            if discard is not None and not task.cancelled() and task.exception() is None:
                discard(task.result())  # it finished instead of stopping: nobody will use the result


class EventStreamResponse(Response):
    """`text/event-stream` of `events`; they are closed the moment the client disconnects, and
    `on_close` runs once, whichever way the stream ends. `source`, the generator that `events`
    reads, is closed after them: closing a generator that never started runs none of its code, so a
    client gone before the first event would otherwise leave the replica stream open.
    `disconnect_errors`: what the server's receive channel raises when the client leaves
    (disconnect_aware)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        on_close: Callable[[], None],
        source: AsyncGenerator | None = None,
        disconnect_errors: tuple[type[Exception], ...] = (),
    ) -> None:
        self.events = events
        self.disconnect_errors = disconnect_errors
        self.source = source
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._send_events, send, group.cancel_scope)
                await _wait_for_disconnect(disconnect_aware(receive, self.disconnect_errors))
                group.cancel_scope.cancel()
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()
                    if self.source is not None:
                        await self.source.aclose()
            finally:  # the slot goes back even if closing the backend stream raised
                self.on_close()

    async def _send_events(self, send: Send, scope: anyio.CancelScope) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the server found the connection closed while writing
            pass
        scope.cancel()


@contextlib.asynccontextmanager
async def closing(generator: AsyncGenerator) -> AsyncGenerator:
    """Close `generator` on the way out, even inside a cancelled task: a replica stream that is
    left open keeps a batch-1 replica decoding for nobody."""
    try:
        yield generator
    finally:
        with anyio.CancelScope(shield=True):
            await generator.aclose()
