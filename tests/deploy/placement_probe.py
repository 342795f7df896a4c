"""Where the builder's placement puts replicas on a real multi-node Ray cluster.

Run as `python -m tests.deploy.placement_probe` (tests/deploy/test_builder.py does): starts a
local cluster of three nodes with two logical GPUs each, labelled like the KubeRay worker groups
(two `latency` trays, one `throughput` tray), deploys a probe with the builder's actor options
and placement for a TP4-over-two-nodes tier and a TP2 one-node tier, and prints as its last line
a JSON object: per tier the placement group's strategy, the node of each bundle, the replica
actor's node and GPU ids; and the node ids of each label. No GPU is needed: Ray schedules
logical GPUs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile

TIER_LABEL = "megaserve.io/tier"
ACCELERATOR = "GB300"
GPUS_PER_NODE = 2
CPUS_PER_NODE = 1
NODE_LABELS = ["latency", "latency", "throughput"]
APP_ARGS = {
    "model": {"path": "/unused"},
    "latency": {"device": "cuda", "engine": "megakernel", "tp_size": 4, "nodes_per_replica": 2,
                "accelerator_type": ACCELERATOR, "label_selector": {TIER_LABEL: "latency"},
                "cpus_per_replica": 0.5},
    "throughput": {"device": "cuda", "engine": "sglang", "tp_size": 2,
                   "accelerator_type": ACCELERATOR, "label_selector": {TIER_LABEL: "throughput"},
                   "cpus_per_replica": 0.5},
}
REPLY_TIMEOUT_SECONDS = 120


def main() -> None:
    # A Ray of its own: token auth on, and its session folder (with the "current cluster" address
    # file that `ray.init()` would read) in a private folder, short enough for Unix sockets.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    ray_tmp = tempfile.mkdtemp(prefix="ms-ray-")
    os.environ["RAY_TMPDIR"] = ray_tmp
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from megaserve.deploy import builder
    from megaserve.deploy.config import AppConfig
    from megaserve.deploy.env import Environment

    @serve.deployment
    class Probe:
        def __call__(self) -> dict:
            from ray.util.placement_group import get_current_placement_group, placement_group_table

            table = placement_group_table(get_current_placement_group())
            bundles = table["bundles_to_node_id"]
            return {"strategy": table["strategy"],
                    "bundle_nodes": [bundles[i] for i in sorted(bundles)],
                    "actor_node": ray.get_runtime_context().get_node_id(),
                    "gpu_ids": ray.get_gpu_ids()}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0,
                                                            "include_dashboard": False})
    try:
        for label in NODE_LABELS:
            cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE,
                             resources={builder.ACCELERATOR_RESOURCE_PREFIX + ACCELERATOR: 1},
                             labels={TIER_LABEL: label})
        ray.init(address=cluster.address)
        config = AppConfig.model_validate(APP_ARGS)
        process_env = builder._process_env(config, Environment.read())
        placed = {}
        for name, tier in (("latency", config.latency), ("throughput", config.throughput)):
            app = Probe.options(name=f"{name}-probe", num_replicas=1,
                                ray_actor_options=builder._actor_options(tier, process_env),
                                **builder._placement(tier)).bind()
            handle = serve.run(app, name=name, route_prefix=None)
            placed[name] = handle.remote().result(timeout_s=REPLY_TIMEOUT_SECONDS)
        placed["nodes"] = {label: [n["NodeID"] for n in ray.nodes()
                                   if n["Alive"] and n["Labels"].get(TIER_LABEL) == label]
                           for label in set(NODE_LABELS)}
        serve.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps(placed))


if __name__ == "__main__":
    main()
