"""SGLangEngine: stock SGLang (`sglang.Engine`) behind the Engine protocol, for the throughput tier.

SGLang is an optional extra (`pip install 'megaserve[sglang]'`, pinned to the release whose
source tests/replicas/engines/test_sglang_api.py checks every name below against) and is imported
only when the engine starts. `sglang.Engine(**launch_args)` takes `ServerArgs` fields as keywords
and starts its scheduler (one process per GPU of the tensor-parallel group, on the GPUs this
process sees) in subprocesses; its TokenizerManager lives in this process, on this event loop.
A request goes in as

    await runtime.async_generate(input_ids=[...], sampling_params={...}, rid=..., priority=..., stream=True)

and comes back as dicts {"output_ids": [...], "meta_info": {"finish_reason": None | {"type": ...}}}.
By default each streamed dict carries all output ids so far; with SGLang's
`incremental_streaming_output` only the new ones. `OutputReader` handles both. A client that
leaves cancels our pump and `runtime.tokenizer_manager.abort_request(rid=...)` drops the request
from SGLang's batch at its next step.

Logprobs (`SamplingParams.logprobs` k, not None): the request also carries `return_logprob=True`,
`top_logprobs_num=k` and `logprob_start_len=-1`, SGLang's "the output's only" (its scheduler then
starts them at the prompt's end: no prompt logprobs are computed); a request without logprobs
carries none of them, and SGLang computes none. meta_info["output_token_logprobs"] has a
(logprob, token id, None) per output id (None: no text, with `skip_tokenizer_init`) and, when
k > 0, meta_info["output_top_logprobs"] a list of k such tuples per output id, most likely first.
Both hold every output id's so far, or with incremental streaming the dict's own ids' (SGLang's own
abort, which repeats the last id, holds every id's so far after those of any new ids). `OutputReader`
turns those of its new ids into `TokenLogprob`s, cut with the ids, and where they are missing or
name other ids fails the request (an abort, which drops SGLang's request too) rather than misalign
them. SGLang's logprobs are by default those of the
temperature-scaled logits; SGLANG_RETURN_ORIGINAL_LOGPROB, set in this process (SGLang's processes
inherit it, as the context switch), makes them the raw logits' log-softmax, as on the other tiers.
SGLang reads it only for requests that ask for logprobs.

Stops are TorchEngine's (and vLLM's): a stop id ends a request with FinishReason.STOP, the stop id
streamed last, and `ignore_eos` drops only EOS. EOS is every id `hf_eos_token_ids` finds, sent as
stop ids: SGLang itself stops only on config.json's and generation_config.json's, and with
`skip_tokenizer_init` never on the tokenizer's `eos_token` (a fine-tune's chat end, often).
SGLang's own check skips the stop ids too under `ignore_eos` (`Req._check_token_based_finish`
returns early), so then they are not sent to SGLang: `OutputReader` ends the stream at the first
one itself and the pump aborts the request in SGLang, as for a client that leaves.

Launch settings the engine owns (OWNED_ARGS; `engine_args` may not set them): the model path,
`tp_size`, `context_length` (the tier's max_seq_len, capped by the model, plus CONTEXT_MARGIN), `dtype`,
`max_running_requests` (the tier's max_batch), `enable_metrics` (SGLang's own `sglang:*` metrics,
written to PROMETHEUS_MULTIPROC_DIR, the node's megaserve metrics folder, and so served beside
ours), `mem_fraction_static` (the tier's `sglang_mem_fraction_static`) and `skip_tokenizer_init`
(always on: token ids in and out, replicas never see text). Any other `ServerArgs` field (e.g.
chunked_prefill_size) comes through `engine_args`, but for those that would fail only once SGLang
starts on the GPUs or would break requests (`check_engine_args`): a placement of its own
(PLACEMENT_ARGS), a schedule policy that priority scheduling refuses, priority scheduling off with
ABORT_ON_PRIORITY_ARG on (SGLang would then abort every request: each one is sent with a priority)
or with RETRACTION_ARG "priority" (SGLang refuses to start), lower priority values first (the
tiers' order reversed), and speculative decoding (SPECULATIVE_ARG: EAGLE reserves draft-token
slots of every request's context, SGLang's num_reserved_tokens, which CONTEXT_MARGIN does not
cover, so SGLang would refuse requests that `Engine.validate` accepts).
`enable_priority_scheduling` is on unless `engine_args` says otherwise, so that
`GenerateRequest.priority` orders SGLang's queue, larger first (SGLang's default direction). A seed
maps to SGLang's `sampling_seed`, which SGLang honours when started with
`enable_deterministic_inference`; a sampled request without one gets a random one, since SGLang
would give every unseeded request the same seed, 42, there.

Context: the tier serves what the other tiers and the router do, the tier's max_seq_len capped by
the model's positions. SGLang serves requests of context_length - 1 tokens (its max_req_len),
refuses a prompt of max_req_len - 5 tokens or more and generates at most max_req_len - prompt - 1
tokens, so the engine asks SGLang for CONTEXT_MARGIN (6) more than `max_context`: then every
request that `Engine.validate` accepts (prompt < max_context, prompt + max_tokens <= max_context)
runs to max_tokens. SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set in this process (SGLang's
processes inherit it), so that SGLang starts with that context_length: it would refuse one past its
own reading of the model's length (`get_context_length`: other config keys first, rope factors),
where that reserve, or the tier's context itself, passes it. The context is the engine's, as on
every tier, and no request reaches a position past max_position_embeddings. A KV pool smaller than
that context lowers SGLang's limit (its max_req_input_len; SGLang only warns), which the engine
reads once SGLang has started: below `max_context`, the engine stops SGLang and fails to start,
naming the numbers and the fixes, as vLLM refuses a max_model_len its KV cache cannot hold. Serving
less instead would go unseen by the router, which sizes a chat request without max_tokens to the
whole context: each such request would be refused for a parameter its client never sent.

Timing: SGLang does not stream per-step durations. Each chunk's tokens get the time since the
previous chunk, split evenly; these are the values recorded as the prefill and decode step
durations, once per chunk of each request (so a batched step is observed once per request in it).
For the first chunk, SGLang's own wall-clock stamps (meta_info "forward_entry_time" and
"prefill_finished_time", sent with `enable_metrics`) give the prefill its own duration and the
chunk's other tokens the time since it, so the wait in SGLang's queue counts as neither; without
them the first chunk's tokens share the time since submission, queue and prefill included.

`shutdown()` ends SGLang's processes; SGLang does it by ending every child process of this
process, so an SGLangEngine needs a process of its own (a Serve replica is one).

Health: a one-token generation, as SGLang's own /health_generate does. Under load the probe may
wait in SGLang's queue; output reaching any other request in the meantime proves SGLang alive too.
Where SGLang refuses the probe for its queue (full under `max_queued_requests`, a waiting timeout, a
higher priority), the probe hears nothing: SGLang reports those refusals as aborts that its
TokenizerManager drops for health rids, so other requests' output decides, as above. An abort that
does reach the probe is SGLang failing the request itself (an internal error): unhealthy.

`sglang_sampling_params` (but for an unseeded request's random seed), `own_stop_ids`,
`engine_launch_args`, `generate_kwargs`, `model_limits` and `OutputReader` are pure and tested
without SGLang; the engine itself is tested against an in-process stand-in for `sglang.Engine`, and
against the real one in tests/gpu/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.config import hf_eos_token_ids
from ..protocol import (
    CONFIG_FILE,
    ENGINE_SHUT_DOWN,
    CoalescePolicy,
    Engine,
    EngineDeadError,
    EngineHealth,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    StepOutput,
    Tier,
    TokenLogprob,
    context_limit,
)
from ..source_tree import import_installed_namesakes
from .engine_metrics import EngineMetrics
from .stream import Chunk, TokenStream

INSTALL_HINT = "pip install 'megaserve[sglang]'"
PRIORITY_ARG = "enable_priority_scheduling"
# With priority scheduling off, SGLang aborts every request that carries a priority, as ours all do.
ABORT_ON_PRIORITY_ARG = "abort_on_priority_when_disabled"
LOW_PRIORITY_FIRST_ARG = "schedule_low_priority_values_first"
RETRACTION_ARG = "retraction_policy"
SPECULATIVE_ARG = "speculative_algorithm"
SGLANG_DEFAULTS: dict[str, Any] = {PRIORITY_ARG: True}
OWNED_ARGS = (
    "model_path", "tp_size", "context_length", "dtype", "max_running_requests", "enable_metrics",
    "mem_fraction_static", "skip_tokenizer_init",
)
# ServerArgs fields that choose SGLang's GPUs and nodes, which the replica's placement fixes: tp_size
# GPUs of one node, the ones Ray gives the actor (dp_size and pp_size multiply the GPUs SGLang takes).
PLACEMENT_ARGS = (
    "dp_size", "pp_size", "nnodes", "node_rank", "dist_init_addr", "base_gpu_id", "gpu_id_step", "device",
)
# The schedule policies SGLang's priority scheduling takes (its check_server_args asserts them).
PRIORITY_SCHEDULE_POLICIES = ("fcfs", "lof")
INCREMENTAL_ARG = "incremental_streaming_output"
TOP_K_DISABLED = -1  # SGLang's spelling of "no top-k": its TOP_K_ALL, the whole vocabulary
FINISH_TYPES = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# A "stop" whose `matched` is this: SGLang sampled an id outside the vocabulary (NaN logits) and
# put a stop id in its place (ScheduleBatch's vocabulary boundary check): a failure, not an end.
NAN_MATCHED = "NaN happened"
OUT_OF_VOCABULARY_ERROR = "SGLang sampled a token outside the vocabulary (NaN in the logits)"
CONTEXT_MARGIN = 6  # SGLang's context_length beyond the engine's max_context (see the module's doc)
# SGLang's switch for a context_length past its reading of the model's length
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
# SGLang's switch for logprobs of the raw logits rather than of the temperature-scaled ones
RAW_LOGPROBS_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# async_generate's logprob keywords, and the meta_info keys they add
RETURN_LOGPROB_ARG, TOP_LOGPROBS_ARG, LOGPROB_START_ARG = "return_logprob", "top_logprobs_num", "logprob_start_len"
OUTPUT_ONLY_LOGPROBS = -1  # logprob_start_len: the output's logprobs, none of the prompt's
TOKEN_LOGPROBS_KEY, TOP_LOGPROBS_KEY = "output_token_logprobs", "output_top_logprobs"
SEED_BITS = 63  # an unseeded sampled request's random sampling_seed: a non-negative int64

# The health probe: SGLang's own prefix (it drops late outputs of such rids quietly), one greedy
# token from a one-token prompt, within a timeout below the replicas' health-check timeout
# (deployments.HEALTH_CHECK_TIMEOUT_SECONDS).
HEALTH_RID_PREFIX = "HEALTH_CHECK"
HEALTH_PROMPT = (0,)
HEALTH_SAMPLING: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
HEALTH_TIMEOUT_SECONDS = 20.0


def sglang_sampling_params(params: SamplingParams, vocab_size: int, eos_ids: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang's `sampling_params` dict for our SamplingParams, the model's vocabulary size and its
    end-of-sequence ids; stop ids only where SGLang checks them (see `own_stop_ids`)."""
    # A top_k of the whole vocabulary or more keeps every token, which SGLang spells -1: it puts
    # each row's top_k in an int32 tensor, which a client's top_k of 2**31 or more would overflow.
    keeps_all = params.top_k == 0 or params.top_k >= vocab_size
    mapped: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,  # greedy rows are greedy on every tier
        "top_p": params.top_p,
        "top_k": TOP_K_DISABLED if keeps_all else params.top_k,
        "ignore_eos": params.ignore_eos,
    }
    stop_ids = list(dict.fromkeys((*params.stop_token_ids, *eos_ids)))
    if stop_ids and not params.ignore_eos:
        mapped["stop_token_ids"] = stop_ids
    if params.seed is not None:
        mapped["sampling_seed"] = params.seed
    elif not params.greedy:
        mapped["sampling_seed"] = random.getrandbits(SEED_BITS)
    return mapped


def own_stop_ids(params: SamplingParams) -> frozenset[int]:
    """The stop ids the engine checks itself: all of them under `ignore_eos`, where SGLang skips them."""
    return frozenset(params.stop_token_ids) if params.ignore_eos else frozenset()


def generate_kwargs(prompt_token_ids: Sequence[int], sampling_params: Mapping[str, Any], rid: str,
                    priority: int, logprobs: int | None = None) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine.async_generate` for one streamed request; `logprobs`:
    SamplingParams.logprobs (None asks SGLang for none, so that it computes none)."""
    kwargs = {"input_ids": list(prompt_token_ids), "sampling_params": dict(sampling_params),
              "rid": rid, "priority": priority, "stream": True}
    if logprobs is not None:
        kwargs |= {RETURN_LOGPROB_ARG: True, TOP_LOGPROBS_ARG: logprobs, LOGPROB_START_ARG: OUTPUT_ONLY_LOGPROBS}
    return kwargs


def check_engine_args(engine_args: Mapping[str, Any]) -> None:
    """Refuse `engine_args` that SGLang would fail on only once its processes start on the GPUs, or
    that would break requests: see the module's doc."""
    placement = sorted(set(PLACEMENT_ARGS) & set(engine_args))
    if placement:
        raise ValueError(f"{placement} must not be set: the replica's placement decides SGLang's GPUs "
                         f"(tp_size of one node, those Ray gives it)")
    policy = engine_args.get("schedule_policy")
    priority = engine_args.get(PRIORITY_ARG, SGLANG_DEFAULTS[PRIORITY_ARG])
    if priority and policy is not None and policy not in PRIORITY_SCHEDULE_POLICIES:
        raise ValueError(f"schedule_policy {policy!r} cannot be used with priority scheduling, which takes "
                         f"{' or '.join(map(repr, PRIORITY_SCHEDULE_POLICIES))}; set {PRIORITY_ARG}: false "
                         f"as well to use it (requests are then no longer ordered by their tier's priority)")
    if not priority and engine_args.get(ABORT_ON_PRIORITY_ARG, False):
        raise ValueError(f"{ABORT_ON_PRIORITY_ARG}: true with {PRIORITY_ARG}: false would make SGLang abort every "
                         f"request, since each one carries its tier's priority; leave {ABORT_ON_PRIORITY_ARG} off")
    if not priority and engine_args.get(RETRACTION_ARG) == "priority":
        raise ValueError(f"{RETRACTION_ARG}: priority needs {PRIORITY_ARG} (SGLang refuses to start without it)")
    if priority and engine_args.get(LOW_PRIORITY_FIRST_ARG, False):
        raise ValueError(f"{LOW_PRIORITY_FIRST_ARG}: true would serve the tier's spillover requests (priority 1) "
                         f"after its own (0): megaserve's priorities are larger first")
    if engine_args.get(SPECULATIVE_ARG) is not None:
        raise ValueError(f"{SPECULATIVE_ARG} is not supported: speculative decoding reserves draft-token slots of "
                         f"every request's context that megaserve's context arithmetic does not count, so SGLang "
                         f"would refuse requests that fill the context")


def engine_launch_args(
    model_dir: str | Path,
    *,
    tp_size: int,
    context_length: int,
    dtype: str = "auto",
    max_running_requests: int | None = None,
    enable_metrics: bool = True,
    mem_fraction_static: float | None = None,
    engine_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine`: our defaults, then the caller's `engine_args`, then the
    settings the engine owns. None leaves a setting to SGLang."""
    engine_args = dict(engine_args or {})
    owned = sorted(set(OWNED_ARGS) & set(engine_args))
    if owned:
        raise ValueError(f"engine_args must not set {owned}: the engine sets them from its own arguments")
    check_engine_args(engine_args)
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    settings = {
        "model_path": str(model_dir), "tp_size": tp_size, "context_length": context_length,
        "dtype": dtype, "max_running_requests": max_running_requests, "enable_metrics": enable_metrics,
        "mem_fraction_static": mem_fraction_static, "skip_tokenizer_init": True,
    }
    return {**SGLANG_DEFAULTS, **engine_args, **{k: v for k, v in settings.items() if v is not None}}


def model_limits(hf_config: Mapping[str, Any], max_seq: int | None) -> tuple[int, int]:
    """(vocab_size, context served) of a model from its Hugging Face config.json contents: the
    tier's `max_seq`, capped by the model's positions, as on every tier."""
    for key in ("vocab_size", "max_position_embeddings"):
        if key not in hf_config:
            raise ValueError(f"config.json lacks {key!r}")
    positions = int(hf_config["max_position_embeddings"])
    return int(hf_config["vocab_size"]), context_limit(max_seq, positions)


@dataclass
class OutputReader:
    """Turns the dicts of one SGLang stream into Chunks of new tokens (with their logprobs where
    `logprobs` is set), ending at the first of `stop_ids` (the stop ids SGLang does not check,
    `own_stop_ids`)."""

    incremental: bool  # SGLang started with incremental_streaming_output
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # the request's SamplingParams.logprobs
    delivered: int = 0  # output ids handed on so far

    def read(self, output: Mapping[str, Any], seconds: float, wall_time: float | None = None) -> Chunk:
        """`seconds`: time since the previous dict (or since submission), split over its tokens;
        `wall_time`: time.time() at its arrival, for the first dict's prefill stamps (step_times)."""
        output_ids = output["output_ids"]
        start = 0 if self.incremental else self.delivered  # where the new ids' logprobs start in meta_info
        if self.incremental:
            # meta_info["completion_tokens"] counts every output id so far: only those past
            # `delivered` are new. A request that SGLang itself aborts outside the output stream
            # (its _handle_abort_req) ends with the last id it already streamed, repeated, and
            # when SGLang coalesces chunks that waited, the repeat comes after their new ids.
            total = output["meta_info"].get("completion_tokens")
            fresh = len(output_ids) if total is None else min(max(total - self.delivered, 0), len(output_ids))
            new = list(output_ids[:fresh])
        else:
            new = list(output_ids[self.delivered:])
        first = self.delivered == 0
        self.delivered += len(new)
        reason, error = finish_of(output["meta_info"].get("finish_reason"))
        if error == OUT_OF_VOCABULARY_ERROR:  # its last id is SGLang's stop id in place of the bad sample
            new = new[:-1]
        steps = step_times(len(new), seconds, output["meta_info"] if first else {}, wall_time)
        logprobs = [] if self.logprobs is None else self.logprobs_of(output["meta_info"], start, new)
        stop = next((i for i, token in enumerate(new) if token in self.stop_ids), None)
        if stop is not None:  # it came before whatever SGLang reports with it (length, abort): STOP, as on TorchEngine
            new, steps, reason, error = new[:stop + 1], steps[:stop + 1], FinishReason.STOP, None
            logprobs = logprobs[:stop + 1]
        return Chunk(new, steps, reason, error, logprobs)

    def logprobs_of(self, meta_info: Mapping[str, Any], start: int, new: Sequence[int]) -> list[TokenLogprob]:
        """The TokenLogprobs of `new`, the ids at `start` of meta_info's logprob lists; a RuntimeError
        where SGLang's lists lack some or name other ids: a misaligned logprob would go unseen."""
        end = start + len(new)  # slices, not copies: in the cumulative mode the lists hold every id so far
        tokens = (meta_info.get(TOKEN_LOGPROBS_KEY) or ())[start:end]
        tops = (meta_info.get(TOP_LOGPROBS_KEY) or ())[start:end] if self.logprobs else [()] * len(new)
        if len(tokens) < len(new) or len(tops) < len(new):
            raise RuntimeError(f"SGLang sent logprobs for {len(tokens)} (top logprobs for {len(tops)}) of "
                               f"{len(new)} new output ids")
        found = []
        for token, (logprob, token_id, *_), row in zip(new, tokens, tops):
            top = tuple((int(top_id), float(top_logprob)) for top_logprob, top_id, *_ in row or ())
            if token_id != token:
                raise RuntimeError(f"SGLang sent the logprob of id {token_id} for output id {token}")
            if len(top) != self.logprobs:
                raise RuntimeError(f"SGLang sent {len(top)} top logprobs of output id {token}, not {self.logprobs}")
            found.append(TokenLogprob(float(logprob), top))
        return found


def step_times(tokens: int, seconds: float, meta_info: Mapping[str, Any], wall_time: float | None) -> list[float]:
    """Each of a dict's `tokens` tokens' step duration: `seconds` split evenly, or, where
    `meta_info` has SGLang's prefill stamps (the first dict of a request, with enable_metrics),
    the prefill's duration for the first token and the time since the prefill for the others."""
    if tokens == 0:
        return []
    entered, prefilled = meta_info.get("forward_entry_time"), meta_info.get("prefill_finished_time")
    if wall_time is None or entered is None or prefilled is None or not entered <= prefilled <= wall_time:
        return [seconds / tokens] * tokens
    decode = (wall_time - prefilled) / (tokens - 1) if tokens > 1 else 0.0
    return [prefilled - entered] + [decode] * (tokens - 1)


def finish_of(reason: Mapping[str, Any] | None) -> tuple[FinishReason | None, str | None]:
    """Our finish reason and error for SGLang's meta_info["finish_reason"]."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind not in FINISH_TYPES:
        return FinishReason.ABORT, f"SGLang finished with an unknown reason {dict(reason)!r}"
    if kind == "stop" and reason.get("matched") == NAN_MATCHED:
        return FinishReason.ABORT, OUT_OF_VOCABULARY_ERROR
    return FINISH_TYPES[kind], reason.get("message") if kind == "abort" else None


def _sglang_engine_class() -> Callable[..., Any]:
    # SGLang imports transformers, which imports the `kernels` distribution: not megaserve's kernels/
    # folder, which a replica started from a checkout has first on sys.path (source_tree.py).
    import_installed_namesakes()
    try:
        import sglang
    except ImportError as exc:
        raise RuntimeError(f"the sglang engine needs SGLang: {INSTALL_HINT}") from exc
    return sglang.Engine


class SGLangEngine(Engine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        tp_size: int = 1,
        max_seq: int | None = None,
        max_batch: int | None = None,
        dtype: str = "auto",
        enable_metrics: bool = True,
        mem_fraction_static: float | None = None,
        engine_args: Mapping[str, Any] | None = None,
        coalesce: CoalescePolicy = CoalescePolicy(),
        tier: Tier | str = Tier.THROUGHPUT,
        model_name: str | None = None,
        health_timeout_seconds: float = HEALTH_TIMEOUT_SECONDS,
        launch: Callable[..., Any] | None = None,
    ) -> None:
        """`max_seq` (capped by the model) becomes SGLang's context_length, `max_batch` its
        max_running_requests, `mem_fraction_static` (None: SGLang's own sizing) the share of each
        GPU's memory SGLang takes for weights and its KV pool, which must hold the whole context (a
        ValueError says so otherwise); `engine_args` are further `ServerArgs` fields. `launch`
        starts SGLang from the launch arguments: `sglang.Engine` unless given (tests pass a
        stand-in)."""
        launch = launch or _sglang_engine_class()
        hf_config = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
        self.vocab_size, self.max_context = model_limits(hf_config, max_seq)
        self.eos_ids = hf_eos_token_ids(model_dir)
        os.environ[LONGER_CONTEXT_ENV] = "1"  # the context is the engine's (module doc)
        os.environ[RAW_LOGPROBS_ENV] = "1"  # logprobs of the raw logits, as on every tier (module doc)
        self.model_name = model_name or Path(model_dir).name
        self.coalesce = coalesce
        self.health_timeout_seconds = health_timeout_seconds
        self.metrics = EngineMetrics(Tier(tier).value, self.model_name)
        self.launch_args = engine_launch_args(
            model_dir, tp_size=tp_size, context_length=self.max_context + CONTEXT_MARGIN, dtype=dtype,
            max_running_requests=max_batch, enable_metrics=enable_metrics,
            mem_fraction_static=mem_fraction_static, engine_args=engine_args,
        )
        self._incremental = bool(self.launch_args.get(INCREMENTAL_ARG, False))
        self._runtime = launch(**self.launch_args)
        # With the whole context in the KV pool, SGLang's limit is max_context (the module doc's
        # arithmetic); a pool that holds less lowers it.
        served = self._runtime.tokenizer_manager.max_req_input_len
        if served < self.max_context:
            self._runtime.shutdown()  # its processes have started and hold the GPUs
            fraction = self.launch_args.get("mem_fraction_static", "unset: SGLang's own sizing")
            raise ValueError(
                f"SGLang's KV cache holds too few tokens for the context of {self.max_context}: the longest "
                f"request SGLang serves is {served} tokens (its max_req_input_len). Raise mem_fraction_static "
                f"(throughput.sglang_mem_fraction_static; now {fraction}), or lower max_seq "
                f"(throughput.max_seq_len, and model.max_context where it is set) to {served} or less"
            )
        self._active: dict[str, tuple[TokenStream, asyncio.Task]] = {}  # rid -> its stream and pump
        self._probes: set[asyncio.Event] = set()  # set by every SGLang output: liveness for health
        self._closed = False

    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Validate now (EngineError at the call, EngineDeadError after shutdown), submit to SGLang
        when iteration starts."""
        if self._closed:
            raise EngineDeadError(ENGINE_SHUT_DOWN)
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
        reader = OutputReader(self._incremental, own_stop_ids(request.sampling), request.sampling.logprobs)
        last = time.perf_counter()
        try:
            outputs = await self._runtime.async_generate(**generate_kwargs(
                request.prompt_token_ids, sglang_sampling_params(request.sampling, self.vocab_size, self.eos_ids),
                rid, request.priority, request.sampling.logprobs))
            async for output in outputs:
                for probe in self._probes:
                    probe.set()
                now = time.perf_counter()
                first = reader.delivered == 0
                chunk = reader.read(output, now - last, time.time())
                last = now
                for seconds in chunk.step_seconds:
                    (self.metrics.prefill_step if first else self.metrics.decode_step)(seconds)
                    first = False
                stream.put(chunk)
                if chunk.finish_reason is not None:
                    if output["meta_info"].get("finish_reason") is None:  # a stop id SGLang skips: it would run on
                        self._runtime.tokenizer_manager.abort_request(rid=rid)
                    return
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error="SGLang ended the stream without a finish reason"))
        except Exception as exc:  # SGLang refused or failed the request, or the reader its output: the client gets why
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error=f"SGLang failed: {type(exc).__name__}: {exc}"))
            # Where the reader refused its output, SGLang would run it on; it ignores a rid it no longer has.
            with contextlib.suppress(Exception):
                self._runtime.tokenizer_manager.abort_request(rid=rid)
        finally:
            self._active.pop(rid, None)
            self.metrics.request_ended()

    def _abort(self, rid: str) -> None:
        """The consumer left: stop the pump and have SGLang drop the request at its next step."""
        entry = self._active.pop(rid, None)
        if entry is not None:
            entry[1].cancel()
            self._runtime.tokenizer_manager.abort_request(rid=rid)

    async def health(self) -> EngineHealth:
        problem = ENGINE_SHUT_DOWN if self._closed else await self._probe()
        return EngineHealth(healthy=not problem, detail=problem, running_requests=len(self._active))

    async def _probe(self) -> str:
        """'' when SGLang answers a one-token generation, or outputs anything to another request,
        within the health timeout; otherwise what went wrong."""
        rid = f"{HEALTH_RID_PREFIX}-{uuid.uuid4().hex}"
        try:
            outputs = await self._runtime.async_generate(**generate_kwargs(HEALTH_PROMPT, HEALTH_SAMPLING, rid, 0))
        except Exception as exc:
            return f"SGLang refused the health generation: {type(exc).__name__}: {exc}"
        progress = asyncio.Event()
        self._probes.add(progress)
        answer = asyncio.ensure_future(anext(outputs))
        other_output = asyncio.ensure_future(progress.wait())
        try:
            await asyncio.wait({answer, other_output}, timeout=self.health_timeout_seconds,
                               return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                reason, error = finish_of(answer.result()["meta_info"].get("finish_reason"))
                return f"SGLang aborted the health generation: {error}" if reason is FinishReason.ABORT else ""
            if other_output.done():
                return ""  # the probe waits in SGLang's queue, but other requests get tokens
            return f"SGLang produced no output for {self.health_timeout_seconds:g} s"
        except Exception as exc:
            return f"SGLang failed the health generation: {type(exc).__name__}: {exc}"
        finally:
            self._probes.discard(progress)
            for waiter in (answer, other_output):
                waiter.cancel()
            await asyncio.gather(answer, other_output, return_exceptions=True)
            await outputs.aclose()
            # As SGLang's /health_generate does: its abort of a health rid keeps the rid's state,
            # which a probe that a busy scheduler skipped would otherwise leave behind.
            self._runtime.tokenizer_manager.rid_to_state.pop(rid, None)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        active = list(self._active.items())
        for rid, (stream, pump) in active:
            pump.cancel()
            self._runtime.tokenizer_manager.abort_request(rid=rid)
            stream.put(Chunk(finish_reason=FinishReason.ABORT, error="the engine is shutting down"))
        await asyncio.gather(*(pump for _, (_, pump) in active), return_exceptions=True)
        await asyncio.to_thread(self._runtime.shutdown)
