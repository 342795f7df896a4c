"""deploy/h200.yaml and deploy/gb300.yaml: valid Serve configs whose replicas fit their hardware."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve._private.build_app import build_app as serve_build
from ray.serve.deployment import deployment_to_schema
from ray.serve.schema import ServeDeploySchema

from megaserve.deploy.builder import build_app
from megaserve.deploy.config import AppConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# GPUs one Ray node offers: a whole H200 server; one GB300 NVL72 compute tray (one k8s node).
HARDWARE = {"h200.yaml": ("H200", 8), "gb300.yaml": ("GB300", 4)}


def _serve_config(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _app_args(name: str) -> dict:
    (app,) = _serve_config(name)["applications"]
    return app["args"]


def _deployments(name: str) -> dict:
    """What `serve build` would write for the app: deployment name -> DeploymentSchema."""
    built = serve_build(build_app(_app_args(name)), name="megaserve")
    return {d.name: deployment_to_schema(d) for d in built.deployments}


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
def test_every_gpu_replica_holds_its_tensor_parallel_group_on_one_node(name):
    accelerator, gpus_per_node = HARDWARE[name]
    config = AppConfig.model_validate(_app_args(name))
    deployments = _deployments(name)
    for deployment, tier in (("LatencyReplica", config.latency),
                             ("ThroughputReplica", config.throughput)):
        schema = deployments[deployment]
        assert schema.num_replicas == tier.num_replicas
        assert schema.ray_actor_options.num_gpus == tier.tp_size
        assert schema.ray_actor_options.accelerator_type == accelerator
        assert schema.placement_group_strategy == "STRICT_PACK"
        (bundle,) = schema.placement_group_bundles
        assert bundle["GPU"] == tier.tp_size <= gpus_per_node
        assert gpus_per_node % tier.tp_size == 0  # replicas pack a node without stranded GPUs


def test_h200_config_fills_one_node_exactly():
    _, gpus_per_node = HARDWARE["h200.yaml"]
    config = AppConfig.model_validate(_app_args("h200.yaml"))
    used = sum(t.num_replicas * t.tp_size for t in (config.latency, config.throughput))
    assert used == gpus_per_node


def test_router_takes_no_gpu():
    for name in HARDWARE:
        router = _deployments(name)["RouterDeployment"]
        assert not router.ray_actor_options.num_gpus
