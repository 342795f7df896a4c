"""The embedded demo model: deterministic to the byte across processes, safe to build concurrently,
loadable by our loader and by transformers (with the same logits), and small enough for a CPU."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from megaserve.replicas.models import load_model
from megaserve.replicas.models.decoder import expected_shapes
from megaserve.replicas.models.demo import DEMO_NAME, VOCAB_SIZE, ensure_demo_model

BUILD_IN_SUBPROCESS = (
    "import sys, pathlib; from megaserve.replicas.models.demo import ensure_demo_model; "
    "print(ensure_demo_model(pathlib.Path(sys.argv[1])))"
)
FLOAT32_REL_TOLERANCE = 1e-5  # same weights, same ops in float32 (see test_decoder.py)
# A CPU decode step reads every weight once: under 1M bf16 parameters it took ~1-2 ms on one core
# (docs/perf.md, the serving path on the CPU), which the embedded default's latency tier relies on.
MAX_DEMO_PARAMETERS = 1_000_000


def file_digests(folder) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("home"))


def test_files_are_the_same_bytes_when_built_concurrently_by_other_processes(demo_dir, tmp_path):
    """Two processes race to build into one home; both get the one folder, which equals ours."""
    racers = [
        subprocess.Popen([sys.executable, "-c", BUILD_IN_SUBPROCESS, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {racer.communicate()[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(paths) == 1
    built = ensure_demo_model(tmp_path)
    assert str(built) in paths and built.name.startswith(DEMO_NAME)
    assert [entry.name for entry in (tmp_path / "models").iterdir()] == [built.name]  # no staging left
    assert file_digests(built) == file_digests(demo_dir)
    assert set(file_digests(built)) == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    }


def test_existing_model_is_reused_untouched(demo_dir):
    stamps = {path.name: path.stat().st_mtime_ns for path in demo_dir.iterdir()}
    assert ensure_demo_model(demo_dir.parent.parent) == demo_dir
    assert {path.name: path.stat().st_mtime_ns for path in demo_dir.iterdir()} == stamps


def test_loads_with_our_loader_and_transformers_with_equal_logits(demo_dir):
    ours = load_model(demo_dir, dtype=torch.float32)
    assert load_model(demo_dir).dtype == torch.bfloat16  # the checkpoint's own dtype
    assert ours.lm_head is ours.embed and ours.config.vocab_size == VOCAB_SIZE
    theirs = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    assert torch.equal(ours.rope_inv_freq, theirs.model.rotary_emb.inv_freq)  # llama3 scaling

    input_ids = torch.randint(0, VOCAB_SIZE, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = ours.forward(input_ids, torch.arange(40)[None], ours.new_cache(1, 64), torch.tensor([0]))
    with torch.no_grad():
        reference = theirs(input_ids).logits
    assert ((logits - reference).norm() / reference.norm()).item() < FLOAT32_REL_TOLERANCE
    # Random weights, but a clear winner: greedy decoding is not decided by rounding.
    top2 = logits[0].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1


def test_the_model_is_small_enough_for_a_cpu_decode_step(demo_dir):
    """Its size, not a timing (timed unit tests fail on a loaded machine): a step's cost is its weights."""
    shapes = expected_shapes(load_model(demo_dir).config)  # every checkpoint tensor, a tied embedding once
    assert 100_000 < sum(math.prod(shape) for shape in shapes.values()) < MAX_DEMO_PARAMETERS
