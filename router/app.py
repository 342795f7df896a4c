"""The OpenAI-compatible HTTP ingress: `create_app(settings, backends)` -> a FastAPI app.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}], GET /health, and vLLM's
POST /tokenize and POST /detokenize.
Per request: authenticate, read and validate the body, apply the chat template and tokenize once,
choose and admit a tier (`policy`), stream the replica's tokens back as text (`generation`),
as server-sent events in OpenAI's chunk format or as one JSON body. The tier used is echoed in
the body's `service_tier` (OpenAI's names: "priority" for latency, "default", "flex" or "scale"
for throughput) and in the `x-megaserve-tier` header ("latency" / "throughput"), with the routing
reason in `x-megaserve-route-reason`. Every refusal is an OpenAI-style error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megaserve.monitoring.metrics import REJECTED_REQUESTS
from megaserve.replicas.protocol import SEED_MIN, GenerateRequest, SamplingParams, Tier
from megaserve.router.backend import Backend
from megaserve.router.errors import GENERATION_ERRORS, INVALID_REQUEST, SERVER_ERROR, APIError, generation_error, invalid
from megaserve.router.generation import Delta, Generation
from megaserve.router.openai_schema import (
    INVALID_FIELD,
    MAX_CHOICES,
    UNSUPPORTED_PARAMETER,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizedText,
    DetokenizeRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    ModelRequest,
    Tokens,
    TokenizeRequest,
)
from megaserve.router.policy import TIER_HEADER, Admission, Lease, RouterPosition, choose_tier, single_router
from megaserve.router.responses import ResponseBuilder, served_tier
from megaserve.router.settings import ANY_ORIGIN, RouterSettings, capped_by_model, sampling_defaults
from megaserve.router.streaming import ClientDisconnected, EventStreamResponse, disconnect_aware, unless_disconnected
from megaserve.router.tokenizer import ChatTemplateError, Tokenizer

ROUTE_REASON_HEADER = "x-megaserve-route-reason"
CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site of a request a page of another origin made
JSON_MEDIA_TYPES = ("application/json",)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"; nobody reads it
SPILLOVER_PRIORITY = 1  # queue position in the throughput engine of work that asked for latency
# OpenAI's default max_tokens for the legacy /v1/completions, kept by vLLM and SGLang; chat's default is
# instead the room left in the context, as in vLLM.
COMPLETION_DEFAULT_MAX_TOKENS = 16
UNION_TAG_TYPES = {"str", "int", "float", "bool"}
# A client chooses the names of the fields it sends: the log line of ignored ones stays bounded.
LOGGED_FIELD_NAMES = 8
LOGGED_NAME_CHARS = 64
# Bodies and prompts of more characters than this are validated and tokenized one at a time, on a
# thread of their own. Validated on the event loop, a body near the limit (4 MB) could hold every
# stream of the router for seconds (4,096 chat messages of 32 content parts each: 0.8 s, 4 s
# where every part is refused; on this thread the loop waits at most ~0.1 s at a time, while the
# validator holds the GIL between its Python calls); a few such prompts, a second or more each and
# hundreds of MB while they last, would otherwise hold every worker thread that the other requests'
# prompts are tokenized on.
LARGE_REQUEST_CHARS = 64 * 1024

log = logging.getLogger(__name__)
T = TypeVar("T")
RequestBody = TypeVar("RequestBody", bound=ModelRequest)


def create_app(
    settings: RouterSettings,
    backends: Mapping[Tier, Backend],
    tokenizer: Tokenizer | None = None,
    position: RouterPosition = single_router,
    disconnect_errors: tuple[type[Exception], ...] = (),
) -> FastAPI:
    """The router app over `backends` (one per enabled tier); the tokenizer is read from
    `settings.model_dir` unless given; `position` places it among several router replicas;
    `disconnect_errors` are what reading a request's body, or watching for its client's disconnect,
    raises where its client has left, besides Starlette's ClientDisconnect (under Serve, Ray's
    TaskCancelledError)."""
    settings = capped_by_model(settings)
    router = _Router(settings, backends, tokenizer or Tokenizer.from_dir(settings.model_dir), position,
                     disconnect_errors)
    # No redirect from a path with a trailing slash: Starlette's 307 takes its address from the Host
    # header, and a client that follows it re-sends the prompt there (without its key).
    app = FastAPI(title="megaserve", openapi_url=None, docs_url=None, redoc_url=None, lifespan=router.lifespan,
                  redirect_slashes=False)
    app.state.router = router
    app.add_exception_handler(APIError, router.error_response)
    app.add_exception_handler(StarletteHTTPException, _http_error_response)
    app.add_exception_handler(ClientDisconnect, _client_gone_response)
    app.add_exception_handler(Exception, _unexpected_error_response)
    app.add_api_route("/v1/chat/completions", router.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", router.completions, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", router.model, methods=["GET"])
    app.add_api_route("/tokenize", router.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", router.detokenize, methods=["POST"])
    app.add_api_route("/health", router.health, methods=["GET"])
    if settings.cors_allowed_origins:
        # A browser page of a listed origin may call the API with its own API key (no cookies:
        # the key is the credential), and read the headers that say how it was served; its 500s
        # too, answered inside the CORS layer (Starlette answers them outside every middleware).
        app.add_middleware(_ServerErrorsInside)
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=[TIER_HEADER, ROUTE_REASON_HEADER, "retry-after"])
    return app


class _Router:
    def __init__(self, settings: RouterSettings, backends: Mapping[Tier, Backend], tokenizer: Tokenizer,
                 position: RouterPosition, disconnect_errors: tuple[type[Exception], ...]) -> None:
        self.settings = settings
        self.disconnect_errors = disconnect_errors
        self.backends = backends
        self.tokenizer = tokenizer
        self.admission = Admission(settings, backends, position)
        self.sampling_defaults = sampling_defaults(settings.model_dir)
        self._large_requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaserve-large-request")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncGenerator[None, None]:
        """The app's life: when it shuts down, the large requests' thread ends once it has done
        the work queued for it. (uvicorn and Ray Serve shut an app down after its requests.)"""
        yield
        self._large_requests.shutdown(wait=False)

    # --- endpoints -------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await self._read(request, ChatCompletionRequest)
        prompt_ids = await self._encode_chat(body.messages, add_generation_prompt=True)
        return await self._generate(request, body, [prompt_ids], arrival, chat=True)

    async def _encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """The prompt ids of `messages` through the model's chat template."""
        rendered = [message.template_message() for message in messages]
        size = sum(len(message["content"]) for message in rendered)
        try:
            return await self._tokenizer_call(size, self.tokenizer.encode_chat, rendered, add_generation_prompt)
        except ChatTemplateError as error:
            raise invalid(str(error), "messages") from None

    async def _tokenizer_call(self, size: int, work: Callable[..., T], *args) -> T:
        """work(*args), the tokenizer's, in a worker thread (a long prompt must not stall every other
        stream of this router), on the large requests' own thread where its input, of `size`
        characters or ids, has more than LARGE_REQUEST_CHARS."""
        if size > LARGE_REQUEST_CHARS:
            return await self._on_large_requests_thread(work, *args)
        return await asyncio.to_thread(work, *args)

    async def _on_large_requests_thread(self, work: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._large_requests, work, *args)

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await self._read(request, CompletionRequest)
        prompts = body.prompts
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        encoded = iter(await self._tokenizer_call(sum(map(len, texts)), self._encode_all, texts)
                       if texts else [])
        prompts_ids = []
        for index, prompt in enumerate(prompts):
            where, param = _prompt_name(index, len(prompts), chat=False)
            ids = next(encoded) if isinstance(prompt, str) else list(prompt)
            if not ids:  # [], or "" where the tokenizer adds no BOS: nothing for a model to go on from
                raise invalid(f"{where} is empty" + ("" if isinstance(prompt, list) else
                                                     ": it has no tokens, and this model's tokenizer adds none"), param)
            if min(ids) < 0:
                raise invalid(f"{where}: token ids must be >= 0", param)
            self._check_token_ids(ids, param)
            prompts_ids.append(ids)
        return await self._generate(request, body, prompts_ids, arrival, chat=False)

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(text) for text in texts]

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids the generation endpoints would read, and the model's context."""
        body = await self._read(request, TokenizeRequest)
        if body.messages is not None:
            ids = await self._encode_chat(body.messages, body.add_generation_prompt)
        else:
            add_special_tokens = body.add_special_tokens is not False
            ids = await self._tokenizer_call(len(body.prompt), self.tokenizer.encode, body.prompt,
                                             add_special_tokens)
        token_strs = (await self._tokenizer_call(len(ids), self.tokenizer.token_strings, ids)
                      if body.return_token_strs else None)
        return _json(Tokens(count=len(ids), max_model_len=self.settings.max_context, tokens=ids,
                            token_strs=token_strs))

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids, special tokens written out (tokenize's inverse)."""
        body = await self._read(request, DetokenizeRequest)
        self._check_token_ids(body.tokens, "tokens")
        text = await self._tokenizer_call(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return _json(DetokenizedText(prompt=text))

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return _json(ModelList(data=[self._model_card()]))

    async def model(self, request: Request, model: str) -> Response:
        self._authorize(request)
        self._check_model(model)
        return _json(self._model_card())

    async def health(self) -> Response:
        tiers = {}
        for tier in Tier:
            slots = self.admission.slots[tier]
            tiers[tier.value] = {
                "healthy": await self.admission.healthy(tier),
                "in_flight": slots.in_flight,
                "capacity": slots.capacity,
            }
        serving = any(t["healthy"] for t in tiers.values())
        status = HTTPStatus.OK if serving else HTTPStatus.SERVICE_UNAVAILABLE
        return JSONResponse({"status": "ok" if serving else "unavailable", "tiers": tiers}, status)

    async def error_response(self, request: Request, error: APIError) -> Response:
        if not error.routed:
            REJECTED_REQUESTS.labels(model=self.settings.model_name, reason=error.reason).inc()
        return JSONResponse(error.body(), error.status, headers=error.headers)

    # --- reading a request ----------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        # A browser page of another site may send a "simple" POST (no preflight: no Content-Type, or
        # text/plain) that CORS never sees; it says so in Sec-Fetch-Site. Without API keys such a page
        # could run generations on a server it found (a local one at 127.0.0.1:8000).
        site, origin = request.headers.get("sec-fetch-site"), request.headers.get("origin")
        allowed = self.settings.cors_allowed_origins
        if site in CROSS_SITE and not (ANY_ORIGIN in allowed or origin in allowed):
            raise APIError(HTTPStatus.FORBIDDEN, f"a page of origin {origin!r} may not call this API: "
                           "it is not in routing.cors_allowed_origins", code="origin_not_allowed",
                           reason="unauthorized")
        if not self.settings.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(key.strip().encode(), k.encode()) for k in self.settings.api_keys
        ):
            raise APIError(HTTPStatus.UNAUTHORIZED, "a valid API key is required: Authorization: Bearer <key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                           reason="unauthorized")

    async def _read(self, request: Request, schema: type[RequestBody]) -> RequestBody:
        self._authorize(request)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type and media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
            raise APIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                           f"the body must be JSON (Content-Type: application/json), got {media_type!r}")
        raw = await self._read_limited(request)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise invalid(f"the body is not valid UTF-8 (byte {error.start})") from None
        try:
            if len(text) > LARGE_REQUEST_CHARS:
                body = await self._on_large_requests_thread(schema.model_validate_json, text)
            else:
                body = schema.model_validate_json(text)
        except ValidationError as error:
            raise _validation_error(error) from None
        if body.model:
            self._check_model(body.model)
        if ignored := body.ignored_fields:
            log.warning("%s: served without fields it does not know: %s", request.url.path, _names_for_log(ignored))
        return body

    async def _read_limited(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is larger than {limit} bytes",
                             code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)

        timeout_seconds = self.settings.body_timeout_seconds
        try:
            await asyncio.wait_for(read(), timeout_seconds)  # not asyncio.timeout: Python 3.10 has none
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            raise APIError(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {timeout_seconds:g} s (it had "
                           f"{size} bytes); send it faster", code="body_timeout", reason="timeout",
                           headers={"Connection": "close"}) from None
        except self.disconnect_errors as error:  # the client left: answered as Starlette's own case is
            raise ClientDisconnect() from error
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist; this server serves "
                           f"`{self.settings.model_name}`.", param="model", code="model_not_found")

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if ids and max(ids) >= vocab:
            raise invalid(f"token id {max(ids)} is outside the vocabulary (size {vocab})", param)

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.settings.model_name, created=self.settings.created,
                         max_model_len=self.settings.max_context)

    def _sampling(self, body: GenerationRequest, prompts: list[list[int]]) -> SamplingParams:
        """The sampling of every choice, its max_tokens fitting the longest prompt's room."""
        context = self.settings.max_context
        chat = isinstance(body, ChatCompletionRequest)
        longest = max(range(len(prompts)), key=lambda index: len(prompts[index]))
        prompt_tokens = len(prompts[longest])
        where, param = _prompt_name(longest, len(prompts), chat)
        if prompt_tokens >= context:
            raise invalid(f"{where} has {prompt_tokens} tokens but the model's context is {context}; "
                          "shorten it", param, "context_length_exceeded")
        room = context - prompt_tokens
        requested = body.requested_max_tokens
        max_tokens = requested or (room if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        if max_tokens > room:
            field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            given = "" if requested else " (the default)"
            raise invalid(f"{field} is {max_tokens}{given} but {where} ({prompt_tokens} tokens) leaves room for "
                          f"{room} in the model's context of {context}", field, "context_length_exceeded")
        stop_ids = tuple(body.stop_token_ids or ())  # the engines add the model's eos ids themselves
        self._check_token_ids(list(stop_ids), "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.sampling_defaults["temperature"] if body.temperature is None else body.temperature,
            top_p=self.sampling_defaults["top_p"] if body.top_p is None else body.top_p,
            top_k=self.sampling_defaults["top_k"] if body.top_k is None else max(body.top_k, 0),
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            logprobs=body.requested_logprobs,
        )

    # --- serving a request ----------------------------------------------------------------

    async def _generate(
        self, request: Request, body: GenerationRequest, prompts: list[list[int]], arrival: float, *, chat: bool
    ) -> Response:
        """Generate `n` choices of each prompt (one, or a completion batch's): choice `p * n + i` is
        prompt p's i-th, as in vLLM and OpenAI."""
        n_per_prompt = body.n or 1
        n = n_per_prompt * len(prompts)
        choices_param = "n" if n_per_prompt > 1 else "prompt"  # what the client has to change
        if n > MAX_CHOICES:
            batch = f" for each of {len(prompts)} prompts, {n} choices in all" if len(prompts) > 1 else ""
            raise invalid(f"n is {n_per_prompt}{batch}; this server returns at most {MAX_CHOICES} choices",
                          choices_param)
        sampling = self._sampling(body, prompts)
        longest = max(map(len, prompts))
        route = choose_tier(self.settings, body.service_tier, request.headers.get(TIER_HEADER), longest, n)
        receive = disconnect_aware(request.receive, self.disconnect_errors)
        try:
            lease = await unless_disconnected(receive, self.admission.admit(route, n, choices_param),
                                              discard=Lease.release)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        asked_for_latency = lease.tier is Tier.THROUGHPUT and lease.route.reason in ("spillover", "only_tier")
        priority = SPILLOVER_PRIORITY if asked_for_latency else 0
        generation = Generation(
            backend=self.backends[lease.tier],
            requests=[
                GenerateRequest(f"{request_id}-{p * n_per_prompt + i}", tuple(prompt_ids),
                                _choice_sampling(sampling, i), priority)
                for p, prompt_ids in enumerate(prompts) for i in range(n_per_prompt)
            ],
            choices_per_prompt=n_per_prompt,
            tier=lease.tier,
            model=self.settings.model_name,
            tokenizer=self.tokenizer,
            stops=body.stop_sequences,
            arrival=arrival,
            include_stop_text=body.include_stop_text,
            skip_special_tokens=body.skips_special_tokens,
        )
        answer = ResponseBuilder(request_id, self.settings.model_name, served_tier(body, lease), chat, generation,
                                 return_token_ids=body.returns_token_ids, logprobs=body.requested_logprobs)
        headers = {TIER_HEADER: lease.tier.value, ROUTE_REASON_HEADER: lease.route.reason}
        events = generation.events()
        try:
            if body.stream:
                first = await unless_disconnected(receive, anext(events))
                stream = answer.sse(first, events, n, body.include_usage, body.continuous_usage)
                response = EventStreamResponse(stream, headers, on_close=lease.release, source=events,
                                               disconnect_errors=self.disconnect_errors)
                lease = None  # the response releases it when the stream ends
                return response
            deltas = await unless_disconnected(receive, _collect(events))
            return _json(answer.complete(deltas, n), headers, exclude=answer.unasked_fields)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (APIError, *GENERATION_ERRORS) as error:
            raise _routed(generation_error(error, lease.tier.value, request_id,
                                           self.settings.retry_after_seconds)) from None
        except Exception:  # noqa: BLE001 - a fault of the router's own: logged under the id the client is told
            log.exception("%s failed", request_id)
            raise _routed(APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error (request id {request_id})",
                                   type=SERVER_ERROR)) from None
        finally:
            if lease is not None:
                try:
                    await events.aclose()
                finally:  # the slot goes back even if closing the backend stream raised
                    lease.release()


def _routed(error: APIError) -> APIError:
    """`error`, raised after admission: counted as its choices' end, not as a rejection."""
    error.routed = True
    return error


async def _collect(events: AsyncGenerator[Delta, None]) -> list[Delta]:
    return [delta async for delta in events]


def _prompt_name(index: int, prompts: int, chat: bool) -> tuple[str, str]:
    """How an error names prompt `index` of `prompts`: in words, and as its `param`."""
    if prompts > 1:
        return f"prompt {index} of the batch", f"prompt.{index}"
    return "the prompt", "messages" if chat else "prompt"


def _choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choices of one request differ by seed (seed + index, wrapped into the seeds' 64-bit range), so
    a seeded request is reproducible."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index - SEED_MIN) % 2**64 + SEED_MIN)


def _json(model: BaseModel, headers: Mapping[str, str] | None = None, exclude: dict | None = None) -> Response:
    return Response(model.model_dump_json(exclude=exclude), media_type="application/json", headers=headers)


def _names_for_log(names: list[str]) -> str:
    shown = [repr(name[:LOGGED_NAME_CHARS]) for name in names[:LOGGED_FIELD_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _validation_error(error: ValidationError) -> APIError:
    """The error that got furthest into the body (for a union: the member the client meant),
    with pydantic's union member tags left out of its path."""
    deepest = max(error.errors(include_url=False), key=lambda e: len(e["loc"]))
    if deepest["type"] == "json_invalid":
        return invalid(f"the body is not valid JSON: {deepest['msg'].removeprefix('Invalid JSON: ')}")
    path = [str(part) for part in deepest["loc"] if not _is_union_tag(part)]
    if deepest["type"] == UNSUPPORTED_PARAMETER:  # the field's own name ends its path: messages.1.tool_calls
        return invalid(deepest["msg"], ".".join([*path, deepest["ctx"]["name"]]), UNSUPPORTED_PARAMETER)
    if deepest["type"] == INVALID_FIELD:  # a field wrong given the others: named as the last
        return invalid(deepest["msg"], ".".join([*path, deepest["ctx"]["name"]]))
    if not path:
        return invalid(f"the body must be a JSON object: {deepest['msg']}")
    param = ".".join(path)
    return invalid(f"{param}: {deepest['msg'].removeprefix('Value error, ')}", param)


def _is_union_tag(part: str | int) -> bool:
    """Pydantic names union members in error paths by type ("str", "list[int]", "ContentPart");
    the schema's field names are all lower_snake_case."""
    return isinstance(part, str) and (part in UNION_TAG_TYPES or "[" in part or part[:1].isupper())


async def _http_error_response(request: Request, error: StarletteHTTPException) -> Response:
    """Unknown paths (404) and wrong methods (405), in OpenAI's error shape."""
    body = {"error": {"message": f"{request.method} {request.url.path}: {error.detail}",
                      "type": INVALID_REQUEST, "param": None, "code": None}}
    return JSONResponse(body, error.status_code, headers=error.headers)


async def _client_gone_response(request: Request, error: ClientDisconnect) -> Response:
    """The client left while sending its body: nothing to answer, nothing went wrong here."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


class _ServerErrorsInside:
    """ASGI middleware: an exception that no handler took becomes the JSON 500 here, before the
    response has started, rather than in Starlette's outermost layer, past the middleware added
    after this one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:  # noqa: BLE001 - what Starlette's ServerErrorMiddleware would take
            if started:  # too late for a status: the server cuts the connection, as without this layer
                raise
            response = await _unexpected_error_response(Request(scope), error)
            await response(scope, receive, send)


async def _unexpected_error_response(request: Request, error: Exception) -> Response:
    log.exception("unexpected error serving %s", request.url.path, exc_info=error)
    body = {"error": {"message": "internal error", "type": SERVER_ERROR, "param": None, "code": None}}
    return JSONResponse(body, HTTPStatus.INTERNAL_SERVER_ERROR)
