"""unless_disconnected: the work's result, or its cancellation when the client leaves, and never a
result lost in between (a lease that nobody would release would hold a tier's slot for good); an
event stream closes what it reads from however early the client leaves."""

from __future__ import annotations

import asyncio

import pytest

from megaserve.replicas.protocol import Tier
from megaserve.router.policy import Lease, Route, TierSlots
from megaserve.router.streaming import ClientDisconnected, EventStreamResponse, disconnect_aware, unless_disconnected

DISCONNECT = {"type": "http.disconnect"}


def _client(leaves: asyncio.Event):
    """An ASGI receive channel whose only message is the disconnect, once `leaves` is set."""

    async def receive():
        await leaves.wait()
        return DISCONNECT

    return receive


async def _gone():
    """An ASGI receive channel of a client that has left already."""
    return DISCONNECT


async def _replica_stream(closed: asyncio.Event):
    """A replica's endless event stream, which sets `closed` once it is closed."""
    try:
        while True:
            yield b"data: {}\n\n"
            await asyncio.sleep(0.01)
    finally:
        closed.set()


def _granted_lease(slots: TierSlots) -> Lease:
    assert slots.take_now(1)
    return Lease(slots, 1, Route(Tier.LATENCY, "policy"))


async def test_the_result_comes_back_and_is_not_discarded():
    discarded = []
    result = await unless_disconnected(_client(asyncio.Event()), asyncio.sleep(0, "lease"), discarded.append)
    assert result == "lease" and discarded == []


async def test_a_client_leaving_cancels_the_work():
    leaves, cancelled = asyncio.Event(), asyncio.Event()

    async def work():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    waiting = asyncio.create_task(unless_disconnected(_client(leaves), work()))
    await asyncio.sleep(0)
    leaves.set()
    with pytest.raises(ClientDisconnected):
        await waiting
    assert cancelled.is_set()


async def test_a_lease_granted_in_the_step_the_caller_is_cancelled_is_released():
    slots = TierSlots(capacity=1)
    admission = asyncio.get_running_loop().create_future()  # stands for Admission.admit's task
    caller = asyncio.create_task(unless_disconnected(_client(asyncio.Event()), admission, Lease.release))
    await asyncio.sleep(0)  # the caller waits on the admission
    admission.set_result(_granted_lease(slots))  # granted ...
    caller.cancel()  # ... and, in the same step, Serve cancels the request's task
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert slots.in_flight == 0  # without discard the slot would stay taken


async def test_work_that_finishes_instead_of_stopping_has_its_result_discarded():
    slots, leaves = TierSlots(capacity=1), asyncio.Event()

    async def admit_ignoring_cancellation() -> Lease:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # e.g. a grant that raced the cancellation: the work returns its lease anyway
        return _granted_lease(slots)

    waiting = asyncio.create_task(unless_disconnected(_client(leaves), admit_ignoring_cancellation(), Lease.release))
    await asyncio.sleep(0)
    leaves.set()
    with pytest.raises(ClientDisconnected):
        await waiting
    assert slots.in_flight == 0


async def test_a_client_gone_before_the_first_event_has_the_source_stream_closed():
    source_closed, released = asyncio.Event(), []


    async def sse(source):  # like ResponseBuilder.sse: it reads the source only once iterated
        async for event in source:
            yield event

    async def send_that_yields(message):  # a server whose send lets the disconnect be seen first
        await asyncio.sleep(0)

    source = _replica_stream(source_closed)
    await anext(source)  # the router awaits the first token before it answers
    response = EventStreamResponse(sse(source), {}, on_close=lambda: released.append(True), source=source)
    await response(scope={}, receive=_gone, send=send_that_yields)
    assert source_closed.is_set() and released == [True]


class ChannelCancelled(Exception):
    """Stands for what a server's receive channel raises once its client has left (Ray Serve's
    proxy: TaskCancelledError)."""


async def _cancelled_channel():
    raise ChannelCancelled


async def test_a_stream_whose_channel_raises_the_disconnect_error_closes_quietly():
    released, source_closed = [], asyncio.Event()


    async def send(message):
        await asyncio.sleep(0)

    source = _replica_stream(source_closed)
    await anext(source)  # the router awaits the first token before it answers
    response = EventStreamResponse(source, {}, on_close=lambda: released.append(True), source=source,
                                   disconnect_errors=(ChannelCancelled,))
    await response(scope={}, receive=_cancelled_channel, send=send)  # no error: the client left
    assert source_closed.is_set() and released == [True]
    # without the disconnect error named, the same channel is a server error
    source = _replica_stream(source_closed)
    response = EventStreamResponse(source, {}, on_close=lambda: released.append(True), source=source)
    with pytest.raises(BaseException) as raised:
        await response(scope={}, receive=_cancelled_channel, send=send)
    assert raised.group_contains(ChannelCancelled) if isinstance(raised.value, BaseExceptionGroup) else (
        isinstance(raised.value, ChannelCancelled))


async def test_work_is_cancelled_when_the_channel_raises_the_disconnect_error():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            cancelled.set()

    with pytest.raises(ClientDisconnected):
        await unless_disconnected(disconnect_aware(_cancelled_channel, (ChannelCancelled,)), work())
    assert cancelled.is_set()
