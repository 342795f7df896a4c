"""The Serve replicas' own code, called directly (Serve's decorators only wrap these classes)."""

from __future__ import annotations

from megaserve.replicas.deployments import LatencyReplica, ReplicaSpec, ThroughputReplica, _Replica
from megaserve.replicas.engines.sglang_engine import HEALTH_TIMEOUT_SECONDS
from megaserve.replicas.protocol import GenerateRequest, SamplingParams
from tests.model_factory import make_tiny_model

ANY_FREE_PORT = 0


async def test_closing_the_replica_stream_cancels_the_engine_stream_at_once(tmp_path):
    spec = ReplicaSpec(
        engine="torch", model_dir=str(make_tiny_model(tmp_path, "llama", seed=3)), metrics_port=ANY_FREE_PORT,
        engine_settings={"model_name": "tiny-replica", "coalesce_seconds": 0.0, "coalesce_tokens": 1},
    )
    replica = _Replica(spec)
    try:
        request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        stream = replica.generate(request)
        await anext(stream)
        (running,) = replica.engine._running.values()
        await stream.aclose()  # what Ray does when the client goes away
        assert running.stream.cancelled  # before any later loop turn could finalize the engine's stream
    finally:
        await replica.__del__()  # Serve's teardown hook: shuts the engine down, once


def test_an_engine_health_probe_finishes_within_serve_s_health_check_timeout():
    for deployment in (LatencyReplica, ThroughputReplica):
        config = deployment._deployment_config
        assert HEALTH_TIMEOUT_SECONDS < config.health_check_timeout_s
        assert config.health_check_period_s < config.health_check_timeout_s
