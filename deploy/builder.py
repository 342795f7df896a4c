"""`build_app`: an AppConfig in, a bound Ray Serve application out.

Usable as the `import_path` of a Serve config (`megaserve.deploy.builder:build_app`, with the
AppConfig as the application's `args`), by `serve run`, `serve deploy`, KubeRay's serveConfigV2
and `megaserve up`. Resources are decided here and only here: GPUs per replica, placement-group
bundles (one node's share of a tensor-parallel group per bundle), accelerator types, node label
selectors, and the environment every megaserve process starts with (the node's metrics folder).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.serve import Application, Deployment
from ray.serve.context import _get_global_client  # Serve has no public getter of its HTTP options

from megaserve.deploy.config import AppConfig, LatencyTier, Routing, ThroughputTier, TierCommon
from megaserve.deploy.env import Environment
from megaserve.monitoring.exporter import MULTIPROC_ENV
from megaserve.replicas.deployments import LatencyReplica, ReplicaSpec, ThroughputReplica
from megaserve.replicas.engines.sglang_engine import INSTALL_HINT
from megaserve.replicas.protocol import Tier
from megaserve.router.deployment import RouterDeployment, router_max_ongoing_requests
from megaserve.router.settings import ANY_ORIGIN, RouterSettings

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; never let NCCL use it.
GPU_PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Ray turns an actor's `accelerator_type: X` into a demand for this resource; inside a placement
# group the demand must fit the bundle, so every bundle carries it (and lands on an X node).
ACCELERATOR_RESOURCE_PREFIX = "accelerator_type:"
ACCELERATOR_RESOURCE_DEMAND = 0.001

log = logging.getLogger(__name__)


def _process_env(config: AppConfig, env: Environment) -> dict[str, str]:
    return {
        MULTIPROC_ENV: config.metrics.multiproc_dir,
        "MEGASERVE_HOME": str(env.home),
        "MEGASERVE_KERNEL_CACHE": str(env.kernel_cache),
    }


def _actor_options(tier: TierCommon, process_env: dict[str, str]) -> dict[str, Any]:
    """The replica actor's own resources: its CPUs and the GPUs of its first node (all of the
    tensor-parallel group's GPUs when the group fits one node)."""
    gpus = tier.gpus_per_node
    env_vars = dict(process_env, **(GPU_PROCESS_ENV if gpus else {}))
    options: dict[str, Any] = {
        "num_cpus": tier.cpus_per_replica,
        "num_gpus": gpus,
        "runtime_env": {"env_vars": env_vars},
    }
    if tier.accelerator_type is not None:
        options["accelerator_type"] = tier.accelerator_type
    if tier.label_selector is not None:
        options["label_selector"] = dict(tier.label_selector)
    return options


def _placement(tier: TierCommon) -> dict[str, Any]:
    """One placement-group bundle per node of the tensor-parallel group.

    Serve starts the replica actor in the first bundle, whose CPUs and GPUs are exactly the
    actor's own (`_actor_options`). One node (nodes_per_replica 1): one STRICT_PACK bundle of all
    tp_size GPUs. Several nodes: STRICT_SPREAD bundles of tp_size / nodes_per_replica GPUs each,
    one per node; the replica actor holds the first node's GPUs, and the engine's ranks on the
    other nodes are to be started in the other bundles (the replica's placement group is
    captured by the tasks and actors it starts). Same-NVLink-domain placement of those nodes is
    the cluster's job (k8s/rayservice.yaml keeps the latency pods in one NVLink clique)."""
    if tier.device != "cuda":
        return {}
    gpus = {"GPU": tier.gpus_per_node}
    if tier.accelerator_type is not None:
        gpus[ACCELERATOR_RESOURCE_PREFIX + tier.accelerator_type] = ACCELERATOR_RESOURCE_DEMAND
    bundles = [{"CPU": tier.cpus_per_replica, **gpus}]
    bundles += [dict(gpus) for _ in range(tier.nodes_per_replica - 1)]
    strategy = "STRICT_PACK" if tier.nodes_per_replica == 1 else "STRICT_SPREAD"
    placement: dict[str, Any] = {
        "placement_group_bundles": bundles,
        "placement_group_strategy": strategy,
    }
    if tier.label_selector is not None:
        placement["placement_group_bundle_label_selector"] = [
            dict(tier.label_selector) for _ in bundles]
    return placement


def _engine_settings(tier_name: Tier, tier: TierCommon, config: AppConfig, env: Environment,
                     engine: str, max_batch: int) -> dict[str, Any]:
    """Keyword arguments of the tier's engine (see replicas.engines.create_engine)."""
    common = {
        "model_name": config.model.name,
        "tier": tier_name.value,
        "coalesce_seconds": tier.coalesce_seconds,
        "coalesce_tokens": tier.coalesce_tokens,
    }
    if engine == "sglang":  # SGLang owns its device and KV cache; it sees the replica's GPUs
        sglang = config.throughput
        return {**common, "tp_size": sglang.tp_size, "max_seq": sglang.max_seq_len,
                "max_batch": sglang.max_batch, "dtype": config.model.dtype,
                "enable_metrics": sglang.sglang_metrics,
                "mem_fraction_static": sglang.sglang_mem_fraction_static,
                "engine_args": dict(sglang.sglang_args)}
    local = {**common, "device": tier.device, "dtype": config.model.dtype, "max_seq": tier.max_seq_len}
    if engine == "megakernel":
        return {**local, "kernel_cache": str(env.kernel_cache)}
    return {**local, "max_batch": max_batch}


def _replica_spec(tier_name: Tier, tier: LatencyTier | ThroughputTier, engine: str, max_batch: int,
                  config: AppConfig, env: Environment, model_dir: str) -> ReplicaSpec:
    return ReplicaSpec(
        engine=engine,
        engine_settings=_engine_settings(tier_name, tier, config, env, engine, max_batch),
        model_dir=model_dir,
        metrics_host=config.metrics.bind_host,
        metrics_port=config.metrics.port,
    )


def model_dir(config: AppConfig, env: Environment) -> str:
    """The model directory every process reads. The demo model is made here, once, on the node
    that builds the app: it is for single-node use; multi-node configs name a shared `path`."""
    if config.model.path is not None:
        return config.model.path
    from megaserve.replicas.models.demo import ensure_demo_model

    return str(ensure_demo_model(env.home))


def router_settings(config: AppConfig, env: Environment, model_dir: str) -> RouterSettings:
    """The tiers' whole capacities: each router replica admits its share (router.settings.router_share)."""
    tiers = [t for t in (config.latency, config.throughput) if t.enabled]
    max_context = config.model.max_context or min(t.max_seq_len for t in tiers)
    latency_slots = config.latency.num_replicas if config.latency.enabled else 0
    throughput_slots = (config.throughput.num_replicas * config.throughput.max_ongoing_requests
                        if config.throughput.enabled else 0)
    return RouterSettings(
        model_name=config.model.name,
        model_dir=model_dir,
        max_context=max_context,
        latency_capacity=latency_slots,
        throughput_capacity=throughput_slots,
        latency_replicas=config.latency.num_replicas,
        throughput_replicas=config.throughput.num_replicas,
        api_keys=env.api_keys,
        max_body_bytes=config.routing.max_body_bytes,
        body_timeout_seconds=config.routing.body_timeout_seconds,
        latency_max_prompt_tokens=config.routing.latency_max_prompt_tokens,
        latency_wait_seconds=config.routing.latency_wait_seconds,
        spillover=config.routing.spillover,
        retry_after_seconds=config.routing.retry_after_seconds,
        cors_allowed_origins=tuple(config.routing.cors_allowed_origins),
        created=int(time.time()),  # /v1/models' `created` (Unix seconds): when this app was built
    )


def warn_if_sglang_is_missing(config: AppConfig) -> bool:
    """Warn (and return True) when the throughput tier runs SGLang and this node cannot import it.

    A warning, not an error: the app is built where Serve's controller runs (a cluster's head
    node, often without GPUs or their packages), and the replicas that need SGLang run on the GPU
    nodes, where SGLangEngine refuses to start without it, naming the install command."""
    tier = config.throughput
    if not (tier.enabled and tier.engine == "sglang") or importlib.util.find_spec("sglang"):
        return False
    log.warning("throughput.engine is sglang but SGLang is not installed on this node; every GPU node "
                "that hosts throughput replicas needs it: %s", INSTALL_HINT)
    return True


def warn_if_gpus_wait_for_tensor_parallelism(config: AppConfig) -> bool:
    """Warn (and return True) when latency replicas reserve a tensor-parallel group that the
    megakernel engine does not use yet: it drives the first GPU of the group, and the group's other
    GPUs stay idle until the tensor-parallel megakernel exists (a deployment sized for it, such as
    deploy/gb300.yaml, keeps its placement meanwhile)."""
    tier = config.latency
    if not (tier.enabled and tier.resolved_engine == "megakernel" and tier.tp_size > 1):
        return False
    log.warning("latency.tp_size is %d, but the megakernel engine drives one GPU of each replica's group; "
                "the other %d stay idle (use tp_size 1 and more replicas to use them now)",
                tier.tp_size, tier.tp_size - 1)
    return True


def warn_if_unauthenticated(env: Environment, routing: Routing) -> bool:
    """Warn (and return True) when the app serves without API keys: MEGASERVE_API_KEYS unset where
    the app is built (exported in a shell other than the one that ran `ray start` or `serve deploy`,
    say), or the client's one-letter-shorter MEGASERVE_API_KEY set in its place."""
    if env.api_keys:
        return False
    mistaken = " (MEGASERVE_API_KEY is set: that is the client's key; the server reads MEGASERVE_API_KEYS)"
    anyone = (f"; with cors_allowed_origins {ANY_ORIGIN!r}, so can every web page its users open"
              if ANY_ORIGIN in routing.cors_allowed_origins else "")
    log.warning("MEGASERVE_API_KEYS is not set: the API serves every caller without a key%s%s",
                mistaken if env.api_key else "", anyone)
    return True


@dataclass(frozen=True)
class ClusterPorts:
    """Ports that servers hold in the Ray cluster this process is in, port -> what holds it:
    `refused` for metrics.port (Serve's HTTP port: Serve runs a proxy on every node unless told
    otherwise), `warned` (Ray's metrics export port of some nodes: which nodes megaserve will run on
    is not known when the app is built, and KubeRay builds it once only the head is up)."""

    refused: dict[int, str] = field(default_factory=dict)
    warned: dict[int, str] = field(default_factory=dict)


def cluster_ports() -> ClusterPorts:
    """Every deploy path builds the app inside a running cluster (`serve deploy` and KubeRay in a
    task of Serve's controller); outside one (a plain call) nothing is known."""
    if not ray.is_initialized():
        return ClusterPorts()
    addresses: dict[int, list[str]] = {}
    for node in ray.nodes():
        if node["Alive"]:
            addresses.setdefault(node["MetricsExportPort"], []).append(node["NodeManagerAddress"])
    ports = ClusterPorts(warned={port: f"Ray's metrics export port on {', '.join(sorted(where))}"
                                 for port, where in addresses.items()})
    serve_client = _get_global_client(raise_if_no_controller_running=False)
    if serve_client is not None:
        ports.refused[serve_client.http_config.port] = "Serve's HTTP port"
    return ports


def refuse_taken_metrics_port(config: AppConfig, ports: ClusterPorts) -> None:
    """Refuse a metrics.port that Serve's proxies hold: the node exporter would wait for it for ever
    (no megaserve metrics), or take it first and keep the proxy from starting. One that Ray exports
    its metrics on somewhere is a warning: it matters only if megaserve runs there."""
    port = config.metrics.port
    if port in ports.refused:
        raise ValueError(f"metrics.port {port} is {ports.refused[port]} too; give it another")
    if port in ports.warned:
        log.warning("metrics.port %d is %s too: megaserve's metrics are not served on those nodes if it runs "
                    "there", port, ports.warned[port])


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Build the whole app: router ingress bound to one deployment per enabled tier."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    refuse_taken_metrics_port(config, cluster_ports())
    warn_if_sglang_is_missing(config)
    warn_if_gpus_wait_for_tensor_parallelism(config)
    env = Environment.read()
    warn_if_unauthenticated(env, config.routing)
    process_env = _process_env(config, env)
    directory = model_dir(config, env)

    def tier_deployment(deployment: Deployment, kind: Tier, tier: TierCommon, engine: str, max_batch: int,
                        **options: Any) -> Application | None:
        """The tier's replicas, bound to their spec; None for a tier the config leaves out."""
        if not tier.enabled:
            return None
        return deployment.options(
            num_replicas=tier.num_replicas,
            graceful_shutdown_timeout_s=tier.graceful_shutdown_seconds,
            ray_actor_options=_actor_options(tier, process_env),
            **_placement(tier),
            **options,
        ).bind(_replica_spec(kind, tier, engine, max_batch, config, env, directory))

    latency = tier_deployment(LatencyReplica, Tier.LATENCY, config.latency, config.latency.resolved_engine, 1)
    throughput = tier_deployment(ThroughputReplica, Tier.THROUGHPUT, config.throughput, config.throughput.engine,
                                 config.throughput.max_batch,
                                 max_ongoing_requests=config.throughput.max_ongoing_requests)

    settings = router_settings(config, env, directory)
    return RouterDeployment.options(
        num_replicas=config.routing.router_replicas,
        max_ongoing_requests=router_max_ongoing_requests(settings),
        graceful_shutdown_timeout_s=config.router_graceful_shutdown_seconds,
        ray_actor_options={"num_cpus": config.routing.router_cpus, "runtime_env": {"env_vars": process_env}},
    ).bind(settings, latency, throughput, config.metrics.bind_host, config.metrics.port)
