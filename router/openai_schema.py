"""The OpenAI wire format of /v1/chat/completions, /v1/completions and /v1/models, and vLLM's of
/tokenize and /detokenize.

Requests are validated strictly (a string where a number belongs is an error, not a guess); fields
OpenAI defines that megaserve does not implement, and vLLM's and SGLang's extensions it does not
implement, are refused by name when set to anything but their neutral value (or, for a switch
megaserve implements one way only, to anything but that way), rather than silently ignored; fields
nobody defines are ignored, as vLLM and SGLang do (OpenAI refuses them), and the router logs their
names, as vLLM does, so that a typo such as `max_token` shows; OpenAI's fields that change nothing
in the output (`store`, `metadata`, ...) are ignored unlogged; a chat message's unknown fields are
ignored too, but an assistant message's tool calls are refused as `tools` is. A request that names
no model gets the served one, as in vLLM and SGLang. Extensions, as in vLLM: `top_k`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `include_stop_str_in_output` (SGLang's
`no_stop_trim`), `return_token_ids` (the responses' `prompt_token_ids` and `token_ids`, left out of
the JSON unless asked for), `stream_options.continuous_usage_stats`. Logprobs are OpenAI's: chat's
`logprobs` switch with `top_logprobs` alternatives, the legacy endpoint's `logprobs` count; at most
MAX_LOGPROBS alternatives, as vLLM's default. Responses
also carry `timing` (seconds), which OpenAI's clients keep as an extra attribute (streams: on the
usage chunk).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from megaserve.replicas.protocol import MAX_LOGPROBS, SEED_MAX, SEED_MIN

ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
OpenAIFinishReason = Literal["stop", "length"]  # a replica's ABORT is an error, never an answer

MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; vLLM any number; matching cost grows with each
# Characters per stop string (OpenAI and vLLM set none): the router builds each one's matching table
# on its event loop, and 16 of 4 MB in all held every stream of the router for seconds.
MAX_STOP_CHARS = 1024
MAX_TEMPERATURE = 2.0  # OpenAI's bound
# A chat's messages are turned into the template's input on the event loop, where every stream of
# the router waits: 4,096 take ~3 ms, 100,000 (a 4 MB body of empty ones) took 0.16 s.
MAX_MESSAGES = 4096
MAX_CHOICES = 8  # choices per request (`n`, times a completion batch's prompts); each takes one slot
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # error type and OpenAI error code; ctx["name"]: the field
# the error type of a field that is wrong given the others; ctx["name"]: the field, which ends the path
INVALID_FIELD = "invalid_field"

TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        if self.text is None:
            raise ValueError("a text content part needs `text`")
        return self


class _RefusesUnsupported(_Request):
    """Refuses each field of `unsupported_neutral` with a value other than its neutral ones, and each
    field of `implemented_only_as` with a value other than null and its one implemented value."""

    unsupported_neutral: ClassVar[dict[str, Any]] = {}
    # vLLM's and SGLang's switches megaserve implements one way only, the endpoint's: null means that way too.
    implemented_only_as: ClassVar[dict[str, Any]] = {}

    @classmethod
    def _refuses_in(cls, data: dict) -> bool:
        """Whether the refusals apply to the request `data` (always, unless a subclass says)."""
        return True

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls._refuses_in(data):
            for name, neutral in cls.unsupported_neutral.items():
                if name in data and not _is_one_of(data[name], neutral):
                    raise PydanticCustomError(UNSUPPORTED_PARAMETER, "`{name}` is not supported by this server",
                                              {"name": name})
            for name, value in cls.implemented_only_as.items():
                if not _is_one_of(data.get(name), (None, value)):
                    raise PydanticCustomError(UNSUPPORTED_PARAMETER,
                                              "`{name}` is not supported by this server except as {value}",
                                              {"name": name, "value": json.dumps(value)})
        return data


def _is_one_of(value: Any, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed` in type too, as strict validation reads it: in Python
    `False == 0` and `1.0 == 1`, but `false` is no count and `1.0` no integer."""
    return any(type(value) is type(choice) and value == choice for choice in allowed)


class ChatMessage(_RefusesUnsupported):
    # an assistant message's tool calls: refused as `tools` is, not dropped from the prompt unseen
    unsupported_neutral: ClassVar[dict[str, Any]] = {"tool_calls": (None, []), "function_call": (None,),
                                                     "audio": (None,)}
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)  # as vLLM joins them

    def template_message(self) -> dict[str, str]:
        """The message as chat templates read it: OpenAI's `developer` is the `system` role of every
        open template; `name`, where given, goes along (vLLM hands templates every field)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


# Fields of OpenAI's API that megaserve does not implement, and the value that means "unused".
_UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # vLLM's extensions (sent through the OpenAI SDK's extra_body), each of which changes the output
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),  # vLLM >= 0.10.2: replaces the guided_* fields
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "mm_processor_kwargs": (None, {}),
    # SGLang's extensions, likewise
    "regex": (None,),
    "stop_regex": (None, []),
    "ebnf": (None,),
    "json_schema": (None,),
    "lora_path": (None,),
}

# OpenAI's fields that leave the output as it is: served without them, and not logged as unknown.
_OPENAI_NO_EFFECT_FIELDS = frozenset({
    "store", "metadata", "parallel_tool_calls", "moderation", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "safety_identifier",
})

# Chat-only fields: OpenAI's, then vLLM's and SGLang's chat template controls.
_CHAT_UNSUPPORTED_NEUTRAL: dict[str, Any] = _UNSUPPORTED_NEUTRAL | {
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "function_call": (None, "none"),  # the legacy form of tool_choice
    "web_search_options": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),  # RAG templates (Command-R, Granite) render them into the prompt
}


class ModelRequest(_RefusesUnsupported):
    """A request body of the router's: it may name the served model, and its unknown top-level
    fields are served without, and named in the log."""

    # Unknown top-level fields are kept, so that `ignored_fields` can name them (merged with
    # _Request's configuration).
    model_config = ConfigDict(extra="allow")
    # fields known to change nothing in the answer: served without, and not logged as unknown
    no_effect_fields: ClassVar[frozenset[str]] = frozenset()
    model: str | None = None  # left out or empty: the served model, as vLLM and SGLang take it

    @property
    def ignored_fields(self) -> list[str]:
        """The top-level fields nobody defines, which the request is served without."""
        known = self.unsupported_neutral.keys() | self.implemented_only_as.keys() | self.no_effect_fields
        return sorted(name for name in self.model_extra or {} if name not in known)


class GenerationRequest(ModelRequest):
    """The sampling fields both endpoints share."""

    unsupported_neutral: ClassVar[dict[str, Any]] = _UNSUPPORTED_NEUTRAL
    no_effect_fields: ClassVar[frozenset[str]] = _OPENAI_NO_EFFECT_FIELDS
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: disabled (vLLM's convention)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    # vLLM's and SGLang's text controls (null: the default): special tokens written out in the text,
    # and the stop string (or stop id's text) kept at its end; no_stop_trim is SGLang's name.
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    # vLLM's: the prompt's ids and each choice's generated ids beside the text
    return_token_ids: bool | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    service_tier: ServiceTier | None = None
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):  # `stream` is validated first
            raise ValueError("only allowed when stream is true")
        return options

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        sequences = [stop] if isinstance(stop, str) else stop or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(sequences)}")
        if any(s == "" for s in sequences):
            raise ValueError("stop sequences must not be empty")
        if (longest := max(map(len, sequences), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {longest}")
        return stop

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM ignores continuous_usage_stats without include_usage too)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_stop_text(self) -> bool:
        return bool(self.include_stop_str_in_output or self.no_stop_trim)

    @property
    def skips_special_tokens(self) -> bool:
        return self.skip_special_tokens is not False

    @property
    def returns_token_ids(self) -> bool:
        return bool(self.return_token_ids)


class ChatCompletionRequest(GenerationRequest):
    unsupported_neutral: ClassVar[dict[str, Any]] = _CHAT_UNSUPPORTED_NEUTRAL
    # The template is applied with the assistant's turn opened, and writes the special tokens itself.
    implemented_only_as: ClassVar[dict[str, Any]] = {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
    }

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM: 0 alternatives ask for nothing
            raise PydanticCustomError(INVALID_FIELD, "`{name}` needs `logprobs` to be true", {"name": "top_logprobs"})
        return self

    @property
    def requested_logprobs(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` replaces the deprecated `max_tokens` when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    # A text prompt is tokenized with the tokenizer's special tokens (BOS), as vLLM's default.
    implemented_only_as: ClassVar[dict[str, Any]] = {"add_special_tokens": True}

    prompt: str | list[int] | list[str] | list[list[int]]
    # The legacy endpoint's logprobs: a count of alternatives; 0 asks for the sampled tokens' alone.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def requested_logprobs(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt: Any) -> str | list[int] | list[str] | list[list[int]]:
        """One prompt (a text or token ids), or OpenAI's batch of them (a list of either); the
        router checks each prompt's tokens, a batch's at most MAX_CHOICES of them."""
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_CHOICES:
            raise ValueError(f"a batch of {len(prompt)} prompts; this server returns at most {MAX_CHOICES} "
                             "choices (n for each prompt)")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch's, in order: each gets `n` choices, the first prompt's first."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TokenizeRequest(ModelRequest):
    """vLLM's POST /tokenize: a prompt as /v1/completions reads it, or messages as chat does."""

    # What would change a chat's count and is not implemented: refused with messages, not ignored.
    # A prompt is read without a template, so vLLM's prompt form has none of these fields.
    unsupported_neutral: ClassVar[dict[str, Any]] = {
        key: _CHAT_UNSUPPORTED_NEUTRAL[key] for key in ("chat_template", "chat_template_kwargs", "documents")
    } | {"tools": (None, []), "continue_final_message": (None, False)}

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # a prompt's BOS (default true); messages' template writes its own
    add_generation_prompt: bool = True  # messages: open the assistant's turn, as chat completions do
    return_token_strs: bool | None = False

    @classmethod
    def _refuses_in(cls, data: dict) -> bool:
        return data.get("messages") is not None

    @property
    def ignored_fields(self) -> list[str]:
        """With a prompt, the chat fields too: a prompt is read without a template."""
        if self.messages is None:
            return sorted(self.model_extra or {})
        return super().ignored_fields

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if self.prompt is None and self.messages is None:
            raise PydanticCustomError(INVALID_FIELD, "give `prompt` (a text) or `messages` (a chat)", {"name": "prompt"})
        if self.prompt is not None and self.messages is not None:
            raise PydanticCustomError(INVALID_FIELD, "give `prompt` or `messages`, not both", {"name": "messages"})
        if self.messages is not None and self.add_special_tokens:
            raise PydanticCustomError(UNSUPPORTED_PARAMETER, "`{name}` is not supported by this server except "
                                      "as false with messages", {"name": "add_special_tokens"})
        return self


class DetokenizeRequest(ModelRequest):
    """vLLM's POST /detokenize: token ids back to text, special tokens written out. The body's size
    limit bounds the ids' count."""

    tokens: list[TokenId]


# --- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timing(BaseModel):
    """Extension: where the time of this request went, measured at the router."""

    time_to_first_token_seconds: float | None  # arrival to first generated token
    mean_step_seconds: float | None  # engine step time per token after the first
    total_seconds: float  # arrival to the last token


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    service_tier: str
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    """A token and its logprob, in chat's format: `bytes` are the UTF-8 bytes of the token's text decoded
    alone (vLLM's too: a byte-level piece of a character is U+FFFD's three bytes, not its own)."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely tokens of the step, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]  # one per generated token (streams: per token of the delta)


class CompletionLogprobs(BaseModel):
    """The legacy endpoint's logprobs: one entry per generated token in each list."""

    text_offset: list[int]  # the length of the token texts before each one's (vLLM's reading of OpenAI's)
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]  # the `logprobs` most likely tokens, and the sampled one


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason
    token_ids: list[int] | None = None  # return_token_ids: the choice's generated ids


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    timing: Timing
    prompt_token_ids: list[int] | None = None  # return_token_ids


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": ...}, then {}
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ids of this delta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timing: Timing | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None
    # return_token_ids: the choice's prompt ids (streams: on its first chunk), its generated ids
    # (streams: this delta's)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timing: Timing | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megaserve"
    max_model_len: int  # vLLM's extension: the context length


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Tokens(BaseModel):
    """/tokenize's answer, vLLM's shape."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizedText(BaseModel):
    prompt: str
