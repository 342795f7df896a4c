"""Which model shapes the decode megakernel supports, and the template arguments that specialize it.

The kernel takes every model dimension as a compile-time constant (`megakernel::ModelShape<...>` in
decode_step.cu). `KernelShape` mirrors that template, checks the kernel's static limits up front so
that an unsupported model gets a clear error instead of a compiler message, and renders the
instantiation's name expression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Limits of decode_step.cu (keep in step with its constants).
THREADS = 512  # kThreads
WARP_SIZE = 32
WARPS = THREADS // WARP_SIZE
VEC_ELEMS = 8  # bf16 per 16-byte load
MAX_SPLITS = 64  # kMaxSplits of attention.cuh
PARTIAL_EXTRA_FLOATS = 4  # kPartialExtraFloats of attention.cuh: a split's max, sum and padding
KV_ROW_BYTES_PER_ITER = 1024  # kKvRowBytesPerIter of kv_rows.cuh
MERGE_ACC_BYTES = 32 * 1024  # kMergeAccBytes of attention.cuh
HEAD_DIMS = (64, 128, 256)  # lanes split a head: 2, 4 or 8 channels each
STATIC_SHARED_LIMIT = 48 * 1024  # kStaticSharedLimit
MIN_CTAS = 96  # kMinCtas of decode_step.cu: a transposed GEMV's input slice per CTA in shared memory is sized for it
SLICE_ROWS_ALIGN = 4  # kSliceRowsAlign
O_COLUMN_GROUPS = (4, 2, 1)  # kOColumnGroups of decode_step.cu: the most that split hidden into whole warp vectors
SHARED_RESERVED = WARPS * (4 + 8 + 8) + 16  # the reduce, best and split_sums arrays beside the union, and alignment
UNION_ALIGN = 16  # SharedStorage's union holds 16-byte vectors (x, AttentionShared's uint4s): its size rounds up to it
FLOAT_BYTES = 4
BF16_BYTES = 2
KERNEL_NAME = "megakernel::decode_step"
SHAPE_TEMPLATE = "megakernel::ModelShape"


class UnsupportedShapeError(ValueError):
    """The model's shape is outside what the megakernel is written for."""


class ShapedConfig(Protocol):
    """The fields of `replicas.models.ModelConfig` that the kernel needs."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    qk_norm: bool


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pow2_floor(n: int) -> int:
    """The largest power of 2 <= n (common.cuh's pow2_floor)."""
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class KernelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    qk_norm: bool

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers"):
            if getattr(self, name) < 1:
                raise UnsupportedShapeError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise UnsupportedShapeError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim not in HEAD_DIMS:
            raise UnsupportedShapeError(f"head_dim {self.head_dim} is not supported; the kernel handles {HEAD_DIMS}")
        if self.group > WARP_SIZE:
            raise UnsupportedShapeError(
                f"{self.group} query heads per KV head: attention gives each head of a group a lane of a warp, "
                f"so at most {WARP_SIZE}"
            )
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % VEC_ELEMS:
                raise UnsupportedShapeError(
                    f"{name} ({getattr(self, name)}) must be a multiple of {VEC_ELEMS} (16-byte weight loads)"
                )
        if self.hidden % (WARPS * VEC_ELEMS):
            raise UnsupportedShapeError(
                f"hidden ({self.hidden}) must be a multiple of {WARPS * VEC_ELEMS}: O's and down's transposed GEMVs "
                f"give each of the {WARPS} warps whole 16-byte vectors of every output row"
            )
        if self.shared_bytes > STATIC_SHARED_LIMIT:
            raise UnsupportedShapeError(
                f"this shape needs {self.shared_bytes} bytes of shared memory per CTA, over the kernel's "
                f"{STATIC_SHARED_LIMIT}: the largest GEMV input is {self.max_input} elements and the "
                f"attention group {self.group} x head_dim {self.head_dim}"
            )

    @classmethod
    def from_config(cls, config: ShapedConfig) -> KernelShape:
        return cls(
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            layers=config.num_layers,
            qk_norm=config.qk_norm,
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def max_input(self) -> int:
        return max(self.hidden, self.q_dim)

    @property
    def o_column_groups(self) -> int:
        """kOColumnGroups: O's output columns split in this many groups of CTAs."""
        return next(groups for groups in O_COLUMN_GROUPS if self.hidden % (groups * WARPS * VEC_ELEMS) == 0)

    @property
    def max_slice_rows(self) -> int:
        """kMaxSliceRows: the input rows of one CTA's slice of a transposed GEMV (O's attention
        channels, shared by a column group's CTAs; the MLP's intermediate rows) on the smallest
        grid, rounded up to SLICE_ROWS_ALIGN."""
        rows = -(-max(self.intermediate, self.q_dim * self.o_column_groups) // MIN_CTAS)
        return _round_up(rows, SLICE_ROWS_ALIGN)

    @property
    def shared_bytes(self) -> int:
        """SharedStorage<S> of decode_step.cu: max(GEMV input, attention buffers) + reductions."""
        group_elems = self.group * self.head_dim
        merge_slots = min(WARPS, _pow2_floor(MERGE_ACC_BYTES // (FLOAT_BYTES * group_elems)))
        merge = FLOAT_BYTES * merge_slots * (group_elems + 2 * self.group)  # merge max, sum, acc
        keys_per_iter = min(KV_ROW_BYTES_PER_ITER // (BF16_BYTES * self.head_dim), _pow2_floor(WARP_SIZE // self.group))
        first_block = 2 * WARPS * keys_per_iter * BF16_BYTES * self.head_dim  # every lane's K and V slices of one block per warp
        attention = FLOAT_BYTES * group_elems + max(merge, first_block)  # q, then the union
        rope = FLOAT_BYTES * self.head_dim  # cos and sin, head_dim / 2 each
        slice_in = FLOAT_BYTES * self.max_slice_rows  # the CTA's inputs of a transposed GEMV
        union = _round_up(max(BF16_BYTES * self.max_input, attention), UNION_ALIGN)
        return union + rope + slice_in + SHARED_RESERVED

    def check_grid(self, ctas: int) -> None:
        """The kernel gives each KV head's QKV rows and attention to CTAs of their own (one persistent
        CTA per SM): a GPU with fewer SMs than KV heads cannot run it."""
        if ctas < self.kv_heads:
            raise UnsupportedShapeError(
                f"the megakernel needs at least one CTA per KV head: {self.kv_heads} KV heads on a GPU of {ctas} SMs"
            )
        if ctas < MIN_CTAS:
            raise UnsupportedShapeError(
                f"the megakernel keeps each CTA's slices of O's and the MLP's inputs in shared memory sized for "
                f"{MIN_CTAS} SMs or more; this GPU has {ctas}"
            )
        if self.intermediate < ctas:  # a CTA with no MLP row would prefetch the row before the first
            raise UnsupportedShapeError(
                f"the megakernel gives every CTA MLP rows of its own: intermediate_size {self.intermediate} is "
                f"fewer than this GPU's {ctas} SMs"
            )

    @property
    def template_args(self) -> str:
        qk_norm = "true" if self.qk_norm else "false"
        dims = (self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.vocab, self.layers)
        return f"{SHAPE_TEMPLATE}<{', '.join(map(str, dims))}, {qk_norm}>"

    def kernel_name(self, timing: bool) -> str:
        """The name expression of decode_step's instantiation for this shape."""
        return f"{KERNEL_NAME}<{self.template_args}, {'true' if timing else 'false'}>"
