"""Every SGLang name SGLangEngine (and its test stand-in) relies on, checked against the source of
the pinned SGLang release, so that an SGLang API change fails here rather than on a GPU node.

The wheel is read, never imported or installed (see sglang_source.py); .ci/run downloads it. A
missing wheel fails these tests: they never skip.
"""

from __future__ import annotations

import __future__
import ast
import inspect
import logging
import os
import sys
import tempfile
import typing
from http import HTTPStatus
from types import SimpleNamespace

import pytest

from megaserve.deploy.config import ModelSpec
from megaserve.replicas.engines.sglang_engine import (
    ABORT_ON_PRIORITY_ARG,
    CONTEXT_MARGIN,
    FINISH_TYPES,
    HEALTH_RID_PREFIX,
    HEALTH_SAMPLING,
    INCREMENTAL_ARG,
    LONGER_CONTEXT_ENV,
    LOGPROB_START_ARG,
    LOW_PRIORITY_FIRST_ARG,
    NAN_MATCHED,
    OUTPUT_ONLY_LOGPROBS,
    PLACEMENT_ARGS,
    PRIORITY_ARG,
    PRIORITY_SCHEDULE_POLICIES,
    RAW_LOGPROBS_ENV,
    RETRACTION_ARG,
    RETURN_LOGPROB_ARG,
    SPECULATIVE_ARG,
    TOKEN_LOGPROBS_KEY,
    TOP_K_DISABLED,
    TOP_LOGPROBS_ARG,
    TOP_LOGPROBS_KEY,
    OutputReader,
    check_engine_args,
    engine_launch_args,
    generate_kwargs,
    sglang_sampling_params,
)
from megaserve.replicas.protocol import SEED_MAX, SEED_MIN, FinishReason, SamplingParams, TokenLogprob
from tests.replicas.engines.sglang_stand_in import (
    QUEUE_FULL_MESSAGE,
    StandInSGLang,
    StandInTokenizerManager,
    stops_on,
)
from tests.replicas.engines.sglang_source import SGLangSource, keyword_value, pinned_version, type_names, wheel_path

ENGINE = "sglang.srt.entrypoints.engine"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"
SAMPLING = "sglang.srt.sampling.sampling_params"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
SAMPLING_BATCH = "sglang.srt.sampling.sampling_batch_info"
SCHEDULER = "sglang.srt.managers.scheduler"
# ServerArgs fields the docs tell operators to put in throughput.sglang_args.
DOCUMENTED_ARGS = ("enable_deterministic_inference", "chunked_prefill_size",
                   "enable_priority_scheduling")
# The annotation type names that accept a value of each Python type.
ACCEPTING = {bool: {"bool"}, int: {"int", "float"}, float: {"float"}, str: {"str"},
             list: {"List", "list", "Set", "set"}}


@pytest.fixture(scope="module")
def sglang() -> SGLangSource:
    return SGLangSource(wheel_path())


def _every_launch_arg() -> dict[str, object]:
    return engine_launch_args("/models/m", tp_size=4, context_length=8192, dtype="bfloat16",
                              max_running_requests=64, enable_metrics=True, mem_fraction_static=0.85,
                              engine_args={INCREMENTAL_ARG: True})


def _every_sampling_param() -> dict[str, object]:
    return sglang_sampling_params(SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, top_k=5, seed=1,
                                                 stop_token_ids=(2,)), vocab_size=32)


def _assert_accepted(values: dict[str, object], fields: dict[str, ast.expr], where: str) -> None:
    missing = sorted(set(values) - set(fields))
    assert not missing, f"{where} has no {missing}"
    for name, value in values.items():
        accepted = type_names(fields[name])
        assert ACCEPTING[type(value)] & accepted, f"{where}.{name} is {accepted}, we pass {value!r}"


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    return [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]


def test_the_wheel_is_the_pinned_release(sglang):
    metadata = sglang.text(f"sglang-{pinned_version()}.dist-info/METADATA")
    assert f"\nVersion: {pinned_version()}\n" in metadata


def test_every_launch_arg_is_a_server_args_field_of_a_compatible_type(sglang):
    _assert_accepted(_every_launch_arg(), sglang.server_args_fields(), "ServerArgs")


def test_documented_sglang_args_are_server_args_fields(sglang):
    assert set(DOCUMENTED_ARGS) <= set(sglang.server_args_fields())


def test_priority_scheduling_serves_larger_values_first_by_default(sglang):
    fields = {node.target.id: node for node in ast.walk(sglang.module("sglang.srt.arg_groups.fields.schedule"))
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert ast.literal_eval(fields["schedule_low_priority_values_first"].value) is False


def test_priority_scheduling_takes_exactly_the_schedule_policies_we_let_through(sglang):
    # check_server_args: `if cfg.enable_priority_scheduling: assert cfg.schedule_policy in [...]`
    hook = sglang.module("sglang.srt.arg_groups.validation_hook")
    branches = [node for node in ast.walk(hook) if isinstance(node, ast.If)
                and isinstance(node.test, ast.Attribute) and node.test.attr == PRIORITY_ARG]
    policies = [ast.literal_eval(node.test.comparators[0]) for branch in branches for statement in branch.body
                for node in ast.walk(statement) if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Attribute) and node.test.left.attr == "schedule_policy"]
    assert policies == [list(PRIORITY_SCHEDULE_POLICIES)]


@pytest.mark.parametrize("priority_scheduling", [False, True])
@pytest.mark.parametrize("abort_on_priority", [False, True])
def test_check_engine_args_refuses_exactly_the_priority_settings_that_make_sglang_abort_our_requests(
        sglang, priority_scheduling, abort_on_priority):
    """generate_kwargs sends every request with a priority: run SGLang's own
    Scheduler._set_or_validate_priority on one, with the scheduler's settings from those ServerArgs fields."""
    assert {PRIORITY_ARG, ABORT_ON_PRIORITY_ARG} <= set(sglang.server_args_fields())
    scheduler = sglang.cls(SCHEDULER, "Scheduler")
    init = ast.unparse(sglang.method(scheduler, "__init__"))
    for name in (PRIORITY_ARG, ABORT_ON_PRIORITY_ARG):
        assert f"self.{name} = get_schedule().{name}" in init
    function = sglang.method(scheduler, "_set_or_validate_priority")
    namespace = {"_make_abort_req": lambda req, finished_reason: SimpleNamespace(finished_reason=finished_reason),
                 "HTTPStatus": HTTPStatus, "sys": sys}
    exec(compile(ast.Module([function], type_ignores=[]), "sglang/srt/managers/scheduler.py", "exec"), namespace)
    aborts: list[SimpleNamespace] = []
    settings = {PRIORITY_ARG: priority_scheduling, ABORT_ON_PRIORITY_ARG: abort_on_priority}
    state = SimpleNamespace(**settings, schedule_low_priority_values_first=False,
                            send_abort_output=lambda abort_req, req: aborts.append(abort_req))
    request = SimpleNamespace(priority=generate_kwargs((1,), {}, "rid", 0)["priority"],
                              time_stats=SimpleNamespace(trace_ctx=SimpleNamespace(abort=lambda abort_info: None)))
    admitted = namespace["_set_or_validate_priority"](state, request)
    assert admitted is not bool(aborts)
    try:
        check_engine_args(settings)
    except ValueError:
        refused = True
    else:
        refused = False
    assert refused is not admitted, settings


def test_the_other_args_check_engine_args_refuses_are_server_args_as_it_reads_them(sglang):
    fields = sglang.server_args_fields()
    assert {LOW_PRIORITY_FIRST_ARG, RETRACTION_ARG, SPECULATIVE_ARG} <= set(fields)
    assert "None" in type_names(fields[SPECULATIVE_ARG])  # unset: no speculative decoding
    # SGLang's own start-up refusal that check_engine_args brings forward to the config's validation
    hook = sglang.text("sglang/srt/arg_groups/validation_hook.py")
    assert f'cfg.{RETRACTION_ARG} == "priority" and not cfg.{PRIORITY_ARG}' in hook
    # Speculative decoding's reserve, which CONTEXT_MARGIN does not count, is the tokenizer's check
    assert "input_token_num += self.num_reserved_tokens" in sglang.text("sglang/srt/managers/tokenizer_manager.py")


def test_an_out_of_vocabulary_sample_is_the_stop_that_finish_of_reads_as_a_failure(sglang):
    check = ast.unparse(sglang.method(sglang.cls(SCHEDULE_BATCH, "Req"), "_check_vocab_boundary_finish"))
    assert f"FINISH_MATCHED_STR(matched={NAN_MATCHED!r})" in check


def test_the_placement_args_refused_are_server_args_and_cover_sglang_s_world_size(sglang):
    assert set(PLACEMENT_ARGS) <= set(sglang.server_args_fields())
    world_size = sglang.function("sglang.srt.server_args", "compute_world_size")
    # Every factor of the GPUs SGLang takes but tp_size, which the replica's placement holds.
    assert set(_parameters(world_size)) - {"tp_size"} <= set(PLACEMENT_ARGS)


def test_every_model_dtype_is_an_sglang_dtype(sglang):
    dtypes = typing.get_args(ModelSpec.model_fields["dtype"].annotation)
    assert set(dtypes) <= set(keyword_value(sglang.server_args_fields()["dtype"], "choices"))


def test_engine_takes_server_args_as_keywords_and_has_a_tokenizer_manager(sglang):
    engine = sglang.cls(ENGINE, "Engine")
    init = sglang.method(engine, "__init__")
    assert init.args.kwarg is not None and init.args.kwarg.arg == "kwargs"
    assigned = {node.attr for node in ast.walk(init) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}
    assert "tokenizer_manager" in assigned


def test_async_generate_takes_our_keywords_and_the_stand_in_no_others(sglang):
    real = sglang.method(sglang.cls(ENGINE, "Engine"), "async_generate")
    assert isinstance(real, ast.AsyncFunctionDef)
    ours = set(generate_kwargs((1,), {}, "rid", 0, logprobs=2))  # every keyword: a request with logprobs
    assert ours <= set(_parameters(real))
    stand_in = set(inspect.signature(StandInSGLang.async_generate).parameters) - {"self"}
    assert stand_in == ours


@pytest.mark.parametrize(("module", "cls", "method", "stand_in"), [
    (TOKENIZER_MANAGER, "TokenizerManager", "abort_request", StandInTokenizerManager.abort_request),
    (ENGINE, "Engine", "shutdown", StandInSGLang.shutdown),
])
def test_abort_and_shutdown_have_the_stand_in_s_parameters(sglang, module, cls, method, stand_in):
    real = sglang.method(sglang.cls(module, cls), method)
    assert isinstance(real, ast.FunctionDef)  # called without await
    assert _parameters(real) == list(inspect.signature(stand_in).parameters)


def test_every_sampling_param_is_an_sglang_sampling_param(sglang):
    fields = sglang.fields(sglang.cls(SAMPLING, "SamplingParams"))
    _assert_accepted(_every_sampling_param(), fields, "SamplingParams")
    _assert_accepted(HEALTH_SAMPLING, fields, "SamplingParams")


def test_minus_one_disables_top_k(sglang):
    post_init = sglang.method(sglang.cls(SAMPLING, "SamplingParams"), "__post_init__")
    compared = [ast.literal_eval(node.comparators[0]) for node in ast.walk(post_init)
                if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq)
                and ast.unparse(node.left) == "self.top_k"]
    assert TOP_K_DISABLED in compared


def test_top_k_goes_into_an_int32_tensor_so_a_larger_one_is_sent_as_minus_one(sglang):
    """Why sglang_sampling_params sends a top_k of the vocabulary or more as -1 (TOP_K_ALL, 2**30)."""
    batch = sglang.method(sglang.cls(SAMPLING_BATCH, "SamplingBatchInfo"), "from_schedule_batch")
    assert "torch.tensor([r.sampling_params.top_k for r in reqs], dtype=torch.int32" in ast.unparse(batch)
    top_k_all = next(node.value for node in sglang.module(SAMPLING).body if isinstance(node, ast.Assign)
                     and ast.unparse(node.targets[0]) == "TOP_K_ALL")
    assert ast.unparse(top_k_all) == "1 << 30"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_stand_in_stops_on_stop_ids_as_sglang_does(sglang, ignore_eos):
    """Run SGLang's own Req._check_token_based_finish: under ignore_eos it skips the stop ids too."""
    function = sglang.method(sglang.cls(SCHEDULE_BATCH, "Req"), "_check_token_based_finish")
    namespace = {"FINISH_MATCHED_TOKEN": lambda matched: {"type": "stop", "matched": matched}}
    exec(compile(ast.Module([function], type_ignores=[]), "sglang/srt/managers/schedule_batch.py", "exec"), namespace)
    params = {"max_new_tokens": 9, "stop_token_ids": [13], "ignore_eos": ignore_eos}
    for token in (12, 13):
        req = SimpleNamespace(sampling_params=SimpleNamespace(**params), eos_token_ids=None, tokenizer=None,
                              output_ids=[11, token], finished_reason=None, finished_len=None)
        assert namespace["_check_token_based_finish"](req, [token]) == stops_on(params, token)
    assert stops_on(params, 13) is not ignore_eos


def test_every_finish_type_sglang_reports_is_one_of_ours(sglang):
    types = set()
    for cls in ast.walk(sglang.module(SCHEDULE_BATCH)):
        if isinstance(cls, ast.ClassDef) and any(ast.unparse(b) == "BaseFinishReason" for b in cls.bases):
            for node in ast.walk(sglang.method(cls, "to_json")):
                if isinstance(node, ast.Dict):
                    types |= {ast.literal_eval(v) for k, v in zip(node.keys, node.values)
                              if isinstance(k, ast.Constant) and k.value == "type"}
    assert types and types <= set(FINISH_TYPES)


def test_token_id_outputs_are_output_ids_with_meta_info_and_a_finish_reason(sglang):
    handle = sglang.method(sglang.cls(TOKENIZER_MANAGER, "TokenizerManager"), "_handle_batch_output")
    key_sets = [{k.value for k in node.keys if isinstance(k, ast.Constant)}
                for node in ast.walk(handle) if isinstance(node, ast.Dict)]
    assert {"output_ids", "meta_info"} in key_sets  # the skip_tokenizer_init branch: no "text"
    assert any("finish_reason" in keys for keys in key_sets)


def test_every_output_counts_its_ids_and_an_abort_outside_the_stream_repeats_the_last_one(sglang):
    """What OutputReader and the stand-in rely on: meta_info["completion_tokens"] in the stream's
    dicts, and _handle_abort_req's incremental output of the last id already streamed."""
    manager = sglang.cls(TOKENIZER_MANAGER, "TokenizerManager")
    handle = ast.unparse(sglang.method(manager, "_handle_batch_output"))
    assert "'completion_tokens': recv_obj.completion_tokens[i]" in handle
    abort = ast.unparse(sglang.method(manager, "_handle_abort_req"))
    assert "meta_info['completion_tokens'] = len(output_ids)" in abort
    assert "output_ids = [output_ids[-1]] if len(output_ids) > 0 else []" in abort


def test_with_metrics_every_output_carries_the_prefill_s_wall_clock_stamps(sglang):
    """What step_times reads: SGLang's scheduler time stats, converted to time.time()'s clock."""
    manager = ast.unparse(sglang.method(sglang.cls(TOKENIZER_MANAGER, "TokenizerManager"), "_handle_batch_output"))
    assert "if self.enable_metrics:" in manager and "convert_to_output_meta_info()" in manager
    stats = sglang.cls("sglang.srt.observability.req_time_stats", "SchedulerReqTimeStats")
    convert = ast.unparse(sglang.method(stats, "convert_to_output_meta_info"))
    for key in ("forward_entry_time", "prefill_finished_time"):
        assert f"meta_data['{key}'] = convert_time_to_realtime(self.{key})" in convert


def test_health_probes_use_sglang_s_health_check_prefix(sglang):
    (prefix,) = [node.value for node in sglang.module("sglang.srt.constants").body if isinstance(node, ast.Assign)
                 and ast.unparse(node.targets[0]) == "HEALTH_CHECK_RID_PREFIX"]
    assert ast.literal_eval(prefix) == HEALTH_RID_PREFIX


def test_sglang_metrics_are_written_to_the_node_s_metrics_folder(sglang, tmp_path, monkeypatch):
    """With enable_metrics SGLang calls set_prometheus_multiproc_dir() before starting its
    processes; run SGLang's own function: a PROMETHEUS_MULTIPROC_DIR already set (the replica's
    node folder) must stay the folder its processes write to."""
    function = sglang.function("sglang.srt.utils.common", "set_prometheus_multiproc_dir")
    namespace = {"os": os, "tempfile": tempfile, "logger": logging.getLogger("sglang")}
    exec(compile(ast.Module([function], type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    namespace["set_prometheus_multiproc_dir"]()
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)


def test_sglang_s_length_limits_are_those_the_engine_leaves_room_for(sglang):
    """CONTEXT_MARGIN: SGLang's max_req_len is context_length - 1, a prompt of max_req_len - 5 tokens
    or more is refused and a request gets at most max_req_len - prompt - 1 new tokens, so with
    context_length = max_context + 6 every prompt < max_context fits, and prompt + max_tokens <=
    max_context runs to max_tokens; a context_length past the positions needs LONGER_CONTEXT_ENV."""
    worker = ast.unparse(sglang.method(sglang.cls("sglang.srt.managers.tp_worker", "TpModelWorker"),
                                       "get_worker_info"))
    assert "max_req_len = min(self.model_config.context_len - 1, kv_capacity - 1)" in worker
    assert "max_req_input_len = max_req_len - 5" in worker
    scheduler = sglang.cls("sglang.srt.managers.scheduler", "Scheduler")
    assert "self.max_req_len - input_len - 1" in ast.unparse(sglang.method(scheduler, "init_req_max_new_tokens"))
    check = ast.unparse(sglang.function("sglang.srt.managers.utils", "validate_input_length"))
    assert "if len(req.origin_input_ids) >= max_req_input_len:" in check
    max_context = 1000
    max_req_len = max_context + CONTEXT_MARGIN - 1
    assert max_context - 1 < max_req_len - 5  # the longest prompt the engine takes is not refused
    assert max_req_len - 1 >= max_context  # max_req_len - prompt - 1 new tokens >= max_context - prompt
    engine = sglang.text("sglang/srt/entrypoints/engine.py")  # what the engine reads back once started
    assert 'tokenizer_manager.max_req_input_len = scheduler_info["max_req_input_len"]' in engine
    model = sglang.cls("sglang.srt.configs.model_config", "ModelConfig")
    derive = ast.unparse(sglang.method(model, "_derive_context_length"))
    assert f"envs.{LONGER_CONTEXT_ENV}.get()" in derive and "self.context_len = context_length" in derive


def test_an_aborted_health_probe_keeps_its_state_and_sglang_s_own_probe_drops_it(sglang):
    """What SGLangEngine._probe's cleanup mirrors."""
    manager = sglang.cls(TOKENIZER_MANAGER, "TokenizerManager")
    first = sglang.method(manager, "_handle_abort_req").body[0]
    assert ast.unparse(first) == "if is_health_check_generate_req(recv_obj):\n    return"
    (probe,) = [node for node in ast.walk(sglang.module("sglang.srt.entrypoints.http_server"))
                if isinstance(node, ast.AsyncFunctionDef) and node.name == "health_generate"]
    assert "_global_state.tokenizer_manager.rid_to_state.pop(rid, None)" in ast.unparse(probe)


def test_a_request_past_the_queue_limit_is_refused_by_an_abort_that_a_health_probe_never_hears(sglang):
    """What the stand-in's queue_full does, and why SGLangEngine._probe need not tell such a refusal from
    a failure: the scheduler sends it (as the eviction by a higher priority) as an AbortReq, which the
    tokenizer manager hands to _handle_abort_req, whose first line returns for a health rid (the test above)."""
    scheduler = sglang.cls(SCHEDULER, "Scheduler")
    limit = ast.unparse(sglang.method(scheduler, "_abort_on_queued_limit"))
    assert f"message = {QUEUE_FULL_MESSAGE!r}" in limit
    assert "self.send_abort_output(_make_abort_req(req_to_abort, finished_reason=" in limit
    send = ast.unparse(sglang.method(scheduler, "send_abort_output"))
    assert "self.ipc_channels.send_to_tokenizer.send_output(abort_req, req)" in send
    manager = sglang.cls(TOKENIZER_MANAGER, "TokenizerManager")
    assert "(AbortReq, self._handle_abort_req)" in ast.unparse(sglang.method(manager, "init_request_dispatcher"))


def test_deterministic_sampling_seeds_unseeded_requests_with_one_constant_and_takes_int64_seeds(sglang):
    """Why the engine sends a random seed with every unseeded sampled request, and the seed range
    SamplingParams and the router enforce (SEED_MIN, SEED_MAX)."""
    batch = ast.unparse(sglang.cls("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo"))
    assert "r.sampling_params.sampling_seed if r.sampling_params.sampling_seed is not None else 42" in batch
    verify = ast.unparse(sglang.method(sglang.cls(SAMPLING, "SamplingParams"), "verify"))
    assert "if not -2 ** 63 <= self.sampling_seed <= 2 ** 63 - 1:" in verify
    assert (SEED_MIN, SEED_MAX) == (-2**63, 2**63 - 1)


def test_the_logprob_keywords_ask_for_the_output_s_logprobs_only(sglang):
    """generate_kwargs' logprob keywords are GenerateReqInput fields of compatible types, and
    logprob_start_len -1 makes SGLang's scheduler start the logprobs at the prompt's end: none of
    the prompt's are computed (the tokenizer manager's default for an unset one, too)."""
    asked = {name: value for name, value in generate_kwargs((1,), {}, "rid", 0, logprobs=3).items()
             if name in (RETURN_LOGPROB_ARG, TOP_LOGPROBS_ARG, LOGPROB_START_ARG)}
    assert asked == {RETURN_LOGPROB_ARG: True, TOP_LOGPROBS_ARG: 3, LOGPROB_START_ARG: OUTPUT_ONLY_LOGPROBS}
    _assert_accepted(asked, sglang.fields(sglang.cls("sglang.srt.managers.io_struct", "GenerateReqInput")),
                     "GenerateReqInput")
    handle = sglang.method(sglang.cls(SCHEDULER, "Scheduler"), "_handle_generate_request")
    (start,) = [node for node in ast.walk(handle) if isinstance(node, ast.If)
                and ast.unparse(node.test) == f"recv_req.{LOGPROB_START_ARG} == {OUTPUT_ONLY_LOGPROBS}"]
    asking = start.body[0]
    assert ast.unparse(asking.test) == f"recv_req.{RETURN_LOGPROB_ARG} and recv_req.token_ids_logprob is None"
    assert ast.unparse(asking.body) == f"req.{LOGPROB_START_ARG} = len(req.origin_input_ids)"


def test_sglang_s_logprobs_are_of_the_raw_logits_under_the_switch_the_engine_sets(sglang):
    """By default SGLang's sampler returns logprobs of logits / temperature; RAW_LOGPROBS_ENV ("1"
    is true) makes them the log-softmax of the logits before the temperature divides them."""
    assert f"{RAW_LOGPROBS_ENV} = EnvBool(False)" in sglang.text("sglang/srt/environ.py")
    sampler_module = sglang.module("sglang.srt.layers.sampler")
    switch = [ast.unparse(node) for node in sampler_module.body if isinstance(node, ast.Assign)
              and ast.unparse(node.targets[0]) == RAW_LOGPROBS_ENV]
    assert switch == [f"{RAW_LOGPROBS_ENV} = get_bool_env_var({RAW_LOGPROBS_ENV!r})"]
    truthy = ast.unparse(sglang.function("sglang.srt.utils.common", "get_bool_env_var"))
    assert "truthy_values = ('true', '1')" in truthy
    forward = _flat(sglang.method(sglang.cls("sglang.srt.layers.sampler", "Sampler"), "forward"))
    raw = forward.index(f"if return_logprob and {RAW_LOGPROBS_ENV} and (target_logprobs is None): "
                        f"original_logprobs = torch.log_softmax(logits, dim=-1)")
    scaled = forward.index("logits.div_(sampling_info.temperatures)")
    assert raw < scaled  # the raw ones are taken before the temperature divides the logits in place
    assert forward.index("torch.log(probs)") > scaled  # the default: of the temperature-scaled logits
    assert f"elif {RAW_LOGPROBS_ENV}: logprobs = original_logprobs" in forward


def _flat(node: ast.AST) -> str:
    """A node's source on one line, single-spaced: what a check reads, indentation aside."""
    return " ".join(ast.unparse(node).split())


def _tokenizer_manager_code(sglang: SGLangSource, incremental: bool) -> SimpleNamespace:
    """SGLang's TokenizerManager code that builds a stream's logprob meta_info, run on stand-ins for
    its state: the methods below, bound to an object with the settings they read."""
    manager = sglang.cls(TOKENIZER_MANAGER, "TokenizerManager")
    methods = ("convert_logprob_style", "add_logprob_to_meta_info", "detokenize_logprob_tokens",
               "detokenize_top_logprobs_tokens", "_coalesce_streaming_chunks", "_handle_abort_req")
    keys = [node for node in sglang.module(TOKENIZER_MANAGER).body if isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "_INCREMENTAL_STREAMING_META_INFO_KEYS"]
    code = ast.Module([*keys, sglang.function(TOKENIZER_MANAGER, "_slice_streaming_output_meta_info"),
                       *(sglang.method(manager, name) for name in methods)], type_ignores=[])
    namespace = {"logger": logging.getLogger("sglang"), "is_health_check_generate_req": lambda obj: False,
                 "get_serving": lambda: SimpleNamespace(skip_tokenizer_init=True)}
    exec(compile(code, "sglang/srt/managers/tokenizer_manager.py", "exec",  # its annotations stay strings
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    bound = type("TokenizerManager", (), {name: namespace[name] for name in methods})()
    bound.__dict__.update(skip_tokenizer_init=True, incremental_streaming_output=incremental, rid_to_state={},
                          config_value=lambda name: "default", _release_lora_once=lambda state: None)
    return SimpleNamespace(manager=bound, slice=namespace["_slice_streaming_output_meta_info"])


def _sglang_logprob(token: int, k: int) -> tuple[float, list[int], list[float]]:
    """A made-up model's logprob of `token` and its step's k most likely (ids, logprobs)."""
    return -token / 100, [token + j for j in range(k)], [-token / 100 - j for j in range(k)]


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_sglang_s_own_logprob_meta_info_reads_as_each_new_id_s_logprobs(sglang, incremental, k):
    """Outputs as SGLang's _handle_batch_output makes them (its logprob and slicing calls checked
    below, run for real), drained as _stream_one_response drains them (two that waited: the last
    one, or with incremental streaming both coalesced), ending with an abort of SGLang's own (whose
    logprobs cover every id so far in both modes): the reader gives every new id its logprob and k
    alternatives. The cumulative stream's abort comes before the last drain; an incremental one's
    after it, as SGLang cannot coalesce its abort with token-id outputs (KeyError: 'text')."""
    handle = ast.unparse(sglang.method(sglang.cls(TOKENIZER_MANAGER, "TokenizerManager"), "_handle_batch_output"))
    assert ("self.convert_logprob_style(meta_info, state, state.obj.top_logprobs_num, state.obj.token_ids_logprob, "
            "state.obj.return_text_in_logprobs and (not self.skip_tokenizer_init), recv_obj, i, "
            "finished=recv_obj.finished_reasons[i] is not None)") in handle
    assert ("_slice_streaming_output_meta_info(meta_info, output_offset, "
            "state.customized_info_accumulated.keys())") in handle
    stream_one = _flat(sglang.method(sglang.cls(TOKENIZER_MANAGER, "TokenizerManager"), "_stream_one_response"))
    assert ("out_list = state.out_list state.out_list = [] finished = state.finished state.event.clear() "
            "incremental_stream = is_stream and self.incremental_streaming_output "
            "if incremental_stream and len(out_list) > 1: out = self._coalesce_streaming_chunks(out_list, obj.rid, "
            "state.customized_info_accumulated.keys()) else: out = out_list[-1]") in stream_one
    sglang_code = _tokenizer_manager_code(sglang, incremental)
    manager = sglang_code.manager
    obj = SimpleNamespace(rid="r", stream=True, return_logprob=True, top_logprobs_num=k, token_ids_logprob=None,
                          return_text_in_logprobs=False, return_flat_raw_top_logprobs=False,
                          return_flat_raw_output_top_logprobs=False, return_flat_raw_top_logprobs_b64=False)
    lists = ("input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val",
             "output_token_logprobs_idx", "input_top_logprobs_val", "input_top_logprobs_idx",
             "output_top_logprobs_val", "output_top_logprobs_idx", "input_token_ids_logprobs_val",
             "input_token_ids_logprobs_idx", "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx",
             "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
             "input_token_ids_logprobs", "output_token_ids_logprobs", "output_ids", "out_list")
    state = SimpleNamespace(obj=obj, last_output_offset=0, customized_info_accumulated={}, prompt_token_ids=None,
                            input_top_logprobs_scheduler_flat=None, input_top_logprobs_flat_fields=None,
                            input_top_logprobs_flat_num_rows=-1, finished=False, get_text=lambda: "",
                            event=SimpleNamespace(set=lambda: None),
                            time_stats=SimpleNamespace(set_finished_time=lambda: None, get_e2e_latency=lambda: 0.0),
                            **{name: [] for name in lists})
    manager.rid_to_state["r"] = state

    def batch_output(ids: list[int]) -> None:  # _handle_batch_output's BatchTokenIDOutput branch for one rid
        rows = [_sglang_logprob(token, k) for token in ids]
        recv_obj = SimpleNamespace(
            input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
            output_token_logprobs_val=[[r[0] for r in rows]], output_token_logprobs_idx=[list(ids)],
            input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]],
            input_top_logprobs_val_flat=None, output_top_logprobs_val=[[r[2] for r in rows]],
            output_top_logprobs_idx=[[r[1] for r in rows]], input_token_ids_logprobs_val=None,
            output_token_ids_logprobs_val=None)
        meta_info = {"id": "r", "finish_reason": None}
        manager.convert_logprob_style(meta_info, state, obj.top_logprobs_num, obj.token_ids_logprob,
                                      obj.return_text_in_logprobs and not manager.skip_tokenizer_init, recv_obj, 0,
                                      finished=False)
        meta_info["completion_tokens"] = len(state.output_ids) + len(ids)
        output_offset = state.last_output_offset
        state.output_ids.extend(ids)
        if incremental:
            sglang_code.slice(meta_info, output_offset, state.customized_info_accumulated.keys())
            state.last_output_offset = len(state.output_ids)
            state.out_list.append({"output_ids": list(ids), "meta_info": meta_info})
        else:
            state.out_list.append({"output_ids": state.output_ids, "meta_info": meta_info})

    def drained() -> dict:  # _stream_one_response's
        out_list, state.out_list = state.out_list, []
        return manager._coalesce_streaming_chunks(out_list, "r", ()) if incremental and len(out_list) > 1 \
            else out_list[-1]

    reader = OutputReader(incremental, logprobs=k)
    chunks = []
    for ids in ([11], [12, 13]):
        batch_output(ids)
        chunks.append(reader.read(drained(), 0.1))
    batch_output([14])
    batch_output([15])
    if incremental:
        waited = drained()
        assert waited["meta_info"][TOKEN_LOGPROBS_KEY] == [(-0.14, 14, None), (-0.15, 15, None)]
        chunks.append(reader.read(waited, 0.1))
    manager._handle_abort_req(SimpleNamespace(rid="r", abort_message="evicted", finished_reason=None,
                                              weight_versions=None))
    last = drained()
    assert last["meta_info"][TOKEN_LOGPROBS_KEY] == [(-t / 100, t, None) for t in range(11, 16)]  # all, in both modes
    assert (TOP_LOGPROBS_KEY in last["meta_info"]) is (k > 0)
    chunks.append(reader.read(last, 0.1))
    assert [chunk.token_ids for chunk in chunks] == [[11], [12, 13], [14, 15]] + ([[]] if incremental else [])
    assert chunks[-1].finish_reason == FinishReason.ABORT and chunks[-1].error == "evicted"
    for chunk in chunks:
        expected = []
        for token in chunk.token_ids:
            logprob, top_ids, top_logprobs = _sglang_logprob(token, k)
            expected.append(TokenLogprob(logprob, tuple(zip(top_ids, top_logprobs))))
        assert chunk.logprobs == expected
