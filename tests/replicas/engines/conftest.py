"""A tiny real model for the engine tests, the reference greedy loop, and an engine factory that
shuts every engine down at the end of its test."""

from __future__ import annotations

import itertools

import pytest
import torch

from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.models import load_model
from tests.model_factory import make_tiny_model

_names = itertools.count()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3)


@pytest.fixture(scope="session")
def reference_logits(tiny_model_dir):
    """logits(tokens) -> [V] float32: the next token's logits after `tokens`, by running the whole
    sequence through the reference model afresh."""
    model = load_model(tiny_model_dir, "cpu", torch.float32)

    def logits(tokens: list[int]) -> torch.Tensor:
        cache = model.new_cache(1, len(tokens))
        return model.forward(
            torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, torch.tensor([0]), last_only=True
        )[0]

    return logits


@pytest.fixture(scope="session")
def reference_greedy(reference_logits):
    """greedy(prompt, n): n tokens by re-running the whole sequence each step and taking argmax."""

    def greedy(prompt: list[int], count: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(int(reference_logits(tokens).argmax()))
        return tokens[len(prompt):]

    return greedy


@pytest.fixture
async def make_engine(tiny_model_dir):
    """make_engine(**settings) -> a TorchEngine on the tiny model, with a model name of its own
    (so that its metrics are its own); all are shut down after the test."""
    engines: list[TorchEngine] = []

    def make(**settings) -> TorchEngine:
        settings.setdefault("model_name", f"tiny-{next(_names)}")
        engine = TorchEngine(tiny_model_dir, **settings)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.shutdown()
