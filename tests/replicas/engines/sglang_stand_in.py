"""An in-process stand-in for `sglang.Engine`, for testing SGLangEngine where SGLang cannot run
(it needs CUDA and its own CUDA build of torch).

It has exactly the members SGLangEngine uses, with the parameter names that test_sglang_api.py
checks against the pinned SGLang's source, and streams as SGLang's TokenizerManager does with
`skip_tokenizer_init`: one dict per decode step holding every output id so far (only the new ones
with `incremental_streaming_output`) and meta_info["completion_tokens"], their count, the last one
with meta_info["finish_reason"] set to {"type": "stop" | "length" | "abort", ...}. A request it
aborts ends as SGLang's `_handle_abort_req` ends one: with every id so far, or with incremental
streaming the last one again (test_sglang_api.py checks that against the source). With
`enable_metrics` its meta_info carries SGLang's wall-clock "forward_entry_time" and
"prefill_finished_time" once they have happened; `queue_seconds` is a wait in its queue before the
first forward. `queue_full` refuses new requests as SGLang's scheduler does past its
`max_queued_requests`: with an abort that its tokenizer manager drops for a health probe, which so
hears nothing (test_sglang_api.py checks both against the source). It refuses a context_length past the model's positions unless SGLang's
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set, applies SGLang's length limits to the launch's
context_length and its KV pool (`max_req_len`, the smaller of context_length and `kv_tokens`, less
one: at most max_req_len - prompt - 1 new tokens, prompts of max_req_len - 5 tokens or more aborted;
max_req_len - 5 is the tokenizer manager's max_req_input_len, as SGLang's), and keeps each
request's entry in the tokenizer manager's `rid_to_state` until it ends, except a health probe's
that it aborts (SGLang's `_handle_abort_req` returns early for those). Its "model" continues a
prompt ending in t with t+1, t+2, ... and has no EOS; it stops on a stop id by SGLang's rule
(`stops_on`). Asked for logprobs (`return_logprob`), its meta_info carries SGLang's
"output_token_logprobs", a (logprob, id, None) per output id, and with `top_logprobs_num` k > 0
"output_top_logprobs", k of them per output id (`stand_in_logprob`), for the same ids as its
output ids but in the abort that repeats the last one, which carries them for every id so far
(test_sglang_api.py checks SGLang's own meta_info against the engine's reader).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from megaserve.replicas.engines.sglang_engine import LONGER_CONTEXT_ENV  # SGLang's name (test_sglang_api.py)

STEP_SECONDS = 0.001
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's (test_sglang_api.py checks the engine's)
QUEUE_FULL_MESSAGE = "The request queue is full."  # SGLang's (test_sglang_api.py)


def stand_in_logprob(token: int, k: int) -> tuple[tuple[float, int, None], list[tuple[float, int, None]]]:
    """The stand-in model's (logprob, id, None) of a token it outputs, and the k most likely at its
    step (the token itself first, then made-up ids), as SGLang's meta_info lists them."""
    logprob = -1.0 / token
    return (logprob, token, None), [(logprob - j, token + 1000 * j, None) for j in range(k)]


def stops_on(params: dict[str, Any], token: int) -> bool:
    """SGLang's `Req._check_token_based_finish` for a model without EOS: a stop id ends the request
    unless `ignore_eos` is set, which makes SGLang skip the stop ids as well as EOS.
    test_sglang_api.py runs SGLang's own check against this one."""
    return not params.get("ignore_eos", False) and token in (params.get("stop_token_ids") or ())


class StandInTokenizerManager:
    def __init__(self, max_req_input_len: int) -> None:
        self.max_req_input_len = max_req_input_len  # set by SGLang's Engine from its scheduler's info
        self.aborted: list[str] = []
        self.rid_to_state: dict[str, dict[str, Any]] = {}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)


class StandInSGLang:
    """`StandInSGLang(**launch_args)` in place of `sglang.Engine(**launch_args)`."""

    kv_tokens = 1 << 20  # its KV pool: tokens of every request at once (SGLang sizes it from memory)

    def __init__(self, **launch_args: Any) -> None:
        positions = json.loads((Path(launch_args["model_path"]) / "config.json").read_text())["max_position_embeddings"]
        if launch_args["context_length"] > positions and os.environ.get(LONGER_CONTEXT_ENV) != "1":
            raise ValueError(f"context_length ({launch_args['context_length']}) is greater than the derived "
                             f"context_length ({positions}); set {LONGER_CONTEXT_ENV}=1")  # as SGLang's ModelConfig
        self.launch_args = launch_args
        self.max_req_len = min(launch_args["context_length"], self.kv_tokens) - 1  # SGLang's TpModelWorker
        self.tokenizer_manager = StandInTokenizerManager(self.max_req_len - 5)
        self.requests: list[dict[str, Any]] = []  # the keyword arguments of every async_generate
        self.stalled = False  # new requests get no output at all (a hung scheduler)
        self.failure: Exception | None = None  # new requests fail with this
        self.queue_full = False  # new requests are refused for a full waiting queue
        self.shut_down = False
        self.queue_seconds = 0.0  # new requests wait this long in the queue before their prefill

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
                             priority: int, stream: bool, return_logprob: bool = False,
                             top_logprobs_num: int | None = None,
                             logprob_start_len: int | None = None) -> AsyncIterator[dict[str, Any]]:
        if not stream:
            raise ValueError("the stand-in streams only")
        if logprob_start_len not in (None, -1):
            raise ValueError("the stand-in has no prompt logprobs")
        self.requests.append({"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                              "priority": priority, "stream": stream, "return_logprob": return_logprob,
                              "top_logprobs_num": top_logprobs_num, "logprob_start_len": logprob_start_len})
        self.tokenizer_manager.rid_to_state[rid] = {}
        top = (top_logprobs_num or 0) if return_logprob else None
        return self._outputs(input_ids, sampling_params, rid, self.stalled, self.failure, self.queue_seconds,
                             self.queue_full, top)

    async def _outputs(self, prompt: list[int], params: dict[str, Any], rid: str, stalled: bool,
                       failure: Exception | None, queue_seconds: float, queue_full: bool,
                       top: int | None) -> AsyncIterator[dict[str, Any]]:
        """`top`: None without logprobs, else top_logprobs_num."""
        states = self.tokenizer_manager.rid_to_state
        try:
            async for output in self._steps(prompt, params, rid, stalled, failure, queue_seconds, queue_full, top):
                if output["meta_info"]["finish_reason"] is not None:
                    states.pop(rid, None)  # a request that ends, health probes too
                yield output
        finally:  # one aborted or closed early: SGLang's abort keeps a health probe's entry
            if not rid.startswith(HEALTH_CHECK_RID_PREFIX):
                states.pop(rid, None)

    async def _steps(self, prompt: list[int], params: dict[str, Any], rid: str, stalled: bool,
                     failure: Exception | None, queue_seconds: float, queue_full: bool,
                     top: int | None) -> AsyncIterator[dict[str, Any]]:
        if failure is not None:
            raise failure
        health_probe = rid.startswith(HEALTH_CHECK_RID_PREFIX)
        if stalled or (queue_full and health_probe):
            await asyncio.Event().wait()
        if queue_full:
            refusal = {"type": "abort", "message": QUEUE_FULL_MESSAGE, "status_code": HTTPStatus.SERVICE_UNAVAILABLE}
            yield {"output_ids": [], "meta_info": {"finish_reason": refusal, "completion_tokens": 0}}
            return
        incremental = self.launch_args.get("incremental_streaming_output", False)

        def logprobs(ids: list[int]) -> dict[str, Any]:  # SGLang's logprob meta_info for these output ids
            if top is None:
                return {}
            rows = [stand_in_logprob(token, top) for token in ids]
            return {"output_token_logprobs": [row[0] for row in rows]} | (
                {"output_top_logprobs": [row[1] for row in rows]} if top else {})

        max_req_len = self.max_req_len
        if len(prompt) >= max_req_len - 5:
            message = f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length ({max_req_len - 5})"
            yield {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": message},
                                                   "completion_tokens": 0, **logprobs([])}}
            return
        max_new_tokens = min(params["max_new_tokens"], max_req_len - len(prompt) - 1)
        await asyncio.sleep(queue_seconds)
        entered = time.time()
        prefilled: float | None = None
        output_ids: list[int] = []
        while True:
            await asyncio.sleep(STEP_SECONDS)
            prefilled = prefilled or time.time()
            stamps = ({"forward_entry_time": entered, "prefill_finished_time": prefilled}
                      if self.launch_args.get("enable_metrics", False) else {})  # SGLang's time stats
            if rid in self.tokenizer_manager.aborted:
                yield {"output_ids": output_ids[-1:] if incremental else list(output_ids),
                       "meta_info": {"finish_reason": {"type": "abort", "message": "aborted"},
                                     "completion_tokens": len(output_ids), **stamps,
                                     **logprobs(output_ids)}}  # every id so far, as SGLang's abort
                return
            token = prompt[-1] + len(output_ids) + 1
            output_ids.append(token)
            reason = None
            if stops_on(params, token):
                reason = {"type": "stop", "matched": token}
            elif len(output_ids) == max_new_tokens:
                reason = {"type": "length", "length": len(output_ids)}
            yield {"output_ids": [token] if incremental else list(output_ids),
                   "meta_info": {"finish_reason": reason, "completion_tokens": len(output_ids), **stamps,
                                 **logprobs([token] if incremental else output_ids)}}
            if reason is not None:
                return

    def shutdown(self) -> None:
        self.shut_down = True
