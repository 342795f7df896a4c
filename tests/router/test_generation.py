"""Stop strings are matched on text as it grows: nothing past a stop string is ever released."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from megaserve.replicas.protocol import FinishReason, GenerateRequest, StepOutput, Tier
from megaserve.router.generation import Generation, StopMatcher
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


def test_a_stop_at_the_very_start_releases_nothing():
    released, stopped = feed(StopMatcher(["\n"]), ["\nrest"])
    assert stopped and released == [""]


def test_text_held_back_at_the_end_is_flushed():
    released, stopped = feed(StopMatcher(["abc"]), ["xyz a", "b"])
    assert not stopped and released == ["xyz ", "", "ab"]


class OneOutputBackend:
    """A replica that sends every token of a generation in one output, as a coalescing engine may."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput(list(self.token_ids), [STEP_SECONDS] * len(self.token_ids), FinishReason.LENGTH)

    async def healthy_replicas(self) -> int:
        return 1


async def generate(tokenizer: Tokenizer, token_ids: list[int], stops: tuple[str, ...]) -> tuple[Generation, str]:
    request = GenerateRequest("r", (1, 2, 3))
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
