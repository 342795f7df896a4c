"""NVRTC builds every instantiation the product uses, and the on-disk cubin cache behaves:
hit, miss on changed source / arch / shape / flags, and a corrupt entry rebuilt."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

from megaserve.kernels.build import (
    CODE_PROBE_TEMPLATE,
    MAIN_SOURCE,
    SOURCE_DIR,
    KernelBuildError,
    KernelCache,
    cache_key,
    elf_section_size,
    resource_usage,
    source_files,
    supported_archs,
)
from megaserve.kernels.shape import THREADS
from megaserve.kernels.shape import KernelShape
from megaserve.replicas.bench import BENCH_CONFIGS
from megaserve.replicas.models import ModelConfig

HOPPER = "sm_90a"
BLACKWELL = ("sm_100a", "sm_103a")
TINY = KernelShape(hidden=256, heads=8, kv_heads=1, head_dim=128, intermediate=768, vocab=512, layers=2, qk_norm=True)
# An odd group at head_dim 256: attention's buffers end 4 bytes past a 16-byte multiple, which the
# union's alignment pads
ODD_GROUP = KernelShape(hidden=1024, heads=17, kv_heads=1, head_dim=256, intermediate=2816, vocab=512, layers=1,
                        qk_norm=False)
CUBIN_MAGIC = b"\x7fELF"
REGISTERS_PER_SM = 65536  # Hopper and Blackwell
SHARED_ALIGNMENT_SLACK = 16  # shape.py's SHARED_RESERVED allows for 16 bytes of padding


def bench_shapes() -> dict[str, KernelShape]:
    return {name: KernelShape.from_config(ModelConfig.from_hf_dict(raw)) for name, raw in BENCH_CONFIGS.items()}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return KernelCache(tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
def test_bench_shapes_compile_for_hopper(shared_cache, name):
    compiled = shared_cache.decode_step(bench_shapes()[name], HOPPER)
    assert compiled.cubin.startswith(CUBIN_MAGIC)
    assert compiled.symbol.startswith("_ZN10megakernel11decode_step")


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
def test_bench_shapes_do_not_spill(name):
    """Local-memory spills in the persistent kernel cost an L1 round trip each in the hottest loops;
    the launch bound (one CTA of THREADS per SM) caps registers at the SM's file / THREADS."""
    usage = resource_usage(bench_shapes()[name], HOPPER)
    assert usage.spill_store_bytes == usage.spill_load_bytes == 0
    assert 0 < usage.registers <= REGISTERS_PER_SM // THREADS


@pytest.mark.parametrize("shape", [*bench_shapes().values(), TINY, ODD_GROUP],
                         ids=[*bench_shapes(), "tiny-group-8", "head-dim-256-group-17"])
def test_shape_estimates_the_static_shared_memory(shape):
    """KernelShape.shared_bytes decides which shapes the kernel accepts (the 48 KB static limit), so it
    must not undercount what the compiled kernel uses, and it overcounts by alignment at most."""
    compiled = resource_usage(shape, HOPPER).shared_bytes
    assert compiled <= shape.shared_bytes <= compiled + SHARED_ALIGNMENT_SLACK


def test_the_barrier_probe_compiles_for_hopper(shared_cache):
    compiled = shared_cache.barrier_probe(HOPPER)
    assert compiled.cubin.startswith(CUBIN_MAGIC)
    assert "barrier_probe" in compiled.symbol


@pytest.mark.parametrize("arch", [HOPPER, *BLACKWELL])
def test_the_streaming_probe_compiles_for_each_target(shared_cache, arch):
    compiled = shared_cache.stream_probe(arch)
    assert compiled.cubin.startswith(CUBIN_MAGIC) and compiled.arch == arch
    assert "stream_stages" in compiled.symbol and compiled.code_bytes > 0


@pytest.mark.parametrize("arch", [HOPPER, *BLACKWELL])
def test_the_ring_probe_compiles_for_each_target(shared_cache, arch):
    compiled = shared_cache.stream_ring_probe(arch, 8)
    assert compiled.cubin.startswith(CUBIN_MAGIC) and compiled.arch == arch
    assert "stream_stages_ring" in compiled.symbol and compiled.name_expression.endswith("<8>")


def test_a_ring_of_one_slot_is_refused(shared_cache):
    with pytest.raises(ValueError, match="at least 2 slots"):
        shared_cache.stream_ring_probe(HOPPER, 1)


def test_the_code_probe_is_straight_line_code_of_its_size(shared_cache):
    """barrier_after_code<steps>: 8 instructions (128 bytes) a step, nothing folded or looped."""
    small, large = shared_cache.code_probe(HOPPER, 64), shared_cache.code_probe(HOPPER, 512)
    assert small.cubin.startswith(CUBIN_MAGIC) and "barrier_after_code" in small.symbol
    assert small.name_expression == CODE_PROBE_TEMPLATE.format(steps=64)
    assert (large.code_bytes - small.code_bytes) / (512 - 64) == pytest.approx(128, rel=0.05)
    assert shared_cache.barrier_probe(HOPPER).code_bytes < small.code_bytes


def test_the_code_probe_needs_a_step(shared_cache):
    with pytest.raises(ValueError, match="at least 1"):
        shared_cache.code_probe(HOPPER, 0)


def test_a_section_size_is_read_from_the_cubin_s_elf_header(shared_cache):
    compiled = shared_cache.barrier_probe(HOPPER)
    assert 0 < elf_section_size(compiled.cubin, f".text.{compiled.symbol}") < len(compiled.cubin)
    with pytest.raises(KernelBuildError, match="no section .text.missing"):
        elf_section_size(compiled.cubin, ".text.missing")
    with pytest.raises(KernelBuildError, match="not an ELF64 image"):
        elf_section_size(b"PK\x03\x04" + bytes(60), ".text")


@pytest.mark.parametrize("arch", BLACKWELL)
def test_compiles_for_blackwell_when_nvrtc_supports_it(shared_cache, arch):
    if arch.rstrip("a") not in supported_archs():
        pytest.skip(f"this NVRTC does not target {arch}")
    compiled = shared_cache.decode_step(bench_shapes()["Llama-3.1-8B"], arch)
    assert compiled.cubin.startswith(CUBIN_MAGIC)


def test_cache_hit_returns_the_same_cubin(tmp_path):
    cache = KernelCache(tmp_path)
    first = cache.decode_step(TINY, HOPPER)
    second = cache.decode_step(TINY, HOPPER)
    assert not first.from_cache and second.from_cache
    assert first.cubin == second.cubin and first.symbol == second.symbol


@pytest.mark.parametrize(
    "variant",
    [dict(arch="sm_100a"), dict(shape=KernelShape(**(vars(TINY) | {"layers": 3}))), dict(timing=True)],
    ids=["arch", "shape", "timing-flag"],
)
def test_cache_misses_on_a_changed_arch_shape_or_flag(tmp_path, variant):
    cache = KernelCache(tmp_path)
    cache.decode_step(TINY, HOPPER)
    if variant.get("arch", HOPPER).rstrip("a") not in supported_archs():
        pytest.skip("this NVRTC lacks the other arch")
    rebuilt = cache.decode_step(variant.get("shape", TINY), variant.get("arch", HOPPER), variant.get("timing", False))
    assert not rebuilt.from_cache
    assert len(list(tmp_path.glob("*.cubin"))) == 2


def test_changed_source_changes_the_key():
    sources = source_files()
    name = TINY.kernel_name(False)
    edited = dict(sources) | {"gemv.cuh": sources["gemv.cuh"] + "\n// edited\n"}
    assert cache_key(sources, HOPPER, name) == cache_key(dict(sources), HOPPER, name)
    assert cache_key(edited, HOPPER, name) != cache_key(sources, HOPPER, name)


def test_cuda_headers_upgraded_in_place_change_the_key(tmp_path, monkeypatch):
    from megaserve.kernels import build

    cudart, cccl = build._include_dirs()
    headers = tmp_path / "include"  # a cudart at a fixed path, upgraded in place (pip upgrades so)
    for name in build.VERSIONED_HEADERS["cudart"]:
        (headers / name).parent.mkdir(parents=True, exist_ok=True)
        (headers / name).write_bytes((Path(cudart) / name).read_bytes())
    monkeypatch.setattr(build, "_include_dirs", lambda: (str(headers), cccl))
    sources, name = source_files(), TINY.kernel_name(False)
    try:
        build.headers_fingerprint.cache_clear()
        before = cache_key(sources, HOPPER, name)
        (headers / "cuda_bf16.h").write_text((headers / "cuda_bf16.h").read_text() + "\n// the next release\n")
        build.headers_fingerprint.cache_clear()
        assert cache_key(sources, HOPPER, name) != before
    finally:
        build.headers_fingerprint.cache_clear()


def test_two_processes_compiling_one_key_at_once_leave_an_entry_that_is_used(tmp_path):
    # NVRTC's cubins differ from run to run: process A's cubin, then B's cubin and record, then A's
    # record used to leave A's record beside B's cubin, a mismatch that every later lookup rebuilt.
    first, second = KernelCache(tmp_path / "a"), KernelCache(tmp_path / "b")
    a, b = first.decode_step(TINY, HOPPER), second.decode_step(TINY, HOPPER)
    assert a.cubin != b.cubin  # else the race below would be no race
    shared = KernelCache(tmp_path / "shared")
    key = cache_key(source_files(), HOPPER, TINY.kernel_name(False))
    a_cubin, a_record = next((tmp_path / "a").glob("*.cubin")), next((tmp_path / "a").glob("*.json"))
    b_cubin, b_record = next((tmp_path / "b").glob("*.cubin")), next((tmp_path / "b").glob("*.json"))
    (tmp_path / "shared").mkdir()
    for path in (a_cubin, b_cubin, b_record, a_record):  # the writes of the two processes, interleaved
        shutil.copy(path, tmp_path / "shared" / path.name)
    assert (tmp_path / "shared" / f"{key}.json").is_file()
    found = shared.decode_step(TINY, HOPPER)
    assert found.from_cache and found.cubin == a.cubin  # the record that landed last, and its own cubin


@pytest.mark.parametrize("damage", ["truncate-cubin", "garbage-record", "other-symbol", "record-not-an-object",
                                    "digest-a-path"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage):
    cache = KernelCache(tmp_path)
    good = cache.decode_step(TINY, HOPPER)
    cubin_path = next(tmp_path.glob("*.cubin"))
    (record_path,) = tmp_path.glob("*.json")
    if damage == "truncate-cubin":
        cubin_path.write_bytes(good.cubin[: len(good.cubin) // 2])
    elif damage == "garbage-record":
        record_path.write_text("{not json")
    elif damage == "record-not-an-object":
        record_path.write_text("[]")
    elif damage == "digest-a-path":
        record_path.write_text(json.dumps(json.loads(record_path.read_text()) | {"sha256": "../" * 20 + "x"}))
    else:
        record_path.write_text(json.dumps(json.loads(record_path.read_text()) | {"name_expression": "other"}))
    rebuilt = cache.decode_step(TINY, HOPPER)
    # NVRTC output is not byte-for-byte reproducible (an embedded module id); same kernel, same size.
    assert not rebuilt.from_cache and rebuilt.symbol == good.symbol and len(rebuilt.cubin) == len(good.cubin)
    assert cache.decode_step(TINY, HOPPER).from_cache  # the entry was rewritten whole


def test_unsupported_arch_is_refused(tmp_path):
    with pytest.raises(KernelBuildError, match="cannot compile for sm_10"):
        KernelCache(tmp_path).decode_step(TINY, "sm_10")


def _source_copy(tmp_path: Path, edit: str = "") -> Path:
    """A copy of the package's kernel sources with `edit` appended to decode_step.cu."""
    folder = tmp_path / "variant"
    shutil.copytree(SOURCE_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (folder / MAIN_SOURCE).write_text((folder / MAIN_SOURCE).read_text() + edit)
    return folder


def test_a_cache_builds_from_the_source_folder_it_is_given(tmp_path):
    """An edited copy of the sources (`megaserve bench --kernel-sources`) compiles from its own files,
    includes too, and shares the cache folder with the package's sources under its own key."""
    variant = _source_copy(tmp_path, "\n// a variant\n")
    merge = "constexpr int kMergeAccBytes = 32 * 1024;"
    assert merge in (variant / "attention.cuh").read_text()
    (variant / "attention.cuh").write_text((variant / "attention.cuh").read_text().replace(
        merge, "constexpr int kMergeAccBytes = 16 * 1024;"))
    own, edited = KernelCache(tmp_path / "cache"), KernelCache(tmp_path / "cache", variant)
    assert edited.source_dir == variant.resolve() and own.source_dir == SOURCE_DIR
    built = edited.decode_step(TINY, HOPPER)
    assert not built.from_cache and not own.decode_step(TINY, HOPPER).from_cache  # two keys, two entries
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 2
    assert edited.decode_step(TINY, HOPPER).from_cache
    # attention's merge in less shared memory: ptxas sees the edited include, not the package's
    shrunk = resource_usage(TINY, HOPPER).shared_bytes - resource_usage(TINY, HOPPER, source_dir=variant).shared_bytes
    assert shrunk > 0


def test_an_edited_header_of_a_subfolder_is_a_cache_miss(tmp_path):
    """Every C++ file a kernel may include is in the key, not only the top-level .cu and .cuh."""
    variant = _source_copy(tmp_path)
    (variant / "tuning").mkdir()
    header = variant / "tuning" / "probe.h"
    header.write_text("constexpr int kProbeValue = 1;\n")
    probe = variant / "barrier_probe.cu"
    probe.write_text(probe.read_text() + '#include "tuning/probe.h"\n'
                     'static_assert(kProbeValue == 1, "the header is read afresh");\n')
    cache = KernelCache(tmp_path / "cache", variant)
    assert not cache.barrier_probe(HOPPER).from_cache
    header.write_text("constexpr int kProbeValue = 2;\n")
    with pytest.raises(KernelBuildError, match="the header is read afresh"):  # compiled again, not served
        cache.barrier_probe(HOPPER)


def test_an_nvrtc_patch_release_changes_the_key(tmp_path, monkeypatch):
    # nvrtcVersion says 13.0 for every 13.0.x: the library files themselves are in the key.
    from megaserve.kernels import build

    library = tmp_path / "libnvrtc.so.13"
    library.write_bytes(b"13.0.48")
    loaded = types.SimpleNamespace(abs_path=str(library))
    monkeypatch.setattr(build.cuda.pathfinder, "load_nvidia_dynamic_lib", lambda name: loaded)
    sources, name = source_files(), TINY.kernel_name(False)
    try:
        build.nvrtc_fingerprint.cache_clear()
        before = cache_key(sources, HOPPER, name)
        library.write_bytes(b"13.0.88 and more")  # pip's upgrade of the wheel in place
        build.nvrtc_fingerprint.cache_clear()
        assert cache_key(sources, HOPPER, name) != before
    finally:
        build.nvrtc_fingerprint.cache_clear()


def test_changed_compiler_options_change_the_key(monkeypatch):
    from megaserve.kernels import build

    sources, name = source_files(), TINY.kernel_name(False)
    before = cache_key(sources, HOPPER, name)
    monkeypatch.setattr(build, "COMPILE_OPTIONS", build.COMPILE_OPTIONS | {"lineinfo": True})
    assert cache_key(sources, HOPPER, name) != before


def test_a_cache_that_cannot_be_written_still_gives_the_compiled_kernel(caplog):
    cache = KernelCache(Path("/proc/megaserve-kernels"))  # a folder no one may create
    with caplog.at_level("WARNING", logger="megaserve.kernels.build"):
        built = cache.barrier_probe(HOPPER)
    assert built.cubin.startswith(CUBIN_MAGIC) and not built.from_cache
    assert "cannot store megakernel::barrier_probe" in caplog.text


def test_a_broken_variant_fails_with_the_compiler_log(tmp_path):
    variant = _source_copy(tmp_path, '\nstatic_assert(false, "variant under test");\n')
    with pytest.raises(KernelBuildError, match="variant under test"):
        KernelCache(tmp_path / "cache", variant).decode_step(TINY, HOPPER)
    with pytest.raises(KernelBuildError, match="variant under test"):  # the ptxas report's own compile
        resource_usage(TINY, HOPPER, source_dir=variant)


def test_a_kernel_cache_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "cache").write_text("")
    with pytest.raises(KernelBuildError, match="the kernel cache .*cache is not a folder"):
        KernelCache(tmp_path / "cache")


def test_a_folder_without_the_kernel_sources_is_refused(tmp_path):
    (tmp_path / "barrier_probe.cu").write_text("// only the probe\n")
    with pytest.raises(KernelBuildError, match="has no decode_step.cu"):
        KernelCache(tmp_path / "cache", tmp_path)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_a_gpu_before_hopper_is_refused_by_name(capability):
    from megaserve.kernels.build import KernelBuildError, arch_for

    with pytest.raises(KernelBuildError, match=f"needs a Hopper or newer GPU .*sm_{capability[0]}{capability[1]}"):
        arch_for(capability)
    assert arch_for((9, 0)) == "sm_90a" and arch_for((10, 3)) == "sm_103a"


def test_cache_entries_are_readable_by_other_users_of_the_cache(tmp_path):
    cache = KernelCache(tmp_path)
    cache.decode_step(TINY, HOPPER)
    entries = list(tmp_path.iterdir())
    assert entries and all(entry.stat().st_mode & 0o044 == 0o044 for entry in entries)  # group and others read
