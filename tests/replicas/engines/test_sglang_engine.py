"""SGLangEngine: the parameter mapping and output conversion (pure functions), and the engine
itself on an in-process stand-in for `sglang.Engine` (tests/replicas/engines/sglang_stand_in.py):
stream translation, logprobs, priority, abort on client disconnect, shutdown, health and metrics. The names
used are checked against SGLang's own source in test_sglang_api.py; the live run against a real
SGLang is tests/gpu/test_sglang_engine_gpu.py."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import time

import pytest
from prometheus_client import REGISTRY

from megaserve.replicas.engines import create_engine
from megaserve.replicas.engines.sglang_engine import (
    CONTEXT_MARGIN,
    LONGER_CONTEXT_ENV,
    RAW_LOGPROBS_ENV,
    TOP_K_DISABLED,
    OutputReader,
    SGLangEngine,
    engine_launch_args,
    finish_of,
    generate_kwargs,
    model_limits,
    own_stop_ids,
    sglang_sampling_params,
    step_times,
)
from megaserve.replicas.protocol import (
    CoalescePolicy,
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenLogprob,
)
from tests.replicas.engines import sglang_stand_in
from tests.replicas.engines.sglang_stand_in import QUEUE_FULL_MESSAGE, StandInSGLang, stand_in_logprob

ONE_BY_ONE = CoalescePolicy(seconds=0.0, tokens=1)
VOCAB = 512  # a vocabulary for the sampling-parameter mappings
SHORT_HEALTH_TIMEOUT = 0.3
_names = itertools.count()


def test_sampling_params_map_to_sglang_names():
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=5,
                            stop_token_ids=(2, 7))
    assert sglang_sampling_params(params, VOCAB) == {
        "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "ignore_eos": False,
        "stop_token_ids": [2, 7], "sampling_seed": 5,
    }
    assert own_stop_ids(params) == frozenset()


def test_under_ignore_eos_the_engine_checks_the_stop_ids_not_sglang():
    params = SamplingParams(stop_token_ids=(2, 7), ignore_eos=True)
    mapped = sglang_sampling_params(params, VOCAB)
    assert mapped["ignore_eos"] is True and "stop_token_ids" not in mapped
    assert own_stop_ids(params) == {2, 7}


def test_a_temperature_below_the_greedy_threshold_is_sent_as_greedy():
    assert sglang_sampling_params(SamplingParams(temperature=1e-30), VOCAB)["temperature"] == 0.0
    assert sglang_sampling_params(SamplingParams(temperature=1e-4), VOCAB)["temperature"] == 1e-4


def test_defaults_disable_top_k_and_leave_out_unset_fields():
    mapped = sglang_sampling_params(SamplingParams(temperature=0.0), VOCAB)
    assert mapped["top_k"] == -1 and mapped["temperature"] == 0.0
    assert "stop_token_ids" not in mapped and "sampling_seed" not in mapped


def test_a_top_k_of_the_whole_vocabulary_or_more_is_sent_as_sglang_s_no_top_k():
    """SGLang keeps each row's top_k in an int32 tensor: a client's top_k of 2**31 would not fit there."""
    assert sglang_sampling_params(SamplingParams(top_k=VOCAB - 1), VOCAB)["top_k"] == VOCAB - 1
    for top_k in (VOCAB, VOCAB + 1, 2**31, 2**70):
        assert sglang_sampling_params(SamplingParams(top_k=top_k), VOCAB)["top_k"] == TOP_K_DISABLED == -1


def test_the_model_s_eos_ids_are_sent_as_stop_ids_unless_ignore_eos():
    """SGLang with skip_tokenizer_init never learns the tokenizer's eos_token: it is sent with the rest."""
    mapped = sglang_sampling_params(SamplingParams(stop_token_ids=(7, 2)), VOCAB, eos_ids=(2, 9))
    assert mapped["stop_token_ids"] == [7, 2, 9]
    assert sglang_sampling_params(SamplingParams(), VOCAB, eos_ids=(9,))["stop_token_ids"] == [9]
    assert "stop_token_ids" not in sglang_sampling_params(SamplingParams(ignore_eos=True), VOCAB, eos_ids=(9,))


def test_an_unseeded_sampled_request_gets_a_random_seed():
    """SGLang's deterministic mode would give every unseeded request the seed 42 (test_sglang_api.py)."""
    seeds = {sglang_sampling_params(SamplingParams(temperature=0.8), VOCAB)["sampling_seed"] for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= seed < 2**63 for seed in seeds)
    assert sglang_sampling_params(SamplingParams(temperature=0.8, seed=-3), VOCAB)["sampling_seed"] == -3


def test_launch_args_layer_defaults_caller_and_owned_settings():
    args = engine_launch_args("/models/m", tp_size=4, context_length=8192, dtype="bfloat16",
                              max_running_requests=128, mem_fraction_static=0.85,
                              engine_args={"enable_priority_scheduling": False, "chunked_prefill_size": 4096})
    assert args == {
        "enable_priority_scheduling": False, "chunked_prefill_size": 4096, "mem_fraction_static": 0.85,
        "model_path": "/models/m",
        "tp_size": 4, "context_length": 8192, "dtype": "bfloat16", "max_running_requests": 128,
        "enable_metrics": True, "skip_tokenizer_init": True,
    }


def test_launch_args_leave_unset_limits_to_sglang():
    args = engine_launch_args("/models/m", tp_size=1, context_length=512, enable_metrics=False)
    assert "max_running_requests" not in args
    assert args["enable_metrics"] is False and args["enable_priority_scheduling"] is True


@pytest.mark.parametrize(("settings", "message"), [
    ({"engine_args": {"tp_size": 2}}, "must not set \\['tp_size'\\]"),
    ({"engine_args": {"skip_tokenizer_init": False, "context_length": 9}},
     "must not set \\['context_length', 'skip_tokenizer_init'\\]"),
    ({"tp_size": 0}, "tp_size must be at least 1"),
    ({"engine_args": {"pp_size": 2}}, "\\['pp_size'\\] must not be set: the replica's placement"),
    ({"engine_args": {"nnodes": 2, "node_rank": 1, "device": "cpu"}},
     "\\['device', 'nnodes', 'node_rank'\\] must not be set"),
    ({"engine_args": {"schedule_policy": "lpm"}}, "schedule_policy 'lpm' cannot be used with priority"),
    ({"engine_args": {"schedule_policy": "dfs-weight", "enable_priority_scheduling": True}},
     "set enable_priority_scheduling: false as well"),
    ({"engine_args": {"enable_priority_scheduling": False, "abort_on_priority_when_disabled": True}},
     "abort_on_priority_when_disabled: true with enable_priority_scheduling: false would make SGLang abort every"),
    ({"engine_args": {"enable_priority_scheduling": False, "retraction_policy": "priority"}},
     "retraction_policy: priority needs enable_priority_scheduling"),
    ({"engine_args": {"schedule_low_priority_values_first": True}},
     r"would serve the tier's spillover requests \(priority 1\) after its own"),
    ({"engine_args": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}},
     "speculative_algorithm is not supported"),
])
def test_bad_launch_settings_are_refused(settings, message):
    settings = {"tp_size": 1, "context_length": 512} | settings
    with pytest.raises(ValueError, match=message):
        engine_launch_args("/models/m", **settings)


@pytest.mark.parametrize("engine_args", [
    {"schedule_policy": "fcfs"}, {"schedule_policy": "lof"},
    {"schedule_policy": "lpm", "enable_priority_scheduling": False},  # the operator gives priority up
    {"abort_on_priority_when_disabled": True},  # priority scheduling stays on: no request is aborted
    {"abort_on_priority_when_disabled": False, "enable_priority_scheduling": False},
    {"retraction_policy": "priority"}, {"retraction_policy": "length", "enable_priority_scheduling": False},
    {"schedule_low_priority_values_first": True, "enable_priority_scheduling": False},  # then it orders nothing
    {"speculative_algorithm": None},
])
def test_schedule_policies_that_priority_scheduling_takes_or_without_it_are_passed_on(engine_args):
    args = engine_launch_args("/models/m", tp_size=1, context_length=512, engine_args=engine_args)
    assert engine_args.items() <= args.items()


def test_generate_kwargs_stream_one_request_by_token_ids():
    assert generate_kwargs((5, 6), {"max_new_tokens": 2}, "r-1", 3) == {
        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "rid": "r-1", "priority": 3,
        "stream": True,
    }


def test_generate_kwargs_ask_sglang_for_logprobs_only_for_a_request_that_asks():
    plain = {"input_ids": [5], "sampling_params": {}, "rid": "r", "priority": 0, "stream": True}
    assert generate_kwargs((5,), {}, "r", 0) == generate_kwargs((5,), {}, "r", 0, logprobs=None) == plain
    for k in (0, 20):
        assert generate_kwargs((5,), {}, "r", 0, logprobs=k) == plain | {
            "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": -1}


def test_model_limits_cap_the_tier_s_sequence_length_by_the_model():
    config = {"vocab_size": 1000, "max_position_embeddings": 4096}
    assert model_limits(config, None) == (1000, 4096)
    assert model_limits(config, 2048) == (1000, 2048)
    assert model_limits(config, 10**6) == (1000, 4096)
    with pytest.raises(ValueError, match="vocab_size"):
        model_limits({"max_position_embeddings": 8}, None)


def test_cumulative_outputs_become_new_tokens_with_split_step_times():
    reader = OutputReader(incremental=False)
    ids = [11]
    first = reader.read({"output_ids": ids, "meta_info": {"finish_reason": None}}, 0.3)
    ids += [12, 13]
    second = reader.read({"output_ids": ids, "meta_info": {"finish_reason": None}}, 0.02)
    length = {"type": "length", "length": 4}
    last = reader.read({"output_ids": ids + [14], "meta_info": {"finish_reason": length}}, 0.01)
    assert (first.token_ids, first.step_seconds) == ([11], [0.3])
    assert (second.token_ids, second.step_seconds) == ([12, 13], [0.01, 0.01])
    assert (last.token_ids, last.finish_reason) == ([14], FinishReason.LENGTH)


def test_incremental_outputs_pass_through():
    reader = OutputReader(incremental=True)
    reader.read({"output_ids": [1, 2], "meta_info": {}}, 0.1)
    chunk = reader.read({"output_ids": [3], "meta_info": {"finish_reason": {"type": "stop", "matched": 3}}}, 0.1)
    assert (chunk.token_ids, chunk.finish_reason, reader.delivered) == ([3], FinishReason.STOP, 3)


@pytest.mark.parametrize("incremental", [False, True])
def test_an_out_of_vocabulary_sample_ends_the_stream_as_a_failure_without_sglang_s_stand_in(incremental):
    """SGLang puts a stop id (here one the reader checks itself, as under ignore_eos) where the bad
    sample was, and reports a stop: the reader drops that id and ends with the error."""
    reader = OutputReader(incremental, stop_ids=frozenset({2}))
    reader.read({"output_ids": [11], "meta_info": {"finish_reason": None}}, 0.1)
    ids = [12, 2] if incremental else [11, 12, 2]
    chunk = reader.read({"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop", "matched": "NaN happened"}}},
                        0.2)
    assert (chunk.token_ids, chunk.finish_reason) == ([12], FinishReason.ABORT)
    assert "outside the vocabulary" in chunk.error


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("sglang_reason", [None, {"type": "length", "length": 4}])
def test_the_reader_ends_at_the_first_of_its_stop_ids(incremental, sglang_reason):
    reader = OutputReader(incremental, stop_ids=frozenset({13, 14}))
    reader.read({"output_ids": [11], "meta_info": {"finish_reason": None}}, 0.1)
    ids = [12, 13, 14] if incremental else [11, 12, 13, 14]
    chunk = reader.read({"output_ids": ids, "meta_info": {"finish_reason": sglang_reason}}, 0.3)
    assert (chunk.token_ids, chunk.finish_reason, chunk.error) == ([12, 13], FinishReason.STOP, None)
    assert chunk.step_seconds == pytest.approx([0.1, 0.1])


def test_an_incremental_abort_that_repeats_the_last_id_adds_nothing():
    reader = OutputReader(incremental=True)
    reader.read({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}, 0.1)
    abort = {"type": "abort", "message": "evicted"}
    chunk = reader.read({"output_ids": [2], "meta_info": {"finish_reason": abort, "completion_tokens": 2}}, 0.1)
    assert (chunk.token_ids, chunk.finish_reason, chunk.error) == ([], FinishReason.ABORT, "evicted")
    assert reader.delivered == 2
    # chunks that waited, coalesced by SGLang with the abort's repeat: [3, 4] new, then 4 again
    reader = OutputReader(incremental=True)
    reader.read({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}, 0.1)
    chunk = reader.read({"output_ids": [3, 4, 4], "meta_info": {"finish_reason": abort, "completion_tokens": 4}}, 0.1)
    assert chunk.token_ids == [3, 4] and reader.delivered == 4


def _entry(token: int) -> tuple[float, int, None]:
    """SGLang's (logprob, id, None) of an output id, made up."""
    return (-token / 100, token, None)


def _top(token: int, k: int) -> list[tuple[float, int, None]]:
    """SGLang's k most likely (logprob, id, None) at an output id's step, made up."""
    return [(-token / 100 - j, token + 7 * j, None) for j in range(k)]


def _logprob_info(tokens: list[int], k: int) -> dict:
    return {"output_token_logprobs": [_entry(t) for t in tokens]} | (
        {"output_top_logprobs": [_top(t, k) for t in tokens]} if k else {})


def _expected(tokens: list[int], k: int) -> list[TokenLogprob]:
    return [TokenLogprob(-t / 100, tuple((token, logprob) for logprob, token, _ in _top(t, k))) for t in tokens]


@pytest.mark.parametrize("k", [0, 3])
def test_cumulative_outputs_give_each_new_id_its_logprob_and_top_alternatives(k):
    reader = OutputReader(incremental=False, logprobs=k)
    first = reader.read({"output_ids": [11], "meta_info": {"finish_reason": None, **_logprob_info([11], k)}}, 0.1)
    second = reader.read({"output_ids": [11, 12, 13],
                          "meta_info": {"finish_reason": None, **_logprob_info([11, 12, 13], k)}}, 0.1)
    length = {"type": "length", "length": 4}
    last = reader.read({"output_ids": [11, 12, 13, 14],
                        "meta_info": {"finish_reason": length, **_logprob_info([11, 12, 13, 14], k)}}, 0.1)
    assert [first.logprobs, second.logprobs, last.logprobs] == [_expected([11], k), _expected([12, 13], k),
                                                                 _expected([14], k)]
    assert second.logprobs[1].logprob == -0.13 and len(second.logprobs[1].top) == k
    if k:
        assert second.logprobs[0].top == ((12, -0.12), (19, -1.12), (26, -2.12))  # (id, logprob), most likely first
    repeat = reader.read({"output_ids": [11, 12, 13, 14], "meta_info": {"finish_reason": length,
                                                                         **_logprob_info([11, 12, 13, 14], k)}}, 0.1)
    assert repeat.token_ids == [] and repeat.logprobs == []


@pytest.mark.parametrize("k", [0, 2])
def test_incremental_outputs_give_each_new_id_its_logprob_and_an_abort_s_repeat_adds_none(k):
    reader = OutputReader(incremental=True, logprobs=k)
    first = reader.read({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2, **_logprob_info([1, 2], k)}}, 0.1)
    # chunks that waited, coalesced with the abort's repeat of 4, whose lists hold every id so far
    abort = {"type": "abort", "message": "evicted"}
    coalesced = {"output_token_logprobs": [_entry(3), _entry(4)] + [_entry(t) for t in (1, 2, 3, 4)]}
    if k:
        coalesced["output_top_logprobs"] = [_top(3, k), _top(4, k)] + [_top(t, k) for t in (1, 2, 3, 4)]
    last = reader.read({"output_ids": [3, 4, 4], "meta_info": {"finish_reason": abort, "completion_tokens": 4,
                                                               **coalesced}}, 0.1)
    assert (first.logprobs, last.token_ids, last.logprobs) == (_expected([1, 2], k), [3, 4], _expected([3, 4], k))
    assert last.finish_reason == FinishReason.ABORT


@pytest.mark.parametrize("incremental", [False, True])
def test_an_own_stop_id_cuts_the_logprobs_with_the_ids(incremental):
    reader = OutputReader(incremental, stop_ids=frozenset({13}), logprobs=1)
    reader.read({"output_ids": [11], "meta_info": {"finish_reason": None, **_logprob_info([11], 1)}}, 0.1)
    ids = [12, 13, 14] if incremental else [11, 12, 13, 14]
    chunk = reader.read({"output_ids": ids, "meta_info": {"finish_reason": None, **_logprob_info(ids, 1)}}, 0.3)
    assert (chunk.token_ids, chunk.finish_reason) == ([12, 13], FinishReason.STOP)
    assert chunk.logprobs == _expected([12, 13], 1)


def test_an_out_of_vocabulary_sample_s_stand_in_id_gets_no_logprob():
    """SGLang's logprob names the bad sample, not the stop id it put in its place: the reader drops both."""
    reader = OutputReader(incremental=True, logprobs=0)
    meta_info = {"finish_reason": {"type": "stop", "matched": "NaN happened"},
                 "output_token_logprobs": [_entry(12), (float("nan"), 600, None)]}
    chunk = reader.read({"output_ids": [12, 2], "meta_info": meta_info}, 0.2)
    assert (chunk.token_ids, chunk.logprobs, chunk.finish_reason) == ([12], _expected([12], 0), FinishReason.ABORT)


@pytest.mark.parametrize("incremental", [False, True])
def test_a_request_without_logprobs_gets_none_whatever_sglang_sends(incremental):
    reader = OutputReader(incremental)
    chunk = reader.read({"output_ids": [11, 12], "meta_info": {"finish_reason": None, **_logprob_info([11, 12], 2)}},
                        0.1)
    assert chunk.token_ids == [11, 12] and chunk.logprobs == []


@pytest.mark.parametrize(("meta_info", "message"), [
    ({"output_token_logprobs": [_entry(11)]}, "SGLang sent logprobs for 1 \\(top logprobs for 0\\) of 2 new"),
    ({"output_token_logprobs": [_entry(11), _entry(12)], "output_top_logprobs": [_top(11, 2)]},
     "top logprobs for 1\\) of 2 new"),
    ({"output_token_logprobs": [_entry(11), _entry(13)], "output_top_logprobs": [_top(11, 2), _top(12, 2)]},
     "the logprob of id 13 for output id 12"),
    ({"output_token_logprobs": [_entry(11), _entry(12)], "output_top_logprobs": [_top(11, 2), None]},
     "sent 0 top logprobs of output id 12, not 2"),
    ({}, "logprobs for 0"),
])
def test_logprobs_that_would_misalign_are_refused(meta_info, message):
    reader = OutputReader(incremental=False, logprobs=2)
    with pytest.raises(RuntimeError, match=message):
        reader.read({"output_ids": [11, 12], "meta_info": {"finish_reason": None, **meta_info}}, 0.1)


def test_the_first_output_s_prefill_stamps_time_its_tokens():
    stamps = {"forward_entry_time": 100.0, "prefill_finished_time": 100.3}
    assert step_times(3, 2.0, stamps, wall_time=100.5) == pytest.approx([0.3, 0.1, 0.1])
    assert step_times(1, 2.0, stamps, wall_time=100.5) == pytest.approx([0.3])
    assert step_times(2, 2.0, {}, wall_time=100.5) == [1.0, 1.0]  # no stamps (enable_metrics off)
    assert step_times(2, 2.0, stamps, wall_time=100.1) == [1.0, 1.0]  # stamps after arrival: clocks disagree
    reader = OutputReader(incremental=True)
    first = reader.read({"output_ids": [1], "meta_info": stamps}, 2.0, wall_time=100.5)
    later = reader.read({"output_ids": [2], "meta_info": stamps}, 0.01, wall_time=100.51)
    assert first.step_seconds == pytest.approx([0.3]) and later.step_seconds == [0.01]  # stamps: the first only


def test_a_final_output_that_repeats_everything_adds_nothing():
    reader = OutputReader(incremental=False)
    reader.read({"output_ids": [1, 2], "meta_info": {}}, 0.1)
    chunk = reader.read({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}, 0.1)
    assert chunk.token_ids == [] and chunk.step_seconds == [] and chunk.finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (None, (None, None)),
        ({"type": "stop", "matched": 2}, (FinishReason.STOP, None)),
        ({"type": "length", "length": 9}, (FinishReason.LENGTH, None)),
        ({"type": "abort", "message": "out of memory", "status_code": 500}, (FinishReason.ABORT, "out of memory")),
    ],
)
def test_finish_reasons_map_to_ours(reason, expected):
    assert finish_of(reason) == expected


def test_an_out_of_vocabulary_sample_aborts_instead_of_stopping():
    reason, error = finish_of({"type": "stop", "matched": "NaN happened"})
    assert reason == FinishReason.ABORT and "outside the vocabulary" in error


def test_an_unknown_finish_reason_aborts_with_its_description():
    reason, error = finish_of({"type": "preempted"})
    assert reason == FinishReason.ABORT and "preempted" in error


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_without_sglang_the_engine_says_how_to_install_it(tiny_model_dir):
    with pytest.raises(RuntimeError, match="pip install 'megaserve\\[sglang\\]'"):
        create_engine("sglang", model_dir=tiny_model_dir, coalesce_seconds=0.01)


@pytest.fixture
async def make_sglang(tiny_model_dir, monkeypatch):
    """make_sglang(**settings) -> (SGLangEngine on the stand-in, the stand-in); each engine has a
    model name of its own (so its metrics are its own) and is shut down after the test. SGLang's
    context and raw-logprob switches, which the engine sets in os.environ, are off before each test
    and gone after it."""
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "0")
    monkeypatch.setenv(RAW_LOGPROBS_ENV, "0")
    engines: list[SGLangEngine] = []

    def make(**settings) -> tuple[SGLangEngine, StandInSGLang]:
        settings = {"model_name": f"tiny-sglang-{next(_names)}", "coalesce": ONE_BY_ONE} | settings
        engine = SGLangEngine(tiny_model_dir, launch=StandInSGLang, **settings)
        engines.append(engine)
        return engine, engine._runtime

    yield make
    for engine in engines:
        await engine.shutdown()


def _request(prompt=(5, 17, 99), name="r", priority=0, **sampling) -> GenerateRequest:
    sampling = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True} | sampling
    return GenerateRequest(name, tuple(prompt), SamplingParams(**sampling), priority=priority)


def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_the_engine_starts_sglang_with_the_tier_s_settings(make_sglang, tiny_model_dir):
    engine, sglang = make_sglang(tp_size=2, max_seq=256, max_batch=4, dtype="float32", mem_fraction_static=0.5)
    assert sglang.launch_args == {
        "enable_priority_scheduling": True, "mem_fraction_static": 0.5, "model_path": str(tiny_model_dir),
        "tp_size": 2, "context_length": 256 + CONTEXT_MARGIN, "dtype": "float32", "max_running_requests": 4,
        "enable_metrics": True, "skip_tokenizer_init": True,
    }
    assert (engine.vocab_size, engine.max_context, engine.eos_ids) == (512, 256, (508, 511))


@pytest.mark.parametrize("max_seq", [64, None])  # None: all 512 of the tiny model's positions
async def test_every_request_the_engine_accepts_runs_to_max_tokens_within_sglang_s_limits(make_sglang, max_seq):
    """SGLang's own limits (max_req_len = context_length - 1, prompts under max_req_len - 5, at most
    max_req_len - prompt - 1 new tokens; pinned in test_sglang_api.py) on the launch's context_length:
    the engine serves the tier's whole context, as the router and the other tiers do, also where
    SGLang's reserve passes the model's positions (the stand-in refuses that unless SGLang's switch is
    on, as SGLang does past its reading of the model's length)."""
    engine, sglang = make_sglang(max_seq=max_seq)
    context = max_seq or 512
    assert engine.max_context == context and sglang.launch_args["context_length"] == context + CONTEXT_MARGIN
    assert os.environ[LONGER_CONTEXT_ENV] == "1"
    for prompt_len, max_tokens in ((context - 1, 1), (context // 2, context - context // 2)):
        items = [item async for item in engine.generate(_request((5,) * prompt_len, max_tokens=max_tokens))]
        assert items[-1].finish_reason == FinishReason.LENGTH and items[-1].error is None
        assert sum(len(item.token_ids) for item in items) == max_tokens
    with pytest.raises(EngineError, match="context"):
        engine.generate(_request((5,) * context, max_tokens=1))


@pytest.mark.parametrize("mem_fraction_static, shown", [(0.8, "now 0.8"), (None, "now unset: SGLang's own sizing")])
async def test_a_kv_pool_smaller_than_the_context_fails_the_start_saying_what_to_change(
        tiny_model_dir, monkeypatch, mem_fraction_static, shown):
    """As vLLM refuses a max_model_len its KV cache cannot hold: serving less would go unseen by the
    router, which sizes a chat request without max_tokens to the whole context."""
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "0")
    monkeypatch.setattr(StandInSGLang, "kv_tokens", 40)
    started: list[StandInSGLang] = []

    def launch(**launch_args) -> StandInSGLang:
        started.append(StandInSGLang(**launch_args))
        return started[-1]

    expected = (r"^SGLang's KV cache holds too few tokens for the context of 64: the longest request SGLang serves "
                r"is 34 tokens \(its max_req_input_len\)\. Raise mem_fraction_static "
                rf"\(throughput\.sglang_mem_fraction_static; {shown}\), or lower max_seq \(throughput\.max_seq_len, "
                r"and model\.max_context where it is set\) to 34 or less$")
    with pytest.raises(ValueError, match=expected):
        SGLangEngine(tiny_model_dir, max_seq=64, mem_fraction_static=mem_fraction_static, launch=launch)
    assert started[0].tokenizer_manager.max_req_input_len == 40 - 1 - 5
    assert started[0].shut_down  # SGLang's processes do not outlive the failed start


async def test_a_kv_pool_that_holds_the_whole_context_and_the_margin_serves_it(make_sglang, monkeypatch):
    monkeypatch.setattr(StandInSGLang, "kv_tokens", 64 + CONTEXT_MARGIN)
    engine, sglang = make_sglang(max_seq=64)
    assert engine.max_context == 64 == sglang.tokenizer_manager.max_req_input_len
    items = [item async for item in engine.generate(_request((5,) * 20, max_tokens=64 - 20))]
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(item.token_ids) for item in items) == 64 - 20


@pytest.mark.parametrize("incremental", [False, True])
async def test_sglang_s_stream_becomes_steps_that_follow_the_yield_rule(make_sglang, incremental):
    engine, sglang = make_sglang(coalesce=CoalescePolicy(seconds=1.0, tokens=2),
                                 engine_args={"incremental_streaming_output": incremental})
    items = [item async for item in engine.generate(_request((5, 17, 99), "greedy", priority=7))]
    assert [item.token_ids for item in items] == [[100], [101, 102], [103, 104]]
    assert items[-1].finish_reason == FinishReason.LENGTH and items[-1].error is None
    assert all(item.prompt_tokens == 3 for item in items)
    assert all(len(item.step_seconds) == len(item.token_ids) for item in items)
    (call,) = sglang.requests
    assert call["input_ids"] == [5, 17, 99] and call["priority"] == 7 and call["stream"] is True
    assert call["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                       "ignore_eos": True}
    assert call["rid"].startswith("greedy-")


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("ignore_eos", [False, True])
async def test_a_stop_token_finishes_with_stop(make_sglang, ignore_eos, incremental):
    """As on TorchEngine, ignore_eos or not; SGLang skips stop ids under ignore_eos (the stand-in
    follows its rule), so there the engine stops and aborts SGLang's request itself."""
    engine, sglang = make_sglang(engine_args={"incremental_streaming_output": incremental})
    labels = {"tier": "throughput", "model": engine.model_name}
    request = _request((5, 10), stop_token_ids=(13,), max_tokens=9, ignore_eos=ignore_eos)
    items = [item async for item in engine.generate(request)]
    assert [t for item in items for t in item.token_ids] == [11, 12, 13]
    assert items[-1].finish_reason == FinishReason.STOP and items[-1].error is None
    assert sglang.tokenizer_manager.aborted == ([sglang.requests[0]["rid"]] if ignore_eos else [])
    assert _sample("megaserve_running_requests", labels) == 0


async def test_the_engine_has_sglang_return_the_raw_logits_logprobs(make_sglang):
    make_sglang()
    assert os.environ[RAW_LOGPROBS_ENV] == "1"  # before SGLang starts: its processes inherit it


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("k", [None, 0, 2])
async def test_logprobs_come_with_each_token_when_asked(make_sglang, incremental, k):
    engine, sglang = make_sglang(coalesce=CoalescePolicy(seconds=1.0, tokens=2),
                                 engine_args={"incremental_streaming_output": incremental})
    items = [item async for item in engine.generate(_request((5, 17, 99), max_tokens=5, logprobs=k))]
    assert [item.token_ids for item in items] == [[100], [101, 102], [103, 104]]
    (call,) = sglang.requests
    if k is None:
        assert all(item.logprobs is None for item in items)
        assert (call["return_logprob"], call["top_logprobs_num"], call["logprob_start_len"]) == (False, None, None)
        return
    assert (call["return_logprob"], call["top_logprobs_num"], call["logprob_start_len"]) == (True, k, -1)
    for item in items:
        expected = [stand_in_logprob(token, k) for token in item.token_ids]
        assert item.logprobs == [TokenLogprob(entry[0], tuple((t, lp) for lp, t, _ in top)) for entry, top in expected]
        assert all(len(logprob.top) == k for logprob in item.logprobs)


@pytest.mark.parametrize("incremental", [False, True])
async def test_an_own_stop_id_ends_the_logprobs_with_the_tokens(make_sglang, incremental):
    engine, _ = make_sglang(engine_args={"incremental_streaming_output": incremental})
    request = _request((5, 10), stop_token_ids=(13,), max_tokens=9, ignore_eos=True, logprobs=1)
    items = [item async for item in engine.generate(request)]
    assert [t for item in items for t in item.token_ids] == [11, 12, 13]
    assert [logprob.logprob for item in items for logprob in item.logprobs] == [-1 / 11, -1 / 12, -1 / 13]
    assert items[-1].finish_reason == FinishReason.STOP


async def test_misaligned_logprobs_end_the_stream_and_the_request_in_sglang(make_sglang, monkeypatch):
    engine, sglang = make_sglang()
    monkeypatch.setattr(sglang_stand_in, "stand_in_logprob",
                        lambda token, k: ((-1.0, token + 1, None), []))  # the logprob of another id
    items = [item async for item in engine.generate(_request(max_tokens=50, logprobs=0))]
    assert (items[-1].finish_reason, items[-1].token_ids) == (FinishReason.ABORT, [])
    assert items[-1].error == "SGLang failed: RuntimeError: SGLang sent the logprob of id 101 for output id 100"
    assert sglang.tokenizer_manager.aborted == [sglang.requests[0]["rid"]]


async def test_the_same_request_id_twice_gets_two_sglang_rids(make_sglang):
    engine, sglang = make_sglang()
    for _ in range(2):
        [item async for item in engine.generate(_request(name="retried"))]
    assert len({call["rid"] for call in sglang.requests}) == 2


async def test_a_client_that_leaves_aborts_the_request_in_sglang(make_sglang):
    engine, sglang = make_sglang()
    labels = {"tier": "throughput", "model": engine.model_name}
    stream = engine.generate(_request(max_tokens=400))
    await anext(stream)
    assert _sample("megaserve_running_requests", labels) == 1
    await stream.aclose()  # what Ray does when the client goes away
    assert sglang.tokenizer_manager.aborted == [sglang.requests[0]["rid"]]
    await asyncio.sleep(0.01)  # the cancelled pump's cleanup
    assert _sample("megaserve_running_requests", labels) == 0
    assert _sample("megaserve_busy_replicas", labels) == 0


async def test_an_sglang_failure_ends_the_stream_with_its_reason(make_sglang):
    engine, sglang = make_sglang()
    sglang.failure = ValueError("the input is longer than the context")
    items = [item async for item in engine.generate(_request())]
    assert len(items) == 1 and items[0].finish_reason == FinishReason.ABORT
    assert "ValueError: the input is longer than the context" in items[0].error


@pytest.mark.parametrize("incremental", [False, True])
async def test_an_abort_from_sglang_ends_the_stream_with_its_message_and_no_repeated_token(make_sglang, incremental):
    engine, sglang = make_sglang(engine_args={"incremental_streaming_output": incremental})
    stream = engine.generate(_request(max_tokens=400))
    items = [await anext(stream)]
    sglang.tokenizer_manager.abort_request(rid=sglang.requests[0]["rid"])  # e.g. SGLang out of memory
    items += [item async for item in stream]
    assert items[-1].finish_reason == FinishReason.ABORT and items[-1].error == "aborted"
    tokens = [token for item in items for token in item.token_ids]
    first = tokens[0]
    assert tokens == list(range(first, first + len(tokens)))  # the stand-in's t+1, t+2, ...: each once


@pytest.mark.parametrize(("prompt", "max_tokens", "message"), [
    ((), 1, "the prompt is empty"),
    ((5, 512), 1, "prompt token id 512 is outside the vocabulary"),
    ((5,) * 10, 10, "maximum context length is 16 tokens"),
])
async def test_bad_requests_are_refused_at_the_call(make_sglang, prompt, max_tokens, message):
    engine, sglang = make_sglang(max_seq=16)
    with pytest.raises(EngineError, match=message):
        engine.generate(_request(prompt, max_tokens=max_tokens))
    assert sglang.requests == []


async def test_step_durations_are_recorded_for_the_throughput_tier(make_sglang):
    engine, _ = make_sglang()
    labels = {"tier": "throughput", "model": engine.model_name}
    items = [item async for item in engine.generate(_request(max_tokens=6))]
    assert items[-1].finish_reason == FinishReason.LENGTH
    await asyncio.sleep(0.01)
    assert _sample("megaserve_step_duration_seconds_count", labels | {"phase": "prefill"}) == 1
    assert _sample("megaserve_step_duration_seconds_count", labels | {"phase": "decode"}) == 5
    assert _sample("megaserve_step_duration_seconds_sum", labels | {"phase": "decode"}) > 0


@pytest.mark.parametrize("enable_metrics", [True, False])
async def test_the_prefill_step_leaves_out_the_wait_in_sglang_s_queue_where_sglang_stamps_it(make_sglang,
                                                                                           enable_metrics):
    engine, sglang = make_sglang(enable_metrics=enable_metrics)
    sglang.queue_seconds = 0.3
    labels = {"tier": "throughput", "model": engine.model_name, "phase": "prefill"}
    items = [item async for item in engine.generate(_request(max_tokens=3))]
    assert items[-1].finish_reason == FinishReason.LENGTH
    prefill = _sample("megaserve_step_duration_seconds_sum", labels)
    if enable_metrics:  # the stand-in's prefill is one STEP_SECONDS; the queue's 0.3 s is not a step
        assert 0 <= prefill < 0.1 and items[0].step_seconds[0] == pytest.approx(prefill)
    else:  # no stamps: the time since submission, the queue's wait included
        assert prefill >= 0.3


async def test_shutdown_aborts_running_streams_stops_sglang_and_refuses_new_ones(make_sglang):
    engine, sglang = make_sglang()
    stream = engine.generate(_request(max_tokens=400))
    await anext(stream)
    await engine.shutdown()
    rest = [item async for item in stream]
    assert rest[-1].finish_reason == FinishReason.ABORT and rest[-1].error == "the engine is shutting down"
    assert sglang.tokenizer_manager.aborted == [sglang.requests[0]["rid"]]
    assert sglang.shut_down
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.generate(_request())
    assert not (await engine.health()).healthy


async def test_health_is_a_one_token_generation(make_sglang):
    engine, sglang = make_sglang()
    health = await engine.health()
    assert health.healthy and health.detail == ""
    (probe,) = sglang.requests
    assert probe["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert probe["rid"].startswith("HEALTH_CHECK")


async def test_a_hung_sglang_is_unhealthy_after_the_timeout(make_sglang):
    engine, sglang = make_sglang(health_timeout_seconds=SHORT_HEALTH_TIMEOUT)
    sglang.stalled = True
    health = await engine.health()
    assert not health.healthy and "no output for 0.3 s" in health.detail


async def test_a_busy_sglang_is_healthy_while_other_requests_get_tokens(make_sglang):
    engine, sglang = make_sglang(health_timeout_seconds=10.0)
    stream = engine.generate(_request(max_tokens=400))
    await anext(stream)
    sglang.stalled = True  # the probe waits in the queue behind the running request
    started = time.monotonic()
    health = await engine.health()
    assert health.healthy and health.running_requests == 1
    assert time.monotonic() - started < 5.0  # seen from the running request, not the 10 s timeout waited out
    await stream.aclose()


async def test_a_probe_refused_for_a_full_queue_leaves_health_to_the_running_requests(make_sglang):
    """With max_queued_requests, SGLang refuses a busy replica's probe as it refuses a client's request,
    but that refusal never reaches the probe (SGLang drops it for health rids; test_sglang_api.py):
    the tokens of the running request show SGLang alive, and the replica is not restarted."""
    engine, sglang = make_sglang(health_timeout_seconds=10.0)
    stream = engine.generate(_request(max_tokens=400))
    await anext(stream)
    sglang.queue_full = True
    refused = [item async for item in engine.generate(_request(name="refused"))]
    assert refused[-1].finish_reason == FinishReason.ABORT and refused[-1].error == QUEUE_FULL_MESSAGE
    started = time.monotonic()
    health = await engine.health()
    assert health.healthy and health.running_requests == 1
    assert time.monotonic() - started < 5.0  # seen from the running request, not the 10 s timeout waited out
    await stream.aclose()


async def test_health_probes_leave_no_request_state_in_sglang(make_sglang):
    """A probe that a busy SGLang never answers is closed by the engine, and SGLang's abort of a
    health rid keeps its entry in rid_to_state (pinned in test_sglang_api.py): the engine drops it."""
    engine, sglang = make_sglang(health_timeout_seconds=10.0)
    assert (await engine.health()).healthy  # answered
    stream = engine.generate(_request(max_tokens=400))
    await anext(stream)
    sglang.stalled = True  # the probes wait in the queue behind the running request
    for _ in range(3):
        assert (await engine.health()).healthy
    probes = [call["rid"] for call in sglang.requests if call["rid"].startswith("HEALTH_CHECK")]
    assert len(probes) == 4 and not set(probes) & set(sglang.tokenizer_manager.rid_to_state)
    await stream.aclose()


async def test_a_failing_sglang_is_unhealthy_with_the_reason(make_sglang):
    engine, sglang = make_sglang()
    sglang.failure = RuntimeError("scheduler died")
    health = await engine.health()
    assert not health.healthy and "RuntimeError: scheduler died" in health.detail
