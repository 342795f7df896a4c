"""Ray Serve deployments of the two tiers: thin wrappers that own one Engine each.

`LatencyReplica` serves one request at a time (`max_ongoing_requests=1`: a batch-1 engine must
never interleave requests); `ThroughputReplica` takes many. Resources (GPUs, placement-group
bundles, accelerator label) are set by `megaserve.deploy.builder`, not here. The router calls
`generate` through a streaming DeploymentHandle; Ray cancels the call when the router closes the
stream (client disconnect), which closes the engine's async generator at the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from ray import serve

from megaserve.monitoring.exporter import start_node_exporter
from megaserve.replicas.engines import create_engine
from megaserve.replicas.protocol import EngineHealth, GenerateRequest, StepOutput


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to build its engine; plain data so it pickles into Serve."""

    engine: str  # "torch" | "megakernel" | "sglang"
    engine_settings: dict = field(default_factory=dict)  # keyword arguments of the engine
    model_dir: str = ""  # Hugging Face-format directory, readable on the replica's node
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400


class _Replica:
    def __init__(self, spec: ReplicaSpec) -> None:
        start_node_exporter(spec.metrics_host, spec.metrics_port)
        self.engine = create_engine(
            spec.engine, model_dir=spec.model_dir, **spec.engine_settings
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        # Closing this stream closes the engine's at once; left to garbage collection, a batch-1
        # engine would go on decoding for nobody while anything (a traceback) holds this frame.
        async with contextlib.aclosing(self.engine.generate(request)) as outputs:
            async for output in outputs:
                yield output

    async def health(self) -> EngineHealth:
        return await self.engine.health()

    async def check_health(self) -> None:
        """Serve's periodic health check: an unhealthy engine makes Serve replace the replica."""
        report = await self.engine.health()
        if not report.healthy:
            raise RuntimeError(f"engine unhealthy: {report.detail}")

    def __del__(self) -> Awaitable[None] | None:
        """Serve's teardown hook: Serve calls it once and awaits the engine shutdown it returns.
        Python calls it again when it frees the replica; then, and when the engine never started,
        there is nothing to do (and no coroutine is made that nobody would await)."""
        engine, self.engine = getattr(self, "engine", None), None
        return engine.shutdown() if engine is not None else None


# Serve calls check_health this often, and replaces a replica whose check takes longer than the
# timeout (Serve's default, set here because an engine's own probe must finish within it: SGLang's
# HEALTH_TIMEOUT_SECONDS).
HEALTH_CHECK_PERIOD_SECONDS = 10.0
HEALTH_CHECK_TIMEOUT_SECONDS = 30.0


@serve.deployment(max_ongoing_requests=1, health_check_period_s=HEALTH_CHECK_PERIOD_SECONDS,
                  health_check_timeout_s=HEALTH_CHECK_TIMEOUT_SECONDS)
class LatencyReplica(_Replica):
    """Batch-1 replica of the latency tier (megakernel on GPU, TorchEngine on CPU)."""


@serve.deployment(max_ongoing_requests=32, health_check_period_s=HEALTH_CHECK_PERIOD_SECONDS,
                  health_check_timeout_s=HEALTH_CHECK_TIMEOUT_SECONDS)
class ThroughputReplica(_Replica):
    """Continuously batched replica of the throughput tier (SGLang on GPU, TorchEngine on CPU)."""
