"""OpenAI-style errors: every refusal is `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app turns it into JSON with its status and headers (Retry-After).
The `type` strings are the ones OpenAI's clients know how to map to exception classes.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from megaserve.replicas.protocol import EngineDeadError, EngineError

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"  # what OpenAI answers with 429
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"
log = logging.getLogger(__name__)


class GenerationFailed(Exception):
    """The replica ended a stream with an error, or without a finish reason."""


# What a generation that its replica ended can raise after the request was admitted
GENERATION_ERRORS = (EngineError, EngineDeadError, GenerationFailed)


class APIError(Exception):
    """A request the router answers with an error status instead of a completion."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str = "invalid",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.reason = reason  # label of megaserve_rejected_requests_total
        # raised after the request was admitted to a tier: its end is counted as its choices'
        # finish (megaserve_finished_requests, "error"), not again as a rejection
        self.routed = False

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request itself is wrong; sending it again will not help."""
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def busy(message: str, retry_after_seconds: int, *, unavailable: bool) -> APIError:
    """429 when every slot is taken, 503 when no replica is healthy; both say when to retry."""
    if unavailable:
        return service_unavailable(message, retry_after_seconds, code="no_healthy_replicas")
    return APIError(HTTPStatus.TOO_MANY_REQUESTS, message, type=RATE_LIMIT, code="saturated",
                    headers={"Retry-After": str(retry_after_seconds)}, reason="saturated")


def service_unavailable(message: str, retry_after_seconds: int, *, code: str) -> APIError:
    """503 with Retry-After: no replica can serve the request now (none is healthy, or the one that
    took it has a dead engine), but a retry may find one, so clients and gateways retry."""
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, type=UNAVAILABLE, code=code,
                    headers={"Retry-After": str(retry_after_seconds)}, reason="unavailable")


def generation_error(error: Exception, tier: str, request_id: str, retry_after_seconds: int) -> APIError:
    """The answer to an admitted request whose generation ended in `error`. A replica's failure text
    (an exception's message: a CUDA error, a file path, a node's address) is for operators: it goes
    to the router's log under the request id, which the client is told, and not to the client, as
    OpenAI's API answers a server fault. A refusal written for clients keeps its text."""
    if isinstance(error, APIError):  # the backend's own: e.g. no replica is running to take the call
        return error
    if isinstance(error, EngineError):  # the engine's validation of the request
        return invalid(str(error))
    if isinstance(error, EngineDeadError):  # shut down (a rolling update) or failed: a retry may find another
        log.warning("%s: the %s replica stopped before the generation finished: %s", request_id, tier, error)
        return service_unavailable(
            f"the {tier} replica that took the request stopped before the generation finished; retry later "
            f"(request id {request_id})", retry_after_seconds, code="engine_dead")
    if isinstance(error, GenerationFailed):
        log.error("%s: the generation failed on the %s replica: %s", request_id, tier, error)
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"the generation failed on the {tier} replica; the server's log has the cause "
                        f"under request id {request_id}", type=SERVER_ERROR)
    raise TypeError(f"not a generation's error: {error!r}")
