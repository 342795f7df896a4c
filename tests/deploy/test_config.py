"""The config schema: defaults, cross-field rules, and the packaged local.yaml."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from megaserve.deploy.config import AppConfig
from megaserve.deploy.local import load_serve_config


def test_defaults_serve_the_demo_model_on_cpu_with_both_tiers():
    config = AppConfig()
    assert config.model.path is None
    assert config.latency.enabled and config.throughput.enabled
    assert config.latency.resolved_engine == "torch"


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, AppConfig.__base__):
                walk(annotation)

    walk(AppConfig)


@pytest.mark.parametrize("args, message", [
    ({"latency": {"enabled": False}, "throughput": {"enabled": False}}, "at least one"),
    ({"latency": {"engine": "megakernel"}}, "needs latency.device: cuda"),
    ({"latency": {"tp_size": 2}}, "tp_size > 1 needs device: cuda"),
    ({"latency": {"device": "cuda", "tp_size": 3}}, "tp_size must be one of 1, 2, 4, 8"),
    ({"throughput": {"engine": "sglang"}}, "needs throughput.device: cuda"),
    ({"throughput": {"max_batch": 64, "max_ongoing_requests": 8}}, "max_ongoing_requests"),
    ({"model": {"max_context": 4096}}, "shorter than model.max_context"),
    ({"model": {"max_context": 4096}, "latency": {"max_seq_len": 4096}},
     r"throughput.max_seq_len \(2048\) is shorter than model.max_context \(4096\)"),
    ({"latency": {"accelerator_type": "H200"}}, "accelerator_type"),
    ({"latency": {"device": "cuda", "accelerator_type": ""}},
     "latency.accelerator_type\n  String should have at least 1 character"),
    ({"latency": {"nodes_per_replica": 2}}, "nodes_per_replica > 1 needs device: cuda"),
    ({"latency": {"device": "cuda", "tp_size": 4, "nodes_per_replica": 3}}, "must split evenly"),
    ({"latency": {"device": "cuda", "tp_size": 2, "nodes_per_replica": 4}}, "must split evenly"),
    ({"latency": {"device": "cuda", "engine": "torch", "tp_size": 8, "nodes_per_replica": 2}},
     "needs engine megakernel"),
    ({"throughput": {"device": "cuda", "engine": "sglang", "tp_size": 8, "nodes_per_replica": 2}},
     "not supported by engine sglang"),
    ({"latency": {"nodes_per_replica": 0}}, "nodes_per_replica"),
    ({"latency": {"device": "cuda", "engine": "torch", "tp_size": 4}}, "latency.tp_size > 1 needs engine megakernel"),
    ({"throughput": {"device": "cuda", "tp_size": 2}}, "throughput.tp_size > 1 needs engine sglang"),
    ({"routing": {"latency_wait_seconds": -1}}, "latency_wait_seconds"),
    ({"routing": {"body_timeout_seconds": 0}}, "routing.body_timeout_seconds\n  Input should be greater than 0"),
    ({"model": {"dtype": "float16"}, "latency": {"device": "cuda"}}, "runs bfloat16 weights, not model.dtype float16"),
    ({"unknown_section": {}}, "unknown_section"),
    ({"model": {"path": ""}}, "model.path\n.*must be an absolute path"),
    ({"model": {"path": "models/llama"}}, "model.path\n.*must be an absolute path"),
    ({"metrics": {"multiproc_dir": ""}}, "metrics.multiproc_dir\n.*must be an absolute path"),
    ({"metrics": {"multiproc_dir": "~/metrics"}}, "metrics.multiproc_dir\n.*must be an absolute path"),
    ({"latency": {"num_replicas": True}}, "latency.num_replicas\n  Input should be a valid integer"),
    ({"throughput": {"max_batch": "8"}}, "throughput.max_batch\n  Input should be a valid integer"),
    # refused by Ray only once the replicas are placed, the app failing to deploy
    ({"throughput": {"cpus_per_replica": 0.00001}}, "Ray cannot reserve less than 0.0001 of a resource"),
    ({"routing": {"router_cpus": 0.00001}}, "routing.router_cpus\n.*Ray cannot reserve less than 0.0001"),
    ({"latency": {"label_selector": {"megaserve.io/tier": "latency tier"}}},
     "latency.label_selector\n.*Invalid label selector value `latency tier`"),
    ({"latency": {"label_selector": {"-bad key": "x"}}}, "latency.label_selector\n"),
])
def test_bad_configs_fail_with_a_message_naming_the_problem(args, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(args)


@pytest.mark.parametrize("text", [
    "latency: {graceful_shutdown_seconds: .inf}",
    "throughput: {graceful_shutdown_seconds: .nan}",
    "latency: {coalesce_seconds: .nan}",
    "throughput: {cpus_per_replica: .inf}",
    "routing: {latency_wait_seconds: .nan}",
    "routing: {body_timeout_seconds: .inf}",
    "routing: {router_cpus: .inf}",
    "throughput: {device: cuda, engine: sglang, sglang_mem_fraction_static: .nan}",
])
def test_an_infinite_or_nan_float_is_refused(text):
    with pytest.raises(ValidationError, match="Input should be a finite number"):
        AppConfig.model_validate(yaml.safe_load(text))


# An origin written otherwise than a browser sends it would match no request.
@pytest.mark.parametrize("origins, message", [
    (["https://chat.example.com/"], "is not an origin as a browser sends it"),
    (["chat.example.com"], "is not an origin as a browser sends it"),
    (["https://Chat.example.com"], "is not an origin as a browser sends it"),
    (["https://chat.example.com:443"], "a port only where it is not"),
    (["http://localhost:99999"], "is not an origin as a browser sends it"),
    (["ftp://files.example.com"], "is not an origin as a browser sends it"),
    (["*", "https://chat.example.com"], "allows every origin; list it alone"),
    (["https://bücher.example"], "a browser sends 'https://xn--bcher-kva.example'"),
    (["https://*.example.com"], "is not an origin as a browser sends it"),
    (["https://chat.example.com:08080"],
     "a browser sends 'https://chat.example.com:8080'"),
    (["https://chat.example.com?"], "is not an origin as a browser sends it"),
    ([" https://chat.example.com"], "is not an origin as a browser sends it"),
    (["http://[0:0:0:0:0:0:0:1]:8080"], "a browser sends 'http://\\[::1\\]:8080'"),
    (["http://127.1:3000"], "is not an origin as a browser sends it"),
    (["http://[fe80::1%25eth0]"], "is not an origin as a browser sends it"),
    (["http://localhost:0"], "is not an origin as a browser sends it"),
    (["null"], "is not an origin as a browser sends it"),
])
def test_cors_origins_a_browser_never_sends_are_refused(origins, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"routing": {"cors_allowed_origins": origins}})


def test_cors_origins_as_browsers_send_them_are_accepted():
    origins = ["https://chat.example.com", "http://localhost:3000", "http://[::1]:8080", "http://127.0.0.1:8080",
               "https://xn--bcher-kva.example", "http://[2001:db8::1]"]
    config = AppConfig.model_validate({"routing": {"cors_allowed_origins": origins}})
    assert config.routing.cors_allowed_origins == origins
    assert AppConfig.model_validate({"routing": {"cors_allowed_origins": ["*"]}}).routing.cors_allowed_origins == ["*"]
    assert AppConfig().routing.cors_allowed_origins == []  # none unless listed


def test_a_disabled_tier_s_sequence_length_does_not_bound_the_context():
    config = AppConfig.model_validate({"model": {"max_context": 4096}, "throughput": {"enabled": False},
                                       "latency": {"max_seq_len": 4096}})
    assert config.model.max_context == 4096


def test_limits_equal_to_what_they_bound_are_accepted():
    config = AppConfig.model_validate({"model": {"max_context": 4096}, "latency": {"max_seq_len": 4096},
                                       "throughput": {"max_seq_len": 4096, "max_batch": 16,
                                                      "max_ongoing_requests": 16}})
    assert config.throughput.max_seq_len == 4096 and config.throughput.max_ongoing_requests == 16


def test_other_dtypes_are_fine_where_the_megakernel_does_not_serve():
    for latency in ({"device": "cuda", "engine": "torch"}, {"enabled": False}, {}):
        assert AppConfig.model_validate({"model": {"dtype": "float16"}, "latency": latency}).model.dtype == "float16"


def test_cuda_latency_tier_picks_the_megakernel():
    config = AppConfig.model_validate({"latency": {"device": "cuda", "tp_size": 8}})
    assert config.latency.resolved_engine == "megakernel"


def test_a_tp_group_over_two_nodes_takes_an_even_share_of_each():
    config = AppConfig.model_validate(
        {"latency": {"device": "cuda", "tp_size": 8, "nodes_per_replica": 2}})
    assert config.latency.gpus_per_node == 4 and config.latency.resolved_engine == "megakernel"
    assert AppConfig().latency.gpus_per_node == 0  # cpu


def test_packaged_local_yaml_is_a_valid_serve_config_and_app_config():
    config = load_serve_config(None)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "megaserve.deploy.builder:build_app"
    parsed = AppConfig.model_validate(app["args"])
    assert config["http_options"]["host"] == "127.0.0.1"
    assert parsed.latency.device == parsed.throughput.device == "cpu"


def test_a_serve_config_without_applications_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"port": 8000}}))
    with pytest.raises(ValueError, match="applications"):
        load_serve_config(str(path))
