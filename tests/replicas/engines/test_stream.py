"""The engine-to-asyncio bridge: the yield rule's timer and counts, cross-thread delivery,
cancellation, and the priority queue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megaserve.replicas.engines.stream import Chunk, RequestQueue, StreamOutbox, TokenStream
from megaserve.replicas.protocol import CoalescePolicy, EngineDeadError, FinishReason, TokenLogprob

STEP = 0.001


def _stream(seconds: float, tokens: int, on_cancel=None) -> TokenStream:
    return TokenStream(7, CoalescePolicy(seconds=seconds, tokens=tokens), asyncio.get_running_loop(), on_cancel)


async def test_pending_tokens_leave_on_the_timer_without_a_new_chunk():
    stream = _stream(seconds=0.05, tokens=100)
    outputs = stream.outputs()
    stream.put(Chunk([1], [STEP]))
    assert (await anext(outputs)).token_ids == [1]
    stream.put(Chunk([2, 3], [STEP, STEP]))
    start = time.monotonic()
    item = await anext(outputs)  # nothing else arrives: the deadline releases 2 and 3
    waited = time.monotonic() - start
    assert item.token_ids == [2, 3] and item.finish_reason is None
    assert 0.03 < waited < 2.0  # the 0.05 s timer, not at once; the slack is for a loaded machine
    stream.put(Chunk([], [], FinishReason.STOP))
    last = await anext(outputs)
    assert last.token_ids == [] and last.finish_reason == FinishReason.STOP
    with pytest.raises(StopAsyncIteration):
        await anext(outputs)


async def test_logprobs_stay_with_their_tokens_through_coalescing():
    stream = _stream(seconds=10.0, tokens=2)
    logprob = {token: TokenLogprob(-token / 10, ((token, -token / 10),)) for token in range(5)}
    stream.put(Chunk([0, 1, 2], [STEP] * 3, logprobs=[logprob[t] for t in (0, 1, 2)]))
    stream.put(Chunk([3, 4], [STEP] * 2, FinishReason.STOP, logprobs=[logprob[3], logprob[4]]))
    items = [item async for item in stream.outputs()]
    assert [item.token_ids for item in items] == [[0], [1, 2], [3, 4]]
    for item in items:
        assert item.logprobs == [logprob[t] for t in item.token_ids]
    # a stream whose request asked for none has None, not an empty list
    plain = _stream(seconds=10.0, tokens=2)
    plain.put(Chunk([0, 1], [STEP] * 2, FinishReason.LENGTH))
    assert all(item.logprobs is None for item in [item async for item in plain.outputs()])


async def test_a_multi_token_first_chunk_still_yields_the_first_token_alone():
    stream = _stream(seconds=10.0, tokens=2)
    for token in range(6):
        stream.put(Chunk([token], [STEP]))
    stream.put(Chunk([6], [STEP], FinishReason.LENGTH))
    items = [item async for item in stream.outputs()]
    assert [item.token_ids for item in items] == [[0], [1, 2], [3, 4], [5, 6]]
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert all(item.prompt_tokens == 7 for item in items)


async def test_an_error_travels_on_the_final_item():
    stream = _stream(seconds=1.0, tokens=4)
    stream.put(Chunk([5], [STEP]))
    stream.put(Chunk([6], [STEP], FinishReason.ABORT, "device lost"))
    items = [item async for item in stream.outputs()]
    assert items[-1].token_ids == [6] and items[-1].error == "device lost"


async def test_closing_the_consumer_cancels_the_stream_once():
    calls = []
    stream = _stream(seconds=1.0, tokens=4, on_cancel=lambda: calls.append(1))
    outputs = stream.outputs()
    stream.put(Chunk([1], [STEP]))
    await anext(outputs)
    assert not stream.cancelled
    await outputs.aclose()
    assert stream.cancelled and calls == [1]


async def test_a_cancel_in_the_turn_a_chunk_arrives_still_cancels_the_stream():
    # Ray cancels the consuming task once on client disconnect; asyncio.wait_for (Python < 3.12,
    # gh-86296) used to swallow it when the pending get() completed in the same loop turn.
    calls = []
    stream = _stream(seconds=10.0, tokens=16, on_cancel=lambda: calls.append(1))
    outputs = stream.outputs()
    stream.put(Chunk([1], [STEP]))
    await anext(outputs)
    stream.put(Chunk([2], [STEP]))
    consumer = asyncio.create_task(_next_item(outputs))
    while not stream._chunks.empty():  # until the consumer took 2 and waits on the coalescing timer
        await asyncio.sleep(0)
    stream.put(Chunk([3], [STEP]))  # the engine's next step lands in the same turn as the cancel
    consumer.cancel()
    stream.put(Chunk([], [], FinishReason.STOP))  # a swallowed cancel would end the consumer normally
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert consumer.cancelled() and stream.cancelled and calls == [1]


async def test_closing_after_a_timer_yield_leaves_no_task_behind():
    stream = _stream(seconds=0.01, tokens=100)
    outputs = stream.outputs()
    stream.put(Chunk([1, 2], [STEP, STEP]))
    assert [(await anext(outputs)).token_ids for _ in range(2)] == [[1], [2]]
    # the deadline passed with a get() still waiting; it is picked up by the next call, or ended here
    await outputs.aclose()
    await asyncio.sleep(0)  # let the cancelled get() finish
    assert asyncio.all_tasks() == {asyncio.current_task()} and stream.cancelled


async def _next_item(outputs):
    return await anext(outputs)


async def test_a_finished_stream_is_not_cancelled():
    stream = _stream(seconds=1.0, tokens=4, on_cancel=lambda: pytest.fail("cancelled"))
    stream.put(Chunk([1], [STEP], FinishReason.STOP))
    assert [item.finish_reason async for item in stream.outputs()] == [FinishReason.STOP]
    assert not stream.cancelled


async def test_outbox_delivers_a_threads_steps_to_every_stream():
    streams = [_stream(seconds=0.0, tokens=1) for _ in range(3)]

    def engine_thread():
        for step in range(2):
            outbox = StreamOutbox()
            for index, stream in enumerate(streams):
                outbox.token(stream, 10 * index + step, STEP)
                if step == 1:
                    outbox.finish(stream, FinishReason.LENGTH)
            outbox.flush()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    results = await asyncio.gather(*(_collect(stream) for stream in streams))
    thread.join()
    for index, items in enumerate(results):
        assert [item.token_ids for item in items] == [[10 * index], [10 * index + 1]]
        assert items[-1].finish_reason == FinishReason.LENGTH


async def _collect(stream: TokenStream) -> list:
    return [item async for item in stream.outputs()]


def test_outbox_marks_streams_of_a_closed_loop_cancelled():
    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(_make_stream_on_running_loop())
    loop.close()
    outbox = StreamOutbox()
    outbox.token(stream, 1, STEP)
    outbox.flush()
    assert stream.cancelled


async def _make_stream_on_running_loop() -> TokenStream:
    return _stream(seconds=0.0, tokens=1)


def test_request_queue_orders_by_priority_then_arrival_and_closes():
    queue: RequestQueue[str] = RequestQueue()
    for item, priority in (("a", 0), ("b", 3), ("c", 0), ("d", 3), ("e", -1)):
        queue.put(item, priority)
    assert len(queue) == 5
    assert [queue.pop() for _ in range(3)] == ["b", "d", "a"]
    queue.close("engine step failed: RuntimeError: boom")
    queue.close()  # the shutdown after a failed step: the failure is still what a put is told
    assert not queue.wait()
    assert queue.drain() == ["c", "e"] and queue.pop() is None
    with pytest.raises(EngineDeadError, match="^engine step failed: RuntimeError: boom$"):
        queue.put("f")


def test_request_queue_wait_wakes_on_put_from_another_thread():
    queue: RequestQueue[str] = RequestQueue()
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(queue.wait()))
    waiter.start()
    time.sleep(0.02)
    queue.put("x")
    waiter.join(timeout=5)
    assert woke == [True] and queue.pop() == "x"


@pytest.mark.parametrize(("seconds", "tokens"), [(0.005, 0), (-0.001, 16)])
def test_a_coalesce_policy_that_could_never_yield_right_is_refused(seconds, tokens):
    # tokens=0 once made TokenStream yield empty items forever after the first token.
    with pytest.raises(ValueError, match="coalesce"):
        CoalescePolicy(seconds=seconds, tokens=tokens)
