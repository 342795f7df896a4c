"""SGLangEngine: the parameter mapping and output conversion (pure, always run), and a live run
against stock SGLang (skipped unless SGLang and a GPU are present)."""

from __future__ import annotations

import importlib.util

import pytest

from megaserve.replicas.engines import create_engine
from megaserve.replicas.engines.sglang_engine import (
    OutputReader,
    engine_launch_args,
    finish_of,
    model_limits,
    sglang_sampling_params,
)
from megaserve.replicas.protocol import FinishReason, GenerateRequest, SamplingParams


def test_sampling_params_map_to_sglang_names():
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=5,
                            stop_token_ids=(2, 7), ignore_eos=True)
    assert sglang_sampling_params(params) == {
        "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "ignore_eos": True,
        "stop_token_ids": [2, 7], "sampling_seed": 5,
    }


def test_defaults_disable_top_k_and_leave_out_unset_fields():
    mapped = sglang_sampling_params(SamplingParams(temperature=0.0))
    assert mapped["top_k"] == -1 and mapped["temperature"] == 0.0
    assert "stop_token_ids" not in mapped and "sampling_seed" not in mapped


def test_launch_args_layer_defaults_caller_and_owned_settings():
    args = engine_launch_args("/models/m", 4, {"mem_fraction_static": 0.8, "skip_tokenizer_init": False})
    assert args == {
        "skip_tokenizer_init": False, "enable_priority_scheduling": True, "mem_fraction_static": 0.8,
        "model_path": "/models/m", "tp_size": 4,
    }
    with pytest.raises(ValueError, match="must not set \\['tp_size'\\]"):
        engine_launch_args("/models/m", 1, {"tp_size": 2})
    with pytest.raises(ValueError, match="tp_size must be at least 1"):
        engine_launch_args("/models/m", 0, {})


def test_model_limits_prefer_sglang_context_length():
    config = {"vocab_size": 1000, "max_position_embeddings": 4096}
    assert model_limits(config, {}) == (1000, 4096)
    assert model_limits(config, {"context_length": 2048}) == (1000, 2048)
    with pytest.raises(ValueError, match="vocab_size"):
        model_limits({"max_position_embeddings": 8}, {})


def test_cumulative_outputs_become_new_tokens_with_split_step_times():
    reader = OutputReader(incremental=False)
    ids = [11]
    first = reader.read({"output_ids": ids, "meta_info": {"finish_reason": None}}, 0.3)
    ids += [12, 13]
    second = reader.read({"output_ids": ids, "meta_info": {"finish_reason": None}}, 0.02)
    last = reader.read({"output_ids": ids + [14], "meta_info": {"finish_reason": {"type": "length", "length": 4}}}, 0.01)
    assert (first.token_ids, first.step_seconds) == ([11], [0.3])
    assert (second.token_ids, second.step_seconds) == ([12, 13], [0.01, 0.01])
    assert (last.token_ids, last.finish_reason) == ([14], FinishReason.LENGTH)


def test_incremental_outputs_pass_through():
    reader = OutputReader(incremental=True)
    reader.read({"output_ids": [1, 2], "meta_info": {}}, 0.1)
    chunk = reader.read({"output_ids": [3], "meta_info": {"finish_reason": {"type": "stop", "matched": 3}}}, 0.1)
    assert (chunk.token_ids, chunk.finish_reason, reader.delivered) == ([3], FinishReason.STOP, 3)


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


def test_an_unknown_finish_reason_aborts_with_its_description():
    reason, error = finish_of({"type": "preempted"})
    assert reason == FinishReason.ABORT and "preempted" in error


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_without_sglang_the_engine_says_how_to_install_it(tiny_model_dir):
    with pytest.raises(RuntimeError, match="pip install 'megaserve\\[sglang\\]'"):
        create_engine("sglang", model_dir=tiny_model_dir, coalesce_seconds=0.01)


def _sglang_on_gpu() -> bool:
    if importlib.util.find_spec("sglang") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _sglang_on_gpu(), reason="needs SGLang and a CUDA GPU")
async def test_live_sglang_matches_the_reference_greedy_tokens(tiny_model_dir, reference_greedy):
    from megaserve.replicas.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine(tiny_model_dir, engine_args={"mem_fraction_static": 0.3}, model_name="tiny-sglang")
    try:
        prompt = (5, 17, 99, 3, 42)
        request = GenerateRequest("live", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        items = [item async for item in engine.generate(request)]
    finally:
        await engine.shutdown()
    assert len(items[0].token_ids) == 1
    assert [t for item in items for t in item.token_ids] == reference_greedy(list(prompt), 8)
    assert items[-1].finish_reason == FinishReason.LENGTH
