"""`megaserve bench`'s arithmetic and report, on the CPU (the measurements themselves need a GPU:
docs/perf.md holds those runs)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megaserve.kernels.barrier_probe import StreamEdge
from megaserve.kernels.build import SOURCE_DIR, KernelBuildError, KernelCache
from megaserve.kernels.launcher import TRANSPOSED_FIELDS, StageTimes
from megaserve.replicas import bench
from megaserve.replicas.bench import (
    BENCH_CONFIGS,
    MEGAKERNEL,
    InnerEdgeProbe,
    Result,
    arg_parser,
    format_table,
    parse_args,
    random_model,
    stage_read_bytes,
    streaming_stages,
    weights_stored_transposed,
)
from megaserve.replicas.models import ModelConfig
from megaserve.replicas.models.sharding import plan_sharding, step_read_bytes

BF16 = 2
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
}


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
@pytest.mark.parametrize("context", [1, 1025, 8193])
def test_stage_bytes_add_up_to_the_roofline_s_bytes_but_norms(name, context):
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS[name])
    stages = stage_read_bytes(config, context)
    floor = step_read_bytes(plan_sharding(config, 1), context, BF16)
    norms = (2 * config.hidden_size + (2 * config.head_dim if config.qk_norm else 0)) * BF16
    assert sum(stages.values()) == floor.total - config.num_layers * norms - floor.other
    assert list(stages) == ["qkv", "attention", "o_proj", "mlp", "lm_head"]


def test_llama_1b_stage_bytes_are_the_checkpoint_s():
    stages = stage_read_bytes(ModelConfig.from_hf_dict(BENCH_CONFIGS["Llama-3.2-1B"]), 1025)
    assert stages["qkv"] == 16 * (2048 + 2 * 512) * 2048 * BF16  # 16 layers of q, k, v rows
    assert stages["attention"] == 16 * 2 * 512 * 1025 * BF16  # K and V of 8 heads x 64
    assert stages["lm_head"] == 128256 * 2048 * BF16  # the tied embedding, read once


def test_the_table_reports_each_stage_s_share_of_the_measured_bandwidth():
    bandwidth = 4e12
    stage_bytes = {"qkv": 4_000_000_000, "lm_head": 2_000_000_000}  # 1 ms and 0.5 ms at the bandwidth
    results = [
        Result("Llama-3.2-1B", 1024, "megakernel", 2.0, 500.0, 1, 0.75,
               stage_ms={"qkv": 2.0, "lm_head": 0.5}, stage_bytes=stage_bytes, timing_cost_ms=0.004,
               stage_tail_ms={"qkv": 0.25}, stage_release_ms={"qkv": 0.125}, stage_late_repeat={"qkv": 0.75}),
        Result("Llama-3.2-1B", 1024, "compile+graph", error="BackendCompilerFailed: inductor\ndetails"),
    ]
    table = format_table(results, bandwidth, barrier_seconds=1.25e-6)
    assert "HBM read bandwidth (reduction): 4,000 GB/s; one grid barrier: 1.25 µs" in table
    assert "megakernel        2.000      500        1    75.0%" in table
    assert "compile+graph  failed: BackendCompilerFailed: inductor" in table and "details" not in table
    assert "stages Llama-3.2-1B ctx=1024 (timing build, which costs +0.004 ms/step):" in table
    assert "| qkv | 4,000.0 | 2.000 | 2,000 | 50% | +1.000 | 0.250 | 0.125 | 75% |" in table
    assert "| lm_head | 2,000.0 | 0.500 | 4,000 | 100% | +0.000 |  |  |  |" in table  # no barrier closes the head


@pytest.mark.parametrize("barriers", bench.STREAM_BARRIERS_PER_LAYER)
def test_the_streaming_probe_reads_the_step_s_bytes_in_its_order_with_its_barriers(barriers):
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS["Llama-3.2-1B"])
    stages = streaming_stages(config, 1025, barriers)
    per_step = stage_read_bytes(config, 1025)
    assert len(stages) == 4 * config.num_layers + 1 and stages[-1].name == "lm_head"
    assert [stage.name for stage in stages[:4]] == ["qkv", "attention", "o_proj", "mlp"]
    for name, read_bytes in per_step.items():
        assert sum(stage.read_bytes for stage in stages if stage.name == name) == read_bytes
    assert sum(stage.edge_after == StreamEdge.GRID for stage in stages) == barriers * config.num_layers
    assert all(stage.edge_after in (StreamEdge.NONE, StreamEdge.GRID) for stage in stages)
    assert stages[-1].edge_after == StreamEdge.NONE
    if barriers in (2, 3):  # attention waits for its head's QKV rows, not for a barrier
        assert all(stage.edge_after == StreamEdge.NONE for stage in stages if stage.name == "qkv")
    if barriers == 2:  # and O for its heads' attention: only the stages before the two RMSNorms end at one
        assert all(stage.edge_after == StreamEdge.NONE for stage in stages if stage.name == "attention")


@pytest.mark.parametrize("inner_edge", [StreamEdge.GROUP, StreamEdge.CLUSTER])
def test_the_inner_edges_follow_qkv_and_attention_and_the_grid_barriers_stay(inner_edge):
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS["Llama-3.2-1B"])
    stages = streaming_stages(config, 1025, 2, inner_edge)
    assert [stage.edge_after for stage in stages[:4]] == [inner_edge, inner_edge, StreamEdge.GRID, StreamEdge.GRID]
    assert stages[4:8] == stages[:4] and stages[-1].edge_after == StreamEdge.NONE


def test_the_stage_table_gives_the_streaming_probe_s_share_of_the_roofline():
    result = Result("Llama-3.2-1B", 1024, "megakernel", 2.0, 500.0, 1, 0.75, stage_ms={"qkv": 2.0},
                    stage_bytes={"qkv": 4_000_000_000}, timing_cost_ms=0.0, stream_ms={0: 1.0, 3: 1.25},
                    ring_stream_ms={0: 1.0, 3: 2.0},
                    inner_edge_ms=[InnerEdgeProbe("counts", 1, 132, 1.6),
                                   InnerEdgeProbe("cluster barriers", 8, 120, 2.0)])
    table = format_table([result], 4e12, barrier_seconds=1e-6)
    assert ("streaming probe, the same bytes with nothing between the loads but grid barriers: "
            "0 per layer 1.000 ms (100.0%), 3 per layer 1.250 ms (80.0%)") in table
    assert ("the same loaded by a loader warp per SM into a 64 KB ring of 4 slots, past the barriers: "
            "0 per layer 1.000 ms (100.0%), 3 per layer 2.000 ms (50.0%)") in table
    assert ("the same with 2 barriers per layer and the inner edges (QKV -> attention -> O) as: counts over the KV "
            "heads on 132 CTAs 1.600 ms (62.5%), cluster barriers in clusters of 8 on 120 CTAs 2.000 ms (50.0%)"
            ) in table
    without_probes = format_table([Result("Llama-3.2-1B", 1024, "megakernel", 2.0, 500.0, 1, 0.75,
                                          stage_ms={"qkv": 2.0}, stage_bytes={"qkv": 4_000_000_000},
                                          timing_cost_ms=0.0)], 4e12, None)
    assert "streaming probe" not in without_probes and "loader warp" not in without_probes
    assert "inner edges" not in without_probes


def test_a_cluster_size_the_gpu_cannot_run_is_reported_and_the_others_are_timed(monkeypatch):
    def cluster_grid(kernel_cache, device, cluster_ctas):
        if cluster_ctas == 16:
            raise RuntimeError("this GPU cannot hold a cluster of 16 CTAs of the probe")
        return 132 if cluster_ctas == 1 else 120

    monkeypatch.setattr(bench, "cluster_grid", cluster_grid)
    monkeypatch.setattr(bench, "time_streaming_step", lambda *args, **kwargs: 1e-3)
    config = ModelConfig.from_hf_dict(BENCH_CONFIGS["Llama-3.2-1B"])
    probes = bench.inner_edges(config, 1025, None, torch.device("cpu"))
    assert [(p.edge, p.cluster_ctas, p.ctas, p.error) for p in probes] == [
        ("counts", 1, 132, None), ("counts", 8, 120, None), ("cluster barriers", 8, 120, None),
        ("clusters", 16, 0, "RuntimeError: this GPU cannot hold a cluster of 16 CTAs of the probe")]
    result = Result("Llama-3.2-1B", 1024, "megakernel", 2.0, 500.0, 1, 0.75, stage_ms={"qkv": 2.0},
                    stage_bytes={"qkv": 4_000_000_000}, timing_cost_ms=0.0, inner_edge_ms=probes)
    table = format_table([result], 4e12, barrier_seconds=None)
    assert ("cluster barriers in clusters of 8 on 120 CTAs 1.000 ms (100.0%), clusters of 16 failed: "
            "RuntimeError: this GPU cannot hold a cluster of 16 CTAs") in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--methods", "eager", "--rounds", "3"], "--rounds times the megakernel's builds in turn: add it to --methods"),
    (["--models", "Qwen3-8B", "Qwen3-8B"], "--models names Qwen3-8B more than once"),
    (["--contexts", "1024", "8192", "1024"], "--contexts names 1024 more than once"),
    (["--methods", "eager", "eager"], "--methods names eager more than once"),
])
def test_flags_that_would_be_ignored_or_run_twice_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(["--kernel-cache", str(tmp_path / "k"), "--out", str(tmp_path / "b.json"), *argv])
    assert message in capsys.readouterr().err


def test_every_flag_says_what_it_does():
    assert [action.option_strings for action in arg_parser()._actions if not action.help] == []


def test_contexts_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--kernel-cache", "k", "--contexts", "0"])
    assert "contexts must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("name", TRANSPOSED_FIELDS)
def test_the_megakernel_gets_its_layout_of_a_weight_and_the_baselines_the_checkpoint_s(name):
    model = random_model(ModelConfig.from_hf_dict(TINY_CONFIG), torch.device("cpu"))
    checkpoint = [getattr(layer, name) for layer in model.layers]
    with weights_stored_transposed(model):
        for layer, weight in zip(model.layers, checkpoint, strict=True):
            assert getattr(layer, name).t().is_contiguous() and torch.equal(getattr(layer, name), weight)
    assert all(getattr(layer, name) is weight for layer, weight in zip(model.layers, checkpoint, strict=True))
    assert all(getattr(layer, name).is_contiguous() for layer in model.layers)


def test_kernel_sources_are_timed_beside_the_package_s_own(tmp_path):
    variant = tmp_path / "qkv-l2"
    shutil.copytree(SOURCE_DIR, variant, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    args = parse_args(["--kernel-cache", str(tmp_path / "cache"), "--kernel-sources", f"qkv.l2={variant}",
                       "--rounds", "3"])
    assert list(args.kernel_caches) == [MEGAKERNEL, f"{MEGAKERNEL}:qkv.l2"]
    assert args.kernel_caches[MEGAKERNEL].source_dir == SOURCE_DIR
    assert args.kernel_caches[f"{MEGAKERNEL}:qkv.l2"].source_dir == variant.resolve()
    assert {cache.directory for cache in args.kernel_caches.values()} == {tmp_path / "cache"}
    assert args.rounds == 3
    assert list(parse_args(["--kernel-cache", "k"]).kernel_caches) == [MEGAKERNEL]


@pytest.mark.parametrize(("argv", "message"), [
    (["--kernel-sources", "no-folder"], "takes NAME=DIR"),
    (["--kernel-sources", "=dir"], "takes NAME=DIR"),
    (["--kernel-sources", "a b=dir"], "takes NAME=DIR"),
    (["--kernel-sources", "v=DIR", "v=DIR"], "names 'v' twice"),
    (["--kernel-sources", "v=EMPTY"], "has no decode_step.cu, barrier_probe.cu"),
    (["--rounds", "0"], "rounds must be at least 1"),
    # variants that would never be timed
    (["--kernel-sources", "v=DIR", "--methods", "eager"], "add it to --methods"),
    # refused before the GPU time that the first model's report would come after
    (["--out", "MISSING/bench.json"], "not a file in an existing folder"),
    (["--out", "EMPTY"], "not a file in an existing folder"),
    (["--kernel-cache", "FILE"], "is not a folder"),
    (["--out", "/proc/bench.json"], "cannot be written"),  # a folder no one may create files in
    # past Qwen3-8B's 40,960 positions once the timed steps' positions are added
    (["--models", "Qwen3-8B", "--contexts", "1024", "40960"], "contexts [40960] are past Qwen3-8B's 40,960"),
])
def test_bad_kernel_sources_rounds_and_paths_are_refused(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    shutil.copytree(SOURCE_DIR, tmp_path / "sources", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    folders = {"DIR": "sources", "EMPTY": "empty", "MISSING": "missing", "FILE": "file"}
    for placeholder, folder in folders.items():
        argv = [arg.replace(placeholder, str(tmp_path / folder)) for arg in argv]
    with pytest.raises(SystemExit):
        parse_args(["--kernel-cache", str(tmp_path / "cache"), *argv])
    assert message in capsys.readouterr().err


def test_the_table_widens_for_a_variant_s_method_compares_it_and_names_it_over_its_stages():
    stages = {"stage_ms": {"qkv": 1.0}, "stage_bytes": {"qkv": 4_000_000_000}, "timing_cost_ms": 0.002}
    results = [Result("Llama-3.2-1B", 1024, MEGAKERNEL, 1.0, 1000.0, 1, 0.9, **stages),
               Result("Llama-3.2-1B", 1024, f"{MEGAKERNEL}:qkv-l2", 0.5, 2000.0, 1, 0.95, **stages)]
    table = format_table(results, 4e12, barrier_seconds=1e-6).splitlines()
    assert table[1].startswith("model            ctx method              ms/step")
    assert "Llama-3.2-1B    1024 megakernel            1.000     1000        1    90.0%" in table
    assert "Llama-3.2-1B    1024 megakernel:qkv-l2     0.500     2000        1    95.0%   -50.0% vs megakernel" in table
    assert "stages Llama-3.2-1B ctx=1024 (timing build, which costs +0.002 ms/step):" in table
    assert "stages Llama-3.2-1B ctx=1024 megakernel:qkv-l2 (timing build, which costs +0.002 ms/step):" in table


class _Step:
    """A DecodeStep on the CPU: a launch writes the cache at its position and advances it by one, as
    the kernel does (it writes pos + 1 to the step state)."""

    failing: set[str] = set()  # the builds whose construction raises, as NVRTC refusing a variant

    def __init__(self, model, cache, slot, kernel_cache, timing=False):
        self.name = kernel_cache.source_dir.name + ("+timing" if timing else "")
        if self.name in self.failing:
            raise KernelBuildError(f"NVRTC refused {self.name}")
        self.cache, self.pos, self.furthest = cache, None, None

    def set_position(self, token, pos):
        self.pos = pos

    def launch(self):
        assert self.pos < self.cache.max_seq, f"{self.name} writes position {self.pos} past the cache"
        self.furthest = self.pos if self.furthest is None else max(self.furthest, self.pos)
        self.pos += 1

    def stage_times(self):
        return StageTimes({"qkv": 1e-3}, {"qkv": 1e-4}, {"qkv": 1e-5})


def _stand_in_for_the_gpu(monkeypatch, tmp_path, failing=frozenset()):
    """The GPU parts of bench_context replaced (tests/gpu/test_bench_gpu.py runs them), each replaying
    the step as often as the real one; returns the log of where each timing started, the builds'
    caches and the steps made."""
    timings: list[str] = []
    steps: list[_Step] = []

    class Step(_Step):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            steps.append(self)

    Step.failing = set(failing)

    class Graph:  # "replays" the step whose launch it captured
        def __init__(self, launch):
            for _ in range(bench.WARMUP_STEPS):  # capture's warm-up runs the step
                launch()
            self.replay = launch

    def time_steps(replay, count):
        step = replay.__self__
        timings.append(f"{step.name}@{step.pos}")
        for _ in range(bench.WARMUP_STEPS + bench.REPEATS * count):
            replay()
        return {"kernels": 1e-3, "copy": 2e-3}.get(step.name, 3e-3) * (1 + 0.1 * len(timings))

    def count_kernel_launches(replay):
        replay(), replay()  # a warm-up and the profiled call
        return 1

    def time_streaming_step(kernel_cache, device, stages, group_ctas=1, cluster_ctas=1):
        # 1 ms per GB, 1 µs per grid barrier, and an inner edge 1 ns per CTA of its group, or 3 ns per
        # CTA of its cluster
        inner = {StreamEdge.GROUP: group_ctas, StreamEdge.CLUSTER: 3 * cluster_ctas}
        return (sum(stage.read_bytes for stage in stages) * 1e-12
                + sum(stage.edge_after == StreamEdge.GRID for stage in stages) * 1e-6
                + sum(inner.get(stage.edge_after, 0) for stage in stages) * 1e-9)

    def time_streaming_ring(kernel_cache, device, stages):  # the loader ring: 2 µs per barrier
        return (sum(stage.read_bytes for stage in stages) * 1e-12
                + sum(stage.edge_after == StreamEdge.GRID for stage in stages) * 2e-6)

    def cluster_grid(kernel_cache, device, cluster_ctas):  # an H200's: 15 clusters of 8 at once, 7 of 16
        return {1: 132, 8: 120, 16: 112}[cluster_ctas]

    monkeypatch.setattr(bench, "DecodeStep", Step)
    monkeypatch.setattr(bench, "capture", Graph)
    monkeypatch.setattr(bench, "time_steps", time_steps)
    monkeypatch.setattr(bench, "count_kernel_launches", count_kernel_launches)
    monkeypatch.setattr(bench, "time_streaming_step", time_streaming_step)
    monkeypatch.setattr(bench, "time_streaming_ring", time_streaming_ring)
    monkeypatch.setattr(bench, "cluster_grid", cluster_grid)
    shutil.copytree(SOURCE_DIR, tmp_path / "copy", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    caches = {MEGAKERNEL: KernelCache(tmp_path / "cache"), "megakernel:copy": KernelCache(tmp_path, tmp_path / "copy")}
    return timings, caches, steps


def test_the_builds_are_timed_in_turn_every_round(tmp_path, monkeypatch):
    """Each build's graph is timed once per round, the builds alternating, from the benchmark's
    position (every replay advances it), and reported as the median of its rounds."""
    timings, caches, steps = _stand_in_for_the_gpu(monkeypatch, tmp_path)
    model = random_model(ModelConfig.from_hf_dict(TINY_CONFIG), torch.device("cpu"))

    measured = dict(bench.bench_context(model, 100, (MEGAKERNEL,), caches, rounds=3))

    assert timings[:6] == ["kernels@100", "copy@100"] * 3  # then each timing build once
    assert timings[6:] == ["kernels+timing@100", "copy+timing@100"]
    # The cache is exactly long enough for the positions the replays write (_Step.launch checks).
    assert max(step.furthest for step in steps) == steps[0].cache.max_seq - 1
    seconds, launches, extra = measured[MEGAKERNEL]
    assert extra["round_ms"] == pytest.approx([1.1, 1.3, 1.5]) and seconds == pytest.approx(1.3e-3)
    assert measured["megakernel:copy"][2]["round_ms"] == pytest.approx([2.4, 2.8, 3.2])
    assert launches == 1 and extra["stage_ms"] == {"qkv": 1.0} and extra["timing_cost_ms"] == pytest.approx(
        3e-3 * 1.7 * 1e3 - 1.3)
    # The streaming probe over the step's bytes, for the package's build only: 2 layers' barriers
    step_ms = sum(bench.stage_read_bytes(model.config, 101).values()) * 1e-9
    assert extra["stream_ms"] == pytest.approx({0: step_ms, 2: step_ms + 2 * 2e-3, 3: step_ms + 2 * 3e-3,
                                                4: step_ms + 2 * 4e-3})
    assert extra["ring_stream_ms"] == pytest.approx({0: step_ms, 3: step_ms + 2 * 3 * 2e-3})
    # The inner edges: counts over TINY_CONFIG's one KV head (132 CTAs), then per cluster size counts and
    # cluster barriers, 2 layers of 2 edges each
    two_barriers = step_ms + 2 * 2e-3
    assert extra["inner_edge_ms"] == [
        InnerEdgeProbe("counts", 1, 132, pytest.approx(two_barriers + 4 * 132e-6)),
        InnerEdgeProbe("counts", 8, 120, pytest.approx(two_barriers + 4 * 8e-6)),
        InnerEdgeProbe("cluster barriers", 8, 120, pytest.approx(two_barriers + 4 * 3 * 8e-6)),
        InnerEdgeProbe("counts", 16, 112, pytest.approx(two_barriers + 4 * 16e-6)),
        InnerEdgeProbe("cluster barriers", 16, 112, pytest.approx(two_barriers + 4 * 3 * 16e-6)),
    ]
    for probe in ("stream_ms", "ring_stream_ms", "inner_edge_ms"):
        assert probe not in measured["megakernel:copy"][2]


@pytest.mark.parametrize("failing", ["copy", "copy+timing"])
def test_a_build_that_fails_is_reported_and_the_other_builds_are_timed(tmp_path, monkeypatch, failing):
    # The likely failure of an A/B run: the edited variant does not compile (or its timing build).
    timings, caches, _ = _stand_in_for_the_gpu(monkeypatch, tmp_path, failing={failing})
    model = random_model(ModelConfig.from_hf_dict(TINY_CONFIG), torch.device("cpu"))

    measured = dict(bench.bench_context(model, 100, (MEGAKERNEL, "eager"), caches, rounds=1))

    assert isinstance(measured["megakernel:copy"], KernelBuildError)
    assert measured[MEGAKERNEL][1] == 1 and "eager" in measured  # the package's build and the baselines ran
    assert "kernels@100" in timings and "kernels+timing@100" in timings


def test_the_report_is_written_after_each_model_so_a_run_cut_short_keeps_them(tmp_path, monkeypatch):
    def bench_model(name, contexts, methods, caches, rounds, bandwidth, log):
        if name == "Qwen3-8B":
            raise KeyboardInterrupt  # the run is stopped while the last model is timed
        return [Result(name, 1024, MEGAKERNEL, 1.0, 1000.0, 1, 0.9)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "test GPU")
    monkeypatch.setattr(bench, "read_bandwidth", lambda device: 4e12)
    monkeypatch.setattr(bench, "time_grid_barrier", lambda cache, device: 1e-6)
    monkeypatch.setattr(bench, "bench_model", bench_model)
    out = tmp_path / "bench.json"
    argv = ["--kernel-cache", str(tmp_path / "cache"), "--out", str(out), "--models", "Llama-3.2-1B", "Llama-3.1-8B"]

    assert bench.main(argv) == 0
    assert json.loads(out.read_text())["finished"] is True
    with pytest.raises(KeyboardInterrupt):
        bench.main([*argv, "Qwen3-8B"])
    report = json.loads(out.read_text())
    assert report["finished"] is False
    assert [r["model"] for r in report["results"]] == ["Llama-3.2-1B", "Llama-3.1-8B"]


def test_a_gpu_the_kernels_do_not_take_still_times_the_baselines(tmp_path, monkeypatch, capsys):
    def refuse(cache, device):
        raise KernelBuildError("the megakernel needs a Hopper or newer GPU (sm_90+); this one is sm_80")

    def bench_model(name, contexts, methods, caches, rounds, bandwidth, log):
        return [Result(name, 1024, "eager", 10.0, 100.0, 700, 0.1)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "older GPU")
    monkeypatch.setattr(bench, "read_bandwidth", lambda device: 2e12)
    monkeypatch.setattr(bench, "time_grid_barrier", refuse)
    monkeypatch.setattr(bench, "bench_model", bench_model)
    out = tmp_path / "bench.json"
    argv = ["--kernel-cache", str(tmp_path / "cache"), "--out", str(out), "--models", "Llama-3.2-1B",
            "--methods", "eager"]
    assert bench.main(argv) == 0
    assert json.loads(out.read_text())["grid_barrier_seconds"] is None
    captured = capsys.readouterr()
    assert "grid barrier not timed: the megakernel needs a Hopper" in captured.err
    assert "one grid barrier: not timed" in captured.out and "Llama-3.2-1B" in captured.out


def test_the_report_s_file_is_tried_for_writing_and_left_as_it_was(tmp_path):
    out = tmp_path / "bench.json"
    parse_args(["--kernel-cache", str(tmp_path / "cache"), "--out", str(out)])
    assert not out.exists()  # a new file is not left behind by the check
    out.write_text("an earlier report")
    parse_args(["--kernel-cache", str(tmp_path / "cache"), "--out", str(out)])
    assert out.read_text() == "an earlier report"
