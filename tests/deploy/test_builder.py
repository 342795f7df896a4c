"""What build_app decides: resources, placement, environment, router capacities."""

from __future__ import annotations

from megaserve.deploy import builder
from megaserve.deploy.config import AppConfig
from megaserve.deploy.env import Environment


def _env(tmp_path) -> Environment:
    return Environment(home=tmp_path, kernel_cache=tmp_path / "k", metrics_port=9400, api_keys=())


def test_gpu_tier_takes_its_tp_group_in_one_strict_pack_bundle(tmp_path):
    config = AppConfig.model_validate(
        {"latency": {"device": "cuda", "tp_size": 8, "accelerator_type": "GB300",
                     "cpus_per_replica": 4}})
    env = builder._process_env(config, _env(tmp_path))
    options = builder._actor_options(config.latency, env)
    assert options["num_gpus"] == 8 and options["accelerator_type"] == "GB300"
    assert options["runtime_env"]["env_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert options["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] == config.metrics.multiproc_dir
    assert builder._placement(config.latency) == {
        "placement_group_bundles": [{"CPU": 4, "GPU": 8}],
        "placement_group_strategy": "STRICT_PACK",
    }


def test_cpu_tier_needs_no_gpu_and_no_placement_group(tmp_path):
    config = AppConfig()
    options = builder._actor_options(config.throughput, builder._process_env(config, _env(tmp_path)))
    assert options["num_gpus"] == 0 and "accelerator_type" not in options
    assert "NCCL_NVLS_ENABLE" not in options["runtime_env"]["env_vars"]
    assert builder._placement(config.throughput) == {}


def test_router_capacities_are_shared_between_router_replicas(tmp_path):
    config = AppConfig.model_validate({
        "latency": {"num_replicas": 3},
        "throughput": {"num_replicas": 2, "max_ongoing_requests": 10},
        "routing": {"router_replicas": 2},
    })
    settings = builder.router_settings(config, _env(tmp_path), "/models/x")
    assert settings.latency_capacity == 2  # ceil(3 / 2): never below one slot per router
    assert settings.throughput_capacity == 10
    assert settings.max_context == 2048


def test_disabled_tier_has_no_capacity(tmp_path):
    config = AppConfig.model_validate({"latency": {"enabled": False}})
    settings = builder.router_settings(config, _env(tmp_path), "/models/x")
    assert settings.latency_capacity == 0 and settings.throughput_capacity == 32


def test_engine_settings_per_engine(tmp_path):
    config = AppConfig.model_validate({"latency": {"device": "cuda"}})
    env = _env(tmp_path)
    mega = builder._engine_settings(builder.Tier.LATENCY, config.latency, config, env, "megakernel", 1)
    assert mega["kernel_cache"] == str(env.kernel_cache) and "max_batch" not in mega
    torch_settings = builder._engine_settings(builder.Tier.THROUGHPUT, config.throughput, config, env,
                                              "torch", 8)
    assert torch_settings["max_batch"] == 8 and torch_settings["tier"] == "throughput"
