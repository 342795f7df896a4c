"""The router app served by a real uvicorn on 127.0.0.1 (ephemeral port, own thread), over real
TorchEngines on the demo model. `HoldingEngine` is the real demo model too, but pauses each
generation after its first output until the test lets it go: a slot held on purpose.
`RecordingEngineBackend` keeps the requests the router sends a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping

import pytest
import uvicorn

from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.models.demo import ensure_demo_model
from megaserve.replicas.protocol import Engine, EngineHealth, GenerateRequest, StepOutput, Tier
from megaserve.router.app import create_app
from megaserve.router.backend import Backend, EngineBackend
from megaserve.router.settings import RouterSettings
from megaserve.router.tokenizer import Tokenizer
from tests.model_factory import sentencepiece_style_tokenizer

MODEL = "megaserve-demo"
LATENCY_MAX_PROMPT_TOKENS = 64
SERVER_START_SECONDS = 10
POLL_SECONDS = 0.005


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    return str(ensure_demo_model(tmp_path_factory.mktemp("router-home")))


@pytest.fixture(scope="session")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir)


@pytest.fixture(scope="session")
def sentencepiece_tokenizer() -> Tokenizer:
    """A tokenizer that decodes as Llama 2's and Mistral's do: "▁" for a space, and the first token of
    a decoded string without its leading space."""
    words = ["<unk>", "▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris"]
    return Tokenizer(sentencepiece_style_tokenizer(words), {}, None)


@pytest.fixture(scope="session")
def engines(demo_model_dir) -> Iterator[dict[Tier, TorchEngine]]:
    made = {
        Tier.LATENCY: TorchEngine(demo_model_dir, tier=Tier.LATENCY, model_name=MODEL),
        Tier.THROUGHPUT: TorchEngine(demo_model_dir, tier=Tier.THROUGHPUT, max_batch=4, model_name=MODEL),
    }
    yield made
    for engine in made.values():
        asyncio.run(engine.shutdown())


def router_settings(model_dir: str, **overrides) -> RouterSettings:
    values = dict(model_name=MODEL, model_dir=model_dir, max_context=2048, latency_capacity=1,
                  throughput_capacity=4, latency_wait_seconds=0.05, retry_after_seconds=2,
                  latency_max_prompt_tokens=LATENCY_MAX_PROMPT_TOKENS)
    return RouterSettings(**(values | overrides))


@contextlib.contextmanager
def serving(app, lifespan: str = "off") -> Iterator[str]:
    """Run `app` on uvicorn in a thread (with its lifespan's startup and shutdown if `lifespan` is
    "on"); yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_SECONDS
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(POLL_SECONDS)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture
def serve_router(demo_model_dir, tokenizer):
    """serve_router(backends, **settings) -> base URL of a router over those backends."""
    with contextlib.ExitStack() as stack:
        def start(backends: Mapping[Tier, Backend], **overrides) -> str:
            app = create_app(router_settings(demo_model_dir, **overrides), backends, tokenizer)
            return stack.enter_context(serving(app))
        yield start


@pytest.fixture(scope="session")
def router_url(demo_model_dir, tokenizer, engines) -> Iterator[str]:
    """One router over both real engines, for tests that do not need special settings."""
    backends = {tier: EngineBackend(engine) for tier, engine in engines.items()}
    with serving(create_app(router_settings(demo_model_dir), backends, tokenizer)) as url:
        yield url


class HoldingEngine(Engine):
    """A real TorchEngine whose generations stop after their first output until `release()`;
    counts generations started and closed (the router must close them when a client leaves)."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.max_context = inner.max_context
        self.started = 0
        self.closed = 0
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        self.started += 1
        try:
            first = True
            async for output in self.inner.generate(request):
                yield output
                while first and not self._released.is_set():
                    await asyncio.sleep(POLL_SECONDS)
                first = False
        finally:
            self.closed += 1

    async def health(self) -> EngineHealth:
        return await self.inner.health()

    async def shutdown(self) -> None:
        self.release()


class RecordingEngineBackend(EngineBackend):
    """A real engine's backend that keeps every request the router sent it."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        self.requests.append(request)
        async for output in super().stream(request):
            yield output


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(POLL_SECONDS)


def running_requests(engine: Engine) -> int:
    return asyncio.run(engine.health()).running_requests
