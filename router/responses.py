"""A generation's deltas as OpenAI bodies: one JSON completion, or server-sent event chunks.

Streams follow OpenAI's order: for chat a first chunk per choice with `{"role": "assistant"}`,
then one chunk per text delta (the last of a choice carries its finish_reason), then, if
`stream_options.include_usage`, a chunk with no choices and the usage, then `data: [DONE]`. With
vLLM's `continuous_usage_stats` as well, every chunk carries the usage so far. With vLLM's
`return_token_ids`, the prompt's ids come with the answer (streams: its first chunk; completions:
each choice's, on each choice's first chunk) and each choice, or delta, has its generated ids.
With logprobs asked for, each choice, or delta, has those of its generated ids (OpenAI's formats:
chat's `content` list, the legacy endpoint's parallel lists), token texts decoded one id at a time
as vLLM names them.
A failure after the first chunk arrives as an `{"error": ...}` event (the status is already sent),
then `[DONE]`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import NamedTuple

from megaserve.replicas.protocol import Tier, TokenLogprob
from megaserve.router.errors import GENERATION_ERRORS, SERVER_ERROR, APIError, generation_error
from megaserve.router.generation import Delta, Generation
from megaserve.router.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    GenerationRequest,
    Timing,
    TopLogprob,
    Usage,
)
from megaserve.router.policy import Lease
from megaserve.router.streaming import closing

SSE_DONE = b"data: [DONE]\n\n"
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")  # vLLM's return_token_ids fields of a choice
# model_dump_json's `exclude` of those fields, and of the prompt's at the top, for answers that did not ask
UNASKED_TOKEN_IDS = {"prompt_token_ids": True, "choices": {"__all__": dict.fromkeys(TOKEN_ID_FIELDS, True)}}
log = logging.getLogger(__name__)
SERVED_SERVICE_TIER = {Tier.LATENCY: "priority", Tier.THROUGHPUT: "default"}
# What OpenAI and vLLM send for a logprob of -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


def _json_logprob(value: float) -> float:
    """`value`, or LOGPROB_FLOOR for -inf and NaN (which fails every comparison), neither of which JSON
    has: pydantic would write them as null, where OpenAI's clients read a number."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def served_tier(body: GenerationRequest, lease: Lease) -> str:
    """OpenAI's name of the tier used: a "flex" or "scale" request served by throughput keeps its
    name; "fast" is OpenAI's alias of "priority", which is what its answers say."""
    if lease.tier is Tier.THROUGHPUT and body.service_tier in ("flex", "scale"):
        return body.service_tier
    return SERVED_SERVICE_TIER[lease.tier]


class _ChunkUsage(NamedTuple):
    """What a stream's chunks say of the usage: nothing (`shown` false), null, or the usage so far."""

    so_far: Callable[[], Usage] | None
    shown: bool


class ResponseBuilder:
    """Turns a generation's deltas into OpenAI responses and chunks."""

    def __init__(self, request_id: str, model: str, service_tier: str, chat: bool, generation: Generation,
                 return_token_ids: bool = False, logprobs: int | None = None) -> None:
        self.common = {"id": request_id, "model": model, "service_tier": service_tier}
        self.created = int(time.time())
        self.chat = chat
        self.generation = generation
        self.return_token_ids = return_token_ids  # vLLM's: prompt and generated ids beside the text
        # what each answer's JSON leaves out: the token-id fields, unless asked for
        self.unasked_fields: dict = {} if return_token_ids else UNASKED_TOKEN_IDS
        self._prompt_ids_sent: set[int] = set()  # choices whose stream has had its prompt's ids
        self.logprobs = logprobs  # None: not asked for; else the alternatives per token
        self._text_offsets: dict[int, int] = {}  # per choice: the legacy logprobs' text_offset so far

    def _ids(self, token_ids: Sequence[int]) -> list[int] | None:
        """`token_ids` where the request asked for ids, else None (left out of the JSON)."""
        return list(token_ids) if self.return_token_ids else None

    def _token_ids_left_out(self, choices: list, extra: dict) -> dict:
        """A chunk's `exclude` of the token-id fields: all where not asked for, else those it has
        none of (the prompt's ids after the first chunk, a role chunk's generated ids)."""
        if not self.return_token_ids:
            return dict(UNASKED_TOKEN_IDS)
        exclude: dict = {} if extra.get("prompt_token_ids") is not None else {"prompt_token_ids": True}
        per_choice = {i: {name: True for name in TOKEN_ID_FIELDS if getattr(choice, name, None) is None}
                      for i, choice in enumerate(choices)}
        if any(per_choice.values()):
            exclude["choices"] = per_choice
        return exclude

    def _token(self, token_id: int, logprob: float) -> dict:
        """The fields of chat's TopLogprob for this token."""
        text = self.generation.tokenizer.token_text(token_id)
        return {"token": text, "logprob": _json_logprob(logprob), "bytes": list(text.encode())}

    def _chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        """Chat's logprobs of these generated ids, or None where the request did not ask."""
        if self.logprobs is None:
            return None
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._token(token_id, lp.logprob),
                             top_logprobs=[TopLogprob(**self._token(top_id, value)) for top_id, value in lp.top])
            for token_id, lp in zip(token_ids, logprobs, strict=True)
        ])

    def _completion_logprobs(self, index: int, token_ids: Sequence[int],
                             logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs | None:
        """The legacy endpoint's logprobs of choice `index`'s next generated ids, or None where the
        request did not ask. Each token's text_offset is the length of the token texts before it, as
        vLLM's: where a token's text alone differs from its part of the choice's text (a byte-level
        piece of a character, a SentencePiece word's dropped space, the stop id, a trimmed stop
        string), the offsets drift from the text as vLLM's do."""
        if self.logprobs is None:
            return None
        token_text = self.generation.tokenizer.token_text
        tokens = [token_text(token_id) for token_id in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = offsets[-1] + len(text)
        tops = []
        for token, lp in zip(tokens, logprobs, strict=True):
            # keyed by text, as OpenAI's: ids that decode alike (a partial character's U+FFFD) share a key
            top = {token_text(top_id): _json_logprob(value) for top_id, value in lp.top}
            top.setdefault(token, _json_logprob(lp.logprob))  # OpenAI's: the sampled token is always there
            tops.append(top)
        return CompletionLogprobs(text_offset=offsets, token_logprobs=[_json_logprob(lp.logprob) for lp in logprobs],
                                  tokens=tokens, top_logprobs=tops)

    def _prompt_ids(self, index: int) -> Sequence[int]:
        return self.generation.requests[index].prompt_token_ids

    def usage(self) -> Usage:
        g = self.generation
        return Usage(prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens,
                     total_tokens=g.prompt_tokens + g.completion_tokens)

    def timing(self) -> Timing:
        g = self.generation
        end = g.finished_at or time.perf_counter()
        return Timing(
            time_to_first_token_seconds=None if g.first_token_at is None else g.first_token_at - g.arrival,
            mean_step_seconds=g.decode_seconds / g.decode_tokens if g.decode_tokens else None,
            total_seconds=end - g.arrival,
        )

    def complete(self, deltas: list[Delta], n: int) -> ChatCompletion | Completion:
        texts = ["" for _ in range(n)]
        generated: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finish: dict[int, str] = {}  # every choice's last delta has one: events() raises otherwise
        for delta in deltas:
            texts[delta.index] += delta.text
            generated[delta.index] += delta.token_ids
            logprobs[delta.index] += delta.logprobs
            if delta.finish_reason is not None:
                finish[delta.index] = delta.finish_reason
        if self.chat:
            choices = [ChatChoice(index=i, message=ChatMessageOut(content=texts[i]), finish_reason=finish[i],
                                  logprobs=self._chat_logprobs(generated[i], logprobs[i]),
                                  token_ids=self._ids(generated[i])) for i in range(n)]
            return ChatCompletion(**self.common, created=self.created, choices=choices, usage=self.usage(),
                                  timing=self.timing(), prompt_token_ids=self._ids(self._prompt_ids(0)))
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=finish[i],
                                    logprobs=self._completion_logprobs(i, generated[i], logprobs[i]),
                                    prompt_token_ids=self._ids(self._prompt_ids(i)), token_ids=self._ids(generated[i]))
                   for i in range(n)]
        return Completion(**self.common, created=self.created, choices=choices, usage=self.usage(),
                          timing=self.timing())

    async def sse(
        self, first: Delta, rest: AsyncGenerator[Delta, None], n: int, include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """Role chunks (chat), then one chunk per delta, the usage chunk if asked, `[DONE]`. As
        OpenAI's, the chunks have `"usage": null` when the usage is asked for and no `usage` else;
        with `continuous_usage`, the usage so far (as vLLM's continuous_usage_stats)."""
        chunk_usage = _ChunkUsage(self.usage if continuous_usage else None, include_usage)
        async with closing(rest):
            try:
                if self.chat:  # a role chunk per choice, as OpenAI's and vLLM's streams have
                    for i in range(n):
                        yield self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})],
                                          chunk_usage, prompt_token_ids=self._ids(self._prompt_ids(0)) if i == 0 else None)
                yield self._delta_chunk(first, chunk_usage)
                async for delta in rest:
                    yield self._delta_chunk(delta, chunk_usage)
            except (APIError, *GENERATION_ERRORS) as error:  # the status is sent: its message as an event
                yield _error_event(generation_error(error, self.generation.tier.value, self.common["id"],
                                                    retry_after_seconds=0).message)
                return
            except Exception:  # noqa: BLE001 - the status is sent: an error event, not a cut connection
                log.exception("stream %s failed", self.common["id"])
                yield _error_event(f"internal error (request id {self.common['id']})")
                return
        if include_usage:
            yield self._chunk([], chunk_usage, usage=self.usage(), timing=self.timing())
        yield SSE_DONE

    def _delta_chunk(self, delta: Delta, chunk_usage: _ChunkUsage) -> bytes:
        if self.chat:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            return self._chunk([ChatChunkChoice(index=delta.index, delta=content, finish_reason=delta.finish_reason,
                                                logprobs=self._chat_logprobs(delta.token_ids, delta.logprobs),
                                                token_ids=self._ids(delta.token_ids))], chunk_usage)
        first_of_choice = delta.index not in self._prompt_ids_sent
        self._prompt_ids_sent.add(delta.index)
        prompt_ids = self._ids(self._prompt_ids(delta.index)) if first_of_choice else None
        return self._chunk([CompletionChoice(index=delta.index, text=delta.text, finish_reason=delta.finish_reason,
                                             logprobs=self._completion_logprobs(delta.index, delta.token_ids,
                                                                                delta.logprobs),
                                             prompt_token_ids=prompt_ids, token_ids=self._ids(delta.token_ids))],
                           chunk_usage)

    def _chunk(self, choices: list, chunk_usage: _ChunkUsage, **extra) -> bytes:
        kind = ChatCompletionChunk if self.chat else Completion
        if chunk_usage.so_far is not None and "usage" not in extra:
            extra["usage"] = chunk_usage.so_far()
        chunk = kind(**self.common, created=self.created, choices=choices, **extra)
        exclude = self._token_ids_left_out(choices, extra)
        if "timing" not in extra:  # the timing extension: on the usage chunk only
            exclude["timing"] = True
        if not chunk_usage.shown:
            exclude["usage"] = True
        return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _error_event(message: str) -> bytes:
    """A failure after the stream began, then `[DONE]` as after any stream (vLLM and SGLang do too)."""
    return _sse({"error": {"message": message, "type": SERVER_ERROR, "param": None, "code": None}}) + SSE_DONE
