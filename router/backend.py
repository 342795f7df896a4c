"""What the router needs from a tier: a token stream per request, and how many replicas are up.

Two implementations: `EngineBackend` runs an `Engine` in this process (the embedded mode, and
tests); `megaserve.router.deployment` calls Ray Serve replicas through a `DeploymentHandle`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from megaserve.replicas.protocol import Engine, GenerateRequest, StepOutput


class Backend(Protocol):
    def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        """The replica's `StepOutput`s for `request`. Closing the generator (`aclose`) must stop
        the generation on the replica at once; an `EngineError` means the request is invalid, an
        `EngineDeadError` that the replica's engine serves nothing any more (another may)."""

    async def healthy_replicas(self) -> int:
        """Replicas able to take requests now; 0 makes the router answer 503 for this tier."""


class EngineBackend:
    """One engine in this process, serving a tier."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        generation = self.engine.generate(request)
        try:
            async for output in generation:
                yield output
        finally:
            await generation.aclose()

    async def healthy_replicas(self) -> int:
        return 1 if (await self.engine.health()).healthy else 0
