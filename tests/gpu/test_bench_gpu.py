"""`megaserve bench`'s megakernel method on a real GPU, with an edited copy of the kernel sources
timed beside the package's own (`--kernel-sources`): one result per build, each timed in every
round, one launch per step, and a stage breakdown that accounts for the step; the package's own build
also gets the streaming probes' times over the same bytes."""

from __future__ import annotations

import shutil

import torch

from megaserve.kernels.build import SOURCE_DIR, KernelCache
from megaserve.kernels.launcher import FINAL_STAGE, STAGES_PER_LAYER
from megaserve.replicas.bench import (
    INNER_EDGE_CLUSTER_CTAS,
    MEGAKERNEL,
    RING_BARRIERS_PER_LAYER,
    STREAM_BARRIERS_PER_LAYER,
    bench_context,
    random_model,
)
from megaserve.replicas.models import ModelConfig

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "torch_dtype": "bfloat16",
}
CONTEXT = 64
ROUNDS = 2
VARIANT = f"{MEGAKERNEL}:copy"


def test_a_variant_is_timed_in_every_round_beside_the_package_s_kernel(tmp_path):
    variant = tmp_path / "copy"
    shutil.copytree(SOURCE_DIR, variant, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (variant / "decode_step.cu").write_text((variant / "decode_step.cu").read_text() + "\n// a variant\n")
    caches = {MEGAKERNEL: KernelCache(tmp_path / "cache"), VARIANT: KernelCache(tmp_path / "cache", variant)}
    model = random_model(ModelConfig.from_hf_dict(TINY_CONFIG), torch.device("cuda"))

    measured = dict(bench_context(model, CONTEXT, (MEGAKERNEL,), caches, ROUNDS))

    assert list(measured) == [MEGAKERNEL, VARIANT]
    for seconds, launches, extra in measured.values():
        assert launches == 1
        assert len(extra["round_ms"]) == ROUNDS and all(ms > 0 for ms in extra["round_ms"])
        assert min(extra["round_ms"]) <= seconds * 1e3 <= max(extra["round_ms"])  # the median of the rounds
        assert list(extra["stage_ms"]) == [*STAGES_PER_LAYER, FINAL_STAGE]
        assert all(ms > 0 for ms in extra["stage_ms"].values())
    stream_ms = measured[MEGAKERNEL][2]["stream_ms"]
    assert list(stream_ms) == list(STREAM_BARRIERS_PER_LAYER) and all(ms > 0 for ms in stream_ms.values())
    ring_ms = measured[MEGAKERNEL][2]["ring_stream_ms"]
    assert list(ring_ms) == list(RING_BARRIERS_PER_LAYER) and all(ms > 0 for ms in ring_ms.values())
    inner = measured[MEGAKERNEL][2]["inner_edge_ms"]
    assert [(probe.edge, probe.cluster_ctas) for probe in inner] == [
        ("counts", 1), *((edge, size) for size in INNER_EDGE_CLUSTER_CTAS for edge in ("counts", "cluster barriers"))]
    assert all(probe.ms > 0 and probe.ctas % probe.cluster_ctas == 0 for probe in inner)
    assert "stream_ms" not in measured[VARIANT][2]  # the probe streams bytes, whichever the sources
    # each build with and without timing, and the two streaming probes
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 6
