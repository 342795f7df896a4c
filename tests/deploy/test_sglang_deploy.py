"""A throughput tier on SGLang: what the config accepts and refuses, what the builder gives its
replicas (GPUs in one bundle, SGLang's launch settings, the metrics folder), and the error a
replica gives where SGLang is not installed (as on this machine)."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from megaserve.deploy import builder
from megaserve.deploy.config import AppConfig
from megaserve.deploy.env import Environment
from megaserve.replicas.deployments import ReplicaSpec, _Replica
from megaserve.replicas.protocol import Tier
from tests.model_factory import make_tiny_model

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None
README = Path(__file__).resolve().parents[2] / "README.md"
ANY_FREE_PORT = 0
SGLANG_TIER = {
    "device": "cuda", "engine": "sglang", "tp_size": 4, "accelerator_type": "H200", "cpus_per_replica": 8,
    "max_seq_len": 8192, "max_batch": 128, "max_ongoing_requests": 256,
    "sglang_mem_fraction_static": 0.85, "sglang_args": {"chunked_prefill_size": 4096},
}


def _config(**throughput) -> AppConfig:
    return AppConfig.model_validate({"model": {"path": "/models/m", "dtype": "bfloat16"},
                                     "latency": {"enabled": False},
                                     "throughput": SGLANG_TIER | throughput})


def _env(tmp_path) -> Environment:
    return Environment(home=tmp_path, kernel_cache=tmp_path / "k", api_keys=())


def test_the_replica_starts_sglang_with_the_tier_s_settings(tmp_path):
    config = _config()
    settings = builder._engine_settings(Tier.THROUGHPUT, config.throughput, config, _env(tmp_path), "sglang",
                                        config.throughput.max_batch)
    assert settings == {
        "model_name": "megaserve-demo", "tier": "throughput", "coalesce_seconds": 0.005, "coalesce_tokens": 16,
        "tp_size": 4, "max_seq": 8192, "max_batch": 128, "dtype": "bfloat16", "enable_metrics": True,
        "mem_fraction_static": 0.85, "engine_args": {"chunked_prefill_size": 4096},
    }
    assert _config(sglang_metrics=False).throughput.sglang_metrics is False


def test_the_replica_holds_its_tp_group_s_gpus_in_one_bundle_and_writes_to_the_metrics_folder(tmp_path):
    config = _config()
    options = builder._actor_options(config.throughput, builder._process_env(config, _env(tmp_path)))
    # SGLang starts one scheduler process per GPU the replica actor sees: all tp_size of them.
    assert options["num_gpus"] == 4
    env_vars = options["runtime_env"]["env_vars"]
    assert env_vars["PROMETHEUS_MULTIPROC_DIR"] == config.metrics.multiproc_dir  # sglang:* metrics too
    assert env_vars["NCCL_NVLS_ENABLE"] == "0"
    assert builder._placement(config.throughput) == {
        "placement_group_bundles": [{"CPU": 8, "GPU": 4, "accelerator_type:H200": 0.001}],
        "placement_group_strategy": "STRICT_PACK",
    }


@pytest.mark.parametrize(("throughput", "message"), [
    ({"engine": "torch", "sglang_args": {}, "sglang_mem_fraction_static": None},
     "throughput.sglang_args, throughput.sglang_mem_fraction_static: only used with engine: sglang"),
    ({"engine": "torch", "sglang_metrics": False, "sglang_args": {}},
     "throughput.sglang_args, throughput.sglang_mem_fraction_static, throughput.sglang_metrics: only used"),
    ({"sglang_args": {"tp_size": 2, "context_length": 4096}},
     "sglang_args must not set \\['context_length', 'tp_size'\\]"),
    ({"sglang_args": {"skip_tokenizer_init": False}}, "must not set \\['skip_tokenizer_init'\\]"),
    ({"sglang_args": {"mem_fraction_static": 0.5}}, "must not set \\['mem_fraction_static'\\]"),
    ({"sglang_args": {"chunked_prefil_size": 4096, "no_such_field": 1}},
     "throughput.sglang_args: 'chunked_prefil_size' is not a ServerArgs field of SGLang 0.5.23 "
     "\\(did you mean 'chunked_prefill_size'.*; 'no_such_field' is not a ServerArgs field"),
    # ServerArgs converts nothing: YAML's `4k`, or 1e-3 (YAML 1.1 reads it as a string), would fail on the GPUs
    ({"sglang_args": {"chunked_prefill_size": "4k", "watchdog_timeout": "1e-3", "enable_metrics_for_all_schedulers": 1}},
     "throughput.sglang_args: 'chunked_prefill_size' must be int or null, got '4k'; "
     "'enable_metrics_for_all_schedulers' must be bool, got 1; 'watchdog_timeout' must be float, got '1e-3'"),
    ({"sglang_args": {"max_prefill_tokens": True}}, "'max_prefill_tokens' must be int, got True"),
    ({"sglang_mem_fraction_static": 1.0}, "sglang_mem_fraction_static\n  Input should be less than 1"),
    ({"sglang_mem_fraction_static": 0}, "sglang_mem_fraction_static\n  Input should be greater than 0"),
    ({"device": "cpu", "tp_size": 1, "accelerator_type": None}, "engine sglang needs throughput.device: cuda"),
    ({"nodes_per_replica": 2, "tp_size": 8}, "not supported by engine sglang"),
    ({"sglang_args": {"dp_size": 2, "base_gpu_id": 4}},
     "throughput.sglang_args: \\['base_gpu_id', 'dp_size'\\] must not be set: the replica's placement"),
    ({"sglang_args": {"schedule_policy": "lpm"}},
     "throughput.sglang_args: schedule_policy 'lpm' cannot be used with priority scheduling"),
])
def test_bad_sglang_tiers_fail_with_a_message_naming_the_field(throughput, message):
    with pytest.raises(ValidationError, match=message):
        _config(**throughput)


def test_sglang_args_of_the_types_their_fields_take_are_passed_on_as_given():
    args = {"chunked_prefill_size": None, "watchdog_timeout": 300, "enable_deterministic_inference": True,
            "stream_interval": 2, "json_model_override_args": "{}", "cuda_graph_bs_decode": [1, 2, 4]}
    assert _config(sglang_args=args).throughput.sglang_args == args  # an int is a float; a list, SGLang's to check


@pytest.mark.skipif(SGLANG_INSTALLED, reason="SGLang is installed here")
def test_building_an_sglang_app_where_sglang_is_missing_warns_with_the_install_command(caplog):
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        assert builder.warn_if_sglang_is_missing(_config())
    assert "pip install 'megaserve[sglang]'" in caplog.text
    assert not builder.warn_if_sglang_is_missing(AppConfig())  # the torch engine needs no SGLang


@pytest.mark.skipif(SGLANG_INSTALLED, reason="SGLang is installed here")
def test_a_replica_without_sglang_fails_to_start_with_the_install_command(tmp_path):
    config = _config(max_seq_len=256)
    settings = builder._engine_settings(Tier.THROUGHPUT, config.throughput, config, _env(tmp_path), "sglang",
                                        config.throughput.max_batch)
    spec = ReplicaSpec(engine="sglang", engine_settings=settings, metrics_port=ANY_FREE_PORT,
                       model_dir=str(make_tiny_model(tmp_path / "model", "llama")))
    with pytest.raises(RuntimeError, match="the sglang engine needs SGLang: pip install 'megaserve\\[sglang\\]'"):
        _Replica(spec)


def test_the_readme_s_sglang_example_is_a_valid_throughput_tier():
    section = README.read_text().split("## Throughput tier on SGLang", 1)[1]
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))
    throughput = AppConfig.model_validate({"latency": {"enabled": False}, **example}).throughput
    assert throughput.engine == "sglang" and throughput.tp_size == 4
    assert throughput.sglang_mem_fraction_static == 0.85
    assert throughput.sglang_args == {"chunked_prefill_size": 4096}


def test_server_args_fields_that_megaserve_does_not_set_are_accepted():
    args = {"enable_deterministic_inference": True, "enable_priority_scheduling": False,
            "incremental_streaming_output": True}
    assert _config(sglang_args=args).throughput.sglang_args == args
