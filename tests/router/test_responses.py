"""A stream that fails after its 200 ends in an OpenAI error event and then `[DONE]`, whatever the
failure, over a real router and HTTP (the status is already sent: the connection must not be cut)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator

import httpx
import pytest

from megaserve.replicas.protocol import EngineDeadError, FinishReason, GenerateRequest, StepOutput, Tier

from .conftest import MODEL

STEP_SECONDS = 0.001
CAUSE = "CUDA error: an illegal memory access"  # a replica's failure text: for the log, not the client


class BackendFailingAfterOneToken:
    """Sends one token, then ends the way `failure` says: a replica's reported error, or an
    exception that no layer expects (a Ray error of a kind the handle does not translate, say)."""

    def __init__(self, failure: str) -> None:
        self.failure = failure

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        yield StepOutput([5], [STEP_SECONDS])
        if self.failure == "reported":
            yield StepOutput([], [], FinishReason.ABORT, error=CAUSE)
        if self.failure == "dead engine":  # the engine died after this choice began (another choice failed it)
            raise EngineDeadError(f"engine step failed: RuntimeError: {CAUSE}")
        raise KeyError("an unexpected failure")

    async def healthy_replicas(self) -> int:
        return 1


@pytest.mark.parametrize(("failure", "message", "logged"), [
    ("reported", "the generation failed on the latency replica; the server's log has the cause under request id ",
     CAUSE),
    ("dead engine", "the latency replica that took the request stopped before the generation finished; retry later "
     "(request id ", CAUSE),
    ("unexpected", "internal error (request id ", "KeyError"),
])
def test_a_failure_mid_stream_is_an_error_event_then_done_and_its_cause_is_logged_not_sent(
        serve_router, caplog, failure, message, logged):
    url = serve_router({Tier.LATENCY: BackendFailingAfterOneToken(failure)})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "service_tier": "priority"}
    with caplog.at_level(logging.WARNING, logger="megaserve.router"):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    request_id = json.loads(payloads[0])["id"]
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and error["message"].startswith(message)
    assert request_id in error["message"] and logged not in error["message"]
    assert any(request_id in record.getMessage() for record in caplog.records) and logged in caplog.text


class BackendFailingAtOnce:
    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        raise KeyError("an unexpected failure")
        yield  # an async generator

    async def healthy_replicas(self) -> int:
        return 1


@pytest.mark.parametrize("origins", [(), ("https://chat.example.com",)], ids=["no CORS", "CORS"])
def test_an_unexpected_failure_before_the_answer_is_a_json_500_that_a_listed_origin_can_read(
        serve_router, caplog, origins):
    url = serve_router({Tier.LATENCY: BackendFailingAtOnce()}, cors_allowed_origins=origins)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "service_tier": "priority"}
    with caplog.at_level(logging.ERROR, logger="megaserve.router"):
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"Origin": "https://chat.example.com"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    # the client is told the id that the log's traceback is under
    [request_id] = re.findall(r"request id (chatcmpl-[0-9a-f]{32})", response.json()["error"]["message"])
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert response.headers.get("access-control-allow-origin") == (origins[0] if origins else None)
