"""Which model shapes map onto the megakernel's template, and clear errors for the rest."""

from __future__ import annotations

import math
import re

import pytest

from megaserve.kernels.build import SOURCE_DIR, KernelCache
from megaserve.kernels.shape import (
    KV_ROW_BYTES_PER_ITER,
    MAX_SPLITS,
    MERGE_ACC_BYTES,
    MIN_CTAS,
    PARTIAL_EXTRA_FLOATS,
    SLICE_ROWS_ALIGN,
    STATIC_SHARED_LIMIT,
    THREADS,
    VEC_ELEMS,
    WARP_SIZE,
    KernelShape,
    UnsupportedShapeError,
)
from megaserve.replicas.bench import BENCH_CONFIGS
from megaserve.replicas.models import ModelConfig
from megaserve.replicas.models.demo import ensure_demo_model

from tests.gpu.conftest import SHAPES

H200_SMS = 132  # one persistent CTA per SM
TINY = dict(hidden=256, heads=4, kv_heads=1, head_dim=64, intermediate=512, vocab=512, layers=2, qk_norm=False)


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
def test_bench_models_map_to_template_arguments(name):
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS[name])
    shape = KernelShape.from_config(config)
    expected = {
        "Llama-3.2-1B": "megakernel::ModelShape<2048, 32, 8, 64, 8192, 128256, 16, false>",
        "Llama-3.1-8B": "megakernel::ModelShape<4096, 32, 8, 128, 14336, 128256, 32, false>",
        "Qwen3-8B": "megakernel::ModelShape<4096, 32, 8, 128, 12288, 151936, 36, true>",
    }[name]
    assert shape.template_args == expected
    assert shape.kernel_name(timing=True) == f"megakernel::decode_step<{expected}, true>"
    assert shape.group == 4


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gpu_test_shapes_are_supported_and_compile(name, tmp_path):
    settings = dict(SHAPES[name])
    family = settings.pop("family")
    raw = {"architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"],
           "vocab_size": 512, "num_hidden_layers": 2, **settings}
    shape = KernelShape.from_config(ModelConfig.from_hf_dict(raw))
    assert shape.qk_norm == (family == "qwen3")
    assert shape.group == settings["num_attention_heads"] // settings["num_key_value_heads"]
    shape.check_grid(H200_SMS)
    compiled = KernelCache(tmp_path / "kernels").decode_step(shape, "sm_90a")
    assert compiled.cubin.startswith(b"\x7fELF")


def test_the_demo_model_runs_on_the_megakernel(tmp_path):
    """The embedded default model is what `megaserve up` serves; on a GPU the latency tier's
    engine is the megakernel, so the demo's shape must be one it compiles."""
    shape = KernelShape.from_config(ModelConfig.from_hf_dir(ensure_demo_model(tmp_path)))
    shape.check_grid(H200_SMS)
    compiled = KernelCache(tmp_path / "kernels").decode_step(shape, "sm_90a")
    assert compiled.cubin.startswith(b"\x7fELF") and compiled.code_bytes > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 16}, "head_dim 16 is not supported"),
        ({"hidden": 260}, "hidden .* multiple of 8"),
        ({"intermediate": 1000 + 4}, "intermediate .* multiple of 8"),
        ({"heads": 6, "kv_heads": 4}, "multiple of kv_heads"),
        ({"hidden": 264}, "hidden .* multiple of 128"),
        ({"hidden": 24576}, "shared memory"),
        ({"heads": 16, "kv_heads": 1, "head_dim": 256}, "shared memory"),
        ({"layers": 0}, "layers must be positive"),
        ({"heads": 64, "kv_heads": 1, "head_dim": 64, "hidden": 256}, "at most 32"),
    ],
)
def test_unsupported_shapes_are_refused_clearly(change, message):
    with pytest.raises(UnsupportedShapeError, match=message):
        KernelShape(**(TINY | change))


def test_a_grid_smaller_than_the_kv_heads_is_refused():
    shape = KernelShape(**(TINY | {"heads": 8, "kv_heads": 8}))
    with pytest.raises(UnsupportedShapeError, match="8 KV heads on a GPU of 7 SMs"):
        shape.check_grid(7)


def test_a_grid_too_small_for_the_mlp_slices_is_refused():
    shape = KernelShape(**TINY)
    shape.check_grid(MIN_CTAS)  # the smallest grid the shared MLP slice is sized for
    with pytest.raises(UnsupportedShapeError, match=f"{MIN_CTAS} SMs or more; this GPU has {MIN_CTAS - 1}"):
        shape.check_grid(MIN_CTAS - 1)


def _kernel_constant(source: str, name: str) -> int:
    """The value of `constexpr int <name> = <a product of integers>;` in a kernel source."""
    match = re.search(rf"constexpr int {name} = ([0-9 *]+);", (SOURCE_DIR / source).read_text())
    assert match, f"{name} is not a constexpr int product of {source}"
    return math.prod(int(factor) for factor in match.group(1).split("*"))


@pytest.mark.parametrize(
    "mirror, source, name",
    [
        (THREADS, "common.cuh", "kThreads"),
        (WARP_SIZE, "common.cuh", "kWarpSize"),
        (VEC_ELEMS, "common.cuh", "kVecElems"),
        (MAX_SPLITS, "attention.cuh", "kMaxSplits"),
        (MERGE_ACC_BYTES, "attention.cuh", "kMergeAccBytes"),
        (PARTIAL_EXTRA_FLOATS, "attention.cuh", "kPartialExtraFloats"),
        (KV_ROW_BYTES_PER_ITER, "kv_rows.cuh", "kKvRowBytesPerIter"),
        (STATIC_SHARED_LIMIT, "decode_step.cu", "kStaticSharedLimit"),
        (MIN_CTAS, "decode_step.cu", "kMinCtas"),
        (SLICE_ROWS_ALIGN, "decode_step.cu", "kSliceRowsAlign"),
    ],
)
def test_python_mirrors_match_the_kernel_constants(mirror, source, name):
    # shape.py sizes buffers and shared memory from these; a kernel edit that left one behind would
    # overrun a buffer on the GPU instead of failing here.
    assert mirror == _kernel_constant(source, name)


def test_fewer_mlp_rows_than_the_grid_s_ctas_are_refused():
    # A CTA with no intermediate row of its own would prefetch the row before the MLP's weights.
    shape = KernelShape(**(TINY | {"intermediate": 128}))
    shape.check_grid(MIN_CTAS)  # 128 rows for 96 CTAs: every CTA has one at least
    shape.check_grid(128)  # one row each
    with pytest.raises(UnsupportedShapeError, match="intermediate_size 128 is fewer than this GPU's 129 SMs"):
        shape.check_grid(129)
    with pytest.raises(UnsupportedShapeError, match="intermediate_size 128 is fewer than this GPU's 132 SMs"):
        shape.check_grid(132)
