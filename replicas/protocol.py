"""The contract between the router and every engine: token ids in, token ids out.

Replicas never see text. The router tokenizes once, sends a `GenerateRequest`, and reads
`StepOutput`s back through a streaming `DeploymentHandle` call. Everything here is plain data
(dataclasses of ints, floats and strings) so it pickles cheaply across Ray and imports without
Ray, pydantic or a web stack.

Yield rule (every `Engine.generate` obeys it):
  1. The first generated token is yielded alone, as soon as it exists (time to first token).
  2. After that, tokens are coalesced: an engine yields when `coalesce_seconds` have passed
     since its last yield or `coalesce_tokens` tokens are pending, whichever comes first, so that
     the per-item cost of Ray's streaming (~0.3 ms) stays far below the step time.
  3. The last item carries `finish_reason` (and any tokens still pending); nothing follows it.
     With STOP, the id that ended the generation (a stop or end-of-sequence id) is that item's
     last token: the router counts it but shows no text for it, so it must not come earlier.
  4. An item is never empty except the last one, which may carry no tokens.
  5. Each token comes with the duration of the engine step that produced it, in seconds.
  6. When the request asked for logprobs (`SamplingParams.logprobs` not None), each token comes
     with its `TokenLogprob`: an item's `logprobs` has one per token id, in order.
Cancelling the consumer (closing the async generator, or Ray cancelling the call on client
disconnect) stops the generation at the next step boundary and frees the slot.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class Tier(str, enum.Enum):
    """Which replica pool serves a request."""

    LATENCY = "latency"
    THROUGHPUT = "throughput"


class FinishReason(str, enum.Enum):
    """Why a generation ended; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"  # an end-of-sequence or stop token id (stop strings are matched by the router)
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled or failed on the replica


class EngineError(Exception):
    """A request that an engine refuses (bad ids, too long, ...); the message is for the client."""


class EngineDeadError(Exception):
    """The engine serves nothing any more: a step failed (the message says how) or it was shut down.
    Not an EngineError: the request was fine, and another replica can serve it once Serve replaces
    this one, so the router answers 503 with Retry-After (vLLM's EngineDeadError), not 400."""


ENGINE_SHUT_DOWN = "the engine is shut down"  # EngineDeadError's message where no step failed


# The files of a Hugging Face model folder that both the router and the replicas read.
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# A seed is a signed 64-bit integer, as in vLLM's OpenAI server and SGLang's sampling_seed.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# The most alternatives a token's logprobs may list (vLLM's default max_logprobs, OpenAI's top_logprobs
# bound): each costs a top-k over the vocabulary and a token string in every answer.
MAX_LOGPROBS = 20

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): logits / temperature would
# overflow float32 (1e-300 is 0 in it), and the draw would then pick among infinities.
GREEDY_TEMPERATURE = 1e-5


def is_integer(value: object) -> bool:
    """An int but not a bool: Python counts True as 1, but no client means `true` as a count, id or seed."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float but not a bool (see is_integer)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature` 0 (or below GREEDY_TEMPERATURE) means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs. k: each generated token's logprob, and the k most likely tokens at its step.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Types before ranges: a float seed, top_k or max_tokens passes its range check and fails only on
        # the engine's step thread (`seed & MASK32`), which ends every stream on the replica, not just this one.
        integers = {"max_tokens": self.max_tokens, "top_k": self.top_k, "seed": self.seed, "logprobs": self.logprobs}
        for name, value in integers.items():
            if not is_integer(value) and not (name in ("seed", "logprobs") and value is None):
                raise EngineError(f"{name} must be an integer, got {value!r}")
        for name, value in {"temperature": self.temperature, "top_p": self.top_p}.items():
            if not is_number(value):
                raise EngineError(f"{name} must be a number, got {value!r}")
        for token in self.stop_token_ids:
            if not is_integer(token):
                raise EngineError(f"stop token id {token!r} is not an integer")
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {self.max_tokens}")
        # NaN passes `< 0` and then samples token 0 forever; inf turns logits / temperature into 0s and NaNs.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise EngineError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN and inf fail this too
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise EngineError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise EngineError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: a tokenized prompt and how to sample its continuation."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # larger is served first where an engine queues (SGLang's convention)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens of its step, as the model gave
    them: the log-softmax of its logits before temperature, top-k and top-p (vLLM's default, "raw"
    logprobs), so the same token scores the same whatever the request's sampling."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; as many as asked


@dataclass
class StepOutput:
    """Tokens produced since the previous item of the same stream (see the yield rule above)."""

    token_ids: list[int]
    step_seconds: list[float]  # one per token: the duration of the step that produced it
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # set on every item, so a consumer that starts late still knows
    error: str | None = None  # set with finish_reason ABORT when the engine failed
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked (rule 6)


@dataclass(frozen=True)
class EngineHealth:
    """What `Engine.health` reports; `healthy=False` makes Serve restart the replica."""

    healthy: bool
    detail: str = ""
    running_requests: int = 0
    waiting_requests: int = 0


@dataclass(frozen=True)
class CoalescePolicy:
    """When an engine yields (rule 2 of the yield rule)."""

    seconds: float = 0.005
    tokens: int = 16

    def __post_init__(self) -> None:
        # tokens < 1 would yield empty items forever; a negative timer is a typo, not a policy.
        if self.tokens < 1:
            raise ValueError(f"coalesce tokens must be at least 1, got {self.tokens}")
        if self.seconds < 0:
            raise ValueError(f"coalesce seconds must be >= 0, got {self.seconds}")


def context_limit(max_seq: int | None, positions: int) -> int:
    """The context an engine serves: the tier's `max_seq` (all of the model's positions when
    unset), never more than the model's `positions`, which a longer cache would only waste."""
    return min(max_seq or positions, positions)


class Engine(abc.ABC):
    """A model that turns token ids into more token ids. Implementations: TorchEngine (CPU or
    GPU reference, batch-1 or continuously batched), MegakernelEngine (batch-1 CUDA decode),
    SGLangEngine (stock SGLang, batched)."""

    model_name: str
    vocab_size: int  # prompt token ids must lie in [0, vocab_size)
    max_context: int  # prompt + generated tokens must fit in this

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Stream the continuation of `request` as `StepOutput`s, following the yield rule."""

    @abc.abstractmethod
    async def health(self) -> EngineHealth:
        """Cheap liveness and load report."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop generating and free the device; pending streams end with ABORT."""

    def validate(self, request: GenerateRequest) -> None:
        """Raise EngineError if `request` cannot run on this engine; called before any work. With
        vLLM's rules and wording: prompt ids must lie in the vocabulary, and prompt + max_tokens must
        fit the context (a request that cannot finish is refused up front rather than cut short)."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise EngineError("the prompt is empty")
        if prompt_len >= self.max_context:
            raise EngineError(
                f"the prompt has {prompt_len} tokens but the model's context is {self.max_context}"
            )
        for token in request.prompt_token_ids:
            if not is_integer(token):  # a float id passes the range check and fails on the step thread
                raise EngineError(f"prompt token id {token!r} is not an integer")
            if not 0 <= token < self.vocab_size:
                raise EngineError(f"prompt token id {token} is outside the vocabulary [0, {self.vocab_size})")
        wanted = request.sampling.max_tokens
        if prompt_len + wanted > self.max_context:
            raise EngineError(
                f"this model's maximum context length is {self.max_context} tokens, but {prompt_len + wanted} "
                f"were requested ({prompt_len} in the prompt, {wanted} to generate); "
                "shorten the prompt or lower max_tokens"
            )
