"""deploy/h200.yaml and deploy/gb300.yaml: valid Serve configs whose replicas fit their hardware."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from ray.serve._private.build_app import build_app as serve_build
from ray.serve.deployment import deployment_to_schema
from ray.serve.schema import ServeDeploySchema

from megaserve.deploy.builder import build_app, warn_if_gpus_wait_for_tensor_parallelism
from megaserve.deploy.config import AppConfig
from megaserve.monitoring.metrics import REQUEST_BUCKETS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# GPUs one Ray node offers: a whole H200 server; one GB300 NVL72 compute tray (one k8s node).
HARDWARE = {"h200.yaml": ("H200", 8), "gb300.yaml": ("GB300", 4)}


def _serve_config(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _app_args(name: str) -> dict:
    (app,) = _serve_config(name)["applications"]
    return app["args"]


def _built(name: str) -> dict:
    """The app's deployments, as Serve's controller builds them: name -> Deployment."""
    built = serve_build(build_app(_app_args(name)), name="megaserve")
    return {d.name: d for d in built.deployments}


def _deployments(name: str) -> dict:
    """What `serve build` would write for the app: deployment name -> DeploymentSchema."""
    return {name: deployment_to_schema(d) for name, d in _built(name).items()}


@pytest.mark.parametrize("name", HARDWARE)
def test_is_a_serve_config_whose_args_are_an_app_config(name):
    serve_config = _serve_config(name)
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "megaserve.deploy.builder:build_app"
    config = AppConfig.model_validate(app["args"])
    assert config.latency.resolved_engine == "megakernel"
    assert config.throughput.engine == "sglang"
    assert config.model.path is not None and config.model.dtype == "bfloat16"
    # Prometheus scrapes every node's exporter from elsewhere, on the port the k8s pods expose.
    assert config.metrics.bind_host == "0.0.0.0" and config.metrics.port == 9400


@pytest.mark.parametrize("name", HARDWARE)
def test_every_gpu_replica_takes_its_tensor_parallel_group_in_whole_nodes(name):
    accelerator, gpus_per_node = HARDWARE[name]
    config = AppConfig.model_validate(_app_args(name))
    deployments = _deployments(name)
    for deployment, tier in (("LatencyReplica", config.latency),
                             ("ThroughputReplica", config.throughput)):
        schema = deployments[deployment]
        assert schema.num_replicas == tier.num_replicas
        assert schema.ray_actor_options.accelerator_type == accelerator
        bundles = schema.placement_group_bundles
        assert len(bundles) == tier.nodes_per_replica
        assert sum(b["GPU"] for b in bundles) == tier.tp_size
        # The replica actor holds its first node's GPUs, as Serve requires of the first bundle.
        assert schema.ray_actor_options.num_gpus == bundles[0]["GPU"]
        # Each node's share fits a node and packs it without stranded GPUs.
        assert all(b["GPU"] <= gpus_per_node and gpus_per_node % b["GPU"] == 0 for b in bundles)
        assert all(b[f"accelerator_type:{accelerator}"] > 0 for b in bundles)
        assert schema.placement_group_strategy == (
            "STRICT_PACK" if tier.nodes_per_replica == 1 else "STRICT_SPREAD")


def test_gb300_latency_tier_is_tp8_over_two_trays(caplog):
    _, gpus_per_tray = HARDWARE["gb300.yaml"]
    # The megakernel engine drives one GPU of the eight: the build says so.
    with caplog.at_level(logging.WARNING, logger="megaserve.deploy.builder"):
        assert warn_if_gpus_wait_for_tensor_parallelism(AppConfig.model_validate(_app_args("gb300.yaml")))
    assert "the other 7 stay idle" in caplog.text
    assert not warn_if_gpus_wait_for_tensor_parallelism(AppConfig.model_validate(_app_args("h200.yaml")))
    latency = AppConfig.model_validate(_app_args("gb300.yaml")).latency
    assert (latency.tp_size, latency.nodes_per_replica) == (8, 2)
    assert latency.gpus_per_node == gpus_per_tray  # each replica takes two whole trays
    # Ray 2.60's DeploymentSchema leaves the bundles' label selector out; the controller keeps it.
    replica_config = _built("gb300.yaml")["LatencyReplica"]._replica_config
    assert replica_config.placement_group_bundle_label_selector == [latency.label_selector] * 2
    assert replica_config.ray_actor_options["label_selector"] == latency.label_selector


def test_h200_config_fills_one_node_exactly():
    _, gpus_per_node = HARDWARE["h200.yaml"]
    config = AppConfig.model_validate(_app_args("h200.yaml"))
    used = sum(t.num_replicas * t.tp_size for t in (config.latency, config.throughput))
    assert used == gpus_per_node


def test_router_takes_no_gpu_and_a_cpu_that_keeps_it_off_a_head_without_cpus():
    for name in HARDWARE:
        router = _deployments(name)["RouterDeployment"]
        assert not router.ray_actor_options.num_gpus
        assert router.ray_actor_options.num_cpus == 1


@pytest.mark.parametrize("name", HARDWARE)
def test_the_request_duration_histogram_reaches_past_the_longest_generation_the_config_lets_finish(name):
    # graceful_shutdown_seconds is sized to a tier's longest generation; one longer than the last
    # bucket edge falls in +Inf, and every quantile of its tier then reads as that edge.
    config = AppConfig.model_validate(_app_args(name))
    longest = max(tier.graceful_shutdown_seconds for tier in (config.latency, config.throughput) if tier.enabled)
    assert REQUEST_BUCKETS[-1] >= longest
