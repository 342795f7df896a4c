"""Bind the compiled decode megakernel to one model's weights and one KV-cache row, and launch it.

`DecodeStep` owns the kernel's device buffers (activations, attention partials, logits, counters,
the step state) and launches one decode step with one cooperative launch on PyTorch's current
stream, which a `torch.cuda.graph` captures. The step reads its input token and position from
`state` in device memory and writes the next ones back (the argmax, and position + 1), so a graph
of one launch replays for every step.

This module knows the model only by duck typing (`DecodeModel` below: the attributes of
`replicas.models.Model`), because kernels/ may import only torch and cuda-python.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from cuda.core import Device, LaunchConfig, launch

from .build import KernelCache, arch_for
from .shape import MAX_SPLITS, PARTIAL_EXTRA_FLOATS, THREADS, KernelShape

# decode_step.cu's enums and constants, mirrored.
STATE_TOKEN, STATE_POS, STATE_ARGMAX, STATE_SLOTS = 0, 1, 2, 4
COUNTER_HEAD_ROWS = 2  # counters: barrier, argmax-done, then per KV head its QKV rows' count, then its splits'
COUNTERS_PER_KV_HEAD = 2
PROJECTION_SUMS_ROWS = 5  # zeros, the down sums of even and odd layers, the O sums of even and odd layers
RESIDUAL_ROWS = 2  # the residual stream after attention, of even and odd layers
STAGES_PER_LAYER = ("qkv", "attention", "o_proj", "mlp")
FINAL_STAGE = "lm_head"
LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
KERNEL_DTYPE = torch.bfloat16
NS_PER_SECOND = 1e9  # the kernel stamps global_timer_ns()
LATE_SHARE = 0.1  # StageTimes.late_repeat follows the latest tenth of the grid at each barrier


class DecodeLayer(Protocol):  # wo and w_down stored transposed: see store_transposed
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class DecodeModel(Protocol):
    config: object  # a ModelConfig (see shape.ShapedConfig); also rms_norm_eps
    embed: torch.Tensor  # [V, H]
    layers: Sequence[DecodeLayer]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    rope_inv_freq: torch.Tensor  # [head_dim / 2] float32


class DecodeCache(Protocol):
    k: Sequence[torch.Tensor]  # per layer [max_batch, kv_heads, max_seq, head_dim]
    v: Sequence[torch.Tensor]
    max_seq: int


@dataclass(frozen=True)
class StageTimes:
    """Seconds spent in each stage kind of one step (summed over layers), from in-kernel timestamps.

    `seconds` is each stage from CTA 0 passing the barrier before it to CTA 0 passing the one after.
    The barrier stages (all but the LM head) split further, from every CTA's arrival time: `tail`
    is from the median CTA's arrival at the closing barrier to the last one's (how late the slowest
    CTAs finish: uneven work, or SMs that the memory system served late; from the median, not the
    first arrival, because CTAs with no rows in a GEMV arrive at once), `release` from the last
    arrival to CTA 0 passing the barrier (its own latency). QKV and attention end at per-KV-head
    counts, not grid barriers: their `release` is from the last CTA of any head to CTA 0 passing
    its own wait (negative when a head that CTA 0 does not wait for finished later), and
    attention's tail counts CTAs with no attention work, which arrive before CTA 0 starts it.

    `late_repeat` says whether a tail is the same CTAs at every layer: of the latest LATE_SHARE of
    the grid at a stage's barrier, the share that were among the latest at the same stage of the
    layer before, averaged over the layers (with two or more). Late CTAs drawn at random repeat
    about LATE_SHARE of the time; near 1, the same CTAs (the same SMs, within one launch) are slow
    every layer, which rebalancing their work could fix and finer work stealing need not. (Where
    the work itself is uneven, as attention's items are, the repeat says that and not more.)
    """

    seconds: dict[str, float]
    tail: dict[str, float]
    release: dict[str, float]
    late_repeat: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @classmethod
    def from_stamps(cls, stamps: Sequence[int], arrivals: Sequence[Sequence[int]]) -> StageTimes:
        """stamps: CTA 0's nanosecond stamps (step start, after each barrier, step end);
        arrivals[b]: every CTA's arrival at barrier b, which ends stage b."""
        if len(arrivals) != len(stamps) - 2 or len(arrivals) % len(STAGES_PER_LAYER):
            raise ValueError(f"{len(stamps)} stamps and {len(arrivals)} barriers do not make whole layers")
        seconds = dict.fromkeys((*STAGES_PER_LAYER, FINAL_STAGE), 0.0)
        tail = dict.fromkeys(STAGES_PER_LAYER, 0.0)
        release = dict.fromkeys(STAGES_PER_LAYER, 0.0)
        late: dict[str, list[set[int]]] = {kind: [] for kind in STAGES_PER_LAYER}  # per layer, the latest CTAs
        for barrier, arrived in enumerate(arrivals):
            if 0 in arrived:  # the buffer is zeroed once; the kernel stamps every arrival of every launch
                raise ValueError(f"CTA {list(arrived).index(0)} recorded no arrival at barrier {barrier}")
            kind = STAGES_PER_LAYER[barrier % len(STAGES_PER_LAYER)]
            seconds[kind] += (stamps[barrier + 1] - stamps[barrier]) / NS_PER_SECOND
            tail[kind] += (max(arrived) - statistics.median_low(arrived)) / NS_PER_SECOND
            release[kind] += (stamps[barrier + 1] - max(arrived)) / NS_PER_SECOND
            latest = max(1, round(LATE_SHARE * len(arrived)))
            late[kind].append(set(sorted(range(len(arrived)), key=arrived.__getitem__)[-latest:]))
        seconds[FINAL_STAGE] = (stamps[-1] - stamps[-2]) / NS_PER_SECOND
        late_repeat = {
            kind: statistics.mean(len(now & before) / len(now) for before, now in itertools.pairwise(sets))
            for kind, sets in late.items()
            if len(sets) > 1
        }
        return cls(seconds, tail, release, late_repeat)


class DecodeStep:
    """One decode step of `model` over row `slot` of `cache` as a single megakernel launch. The
    model's wo and w_down must be stored transposed (store_transposed)."""

    def __init__(
        self,
        model: DecodeModel,
        cache: DecodeCache,
        slot: int,
        kernel_cache: KernelCache,
        timing: bool = False,
    ) -> None:
        self.shape = KernelShape.from_config(model.config)
        self.device = model.embed.device
        if self.device.type != "cuda":
            raise ValueError(f"the megakernel runs on CUDA devices; the model is on {self.device}")
        self.max_seq = cache.max_seq
        self.timing = timing
        check_weights(model, self.shape)
        self._layer_table = self._build_layer_table(model, cache, slot)
        # the tensors whose addresses the kernel holds, kept alive even if the model's layers change
        self._weights = [getattr(layer, field) for layer in model.layers for field in LAYER_FIELDS]
        self._model = model
        self._cache = cache

        cuda_device = Device(self.device.index if self.device.index is not None else torch.cuda.current_device())
        cuda_device.set_current()
        compiled = kernel_cache.decode_step(self.shape, arch_for(cuda_device.compute_capability), timing)
        self.from_cache = compiled.from_cache
        self._kernel = compiled.object_code().get_kernel(compiled.name_expression)
        blocks_per_sm = self._kernel.occupancy.max_active_blocks_per_multiprocessor(THREADS, 0)
        if blocks_per_sm < 1:
            raise RuntimeError(f"the megakernel for {self.shape} cannot fit one CTA of {THREADS} threads on an SM")
        self.grid = cuda_device.properties.multiprocessor_count  # one persistent CTA per SM
        self.shape.check_grid(self.grid)
        self._config = LaunchConfig(grid=self.grid, block=THREADS, is_cooperative=True)
        self._cuda_device = cuda_device
        self._streams: dict[int, object] = {}

        shape, dev = self.shape, self.device
        self.state = torch.zeros(STATE_SLOTS, dtype=torch.int32, device=dev)
        counters = COUNTER_HEAD_ROWS + COUNTERS_PER_KV_HEAD * shape.kv_heads
        self.counters = torch.zeros(counters, dtype=torch.int32, device=dev)
        self.hidden = torch.empty(RESIDUAL_ROWS, shape.hidden, dtype=KERNEL_DTYPE, device=dev)
        self.qkv = torch.empty(shape.q_dim + 2 * shape.kv_dim, dtype=KERNEL_DTYPE, device=dev)
        # zeros, then the down and O projections' fp32 sums of even and odd layers: zero here, as the
        # first step's layer 0 needs them (row 0 always; the kernel zeroes each row before its next use)
        self.projection_sums = torch.zeros(PROJECTION_SUMS_ROWS, shape.hidden, dtype=torch.float32, device=dev)
        # per query head and split: acc[head_dim], max, sum and padding
        partials = shape.heads * MAX_SPLITS * (shape.head_dim + PARTIAL_EXTRA_FLOATS)
        self.attn_partials = torch.empty(partials, dtype=torch.float32, device=dev)
        self.logits = torch.empty(shape.vocab, dtype=torch.float32, device=dev)  # [V], bf16-exact values
        self.argmax_partials = torch.empty(self.grid, dtype=torch.int64, device=dev)
        # CTA 0's stamps, then (timing builds) every CTA's arrival at each barrier: StageTimer in common.cuh
        self._barriers = len(STAGES_PER_LAYER) * shape.layers
        arrivals = self._barriers * self.grid if timing else 0
        self.stage_stamps = torch.zeros(self._barriers + 2 + arrivals, dtype=torch.int64, device=dev)
        self._eps = np.float32(model.config.rms_norm_eps)

    def _build_layer_table(self, model: DecodeModel, cache: DecodeCache, slot: int) -> torch.Tensor:
        """[layers, 13] int64 device table of LayerWeights (decode_step.cu): weight and cache-row addresses."""
        if not 0 <= slot < cache.k[0].shape[0]:
            raise ValueError(f"slot {slot} is outside the cache's {cache.k[0].shape[0]} rows")
        rows = []
        for index, (layer, k, v) in enumerate(zip(model.layers, cache.k, cache.v, strict=True)):
            for name, tensor in (("k", k), ("v", v)):
                expected = (self.shape.kv_heads, cache.max_seq, self.shape.head_dim)
                if tensor.dtype != KERNEL_DTYPE or not tensor.is_contiguous() or tuple(tensor.shape[1:]) != expected:
                    raise ValueError(
                        f"cache.{name}[{index}] must be a contiguous {KERNEL_DTYPE} [max_batch, {expected}] tensor, "
                        f"got {tensor.dtype} {tuple(tensor.shape)}"
                    )
            pointers = [_address(getattr(layer, field)) for field in LAYER_FIELDS]  # wo, w_down: transposed storage
            pointers += [k[slot].data_ptr(), v[slot].data_ptr()]
            rows.append(pointers)
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def set_position(self, token: int, pos: int) -> None:
        """Make the next launch decode `token` at position `pos` (its key/value land at cache[pos])."""
        if not 0 <= token < self.shape.vocab:
            raise ValueError(f"token {token} is outside the vocabulary of {self.shape.vocab}")
        if not 0 <= pos < self.max_seq:
            raise ValueError(f"position {pos} is outside the cache's {self.max_seq} positions")
        self.state[STATE_TOKEN] = token
        self.state[STATE_POS] = pos

    def launch(self, greedy: bool = True) -> None:
        """Enqueue one decode step on the current stream. Afterwards `state` holds the argmax (and,
        when greedy, it as the next input token) and position + 1; `logits` holds the logits."""
        stream = self._stream()
        launch(
            stream, self._config, self._kernel,
            self._layer_table.data_ptr(), self._model.embed.data_ptr(), self._model.final_norm.data_ptr(),
            self._model.lm_head.data_ptr(), self._model.rope_inv_freq.data_ptr(),
            self.state.data_ptr(), self.counters.data_ptr(), self.hidden.data_ptr(), self.qkv.data_ptr(),
            self.projection_sums.data_ptr(), self.attn_partials.data_ptr(),
            self.logits.data_ptr(), self.argmax_partials.data_ptr(), self.stage_stamps.data_ptr(),
            self._eps, np.int32(self.max_seq), np.int32(1 if greedy else 0),
        )

    def _stream(self):
        torch_stream = torch.cuda.current_stream(self.device)
        key = torch_stream.cuda_stream
        if key not in self._streams:
            self._streams[key] = self._cuda_device.create_stream(torch_stream)
        return self._streams[key]

    @property
    def next_token(self) -> torch.Tensor:
        """The argmax of the last step, on the device (int32 scalar view)."""
        return self.state[STATE_ARGMAX]

    @property
    def token_slot(self) -> torch.Tensor:
        """The input token of the next step, on the device (a sampler writes here)."""
        return self.state[STATE_TOKEN]

    def stage_times(self) -> StageTimes:
        """Per-stage time of the last launch (needs timing=True); synchronizes."""
        if not self.timing:
            raise RuntimeError("this DecodeStep was built without timing; pass timing=True")
        values = self.stage_stamps.cpu()
        stamps = values[: self._barriers + 2].tolist()
        arrivals = values[self._barriers + 2 :].view(self._barriers, self.grid).tolist()
        return StageTimes.from_stamps(stamps, arrivals)


TRANSPOSED_FIELDS = ("wo", "w_down")  # the kernel streams these by their input rows (gemv_transposed_rows)


def store_transposed(model: DecodeModel) -> None:
    """Store every layer's wo ([H, heads * head_dim]) and w_down ([H, I]) as the kernel reads them,
    transposed and row-major (weight.t() contiguous), in place. The values and shapes stay, so
    PyTorch code that multiplies by them (F.linear) runs as before; the copy is made one weight at
    a time. Weights already stored that way are left as they are."""
    for layer in model.layers:
        for name in TRANSPOSED_FIELDS:
            weight = getattr(layer, name)
            if not weight.t().is_contiguous():
                setattr(layer, name, weight.t().contiguous().t())


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def check_weights(model: DecodeModel, shape: KernelShape) -> None:
    """Every weight the kernel reads must be a contiguous bf16 tensor of the expected shape, wo and
    w_down contiguous as their transposes (store_transposed)."""
    expected = {
        "embed": (model.embed, (shape.vocab, shape.hidden)),
        "final_norm": (model.final_norm, (shape.hidden,)),
        "lm_head": (model.lm_head, (shape.vocab, shape.hidden)),
    }
    layer_shapes = {
        "attn_norm": (shape.hidden,), "wq": (shape.q_dim, shape.hidden), "wk": (shape.kv_dim, shape.hidden),
        "wv": (shape.kv_dim, shape.hidden), "wo": (shape.hidden, shape.q_dim), "mlp_norm": (shape.hidden,),
        "w_gate": (shape.intermediate, shape.hidden), "w_up": (shape.intermediate, shape.hidden),
        "w_down": (shape.hidden, shape.intermediate),
    }
    if shape.qk_norm:
        layer_shapes |= {"q_norm": (shape.head_dim,), "k_norm": (shape.head_dim,)}
    if len(model.layers) != shape.layers:
        raise ValueError(f"the model has {len(model.layers)} layers, its config {shape.layers}")
    for index, layer in enumerate(model.layers):
        expected |= {f"layers[{index}].{name}": (getattr(layer, name), dims) for name, dims in layer_shapes.items()}
    for name, (tensor, dims) in expected.items():
        if tensor is None or tensor.dtype != KERNEL_DTYPE or tuple(tensor.shape) != dims:
            got = "None" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"model.{name} must be a {KERNEL_DTYPE} tensor of shape {dims}, got {got}")
        if name.rpartition(".")[2] in TRANSPOSED_FIELDS:  # the kernel streams it by its input rows
            if not tensor.t().is_contiguous():
                raise ValueError(
                    f"model.{name} must be stored transposed ({name.rpartition('.')[2]}.t() contiguous) for the "
                    "megakernel: call store_transposed(model) first"
                )
        elif not tensor.is_contiguous():
            raise ValueError(f"model.{name} must be contiguous")
    inv_freq = model.rope_inv_freq
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (shape.head_dim // 2,):
        raise ValueError(
            f"model.rope_inv_freq must be float32 [{shape.head_dim // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}"
        )
