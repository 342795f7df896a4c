"""Every SGLang name SGLangEngine (and its test stand-in) relies on, checked against the source of
the pinned SGLang release, so that an SGLang API change fails here rather than on a GPU node.

The wheel is read, never imported or installed (see sglang_source.py); .ci/run downloads it. A
missing wheel fails these tests: they never skip.
"""

from __future__ import annotations

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
    LOW_PRIORITY_FIRST_ARG,
    NAN_MATCHED,
    PLACEMENT_ARGS,
    PRIORITY_ARG,
    PRIORITY_SCHEDULE_POLICIES,
    RETRACTION_ARG,
    SPECULATIVE_ARG,
    TOP_K_DISABLED,
    check_engine_args,
    engine_launch_args,
    generate_kwargs,
    sglang_sampling_params,
)
from megaserve.replicas.protocol import SEED_MAX, SEED_MIN, SamplingParams
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
    ours = set(generate_kwargs((1,), {}, "rid", 0))
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
