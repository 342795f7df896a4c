"""One admitted request on its tier: replica streams in, text deltas out, metrics recorded.

Each of the request's `n` choices (of each prompt, for a completion batch) is one
`GenerateRequest` to the tier's backend. Its token ids are detokenized incrementally; stop strings
are matched on the text (the output ends before the stop string, finish_reason "stop") and the
replica stream is then closed, so the replica stops decoding. A stop token id that ends a choice
counts as a completion token but adds no text, as in vLLM and SGLang by default. With
`include_stop_text` (vLLM's include_stop_str_in_output, SGLang's no_stop_trim) the text ends with
the stop string, or with the stop id's text; with `skip_special_tokens` off, special tokens are
written out in the text, as vLLM and SGLang do. A choice that its
replica aborts fails the whole request: with the replica's error (`GenerationFailed`), or without
one, when the engine was shut down, as `EngineDeadError`; no answer says "abort". Leaving
`events()` early (client gone, error) closes every replica stream at once.

Metrics: time to first token (arrival to the first token of any choice), inter-token latency
(per token after a choice's first, the wall time since the choice's previous output, spread over
the output's tokens: what a client sees, stalls included, such as a batch's admissions), request
duration, prompt tokens (each prompt's once), generated tokens (as they arrive), and one
finished-request count per choice: by its OpenAI finish_reason, "cancelled" when the client left
first, "error" when the replica failed.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import anyio

from megaserve.monitoring.metrics import (
    FINISHED_REQUESTS,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    PROMPT_TOKENS,
    REQUEST_DURATION,
    TIME_TO_FIRST_TOKEN,
)
from megaserve.replicas.protocol import EngineDeadError, FinishReason, GenerateRequest, StepOutput, Tier, TokenLogprob
from megaserve.router.backend import Backend
from megaserve.router.errors import GenerationFailed
from megaserve.router.streaming import closing
from megaserve.router.tokenizer import IncrementalDetokenizer, Tokenizer

CANCELLED = "cancelled"  # finish_reason label of a choice whose client went away
FAILED = "error"  # finish_reason label of a choice that its replica failed, or that was refused
# An ABORT without an error: the engine was shut down (a rolling update, a scale-down) with the
# choice unfinished. The request was fine: a 503 to retry, or an error event once streaming.
STOPPED_BEFORE_THE_END = "the replica was shut down before the generation finished"
# Stop strings whose matching tables are kept: 16 of at most 1,024 characters per request
# (openai_schema's limits), so a few MB at most.
STOP_TABLES_CACHED = 256


@dataclass(frozen=True)
class Delta:
    """New text of one choice; `finish_reason` is set on the choice's last delta only. `token_ids`:
    the generated ids counted since the choice's previous delta (text held back as a stop string's
    possible start comes later than its ids); all of a choice's deltas' ids are its usage.
    `logprobs`: one per id of `token_ids`, where the request asked for logprobs."""

    index: int
    text: str
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


class StopMatcher:
    """Finds the first stop string in a choice's text as it grows: the one that ends first (of two
    ending on the same character, the longer), however the text is split into pieces; the text is
    released up to that stop string, or through it with `include_stop`.

    Text that could still turn out to be the start of a stop string is held back (but with
    `include_stop`, where it goes out either way), so nothing past a stop string is ever sent.
    Each stop string keeps how much of it the text so far ends with (a Knuth-Morris-Pratt
    automaton), so each character costs the same whatever is held back.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop  # release the stop string that was found with the text before it
        self._fallbacks = [_kmp_fallbacks(stop) for stop in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: the longest end of the text that begins it
        self.pending = ""  # text received but not released

    def push(self, text: str) -> tuple[str, bool]:
        """Add `text`; return what may be released, and whether a stop string was found."""
        if not self.stops:
            return text, False
        start = len(self.pending)
        self.pending += text
        for offset, char in enumerate(text):
            ends_here = [len(stop) for i, stop in enumerate(self.stops) if self._advance(i, char)]
            if ends_here:
                end = start + offset + 1
                released, self.pending = self.pending[: end if self.include_stop else end - max(ends_here)], ""
                return released, True
        # Text that may start a stop string is held back, unless the stop string goes out anyway.
        cut = len(self.pending) if self.include_stop else len(self.pending) - max(self._matched)
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released, False

    def flush(self) -> str:
        released, self.pending = self.pending, ""
        return released

    def _advance(self, i: int, char: str) -> bool:
        """Stop i after one more character of text: whether the text now ends with all of it."""
        stop, matched = self.stops[i], self._matched[i]
        while matched and stop[matched] != char:
            matched = self._fallbacks[i][matched - 1]
        if stop[matched] == char:
            matched += 1
        if matched == len(stop):
            return True
        self._matched[i] = matched
        return False


@functools.lru_cache(maxsize=STOP_TABLES_CACHED)  # a request's n choices, and its next requests, share them
def _kmp_fallbacks(stop: str) -> tuple[int, ...]:
    """fallbacks[k]: the longest proper end of stop[:k + 1] that is also a beginning of stop."""
    fallbacks = [0] * len(stop)
    matched = 0
    for k in range(1, len(stop)):
        while matched and stop[k] != stop[matched]:
            matched = fallbacks[matched - 1]
        if stop[k] == stop[matched]:
            matched += 1
        fallbacks[k] = matched
    return tuple(fallbacks)


@dataclass
class Generation:
    """The replica streams of one request and what they have produced so far."""

    backend: Backend
    requests: list[GenerateRequest]  # one per choice
    tier: Tier
    model: str
    tokenizer: Tokenizer
    stops: tuple[str, ...]
    arrival: float  # time.perf_counter() when the request reached the router
    choices_per_prompt: int = 1  # `n`: the requests are each prompt's choices in turn
    include_stop_text: bool = False  # the stop string, or the stop id's text, ends the text
    skip_special_tokens: bool = True  # special tokens add no text
    completion_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    decode_seconds: float = 0.0  # sum of engine step times after each choice's first token
    decode_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    last_output_at: dict[int, float] = field(default_factory=dict)  # per choice: its latest tokens' arrival

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens once, however many choices it has (as vLLM's usage counts them)."""
        return sum(len(request.prompt_token_ids) for request in self.requests[::self.choices_per_prompt])

    async def events(self) -> AsyncGenerator[Delta, None]:
        """Text deltas of every choice, interleaved as they arrive."""
        PROMPT_TOKENS.labels(tier=self.tier.value, model=self.model).inc(self.prompt_tokens)
        choices = [self._choice(index, request) for index, request in enumerate(self.requests)]
        try:
            async for delta in _merge(choices):
                yield delta
        finally:
            self._record_end()

    async def _choice(self, index: int, request: GenerateRequest) -> AsyncGenerator[Delta, None]:
        try:
            async for delta in self._choice_deltas(index, request):
                yield delta
        except Exception:  # not the client leaving: that closes or cancels, a BaseException
            self.finish_reasons.setdefault(index, FAILED)
            raise

    async def _choice_deltas(self, index: int, request: GenerateRequest) -> AsyncGenerator[Delta, None]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                             skip_special_tokens=self.skip_special_tokens)
        matcher = StopMatcher(self.stops, include_stop=self.include_stop_text)
        first = True
        final: Delta | None = None
        unsent_ids: list[int] = []  # counted, not yet on a delta
        unsent_logprobs: list[TokenLogprob] = []  # theirs, where asked for
        async with closing(self.backend.stream(request)) as stream:
            async for output in stream:
                if request.sampling.logprobs is not None and len(output.logprobs or ()) != len(output.token_ids):
                    # a replica that does not know logprobs (an older one during a rolling update)
                    raise GenerationFailed(f"the replica sent {len(output.logprobs or ())} logprobs for "
                                           f"{len(output.token_ids)} tokens")
                # Token by token, so that a stop string ends the count at the token that completes it.
                released, stopped, used = "", False, 0
                last = len(output.token_ids) - 1
                for position, token in enumerate(output.token_ids):
                    used += 1
                    if position == last and output.finish_reason is FinishReason.STOP and not self.include_stop_text:
                        # the token that ended the choice, an end-of-sequence or stop id (engines
                        # stream it last): counted, but no text, as in vLLM, even where it is no
                        # special token that the detokenizer would skip
                        break
                    text, stopped = matcher.push(detokenizer.push(token))
                    released += text
                    if stopped:
                        break
                if not stopped and output.finish_reason is not None:
                    text, stopped = matcher.push(detokenizer.finish())
                    released += text
                self._count(index, output, used, first)
                unsent_ids += output.token_ids[:used]
                unsent_logprobs += (output.logprobs or ())[:used]
                first = first and not output.token_ids
                if stopped:
                    final = self._finish(index, released, FinishReason.STOP.value, unsent_ids, unsent_logprobs)
                    break
                if output.finish_reason is FinishReason.ABORT:  # the router closes, never sees, what it cancels
                    if output.error:
                        raise GenerationFailed(output.error)
                    raise EngineDeadError(STOPPED_BEFORE_THE_END)
                if output.finish_reason is not None:
                    final = self._finish(index, released + matcher.flush(), output.finish_reason.value, unsent_ids,
                                         unsent_logprobs)
                    break
                if released:
                    yield Delta(index, released, token_ids=tuple(unsent_ids), logprobs=tuple(unsent_logprobs))
                    unsent_ids, unsent_logprobs = [], []
        if final is None:
            raise GenerationFailed("the replica stream ended without a finish reason")
        yield final  # after the replica stream is closed: a stop string frees the replica first

    def _count(self, index: int, output: StepOutput, tokens: int, first_of_choice: bool) -> None:
        """Record the first `tokens` of choice `index`'s `output`: those before a stop string, or all."""
        if not tokens:
            return
        now = time.perf_counter()
        labels = {"tier": self.tier.value, "model": self.model}
        steps = output.step_seconds[:tokens]
        if self.first_token_at is None:
            self.first_token_at = now
            TIME_TO_FIRST_TOKEN.labels(**labels).observe(now - self.arrival)
        histogram = INTER_TOKEN_LATENCY.labels(**labels)
        if first_of_choice:
            steps = steps[1:]  # the first token's step is the prefill: counted in TTFT
            gaps = steps  # tokens that came with the first: no arrival gap to see, their engine steps
        else:
            gaps = [(now - self.last_output_at[index]) / tokens] * tokens
        for seconds in gaps:
            histogram.observe(seconds)
        self.last_output_at[index] = now
        self.decode_seconds += sum(steps)
        self.decode_tokens += len(steps)
        self.completion_tokens += tokens
        GENERATION_TOKENS.labels(**labels).inc(tokens)

    def _finish(self, index: int, text: str, finish_reason: str, token_ids: list[int],
                logprobs: list[TokenLogprob]) -> Delta:
        self.finish_reasons[index] = finish_reason
        return Delta(index, text, finish_reason, tuple(token_ids), tuple(logprobs))

    def _record_end(self) -> None:
        self.finished_at = time.perf_counter()
        labels = {"tier": self.tier.value, "model": self.model}
        REQUEST_DURATION.labels(**labels).observe(self.finished_at - self.arrival)
        for index in range(len(self.requests)):
            reason = self.finish_reasons.get(index, CANCELLED)
            FINISHED_REQUESTS.labels(**labels, finish_reason=reason).inc()


async def _merge(choices: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
    """Interleave the choices' deltas; closing this closes every choice."""
    if len(choices) == 1:
        async with closing(choices[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(choice: AsyncGenerator[Delta, None]) -> None:
        try:
            async with closing(choice):
                async for delta in choice:
                    queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

