"""`megaserve generate --engine megakernel` on CUDA: the command-line check of any Hugging Face
directory. Greedy on the demo model (bf16) against the same command with `--engine torch`; seeded
sampling on a tiny random Llama whose next-token distributions are broad enough for the seed to
matter (the demo's are not: it samples its favourite token at any seed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import torch

from megaserve.replicas.models.demo import ensure_demo_model
from tests.gpu.conftest import LONG_CONTEXT, SHAPES
from tests.model_factory import make_tiny_model

MAX_TOKENS = 32
# Both engines run the same bf16 weights; decode steps differ by rounding order only (rel. err
# ~1e-2 on the logits, tests/gpu/test_megakernel.py). On the demo's greedy path from this prompt
# the top logit leads the second by at least 39% of its value at every one of the 32 steps
# (transformers, float32), so no rounding difference can flip a choice: all tokens must match.
@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return str(ensure_demo_model(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    settings = dict(SHAPES["llama-hd64-gqa4"])
    family = settings.pop("family")
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family, dtype=torch.bfloat16,
                               max_position_embeddings=LONG_CONTEXT, **settings))


@pytest.fixture(scope="module")
def generate(tmp_path_factory):
    env = dict(os.environ, MEGASERVE_KERNEL_CACHE=str(tmp_path_factory.mktemp("kernels")))

    def run(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "generate", *args, "--json"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run


def test_megakernel_greedy_matches_the_torch_engine(demo_dir, generate):
    common = ("Tell me a story", "--model", demo_dir, "--max-tokens", str(MAX_TOKENS), "--ignore-eos")
    fast = generate(*common, "--engine", "megakernel")
    reference = generate(*common, "--engine", "torch", "--device", "cuda")
    assert fast["engine"] == "megakernel"
    assert fast["prompt_token_ids"] == reference["prompt_token_ids"]
    assert len(fast["token_ids"]) == len(fast["step_ms"]) == MAX_TOKENS
    assert fast["finish_reason"] == "length"
    assert all(ms > 0 for ms in fast["step_ms"])
    assert fast["token_ids"] == reference["token_ids"]


def test_megakernel_seeded_sampling_is_reproducible(tiny_llama_dir, generate):
    args = ("hello", "--model", tiny_llama_dir, "--engine", "megakernel", "--max-tokens", str(MAX_TOKENS),
            "--ignore-eos", "--temperature", "1.0", "--top-p", "0.95", "--seed", "7")
    first, second = generate(*args), generate(*args)
    assert first["token_ids"] == second["token_ids"]
    assert len(first["token_ids"]) == MAX_TOKENS
    other_seed = generate(*args[:-1], "8")
    assert other_seed["token_ids"] != first["token_ids"]  # the seed reaches the on-GPU sampler
