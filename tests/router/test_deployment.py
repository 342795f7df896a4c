"""ServeBackend's translation of what a DeploymentHandle raises, with a stand-in handle (the real
ones run in tests/deploy/test_app.py): every Ray failure of a call ends the generation as
GenerationFailed, which the router reports as an OpenAI server error, and the call is cancelled."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ObjectLostError, WorkerCrashedError

from megaserve.replicas.protocol import GenerateRequest, StepOutput
from megaserve.router.deployment import ServeBackend
from megaserve.router.generation import GenerationFailed


class FailingResponse:
    """A streaming response that yields one output and then raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.cancelled = False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        yield StepOutput([5], [0.001])
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Stands in for `DeploymentHandle`: options(stream=True).generate.remote(request)."""

    deployment_name = "LatencyReplica"

    def __init__(self, response: FailingResponse) -> None:
        self.generate = self
        self.response = response

    def options(self, stream: bool) -> "Handle":
        return self

    def remote(self, request: GenerateRequest) -> FailingResponse:
        return self.response


@pytest.mark.parametrize("error", [WorkerCrashedError(), ObjectLostError("abc", "owner", "call site")])
def test_a_ray_failure_of_the_call_is_a_failed_generation(error):
    response = FailingResponse(error)
    backend = ServeBackend(Handle(response), retry_after_seconds=1)

    async def consume() -> list[StepOutput]:
        return [output async for output in backend.stream(GenerateRequest("r", (1, 2)))]

    expected = f"the call to the LatencyReplica replica failed: {type(error).__name__}"
    with pytest.raises(GenerationFailed, match=expected):
        asyncio.run(consume())
    assert response.cancelled
