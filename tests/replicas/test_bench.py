"""`megaserve bench`'s arithmetic and report, on the CPU (the measurements themselves need a GPU:
docs/perf.md holds those runs)."""

from __future__ import annotations

import pytest
import torch

from megaserve.replicas.bench import (
    BENCH_CONFIGS,
    Result,
    down_stored_transposed,
    format_table,
    parse_args,
    random_model,
    stage_read_bytes,
)
from megaserve.replicas.models import ModelConfig
from megaserve.replicas.models.sharding import plan_sharding, step_read_bytes

BF16 = 2


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
@pytest.mark.parametrize("context", [1, 1025, 8193])
def test_stage_bytes_add_up_to_the_roofline_s_bytes_but_norms(name, context):
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS[name])
    stages = stage_read_bytes(config, context)
    floor = step_read_bytes(plan_sharding(config, 1), context, BF16)
    norms = (2 * config.hidden_size + (2 * config.head_dim if config.qk_norm else 0)) * BF16
    assert sum(stages.values()) == floor.total - config.num_layers * norms - floor.other
    assert list(stages) == ["qkv", "attention", "o_proj", "mlp", "lm_head"]


def test_llama_1b_stage_bytes_are_the_checkpoint_s():
    stages = stage_read_bytes(ModelConfig.from_hf_dict(BENCH_CONFIGS["Llama-3.2-1B"]), 1025)
    assert stages["qkv"] == 16 * (2048 + 2 * 512) * 2048 * BF16  # 16 layers of q, k, v rows
    assert stages["attention"] == 16 * 2 * 512 * 1025 * BF16  # K and V of 8 heads x 64
    assert stages["lm_head"] == 128256 * 2048 * BF16  # the tied embedding, read once


def test_the_table_reports_each_stage_s_share_of_the_measured_bandwidth():
    bandwidth = 4e12
    stage_bytes = {"qkv": 4_000_000_000, "lm_head": 2_000_000_000}  # 1 ms and 0.5 ms at the bandwidth
    results = [
        Result("Llama-3.2-1B", 1024, "megakernel", 2.0, 500.0, 1, 0.75,
               stage_ms={"qkv": 2.0, "lm_head": 0.5}, stage_bytes=stage_bytes, timing_cost_ms=0.004,
               stage_tail_ms={"qkv": 0.25}, stage_release_ms={"qkv": 0.125}),
        Result("Llama-3.2-1B", 1024, "compile+graph", error="BackendCompilerFailed: inductor\ndetails"),
    ]
    table = format_table(results, bandwidth, barrier_seconds=1.25e-6)
    assert "HBM read bandwidth (reduction): 4,000 GB/s; one grid barrier: 1.25 µs" in table
    assert "megakernel        2.000      500        1    75.0%" in table
    assert "compile+graph  failed: BackendCompilerFailed: inductor" in table and "details" not in table
    assert "stages Llama-3.2-1B ctx=1024 (timing build, which costs +0.004 ms/step):" in table
    assert "| qkv | 4,000.0 | 2.000 | 2,000 | 50% | +1.000 | 0.250 | 0.125 |" in table
    assert "| lm_head | 2,000.0 | 0.500 | 4,000 | 100% | +0.000 |  |  |" in table  # no barrier closes the head


def test_contexts_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--kernel-cache", "k", "--contexts", "0"])
    assert "contexts must be positive" in capsys.readouterr().err


def test_the_megakernel_gets_its_layout_of_w_down_and_the_baselines_the_checkpoint_s():
    config = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    })
    model = random_model(config, torch.device("cpu"))
    checkpoint = [layer.w_down for layer in model.layers]
    with down_stored_transposed(model):
        for layer, w_down in zip(model.layers, checkpoint, strict=True):
            assert layer.w_down.t().is_contiguous() and torch.equal(layer.w_down, w_down)
    assert all(layer.w_down is w_down for layer, w_down in zip(model.layers, checkpoint, strict=True))
    assert all(layer.w_down.is_contiguous() for layer in model.layers)
