"""`megaserve bench`: batch-1 decode on one GPU, the megakernel against stock PyTorch paths.

For each model shape (real configs, random bf16 weights made on the GPU, nothing downloaded) and
each context length, one run measures:

  megakernel      one persistent launch per step (kernels/), replayed as a one-node CUDA graph
  eager           the reference forward, op by op from Python
  cuda-graph      the same forward (cache view bound up front) captured in a CUDA graph
  compile+graph   torch.compile (inductor) of the same step, captured in a CUDA graph

and reports ms/step, tokens/s, kernel launches per step (counted with torch.profiler) and the
fraction of the HBM roofline: (weight bytes + KV bytes read per step) / step time, over the read
bandwidth measured in the same run with a large reduction. The megakernel's per-stage breakdown
comes from its in-kernel timestamps (a second build with timing on; its cost is reported too), a
Markdown table per model and context: each stage beside the bytes it must read, the bandwidth it
reached and its time over the floor (bytes / measured bandwidth), and its closing barrier split
into the tail of the CTAs' arrivals (median to last) and the release after the last one; the cost
of one grid barrier alone (kernels/barrier_probe.py) is measured in the same run. Under each stage
table, the streaming probe (kernels/barrier_probe.py, `streaming_ceiling`): the same bytes streamed
with 0, 2 (the fewest a dense layer allows, and the megakernel's), 3 or 4 grid barriers per layer and
nothing else between the loads, the fastest that a kernel with those edges could be; and the same
bytes loaded by a loader warp per SM
into a ring of shared memory that never waits at the barriers (`ring_streaming`), what a kernel
whose loads run past its edges could be; and the same with 2 grid barriers per layer and the
layer's inner edges (QKV -> attention -> O) as counts over each KV head's CTAs, as the megakernel
crosses them, or in clusters of 8 and 16 CTAs as counts and as cluster barriers, on the grid such
clusters fill (`inner_edges`): what handing QKV rows and attention partials on within a cluster
could save, and what the SMs a cluster grid leaves idle cost.

`--kernel-sources NAME=DIR ...` times edited copies of the kernel sources beside the package's own
(methods `megakernel:NAME` beside `megakernel`), on the same weights and cache: their CUDA graphs are
replayed in turn, `--rounds` times, so that the comparison is one of ratios within one run.

Runs on a bare GPU image: imports only torch, cuda-python and this package's kernels/ and models/.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from megaserve.kernels.barrier_probe import (
    RING_BYTES,
    RING_SLOTS,
    StreamEdge,
    StreamStage,
    cluster_grid,
    time_grid_barrier,
    time_streaming_ring,
    time_streaming_step,
)
from megaserve.kernels.build import KernelBuildError, KernelCache
from megaserve.kernels.launcher import (
    FINAL_STAGE,
    STAGES_PER_LAYER,
    TRANSPOSED_FIELDS,
    DecodeStep,
    StageTimes,
    store_transposed,
)
from megaserve.kernels.profiling import count_kernel_launches
from megaserve.kernels.shape import UnsupportedShapeError
from megaserve.replicas.models import Model, ModelConfig
from megaserve.replicas.models.decoder import expected_shapes
from megaserve.replicas.models.sharding import plan_sharding, step_read_bytes

# The shapes of the real checkpoints' config.json (only what ModelConfig reads).
_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
BENCH_CONFIGS = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_SCALING, "factor": 32.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_SCALING, "factor": 8.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
CONTEXTS = (1024, 8192)
MEGAKERNEL = "megakernel"  # the method of the package's own kernel sources; a variant's is MEGAKERNEL:NAME
METHODS = (MEGAKERNEL, "eager", "cuda-graph", "compile+graph")
WEIGHT_STD = 0.02  # like an initializer: keeps activations finite through 36 layers
NORM_JITTER = 0.1
CACHE_STD = 1.0
BANDWIDTH_PROBE_BYTES = 4 << 30  # several times the 60 MB L2
BANDWIDTH_TIMED_CALLS = 10  # per timed block: each call reads the whole probe, about 1 ms on an H200
WARMUP_STEPS = 5
TIMED_STEPS = 50
EAGER_TIMED_STEPS = 10
REPEATS = 3  # median of this many timed blocks
# Replays of a captured megakernel step between two resets of its position (time_steps' warm-up and
# timed blocks; capture's warm-up and count_kernel_launches' two calls are fewer): each replay
# writes the K and V of its position and advances it by one, so the cache holds this many more.
REPLAYS_PER_POSITION_RESET = WARMUP_STEPS + REPEATS * TIMED_STEPS
SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
BF16_BYTES = 2


@dataclass
class Result:
    model: str
    context: int
    method: str
    ms_per_step: float = float("nan")
    tokens_per_second: float = float("nan")
    launches_per_step: int = 0
    roofline_fraction: float = float("nan")
    stage_ms: dict[str, float] = field(default_factory=dict)
    stage_bytes: dict[str, int] = field(default_factory=dict)  # what each stage must read per step
    # of each barrier stage: the tail of the CTAs' arrivals at its closing barrier (median to last),
    # and the barrier's release after the last one (kernels.launcher.StageTimes)
    stage_tail_ms: dict[str, float] = field(default_factory=dict)
    stage_release_ms: dict[str, float] = field(default_factory=dict)
    stage_late_repeat: dict[str, float] = field(default_factory=dict)  # StageTimes.late_repeat
    timing_cost_ms: float | None = None
    round_ms: list[float] = field(default_factory=list)  # a megakernel's ms/step of each --rounds round
    # The package's megakernel only: ms per step of the streaming probe over the same bytes, by the
    # grid barriers per layer it crosses (streaming_ceiling)
    stream_ms: dict[int, float] = field(default_factory=dict)
    ring_stream_ms: dict[int, float] = field(default_factory=dict)  # the same with the loader ring (ring_streaming)
    inner_edge_ms: list[InnerEdgeProbe] = field(default_factory=list)  # the inner edges' probe (inner_edges)
    error: str | None = None  # set (and the figures NaN) when this method failed to run


def stage_read_bytes(config: ModelConfig, context_len: int) -> dict[str, int]:
    """Bytes each megakernel stage must read per step, summed over layers, with `context_len` cached
    positions (the new one included): its weights, or the K and V rows for attention. Norm weights
    and activations are a few KB and left out."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * head_dim, config.num_kv_heads * head_dim
    per_layer = {
        "qkv": (q_dim + 2 * kv_dim) * hidden,
        "attention": 2 * kv_dim * context_len,
        "o_proj": hidden * q_dim,
        "mlp": 3 * hidden * config.intermediate_size,  # gate/up and down, one stage
    }
    stages = {name: per_layer[name] * config.num_layers * BF16_BYTES for name in STAGES_PER_LAYER}
    return stages | {FINAL_STAGE: config.vocab_size * hidden * BF16_BYTES}


# Grid barriers per layer that the streaming probe crosses: none (the loads' own rate), two (the
# fewest any dense layer can have: each RMSNorm needs the whole residual stream, so the stages
# before the MLP's and the next layer's norms end at all-to-all edges), the megakernel's three,
# and four (its wait for a KV head's QKV rows timed as a fourth barrier).
STREAM_BARRIERS_PER_LAYER = (0, 2, 3, 4)
# Of each layer's stages, those followed by a barrier, for each count above.
_STREAM_BARRIER_STAGES = {0: (), 2: ("o_proj", "mlp"), 3: ("attention", "o_proj", "mlp"), 4: STAGES_PER_LAYER}


def streaming_stages(config: ModelConfig, context_len: int, barriers_per_layer: int,
                     inner_edge: StreamEdge = StreamEdge.NONE) -> list[StreamStage]:
    """The step as stream_stages runs it: every layer's stage_read_bytes in order, then the LM head,
    with a grid barrier after the stages _STREAM_BARRIER_STAGES names and `inner_edge` after the
    layer's other stages before O (_INNER_EDGE_STAGES)."""
    per_step = stage_read_bytes(config, context_len)
    after = _STREAM_BARRIER_STAGES[barriers_per_layer]

    def edge(name: str) -> StreamEdge:
        return StreamEdge.GRID if name in after else inner_edge if name in _INNER_EDGE_STAGES else StreamEdge.NONE

    layer = [StreamStage(name, per_step[name] // config.num_layers, edge(name)) for name in STAGES_PER_LAYER]
    return [*layer * config.num_layers, StreamStage(FINAL_STAGE, per_step[FINAL_STAGE], StreamEdge.NONE)]


def streaming_ceiling(config: ModelConfig, context_len: int, kernel_cache: KernelCache,
                      device: torch.device) -> dict[int, float]:
    """ms per step of the streaming probe (kernels/barrier_probe.py) over the step's bytes, by grid
    barriers per layer (STREAM_BARRIERS_PER_LAYER): how fast a kernel with those edges, and nothing
    else between its loads, could be."""
    return {count: time_streaming_step(kernel_cache, device, streaming_stages(config, context_len, count)) * 1e3
            for count in STREAM_BARRIERS_PER_LAYER}


# The stages that end at a layer's inner edges: QKV (attention on a KV head waits for that head's
# rows) and attention (O on a slice of channels waits for their heads' splits).
_INNER_EDGE_STAGES = ("qkv", "attention")
# Cluster sizes of the inner-edge probe: a KV head's CTAs on the 8B and 1B shapes on 132 SMs (16:
# one cluster per head would hand QKV rows and partials on in shared memory), and half of it.
INNER_EDGE_CLUSTER_CTAS = (8, 16)


@dataclass(frozen=True)
class InnerEdgeProbe:
    """The streaming probe with 2 grid barriers per layer and the layer's inner edges as `edge`, on a
    grid of `ctas` CTAs (in clusters of `cluster_ctas`): its ms per step, or why it could not run (a
    GPU that cannot hold, or launch, clusters of that size)."""

    edge: str
    cluster_ctas: int
    ctas: int
    ms: float
    error: str | None = None


def inner_edges(config: ModelConfig, context_len: int, kernel_cache: KernelCache,
                device: torch.device) -> list[InnerEdgeProbe]:
    """What the layer's inner edges cost a step with no dependent work: the streaming probe with 2
    grid barriers per layer and its inner edges as the megakernel crosses them (counts over a KV
    head's grid // kv_heads CTAs, on the whole grid), then, for each INNER_EDGE_CLUSTER_CTAS, on the
    grid that clusters of that size fill, as the same counts over each cluster and as cluster
    barriers (each CTA's payload in the others' shared memory)."""
    whole = cluster_grid(kernel_cache, device, 1)
    counted = streaming_stages(config, context_len, 2, StreamEdge.GROUP)
    probes = [InnerEdgeProbe("counts", 1, whole, 1e3 * time_streaming_step(
        kernel_cache, device, counted, group_ctas=max(1, whole // config.num_kv_heads)))]
    for size in INNER_EDGE_CLUSTER_CTAS:
        try:
            ctas = cluster_grid(kernel_cache, device, size)
            for name, edge in (("counts", StreamEdge.GROUP), ("cluster barriers", StreamEdge.CLUSTER)):
                stages = streaming_stages(config, context_len, 2, edge)
                ms = 1e3 * time_streaming_step(kernel_cache, device, stages, group_ctas=size, cluster_ctas=size)
                probes.append(InnerEdgeProbe(name, size, ctas, ms))
        except Exception as error:  # noqa: BLE001 - reported in the table, the bench goes on
            probes.append(InnerEdgeProbe("clusters", size, 0, float("nan"), f"{type(error).__name__}: {error}"))
    return probes


# Grid barriers per layer of the ring probe: none (the ring's own rate) and three, the megakernel's
# until O waited per KV head (docs/perf.md runs 77-84 compare the ring with the plain probe there).
RING_BARRIERS_PER_LAYER = (0, 3)


def ring_streaming(config: ModelConfig, context_len: int, kernel_cache: KernelCache,
                   device: torch.device) -> dict[int, float]:
    """ms per step of the ring probe (time_streaming_ring: a loader warp per SM fills a ring of
    shared memory through the copy engine and never waits at a barrier) over the step's bytes, by
    grid barriers per layer (RING_BARRIERS_PER_LAYER)."""
    return {count: time_streaming_ring(kernel_cache, device, streaming_stages(config, context_len, count)) * 1e3
            for count in RING_BARRIERS_PER_LAYER}


def random_model(config: ModelConfig, device: torch.device) -> Model:
    """A Model of `config` with random bf16 weights created directly on `device`."""
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if len(shape) == 1:  # a norm weight
            tensor.normal_(1.0, NORM_JITTER, generator=generator)
        else:
            tensor.normal_(0.0, WEIGHT_STD, generator=generator)
        tensors[name] = tensor
    return Model(config, tensors)


def read_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large reduction over a buffer far larger than L2."""
    data = torch.empty(BANDWIDTH_PROBE_BYTES // BF16_BYTES, dtype=torch.bfloat16, device=device).normal_()
    return BANDWIDTH_PROBE_BYTES / time_steps(data.sum, BANDWIDTH_TIMED_CALLS)


def time_steps(step: Callable[[], object], count: int) -> float:
    """Median seconds per call of `step` over REPEATS blocks of `count` calls, timed with events."""
    for _ in range(WARMUP_STEPS):
        step()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / count)
    return statistics.median(samples)


def capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocator, autotuning, lazy init) outside the graph
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def bench_model(name: str, contexts: tuple[int, ...], methods: tuple[str, ...],
                kernel_caches: dict[str, KernelCache], rounds: int, bandwidth: float,
                log: Callable[[str], None]) -> list[Result]:
    model = random_model(ModelConfig.from_hf_dict(BENCH_CONFIGS[name]), torch.device("cuda"))
    results = []
    for context in contexts:
        # The whole step's reads with the new token's key and value: tp=1 is the whole model.
        floor_bytes = step_read_bytes(plan_sharding(model.config, 1), context + 1, BF16_BYTES).total
        for method, measured in bench_context(model, context, methods, kernel_caches, rounds):
            if isinstance(measured, Exception):  # a baseline that this torch cannot run
                results.append(Result(name, context, method, error=f"{type(measured).__name__}: {measured}"))
                log(f"{name} ctx={context} {method}: failed: {results[-1].error.splitlines()[0]}")
                continue
            seconds, launches, extra = measured
            result = Result(name, context, method, seconds * 1e3, 1 / seconds, launches,
                            floor_bytes / seconds / bandwidth, **extra)
            results.append(result)
            log(f"{name} ctx={context} {method}: {result.ms_per_step:.3f} ms/step, {launches} launches, "
                f"{100 * result.roofline_fraction:.1f}% of roofline")
        torch.cuda.empty_cache()
    return results


@torch.no_grad()
def bench_context(
    model: Model, context: int, methods: tuple[str, ...], kernel_caches: dict[str, KernelCache], rounds: int
) -> Iterator[tuple[str, tuple[float, int, dict] | Exception]]:
    """(method, (seconds per step, launches per step, extra Result fields)) at `context` keys, one
    method at a time (the megakernel once per entry of `kernel_caches`, method name -> the cache
    of its sources); a PyTorch baseline that fails yields its exception instead."""
    device = model.device
    cache = model.new_cache(1, context + REPLAYS_PER_POSITION_RESET)
    for tensor in (*cache.k, *cache.v):
        tensor.normal_(0.0, CACHE_STD)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    positions = torch.full((1, 1), context, dtype=torch.long, device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)

    def eager() -> torch.Tensor:
        return model.forward(ids, positions, cache, slots)

    def bound(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the cache view bound up front: no host sync, so a CUDA graph can hold it
        return model.forward(ids, positions, cache, slots, context_len=context + 1)

    def bound_for_compile(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The same reference forward without its inference_mode wrapper: inductor (torch 2.11)
        # fails on inference tensors ("weakref to UntypedStorage"); no_grad is in force here.
        return Model.forward.__wrapped__(model, ids, positions, cache, slots, context_len=context + 1)

    def graphed(step: Callable[[], object]) -> tuple[float, int, dict]:
        graph = capture(step)
        return time_steps(graph.replay, TIMED_STEPS), count_kernel_launches(graph.replay), {}

    if MEGAKERNEL in methods:
        with weights_stored_transposed(model):
            for method, measured in bench_megakernels(model, cache, context, kernel_caches, rounds):
                if isinstance(measured, Exception):  # a build that failed: the others are timed
                    yield method, measured
                    continue
                round_seconds, launches, stages, timing_cost_ms = measured
                extra = {"stage_ms": _ms(stages.seconds), "stage_bytes": stage_read_bytes(model.config, context + 1),
                         "stage_tail_ms": _ms(stages.tail), "stage_release_ms": _ms(stages.release),
                         "stage_late_repeat": stages.late_repeat, "timing_cost_ms": timing_cost_ms,
                         "round_ms": [seconds * 1e3 for seconds in round_seconds]}
                if method == MEGAKERNEL:
                    extra["stream_ms"] = streaming_ceiling(model.config, context + 1, kernel_caches[method], device)
                    extra["ring_stream_ms"] = ring_streaming(model.config, context + 1, kernel_caches[method], device)
                    extra["inner_edge_ms"] = inner_edges(model.config, context + 1, kernel_caches[method], device)
                yield method, (statistics.median(round_seconds), launches, extra)
    baselines = {
        "eager": lambda: (time_steps(eager, EAGER_TIMED_STEPS), count_kernel_launches(eager), {}),
        "cuda-graph": lambda: graphed(lambda: bound(ids, positions)),
        "compile+graph": lambda: graphed(partial(torch.compile(bound_for_compile, dynamic=False), ids, positions)),
    }
    for method, run in baselines.items():
        if method in methods:
            try:
                yield method, run()
            except Exception as error:  # noqa: BLE001 - reported in the table, the run goes on
                yield method, error


def _ms(seconds: dict[str, float]) -> dict[str, float]:
    return {name: value * 1e3 for name, value in seconds.items()}


@contextmanager
def weights_stored_transposed(model: Model) -> Iterator[None]:
    """The megakernel's layout of wo and w_down (a transposed copy of each) while the block runs;
    the PyTorch baselines then run on the checkpoint's row-major layout, as its users would."""
    row_major = [{name: getattr(layer, name) for name in TRANSPOSED_FIELDS} for layer in model.layers]
    store_transposed(model)
    try:
        yield
    finally:
        for layer, weights in zip(model.layers, row_major, strict=True):
            for name, weight in weights.items():
                setattr(layer, name, weight)


# What building a megakernel can raise: a variant's sources that NVRTC refuses, a shape or GPU the
# kernel does not take. The bench reports it as that build's result and times the others.
BUILD_ERRORS = (KernelBuildError, UnsupportedShapeError)


def bench_megakernels(
    model: Model, cache, context: int, kernel_caches: dict[str, KernelCache], rounds: int
) -> Iterator[tuple[str, tuple[list[float], int, StageTimes, float] | Exception]]:
    """Per build of the megakernel (method name -> the cache of its sources): (seconds per step of
    each round, launches per step, per-stage times, ms/step that the timestamps cost), or the
    BUILD_ERRORS exception of a build that failed. The builds' graphs are timed in turn, `rounds`
    times, so that a drift of the GPU's clocks meets every build alike."""
    steps = {}
    for method, kernel_cache in kernel_caches.items():
        try:
            steps[method] = DecodeStep(model, cache, 0, kernel_cache)
        except BUILD_ERRORS as error:
            yield method, error
    graphs = {}
    for method, step in steps.items():
        step.set_position(0, context)
        graphs[method] = capture(step.launch)
    samples: dict[str, list[float]] = {method: [] for method in steps}
    for _ in range(rounds):
        for method, graph in graphs.items():
            steps[method].set_position(0, context)
            samples[method].append(time_steps(graph.replay, TIMED_STEPS))
    for method, step in steps.items():
        seconds = statistics.median(samples[method])  # what the timing build's cost is measured against
        step.set_position(0, context)
        launches = count_kernel_launches(graphs[method].replay)
        try:
            timed = DecodeStep(model, cache, 0, kernel_caches[method], timing=True)
        except BUILD_ERRORS as error:
            yield method, error
            continue
        timed.set_position(0, context)
        timed_graph = capture(timed.launch)
        timed.set_position(0, context)
        timed_seconds = time_steps(timed_graph.replay, TIMED_STEPS)
        # the stages of one more replay, at the context's position as every byte count of the bench
        timed.set_position(0, context)
        timed_graph.replay()
        yield method, (samples[method], launches, timed.stage_times(), (timed_seconds - seconds) * 1e3)


def _barrier_text(barrier_seconds: float | None) -> str:
    return "not timed" if barrier_seconds is None else f"{barrier_seconds * 1e6:.2f} µs"


def format_table(results: list[Result], bandwidth: float, barrier_seconds: float | None) -> str:
    width = 1 + max(len(method) for method in (*METHODS, *(r.method for r in results)))  # the method column
    lines = [f"HBM read bandwidth (reduction): {bandwidth / 1e9:,.0f} GB/s; one grid barrier: "
             f"{_barrier_text(barrier_seconds)}",
             f"{'model':<14} {'ctx':>5} {'method':<{width}} {'ms/step':>8} {'tok/s':>8} {'launches':>8} "
             f"{'roofline':>8}"]
    own = {(r.model, r.context): r.ms_per_step for r in results if r.method == MEGAKERNEL and not r.error}
    for r in results:
        if r.error:
            lines.append(f"{r.model:<14} {r.context:>5} {r.method:<{width}} failed: {r.error.splitlines()[0][:60]}")
            continue
        line = (f"{r.model:<14} {r.context:>5} {r.method:<{width}} {r.ms_per_step:>8.3f} "
                f"{r.tokens_per_second:>8.0f} {r.launches_per_step:>8} {100 * r.roofline_fraction:>7.1f}%")
        if r.method.startswith(f"{MEGAKERNEL}:") and (r.model, r.context) in own:  # a variant, beside the sources
            line += f" {r.ms_per_step / own[r.model, r.context] - 1:+8.1%} vs {MEGAKERNEL}"
        lines.append(line)
    for r in results:
        if r.stage_ms:
            lines += _stage_table(r, bandwidth)
    return "\n".join(lines)


def _stage_table(r: Result, bandwidth: float) -> list[str]:
    """Where one step's time goes, as a Markdown table: per stage (each with its closing barrier) the
    bytes it must read, its time, the bandwidth that makes, and its time over the floor (bytes /
    measured bandwidth); then the closing barrier's arrival tail (median CTA to last), release
    (last arrival to the next stage's start) and how often its latest CTAs were the previous layer's
    (StageTimes.late_repeat)."""
    build = "" if r.method == MEGAKERNEL else f" {r.method}"
    lines = [f"stages {r.model} ctx={r.context}{build} (timing build, which costs {r.timing_cost_ms:+.3f} ms/step):",
             "| stage | MB read | ms | GB/s | % of bandwidth | ms over floor | arrival tail ms | release ms "
             "| late CTAs repeat |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, ms in r.stage_ms.items():
        read_bytes = r.stage_bytes[name]
        achieved = read_bytes / (ms * 1e-3) if ms > 0 else 0.0
        rate = f"{achieved / 1e9:,.0f} | {100 * achieved / bandwidth:.0f}%" if ms > 0 else "n/a | n/a"
        over_floor = ms - read_bytes / bandwidth * 1e3
        tail, release = r.stage_tail_ms.get(name), r.stage_release_ms.get(name)
        barrier = f"{tail:.3f} | {release:.3f}" if tail is not None and release is not None else " | "
        repeat = r.stage_late_repeat.get(name)
        barrier += f" | {100 * repeat:.0f}%" if repeat is not None else " | "
        lines.append(f"| {name} | {read_bytes / 1e6:,.1f} | {ms:.3f} | {rate} | {over_floor:+.3f} | {barrier} |")
    step_bytes = sum(r.stage_bytes.values())

    def per_barrier_count(probe_ms: dict[int, float]) -> str:
        return ", ".join(f"{count} per layer {ms:.3f} ms ({100 * step_bytes / (ms * 1e-3) / bandwidth:.1f}%)"
                         for count, ms in probe_ms.items())

    if r.stream_ms:
        lines.append("streaming probe, the same bytes with nothing between the loads but grid barriers: "
                     + per_barrier_count(r.stream_ms))
    if r.ring_stream_ms:
        lines.append(f"the same loaded by a loader warp per SM into a {RING_BYTES // 1024} KB ring of {RING_SLOTS} "
                     "slots, past the barriers: " + per_barrier_count(r.ring_stream_ms))
    if r.inner_edge_ms:
        lines.append("the same with 2 barriers per layer and the inner edges (QKV -> attention -> O) as: " + ", ".join(
            f"clusters of {p.cluster_ctas} failed: {p.error.splitlines()[0][:60]}" if p.error else
            f"{p.edge} {'over the KV heads' if p.cluster_ctas == 1 else f'in clusters of {p.cluster_ctas}'} on "
            f"{p.ctas} CTAs {p.ms:.3f} ms ({100 * step_bytes / (p.ms * 1e-3) / bandwidth:.1f}%)"
            for p in r.inner_edge_ms))
    return lines


def _cannot_write(path: Path) -> str | None:
    """Why `path` cannot be opened for writing, or None; tried, not inferred from its mode bits (which
    root's writes ignore), and left as it was."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    if not existed:
        path.unlink()
    return None


def arg_parser(kernel_cache: Path | None = None) -> argparse.ArgumentParser:
    """The bench's flags; `kernel_cache` is --kernel-cache's default (`megaserve bench` passes
    MEGASERVE_KERNEL_CACHE's folder), without which the flag is required."""
    parser = argparse.ArgumentParser(prog="megaserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(BENCH_CONFIGS), default=list(BENCH_CONFIGS),
                        help="model shapes to time, each with random weights (default: all)")
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS),
                        help="tokens already in the KV cache when the timed steps start (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="decode engines timed side by side on each shape (default: all)")
    parser.add_argument("--kernel-cache", type=Path, required=kernel_cache is None, default=kernel_cache,
                        help="folder for compiled kernels" + (f" (default {kernel_cache})" if kernel_cache else ""))
    parser.add_argument("--out", type=Path, default=Path("bench.json"),
                        help="where to write the JSON results (rewritten after each model)")
    parser.add_argument("--kernel-sources", nargs="+", default=[], metavar="NAME=DIR",
                        help="edited copies of the kernel sources, each timed beside the package's own as "
                             f"method {MEGAKERNEL}:NAME")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each megakernel build is timed, the builds in turn (median of the rounds)")
    return parser


def parse_args(argv: list[str] | None, kernel_cache: Path | None = None) -> argparse.Namespace:
    """The bench's flags, checked; `kernel_cache` as for arg_parser."""
    parser = arg_parser(kernel_cache)
    args = parser.parse_args(argv)
    if any(context < 1 for context in args.contexts):
        parser.error("contexts must be positive")
    if args.rounds < 1:
        parser.error("rounds must be at least 1")
    if args.kernel_sources and MEGAKERNEL not in args.methods:
        parser.error(f"--kernel-sources times variants beside the {MEGAKERNEL}: add it to --methods")
    if args.rounds > 1 and MEGAKERNEL not in args.methods:
        parser.error(f"--rounds times the {MEGAKERNEL}'s builds in turn: add it to --methods")
    for flag, values in (("--models", args.models), ("--contexts", args.contexts), ("--methods", args.methods)):
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            parser.error(f"{flag} names {', '.join(map(str, repeated))} more than once")
    if not args.out.parent.is_dir() or args.out.is_dir():
        parser.error(f"--out {args.out}: not a file in an existing folder (the report is written after each model)")
    unwritable = _cannot_write(args.out)
    if unwritable:
        parser.error(f"--out {args.out}: cannot be written ({unwritable}; the report is written after each model)")
    for name in args.models:  # the cache holds the context's keys and the positions the replays write
        limit = BENCH_CONFIGS[name]["max_position_embeddings"]
        too_long = [context for context in args.contexts if context + REPLAYS_PER_POSITION_RESET > limit]
        if too_long:
            parser.error(f"contexts {too_long} are past {name}'s {limit:,} positions (with the "
                         f"{REPLAYS_PER_POSITION_RESET} positions its timed steps write)")
    try:
        args.kernel_caches = {MEGAKERNEL: KernelCache(args.kernel_cache)}
    except KernelBuildError as error:
        parser.error(str(error))
    for entry in args.kernel_sources:
        name, sep, folder = entry.partition("=")
        if not sep or not SOURCE_NAME.fullmatch(name) or not folder:
            parser.error(f"--kernel-sources takes NAME=DIR with a NAME of letters, digits, '_', '.' and '-'; "
                         f"got {entry!r}")
        method = f"{MEGAKERNEL}:{name}"
        if method in args.kernel_caches:
            parser.error(f"--kernel-sources names {name!r} twice")
        try:
            args.kernel_caches[method] = KernelCache(args.kernel_cache, folder)
        except KernelBuildError as error:
            parser.error(str(error))
    return args


def main(argv: list[str] | None = None, kernel_cache: Path | None = None) -> int:
    args = parse_args(argv, kernel_cache)
    if not torch.cuda.is_available():
        print("megaserve bench needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.time()
    device = torch.device("cuda")
    bandwidth = read_bandwidth(device)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        barrier_seconds = time_grid_barrier(args.kernel_caches[MEGAKERNEL], device)
    except KernelBuildError as error:  # a GPU the kernels do not take: the baselines still run
        log(f"grid barrier not timed: {error}")
        barrier_seconds = None
    log(f"read bandwidth {bandwidth / 1e9:,.0f} GB/s, grid barrier {_barrier_text(barrier_seconds)} "
        f"on {torch.cuda.get_device_name(device)}")
    results = []

    def write_report(finished: bool) -> None:
        report = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "read_bandwidth_bytes_per_second": bandwidth,
            "grid_barrier_seconds": barrier_seconds,
            "kernel_sources": {method: str(cache.source_dir) for method, cache in args.kernel_caches.items()},
            "seconds": time.time() - started,
            "finished": finished,  # False: a run cut short, its models so far
            "results": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2))

    for index, name in enumerate(args.models, start=1):
        results += bench_model(name, tuple(args.contexts), tuple(args.methods), args.kernel_caches, args.rounds,
                               bandwidth, log)
        write_report(finished=index == len(args.models))
        torch.cuda.empty_cache()
    print(format_table(results, bandwidth, barrier_seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
