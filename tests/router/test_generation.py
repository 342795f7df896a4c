"""Stop strings are matched on text as it grows: nothing past a stop string is ever released; and
the per-request metrics the router records as tokens arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from functools import partial

import pytest

from megaserve.monitoring.metrics import FINISHED_REQUESTS, GENERATION_TOKENS, INTER_TOKEN_LATENCY
from megaserve.replicas.protocol import FinishReason, GenerateRequest, SamplingParams, StepOutput, Tier, TokenLogprob
from megaserve.router.errors import GenerationFailed
from megaserve.router.generation import Generation, StopMatcher, _kmp_fallbacks
from megaserve.router.tokenizer import Tokenizer

STEP_SECONDS = 0.001


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    released = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        released.append(text)
        if stopped:
            return released, True
    released.append(matcher.flush())
    return released, False


def test_a_request_s_choices_build_its_stops_matching_tables_once():
    """Built on the event loop: 8 choices that each built tables for 16 long stop strings held every
    stream of the router for seconds."""
    stops = [f"stop {i} " * 100 for i in range(2)]  # strings no other test uses
    before = _kmp_fallbacks.cache_info().misses
    for _ in range(8):  # n = 8 choices
        assert feed(StopMatcher(stops), ["a", stops[1], "b"]) == (["a", ""], True)
    assert _kmp_fallbacks.cache_info().misses - before == len(stops)


def test_without_stops_everything_passes_at_once():
    assert feed(StopMatcher(()), ["ab", "cd"]) == (["ab", "cd", ""], False)


def test_a_stop_string_split_over_pieces_is_found_and_its_start_never_released():
    released, stopped = feed(StopMatcher(["END"]), ["hello E", "N", "D and more"])
    assert stopped and released == ["hello ", "", ""]


def test_a_false_start_is_released_once_it_cannot_be_a_stop():
    released, stopped = feed(StopMatcher(["END"]), ["hello E", "NOUGH"])
    assert not stopped and "".join(released) == "hello ENOUGH"
    assert released[0] == "hello "


def test_the_earliest_of_several_stops_wins_and_text_before_it_comes_out():
    released, stopped = feed(StopMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert stopped and "".join(released) == "hel"


@pytest.mark.parametrize("pieces", [["Hello the"], ["Hel", "lo", " the"], ["Hel", "lo", " th", "e"]])
def test_the_stop_that_ends_first_wins_however_the_text_is_split(pieces):
    released, stopped = feed(StopMatcher([" the", "th"]), pieces)
    assert stopped and "".join(released) == "Hello "


@pytest.mark.parametrize("stops, text, expected", [
    (["abab"], "xabaabab tail", "xaba"),  # a false start that overlaps the real one
    (["aab"], "aaab", "a"),
    (["abcd", "bc"], "abcd", "a"),  # "bc" ends first
    (["ab", "xab"], "xab", ""),  # both end on the same character: the longer one
])
def test_overlapping_starts_are_matched_character_by_character(stops, text, expected):
    for pieces in ([text], list(text)):
        released, stopped = feed(StopMatcher(stops), pieces)
        assert stopped and "".join(released) == expected


@pytest.mark.parametrize(("stops", "pieces", "expected"), [
    (["END"], ["hello E", "N", "D and more"], "hello END"),  # split over pieces; nothing after it
    (["world", "lo w"], ["hel", "lo world"], "hello w"),  # the one that ends first
    (["ab", "xab"], ["xab"], "xab"),  # both end on the same character
])
def test_with_include_stop_the_text_ends_with_the_stop_string_found(stops, pieces, expected):
    released, stopped = feed(StopMatcher(stops, include_stop=True), pieces)
    assert stopped and "".join(released) == expected


def test_with_include_stop_nothing_is_held_back_as_a_possible_start():
    """It would go out either way: holding it back would only delay it (vLLM holds nothing back either)."""
    released, stopped = feed(StopMatcher(["END"], include_stop=True), ["hello E", "N", "D and more"])
    assert stopped and released == ["hello E", "N", "D"]


def test_a_stop_at_the_very_start_releases_nothing():
    released, stopped = feed(StopMatcher(["\n"]), ["\nrest"])
    assert stopped and released == [""]


def test_text_held_back_at_the_end_is_flushed():
    released, stopped = feed(StopMatcher(["abc"]), ["xyz a", "b"])
    assert not stopped and released == ["xyz ", "", "ab"]


class OneOutputBackend:
    """A replica that sends every token of a generation in one output, as a coalescing engine may, and
    ends it for `finish` (on a stop id: the last token is it)."""

    def __init__(self, token_ids: list[int], finish: FinishReason = FinishReason.LENGTH) -> None:
        self.token_ids, self.finish = token_ids, finish

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput(list(self.token_ids), [STEP_SECONDS] * len(self.token_ids), self.finish)

    async def healthy_replicas(self) -> int:
        return 1


async def generate(tokenizer: Tokenizer, token_ids: list[int], stops: tuple[str, ...],
                   prompt_ids: tuple[int, ...] = (1, 2, 3)) -> tuple[Generation, str]:
    request = GenerateRequest("r", prompt_ids)
    generation = Generation(OneOutputBackend(token_ids), [request], Tier.LATENCY, "m", tokenizer, stops,
                            arrival=time.perf_counter())
    text = "".join([delta.text async for delta in generation.events()])
    return generation, text


def test_usage_counts_the_tokens_up_to_the_one_that_completes_a_stop_string(tokenizer):
    token_ids = tokenizer.encode("ab STOP cd ef gh", add_special_tokens=False)
    completing = next(k for k in range(1, len(token_ids) + 1) if "STOP" in tokenizer.decode(token_ids[:k]))
    assert completing < len(token_ids)  # tokens follow the stop string in the same output
    generation, text = asyncio.run(generate(tokenizer, token_ids, ("STOP",)))
    assert text == "ab "
    assert generation.completion_tokens == completing
    assert generation.decode_tokens == completing - 1  # the first token's step is the prefill
    generation, text = asyncio.run(generate(tokenizer, token_ids, ()))
    assert text == "ab STOP cd ef gh" and generation.completion_tokens == len(token_ids)


@pytest.mark.parametrize("stops", [(), (" Paris",)], ids=["no stop", "a stop that starts with a space"])
def test_a_completion_goes_on_from_its_prompt_s_text(sentencepiece_tokenizer, stops):
    # A SentencePiece decoder drops a string's first space: decoded alone, the completion would
    # read "Paris is" and never match a stop string that starts with a space.
    prompt = tuple(sentencepiece_tokenizer.encode("The capital of France is", add_special_tokens=False))
    token_ids = sentencepiece_tokenizer.encode("Paris is", add_special_tokens=False)
    generation, text = asyncio.run(generate(sentencepiece_tokenizer, token_ids, stops, prompt))
    assert text == ("" if stops else " Paris is")
    assert generation.completion_tokens == (1 if stops else 2)


def test_a_choice_that_ends_inside_a_character_keeps_its_incomplete_tail_as_a_full_decode_does(tokenizer):
    token_ids = tokenizer.encode("ok \U0001F600", add_special_tokens=False)[:-1]  # the emoji less its last byte
    assert tokenizer.decode(token_ids).endswith("\ufffd")
    generation, text = asyncio.run(generate(tokenizer, token_ids, ()))
    assert text == tokenizer.decode(token_ids) == "ok \ufffd"
    assert generation.completion_tokens == len(token_ids)


class StopIdBackend:
    """A replica whose generation ends on a stop id, streamed last with finish_reason STOP."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput(self.token_ids[:1], [STEP_SECONDS])
        yield StepOutput(self.token_ids[1:], [STEP_SECONDS] * (len(self.token_ids) - 1), FinishReason.STOP)

    async def healthy_replicas(self) -> int:
        return 1


@pytest.mark.parametrize("stop_ids", [True, False])
def test_a_stop_id_that_ends_a_choice_is_counted_but_adds_no_text(tokenizer, stop_ids):
    """vLLM's and SGLang's default (include_stop_str_in_output / no_stop_trim off); the same for a
    token that ends a choice without being a stop id of the request (the model's end-of-sequence id,
    which need not be a special token)."""
    token_ids = tokenizer.encode("ab cd ef", add_special_tokens=False)
    stop = token_ids[-1]
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(stop_token_ids=(stop,) if stop_ids else ()))
    generation = Generation(StopIdBackend(token_ids), [request], Tier.LATENCY, "m", tokenizer, (),
                            arrival=time.perf_counter())
    deltas = asyncio.run(_collect(generation.events()))
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids[:-1])
    assert tokenizer.decode(token_ids[:-1]) != tokenizer.decode(token_ids)  # the stop id has text
    assert deltas[-1].finish_reason == "stop" and generation.completion_tokens == len(token_ids)


@pytest.mark.parametrize("backend", [StopIdBackend, partial(OneOutputBackend, finish=FinishReason.STOP)],
                         ids=["stop id alone first", "one output"])
def test_with_include_stop_text_the_stop_id_that_ends_a_choice_adds_its_text(tokenizer, backend):
    """vLLM's include_stop_str_in_output and SGLang's no_stop_trim."""
    token_ids = tokenizer.encode("ab cd ef", add_special_tokens=False)
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(stop_token_ids=(token_ids[-1],)))
    generation = Generation(backend(token_ids), [request], Tier.LATENCY, "m", tokenizer, (),
                            arrival=time.perf_counter(), include_stop_text=True)
    deltas = asyncio.run(_collect(generation.events()))
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids) != tokenizer.decode(token_ids[:-1])
    assert deltas[-1].finish_reason == "stop" and generation.completion_tokens == len(token_ids)


def id_logprob(token: int) -> TokenLogprob:
    """A stand-in logprob that names its token, so that a test can see which token it went with."""
    return TokenLogprob(-token / 1000)


class TokenByTokenBackend:
    """A replica that sends one token per output (with its `id_logprob`), then ends the generation
    for its length."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        for position, token in enumerate(self.token_ids):
            last = position == len(self.token_ids) - 1
            yield StepOutput([token], [STEP_SECONDS], FinishReason.LENGTH if last else None,
                             logprobs=[id_logprob(token)])

    async def healthy_replicas(self) -> int:
        return 1


@pytest.mark.parametrize("stops", [(), ("c",), ("d e",)])
def test_a_choice_s_deltas_carry_the_ids_usage_counts_held_back_text_s_with_its_release(tokenizer, stops):
    token_ids = tokenizer.encode("ab cd ef gh", add_special_tokens=False)
    # usage counts the tokens up to the one whose text completes the stop string
    counted = next((k for k in range(1, len(token_ids) + 1)
                    if any(stop in tokenizer.decode(token_ids[:k]) for stop in stops)), len(token_ids))
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(logprobs=0))
    generation = Generation(TokenByTokenBackend(token_ids), [request], Tier.LATENCY, "m", tokenizer, stops,
                            arrival=time.perf_counter())
    deltas = asyncio.run(_collect(generation.events()))
    assert [token for delta in deltas for token in delta.token_ids] == token_ids[:counted]
    for delta in deltas:  # each id's logprob on the same delta as the id, through holds and stop cuts
        assert list(delta.logprobs) == [id_logprob(token) for token in delta.token_ids]
    assert generation.completion_tokens == counted < len(token_ids) or not stops
    if stops == ("d e",):  # "d" and " " are held back as a possible start: their ids wait with them
        assert deltas[-1].text == "" and len(deltas[-1].token_ids) > 1


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_written_out_only_when_not_skipped(tokenizer, skip):
    special = min(tokenizer.special_ids)
    token_ids = [*tokenizer.encode("ab", add_special_tokens=False), special,
                 *tokenizer.encode(" cd", add_special_tokens=False)]
    generation = Generation(OneOutputBackend(token_ids), [GenerateRequest("r", (1, 2, 3))], Tier.LATENCY, "m",
                            tokenizer, (), arrival=time.perf_counter(), skip_special_tokens=skip)
    text = "".join(d.text for d in asyncio.run(_collect(generation.events())))
    assert text == tokenizer.decode(token_ids, skip_special_tokens=skip)
    assert (tokenizer.decode([special], skip_special_tokens=False) in text) != skip


@pytest.mark.parametrize("backend", [StopIdBackend, partial(OneOutputBackend, finish=FinishReason.STOP)],
                         ids=["stop id alone first", "one output"])
def test_only_the_stop_id_that_ends_a_choice_loses_its_text_not_one_earlier_in_it(tokenizer, backend):
    """A stop id that the engine streamed before the last token (it did not end the choice) is text."""
    stop, other = tokenizer.encode(" ab cd", add_special_tokens=False)[:2]
    token_ids = [stop, other, stop]
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(stop_token_ids=(stop,)))
    generation = Generation(backend(token_ids), [request], Tier.LATENCY, "m", tokenizer, (),
                            arrival=time.perf_counter())
    deltas = asyncio.run(_collect(generation.events()))
    assert "".join(d.text for d in deltas) == tokenizer.decode([stop, other])
    assert tokenizer.decode([stop, other]) != tokenizer.decode([other])  # the first stop id has text
    assert deltas[-1].finish_reason == "stop" and generation.completion_tokens == 3


async def _collect(events: AsyncGenerator) -> list:
    return [delta async for delta in events]


def test_a_replica_that_sends_tokens_without_the_logprobs_asked_for_fails_the_choice_by_name(tokenizer):
    """A replica that does not know logprobs (an older one during a rolling update) must not pass for
    one whose tokens have none: the answer would lack them silently, or misalign them."""
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(logprobs=2))
    token_ids = tokenizer.encode("ab cd", add_special_tokens=False)
    generation = Generation(OneOutputBackend(token_ids), [request], Tier.LATENCY, "m", tokenizer, (),
                            arrival=time.perf_counter())
    with pytest.raises(GenerationFailed, match=f"^the replica sent 0 logprobs for {len(token_ids)} tokens$"):
        asyncio.run(_collect(generation.events()))


class FailingBackend:
    """A replica that sends one token of request "r" and then fails, as a replica whose GPU faulted
    does; any other request gets one token and then waits for a step that never comes."""

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput([5], [STEP_SECONDS])
        if request.request_id != "r":
            await asyncio.Event().wait()
        yield StepOutput([], [], FinishReason.ABORT, error="CUDA error: an illegal memory access")

    async def healthy_replicas(self) -> int:
        return 1


def test_a_failed_replica_is_counted_as_an_error_not_as_a_client_that_left(tokenizer):
    counted = {reason: FINISHED_REQUESTS.labels(tier="latency", model="failing", finish_reason=reason)
               for reason in ("error", "cancelled")}
    before = {reason: counter._value.get() for reason, counter in counted.items()}
    requests = [GenerateRequest("r", (1, 2, 3)), GenerateRequest("r-1", (1, 2, 3))]
    generation = Generation(FailingBackend(), requests, Tier.LATENCY, "failing", tokenizer, (),
                            arrival=time.perf_counter())

    async def consume() -> None:
        async for _ in generation.events():
            pass

    with pytest.raises(GenerationFailed, match="illegal memory access"):
        asyncio.run(consume())
    after = {reason: counter._value.get() for reason, counter in counted.items()}
    # the choice that failed, and the one still decoding that the failure closed
    assert (after["error"], after["cancelled"]) == (before["error"] + 1, before["cancelled"] + 1)


STALL_SECONDS = 0.2  # a batch's admission prefill between two decode steps, say


class StallingBackend:
    """A replica whose second output comes STALL_SECONDS after its first, though each token's engine
    step took STEP_SECONDS (the running requests wait while the engine prefills another)."""

    def __init__(self) -> None:
        self.generated_before_the_last = None

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput([5], [STEP_SECONDS])
        await asyncio.sleep(STALL_SECONDS)
        yield StepOutput([6, 7], [STEP_SECONDS] * 2)
        self.generated_before_the_last = _sample(GENERATION_TOKENS, "_total")
        yield StepOutput([8], [STEP_SECONDS], FinishReason.LENGTH)

    async def healthy_replicas(self) -> int:
        return 1


def _sample(metric, suffix: str) -> float:
    labels = {"tier": "latency", "model": "stalling"}
    return next(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix) and s.labels == labels)


def test_inter_token_latency_is_the_gap_a_client_sees_and_tokens_are_counted_as_they_arrive(tokenizer):
    INTER_TOKEN_LATENCY.labels(tier="latency", model="stalling")  # the series, before the first request
    GENERATION_TOKENS.labels(tier="latency", model="stalling")
    before = {"itl_sum": _sample(INTER_TOKEN_LATENCY, "_sum"), "itl_count": _sample(INTER_TOKEN_LATENCY, "_count"),
              "tokens": _sample(GENERATION_TOKENS, "_total")}
    backend = StallingBackend()
    generation = Generation(backend, [GenerateRequest("r", (1, 2, 3))], Tier.LATENCY, "stalling", tokenizer, (),
                            arrival=time.perf_counter())

    async def consume() -> None:
        async for _ in generation.events():
            pass

    asyncio.run(consume())
    assert _sample(INTER_TOKEN_LATENCY, "_count") - before["itl_count"] == 3  # every token after the first
    assert _sample(INTER_TOKEN_LATENCY, "_sum") - before["itl_sum"] >= STALL_SECONDS  # the stall, spread over 6, 7
    assert backend.generated_before_the_last - before["tokens"] == 3  # counted before the request ended
    assert _sample(GENERATION_TOKENS, "_total") - before["tokens"] == 4
    assert generation.decode_seconds == pytest.approx(3 * STEP_SECONDS)  # the timing field stays engine steps
