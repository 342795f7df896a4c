"""SGLangEngine: stock SGLang (`sglang.Engine`) behind the Engine protocol, for the throughput tier.

SGLang is an optional extra (`pip install megaserve[sglang]`) and is imported only when the engine
is built. `sglang.Engine(model_path=..., tp_size=..., **engine_args)` starts its scheduler (one
process per GPU of the tensor-parallel group) and detokenizer in subprocesses; its
TokenizerManager lives in this process, on this event loop. A request goes in as

    await engine.async_generate(input_ids=[...], sampling_params={...}, rid=..., priority=..., stream=True)

and comes back as dicts {"output_ids": [...], "meta_info": {"finish_reason": None | {"type": ...}}}.
By default each streamed dict carries all output ids so far; with SGLang's
`incremental_streaming_output` only the new ones. `OutputReader` handles both.

Settings we start SGLang with unless `engine_args` says otherwise: `skip_tokenizer_init` (token ids
in and out, no detokenizer work: replicas never see text) and `enable_priority_scheduling` (so that
`GenerateRequest.priority` orders SGLang's queue, larger first: SGLang's default direction). A seed
maps to SGLang's `sampling_seed`, which SGLang honours when started with its deterministic
inference mode.

Timing: SGLang does not stream per-step durations. Each chunk's tokens get the time since the
previous chunk (since submission for the first one, so it includes SGLang's queue and prefill),
split evenly; these are the values recorded as the prefill and decode step durations, once per
chunk of each request (so a batched step is observed once per request in it).

The functions `sglang_sampling_params`, `engine_launch_args`, `model_limits` and `OutputReader` are
pure and tested without SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol import (
    CoalescePolicy,
    Engine,
    EngineError,
    EngineHealth,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    StepOutput,
    Tier,
)
from .engine_metrics import EngineMetrics
from .stream import Chunk, TokenStream
from .validation import check_context, check_token_ids

SGLANG_DEFAULTS: dict[str, Any] = {"skip_tokenizer_init": True, "enable_priority_scheduling": True}
RESERVED_ARGS = ("model_path", "tp_size")  # set from the engine's own arguments
INCREMENTAL_ARG = "incremental_streaming_output"
TOP_K_DISABLED = -1  # SGLang's spelling of "no top-k"
FINISH_TYPES = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
CONTEXT_LENGTH_ARG = "context_length"


def sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` dict for our SamplingParams."""
    mapped: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else TOP_K_DISABLED,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop_token_ids:
        mapped["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        mapped["sampling_seed"] = params.seed
    return mapped


def engine_launch_args(model_dir: str | Path, tp_size: int, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine`: our defaults, then the caller's, then ours again for
    the two settings the engine owns."""
    reserved = sorted(set(RESERVED_ARGS) & set(engine_args))
    if reserved:
        raise ValueError(f"engine_args must not set {reserved}: they come from the tier's model and tp_size")
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    return {**SGLANG_DEFAULTS, **engine_args, "model_path": str(model_dir), "tp_size": tp_size}


def model_limits(hf_config: Mapping[str, Any], engine_args: Mapping[str, Any]) -> tuple[int, int]:
    """(vocab_size, max_context) of a model from its Hugging Face config.json contents; SGLang's
    `context_length`, when given, overrides the model's positions as it does in SGLang."""
    for key in ("vocab_size", "max_position_embeddings"):
        if key not in hf_config:
            raise ValueError(f"config.json lacks {key!r}")
    return int(hf_config["vocab_size"]), int(engine_args.get(CONTEXT_LENGTH_ARG) or hf_config["max_position_embeddings"])


@dataclass
class OutputReader:
    """Turns the dicts of one SGLang stream into Chunks of new tokens."""

    incremental: bool  # SGLang started with incremental_streaming_output
    delivered: int = 0  # output ids handed on so far

    def read(self, output: Mapping[str, Any], seconds: float) -> Chunk:
        """`seconds`: time since the previous dict (or since submission), split over its tokens."""
        output_ids = output["output_ids"]
        new = list(output_ids) if self.incremental else list(output_ids[self.delivered:])
        self.delivered += len(new)
        reason, error = finish_of(output["meta_info"].get("finish_reason"))
        per_token = seconds / len(new) if new else 0.0
        return Chunk(new, [per_token] * len(new), reason, error)


def finish_of(reason: Mapping[str, Any] | None) -> tuple[FinishReason | None, str | None]:
    """Our finish reason and error for SGLang's meta_info["finish_reason"]."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind not in FINISH_TYPES:
        return FinishReason.ABORT, f"SGLang finished with an unknown reason {dict(reason)!r}"
    return FINISH_TYPES[kind], reason.get("message") if kind == "abort" else None


class SGLangEngine(Engine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        tp_size: int = 1,
        engine_args: Mapping[str, Any] | None = None,
        coalesce: CoalescePolicy = CoalescePolicy(),
        tier: Tier | str = Tier.THROUGHPUT,
        model_name: str | None = None,
    ) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise RuntimeError("the sglang engine needs SGLang: pip install 'megaserve[sglang]'") from exc
        engine_args = dict(engine_args or {})
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.vocab_size, self.max_context = model_limits(hf_config, engine_args)
        self.model_name = model_name or Path(model_dir).name
        self.coalesce = coalesce
        self.metrics = EngineMetrics(Tier(tier).value, self.model_name)
        self._incremental = bool(engine_args.get(INCREMENTAL_ARG, False))
        self._engine = sglang.Engine(**engine_launch_args(model_dir, tp_size, engine_args))
        self._active: dict[str, tuple[TokenStream, asyncio.Task]] = {}  # rid -> its stream and pump
        self._closed = False

    def validate(self, request: GenerateRequest) -> None:
        super().validate(request)
        check_token_ids(request, self.vocab_size)
        check_context(request, self.max_context)

    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Validate now (EngineError at the call), submit to SGLang when iteration starts."""
        if self._closed:
            raise EngineError("the engine is shut down")
        self.validate(request)
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        # SGLang refuses a rid it already has; a retried request id must not collide.
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        stream = TokenStream(
            len(request.prompt_token_ids), self.coalesce, asyncio.get_running_loop(),
            on_cancel=lambda: self._abort(rid),
        )
        self._active[rid] = (stream, asyncio.create_task(self._pump(request, rid, stream)))
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                yield output

    async def _pump(self, request: GenerateRequest, rid: str, stream: TokenStream) -> None:
        """Feed SGLang's stream for `rid` into our TokenStream until it finishes."""
        self.metrics.request_started()
        reader = OutputReader(self._incremental)
        last = time.perf_counter()
        try:
            outputs = await self._engine.async_generate(
                input_ids=list(request.prompt_token_ids),
                sampling_params=sglang_sampling_params(request.sampling),
                rid=rid, priority=request.priority, stream=True,
            )
            async for output in outputs:
                now = time.perf_counter()
                first = reader.delivered == 0
                chunk = reader.read(output, now - last)
                last = now
                for seconds in chunk.step_seconds:
                    (self.metrics.prefill_step if first else self.metrics.decode_step)(seconds)
                    first = False
                stream.put(chunk)
                if chunk.finish_reason is not None:
                    return
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error="SGLang ended the stream without a finish reason"))
        except Exception as exc:  # SGLang refused or failed the request: the client gets the reason
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error=f"SGLang failed: {type(exc).__name__}: {exc}"))
        finally:
            self._active.pop(rid, None)
            self.metrics.request_ended()

    def _abort(self, rid: str) -> None:
        """The consumer left: stop the pump and have SGLang drop the request at its next step."""
        entry = self._active.pop(rid, None)
        if entry is not None:
            entry[1].cancel()
            self._engine.tokenizer_manager.abort_request(rid=rid)

    async def health(self) -> EngineHealth:
        return EngineHealth(
            healthy=not self._closed, detail="the engine is shut down" if self._closed else "",
            running_requests=len(self._active),
        )

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        active = list(self._active.items())
        for rid, (stream, pump) in active:
            pump.cancel()
            self._engine.tokenizer_manager.abort_request(rid=rid)
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error="the engine is shutting down"))
        await asyncio.gather(*(pump for _, (_, pump) in active), return_exceptions=True)
        await asyncio.to_thread(self._engine.shutdown)
