"""What build_app decides: resources, placement, environment, router capacities."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ray.serve._private.config import ReplicaConfig

from megaserve.deploy import builder
from megaserve.deploy.config import AppConfig
from megaserve.deploy.env import Environment
from tests.live import free_port

REPO = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_SECONDS = 300
# In a running Ray cluster with Serve, where every deploy path builds the app: metrics.port as Serve's
# HTTP port, deployed as `serve deploy` and `serve run FILE` do (built in a task of Serve's controller),
# then built here with Ray's metrics export port and with a free port; prints what each came to.
PORT_PROBE = textwrap.dedent("""
    import json, os, shutil, sys, tempfile, time
    os.environ["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="ms-ray-")  # no other cluster's address
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    from megaserve.deploy import builder
    http_port, free_metrics_port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {"model": {"path": model_dir}, "metrics": {"port": http_port}}
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [
            {"name": "clash", "import_path": "megaserve.deploy.builder:build_app", "args": args}]}))
        deadline = time.monotonic() + 240
        while (app := serve.status().applications["clash"]).status != "DEPLOY_FAILED":
            assert time.monotonic() < deadline, app
            time.sleep(0.5)
        said = {"http": app.message}
        (node,) = ray.nodes()
        for name, port in (("ray", node["MetricsExportPort"]), ("free", free_metrics_port)):
            try:
                builder.build_app({**args, "metrics": {"port": port}})
                said[name] = "built"
            except ValueError as error:
                said[name] = str(error)
        serve.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps(said))
""")

class Probe:
    """A stand-in replica class for Serve's option checks."""


def _env(tmp_path) -> Environment:
    return Environment(home=tmp_path, kernel_cache=tmp_path / "k", api_keys=())


def test_gpu_tier_takes_its_tp_group_in_one_strict_pack_bundle(tmp_path):
    config = AppConfig.model_validate(
        {"latency": {"device": "cuda", "tp_size": 8, "accelerator_type": "GB300",
                     "cpus_per_replica": 4}})
    env = builder._process_env(config, _env(tmp_path))
    options = builder._actor_options(config.latency, env)
    assert options["num_gpus"] == 8 and options["accelerator_type"] == "GB300"
    assert "label_selector" not in options
    assert options["runtime_env"]["env_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert options["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] == config.metrics.multiproc_dir
    assert builder._placement(config.latency) == {
        "placement_group_bundles": [{"CPU": 4, "GPU": 8, "accelerator_type:GB300": 0.001}],
        "placement_group_strategy": "STRICT_PACK",
    }


def test_tp_group_over_two_nodes_takes_one_strict_spread_bundle_per_node(tmp_path):
    tier = {"megaserve.io/tier": "latency"}
    config = AppConfig.model_validate(
        {"latency": {"device": "cuda", "tp_size": 8, "nodes_per_replica": 2,
                     "accelerator_type": "GB300", "label_selector": tier, "cpus_per_replica": 4}})
    options = builder._actor_options(config.latency, builder._process_env(config, _env(tmp_path)))
    # The replica actor is the first node's share: the first bundle's CPUs and GPUs.
    assert options["num_gpus"] == 4 and options["num_cpus"] == 4
    assert options["label_selector"] == tier
    assert builder._placement(config.latency) == {
        "placement_group_bundles": [{"CPU": 4, "GPU": 4, "accelerator_type:GB300": 0.001},
                                    {"GPU": 4, "accelerator_type:GB300": 0.001}],
        "placement_group_strategy": "STRICT_SPREAD",
        "placement_group_bundle_label_selector": [tier, tier],
    }


def test_serve_accepts_the_placement_and_the_actor_fits_its_first_bundle(tmp_path):
    config = AppConfig.model_validate(
        {"latency": {"device": "cuda", "tp_size": 4, "nodes_per_replica": 2,
                     "accelerator_type": "GB300", "label_selector": {"megaserve.io/tier": "l"}}})
    options = builder._actor_options(config.latency, builder._process_env(config, _env(tmp_path)))
    placement = builder._placement(config.latency)
    ReplicaConfig.create(Probe, ray_actor_options=options, **placement)  # Serve's own checks
    too_big = dict(options, num_gpus=config.latency.tp_size)
    with pytest.raises(ValueError, match="first bundle"):
        ReplicaConfig.create(Probe, ray_actor_options=too_big, **placement)


def test_a_bad_label_selector_fails_when_the_app_is_built(tmp_path):
    with pytest.raises(ValueError, match="label key"):
        builder.build_app({"model": {"path": str(tmp_path)},
                           "latency": {"label_selector": {"not a key!": "x"}}})


def test_an_app_built_with_api_keys_set_to_no_key_fails_naming_the_variable(monkeypatch, tmp_path):
    # `serve run`, `serve deploy` and KubeRay build the app where the variable is read: Serve shows
    # this error as the application's DEPLOY_FAILED message, instead of routers open to everyone.
    monkeypatch.setenv("MEGASERVE_API_KEYS", " , ")
    with pytest.raises(ValueError, match="MEGASERVE_API_KEYS is set but holds no key"):
        builder.build_app({"model": {"path": str(tmp_path)}})


@pytest.mark.parametrize("client_key, keys, origins, warning", [
    (None, None, [], "MEGASERVE_API_KEYS is not set: the API serves every caller without a key"),
    ("sk-meant-for-the-server", None, [], "MEGASERVE_API_KEY is set: that is the client's key"),
    (None, None, ["*"], "with cors_allowed_origins '*', so can every web page its users open"),
    ("sk-client", "sk-a,sk-b", ["*"], None),
], ids=["no keys", "the client's variable instead", "no keys and any origin", "keys set"])
def test_an_app_built_without_api_keys_says_so(monkeypatch, tmp_path, caplog, client_key, keys, origins, warning):
    for name, value in (("MEGASERVE_API_KEY", client_key), ("MEGASERVE_API_KEYS", keys)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        app = builder.build_app({"model": {"path": str(tmp_path)}, "routing": {"cors_allowed_origins": origins}})
    assert app._bound_deployment.init_args[0].api_keys == (tuple(keys.split(",")) if keys else ())
    said = [r.getMessage() for r in caplog.records if "MEGASERVE_API_KEYS" in r.getMessage()]
    assert (warning is None and not said) or (len(said) == 1 and warning in said[0]), said


def test_a_metrics_port_that_the_cluster_s_servers_hold_is_refused_by_the_builder(monkeypatch, tmp_path, caplog):
    """Serve's HTTP port is refused; Ray's metrics export port of some node only warned of (a KubeRay
    head that exports Ray's metrics on it and runs no megaserve process is a valid layout, and the
    head may be the only node when the app is built)."""
    app = {"model": {"path": str(tmp_path)}, "metrics": {"port": 8000}}
    ports = builder.ClusterPorts(refused={8000: "Serve's HTTP port"},
                                 warned={9400: "Ray's metrics export port on 10.0.0.1"})
    monkeypatch.setattr(builder, "cluster_ports", lambda: ports)
    with pytest.raises(ValueError, match="metrics.port 8000 is Serve's HTTP port too; give it another"):
        builder.build_app(app)
    builder.build_app({**app, "metrics": {"port": 9400}})
    assert "metrics.port 9400 is Ray's metrics export port on 10.0.0.1 too" in caplog.text
    builder.build_app({**app, "metrics": {"port": 9500}})


def test_the_builder_knows_the_http_and_ray_metrics_ports_of_a_real_cluster(tmp_path):
    """`serve deploy`, `serve run FILE` and KubeRay build the app where Serve already runs, so that
    a config that `megaserve up` would refuse is refused there too; in a process of its own."""
    result = subprocess.run([sys.executable, "-c", PORT_PROBE, str(free_port()), str(free_port()), str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert "is Serve's HTTP port too; give it another" in said["http"], said
    assert said["ray"] == "built", said  # a warning: megaserve may never run where Ray exports on it
    assert said["free"] == "built"


def test_two_node_replicas_land_on_two_labelled_nodes_of_a_real_cluster():
    """A real multi-node Ray cluster (three 2-GPU nodes, no GPUs needed) running Serve with the
    builder's placement; in a process of its own, so that no other Ray of this test session
    is in the way."""
    result = subprocess.run([sys.executable, "-m", "tests.deploy.placement_probe"], cwd=REPO,
                            capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS,
                            check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    placed = json.loads(result.stdout.strip().splitlines()[-1])
    spread, packed = placed["latency"], placed["throughput"]
    assert spread["strategy"] == "STRICT_SPREAD" and packed["strategy"] == "STRICT_PACK"
    # TP4 over two nodes: one bundle per latency node, the actor on the first with its 2 GPUs.
    assert sorted(spread["bundle_nodes"]) == sorted(placed["nodes"]["latency"])
    assert spread["actor_node"] == spread["bundle_nodes"][0] and len(spread["gpu_ids"]) == 2
    # TP2 on one node: the throughput-labelled one.
    assert packed["bundle_nodes"] == placed["nodes"]["throughput"] == [packed["actor_node"]]
    assert len(packed["gpu_ids"]) == 2


def test_cpu_tier_needs_no_gpu_and_no_placement_group(tmp_path):
    config = AppConfig()
    options = builder._actor_options(config.throughput, builder._process_env(config, _env(tmp_path)))
    assert options["num_gpus"] == 0 and "accelerator_type" not in options
    assert "NCCL_NVLS_ENABLE" not in options["runtime_env"]["env_vars"]
    assert builder._placement(config.throughput) == {}


def test_router_settings_hold_the_tiers_whole_capacities(tmp_path):
    config = AppConfig.model_validate({
        "latency": {"num_replicas": 3},
        "throughput": {"num_replicas": 2, "max_ongoing_requests": 10},
        "routing": {"router_replicas": 2},
    })
    settings = builder.router_settings(config, _env(tmp_path), "/models/x")
    # the tiers' whole: each router replica takes its share from its rank (RouterSettings.for_router)
    assert settings.latency_capacity == 3
    assert settings.throughput_capacity == 20
    assert (settings.latency_replicas, settings.throughput_replicas) == (3, 2)  # what the capacities count
    assert settings.max_context == 2048


def test_router_settings_carry_the_cors_origins(tmp_path):
    config = AppConfig.model_validate({"routing": {"cors_allowed_origins": ["https://chat.example.com"]}})
    assert builder.router_settings(config, _env(tmp_path), "/models/x").cors_allowed_origins == (
        "https://chat.example.com",)


def test_serve_never_queues_at_a_router_what_the_router_would_admit(tmp_path):
    """Serve holds a router's requests past its max_ongoing_requests in the proxy's queue, with no
    429: the limit must be above every slot the router may admit (here 1 + 4 * 512)."""
    config = {"model": {"path": str(tmp_path)}, "throughput": {"num_replicas": 4, "max_ongoing_requests": 512}}
    router = builder.build_app(config)._bound_deployment
    settings = router.init_args[0]
    admitted = settings.latency_capacity + settings.throughput_capacity
    assert admitted == 2049
    assert router._deployment_config.max_ongoing_requests > admitted


def test_the_served_model_was_created_when_the_app_was_built(tmp_path):
    before = int(time.time())
    router = builder.build_app({"model": {"path": str(tmp_path)}})._bound_deployment
    settings = router.init_args[0]
    assert before <= settings.created <= time.time()  # Unix seconds, as OpenAI's and vLLM's `created`


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


def test_replicas_and_routers_let_running_generations_finish_when_they_stop(tmp_path):
    app = builder.build_app({"model": {"path": str(tmp_path)}, "latency": {"graceful_shutdown_seconds": 90},
                             "throughput": {"graceful_shutdown_seconds": 600}})
    router = app._bound_deployment
    _, latency, throughput = router.init_args[:3]
    timeout = {name: deployment._deployment_config.graceful_shutdown_timeout_s for name, deployment in (
        ("router", router), ("latency", latency._bound_deployment), ("throughput", throughput._bound_deployment))}
    assert timeout == {"latency": 90, "throughput": 600, "router": 600}  # the router outlasts its tiers' streams
    default = builder.build_app({"model": {"path": str(tmp_path)}})._bound_deployment
    assert default._deployment_config.graceful_shutdown_timeout_s == 300  # Serve's own 20 s cut generations off
    for tiers, longest in (({"latency": {"graceful_shutdown_seconds": 900}}, 900),
                           ({"throughput": {"enabled": False}, "latency": {"graceful_shutdown_seconds": 45}}, 45)):
        router = builder.build_app({"model": {"path": str(tmp_path)}, **tiers})._bound_deployment
        assert router._deployment_config.graceful_shutdown_timeout_s == longest


def test_routers_reserve_the_configured_cpus_and_none_by_default(tmp_path):
    for routing, cpus in (({}, 0), ({"router_cpus": 1.5}, 1.5)):
        router = builder.build_app({"model": {"path": str(tmp_path)}, "routing": routing})._bound_deployment
        assert router.ray_actor_options["num_cpus"] == cpus
    with pytest.raises(ValueError, match="router_cpus"):
        AppConfig.model_validate({"routing": {"router_cpus": -1}})
