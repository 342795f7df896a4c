"""Tensor-parallel sharding of a decoder over the GPUs of one node (Megatron-style, batch-1 decode).

With tp_size ranks, rank r holds:

    embed, every RMSNorm weight       replicated (a step reads one embedding row: H elements)
    wq  [heads/tp * head_dim, H]       column-parallel: whole query heads [r*heads/tp, (r+1)*heads/tp)
    wk, wv [kv_per_rank * head_dim, H] the KV heads its query heads use (see below)
    wo  [H, heads/tp * head_dim]       row-parallel: its heads' columns; gives a partial [H] sum
    w_gate, w_up [I/tp, H]             column-parallel: intermediate slice [r*I/tp, (r+1)*I/tp)
    w_down [H, I/tp]                   row-parallel: the same slice's columns; a partial [H] sum
    lm_head [V_pad/tp, H]              a contiguous vocabulary slice, zero rows past the vocabulary

so a layer needs two sums of [H] partials across ranks (after O and after down: the all-reduces),
and the LM head needs one distributed argmax over the vocabulary slices.

KV heads. Query head h uses KV head h // (num_heads / num_kv_heads). Rank r's query heads
[r*heads/tp, (r+1)*heads/tp) therefore use
  - KV heads [r*kv/tp, (r+1)*kv/tp) when tp <= num_kv_heads (kv divisible by tp): a plain split;
  - the single KV head r // (tp / kv) when tp > num_kv_heads (tp divisible by kv): that head is
    REPLICATED on tp/kv consecutive ranks, each computing and caching its own copy of it.
Any other ratio would give a rank parts of two KV heads and is refused.

Padding rows of the LM head are zero; whoever computes logits must mask them to -inf (or skip
them) so that padding never wins the argmax: `RankShard.vocab_valid` says how many rows are real.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import ModelConfig
from .decoder import Layer, Model


class ShardingError(ValueError):
    """The model's shape cannot be split over tp_size ranks."""


@dataclass(frozen=True)
class ShardPlan:
    """How `config` splits over `tp_size` ranks; every size below is per rank."""

    config: ModelConfig
    tp_size: int
    heads_per_rank: int
    kv_heads_per_rank: int  # kv/tp, or 1 when the KV heads are replicated
    kv_replicas: int  # ranks that hold each KV head: 1, or tp/kv when replicated
    intermediate_per_rank: int
    vocab_per_rank: int  # ceil(V / tp); the last ranks' slices end in padding

    @property
    def padded_vocab(self) -> int:
        return self.vocab_per_rank * self.tp_size

    def query_heads(self, rank: int) -> range:
        self._check_rank(rank)
        return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank `rank` holds: those its query heads use (h // group)."""
        first = self.query_heads(rank).start // (self.config.num_heads // self.config.num_kv_heads)
        return range(first, first + self.kv_heads_per_rank)

    def intermediate(self, rank: int) -> range:
        self._check_rank(rank)
        return range(rank * self.intermediate_per_rank, (rank + 1) * self.intermediate_per_rank)

    def vocab(self, rank: int) -> range:
        """The real token ids of rank `rank`'s LM-head slice (may be shorter than vocab_per_rank)."""
        self._check_rank(rank)
        start = rank * self.vocab_per_rank
        return range(min(start, self.config.vocab_size), min(start + self.vocab_per_rank, self.config.vocab_size))

    def local_config(self) -> ModelConfig:
        """The config of the shapes one rank holds: its heads, KV heads and intermediate slice.

        The reference decoder's per-layer math runs unchanged on these shapes; what it returns from
        O and down is then a partial sum that the ranks add up.
        """
        return replace(
            self.config,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank,
            vocab_size=self.vocab_per_rank,
            tie_word_embeddings=False,  # a rank's LM head is its own vocabulary slice
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise ShardingError(f"rank must be in [0, {self.tp_size}) for tp_size {self.tp_size}, got {rank}")


def plan_sharding(config: ModelConfig, tp_size: int) -> ShardPlan:
    """Check that `config` splits over `tp_size` ranks and say how; ShardingError names the numbers."""
    if tp_size < 1:
        raise ShardingError(f"tp_size must be positive, got {tp_size}")
    heads, kv_heads, intermediate = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % tp_size:
        raise ShardingError(
            f"num_attention_heads ({heads}) is not divisible by tp_size ({tp_size}): each rank must hold whole heads"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ShardingError(
            f"num_key_value_heads ({kv_heads}) and tp_size ({tp_size}): one must divide the other, or a rank's "
            f"query heads would use parts of two KV heads"
        )
    if intermediate % tp_size:
        raise ShardingError(f"intermediate_size ({intermediate}) is not divisible by tp_size ({tp_size})")
    replicated = tp_size > kv_heads
    return ShardPlan(
        config=config,
        tp_size=tp_size,
        heads_per_rank=heads // tp_size,
        kv_heads_per_rank=1 if replicated else kv_heads // tp_size,
        kv_replicas=tp_size // kv_heads if replicated else 1,
        intermediate_per_rank=intermediate // tp_size,
        vocab_per_rank=-(-config.vocab_size // tp_size),
    )


@dataclass
class RankShard:
    """The weights one rank holds; `layers` reuse the decoder's Layer with per-rank shapes."""

    plan: ShardPlan
    rank: int
    embed: torch.Tensor  # [V, H], replicated
    layers: list[Layer]  # wq [heads/tp * D, H], wk/wv [kv_per_rank * D, H], wo [H, heads/tp * D], ...
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [vocab_per_rank, H]; rows from vocab_valid on are zero padding
    vocab_start: int  # the token id of lm_head's row 0
    vocab_valid: int  # real rows of lm_head; rows [vocab_valid, vocab_per_rank) must never win


def shard_model(model: Model, tp_size: int, rank: int) -> RankShard:
    """Rank `rank`'s shard of `model` for tp_size ranks (contiguous tensors, as a GPU would hold)."""
    plan = plan_sharding(model.config, tp_size)
    head_dim = model.config.head_dim
    heads, kv_heads = plan.query_heads(rank), plan.kv_heads(rank)
    q_rows = slice(heads.start * head_dim, heads.stop * head_dim)
    kv_rows = slice(kv_heads.start * head_dim, kv_heads.stop * head_dim)
    inter = slice(plan.intermediate(rank).start, plan.intermediate(rank).stop)

    def shard_layer(layer: Layer) -> Layer:
        return Layer(
            attn_norm=layer.attn_norm,
            wq=layer.wq[q_rows].contiguous(),
            wk=layer.wk[kv_rows].contiguous(),
            wv=layer.wv[kv_rows].contiguous(),
            wo=layer.wo[:, q_rows].contiguous(),
            q_norm=layer.q_norm,
            k_norm=layer.k_norm,
            mlp_norm=layer.mlp_norm,
            w_gate=layer.w_gate[inter].contiguous(),
            w_up=layer.w_up[inter].contiguous(),
            w_down=layer.w_down[:, inter].contiguous(),
        )

    vocab = plan.vocab(rank)
    lm_head = model.lm_head[vocab.start:vocab.stop]  # [vocab_valid, H]
    padding = plan.vocab_per_rank - len(vocab)
    if padding:
        lm_head = torch.cat([lm_head, lm_head.new_zeros(padding, lm_head.shape[1])])
    return RankShard(
        plan=plan,
        rank=rank,
        embed=model.embed,
        layers=[shard_layer(layer) for layer in model.layers],
        final_norm=model.final_norm,
        lm_head=lm_head.contiguous(),
        vocab_start=rank * plan.vocab_per_rank,
        vocab_valid=len(vocab),
    )


@dataclass(frozen=True)
class StepReadBytes:
    """What the busiest rank reads from HBM in one batch-1 decode step."""

    layer_weights: int  # one layer's weights (its shards plus the replicated norms)
    layer_kv: int  # one layer's KV cache at context_len
    lm_head: int  # the largest vocabulary slice
    other: int  # one embedding row and the final norm
    num_layers: int

    @property
    def total(self) -> int:
        return self.num_layers * (self.layer_weights + self.layer_kv) + self.lm_head + self.other


def step_read_bytes(plan: ShardPlan, context_len: int, dtype_bytes: int) -> StepReadBytes:
    """Bytes one rank reads per decode step with `context_len` cached positions (the roofline floor
    is this over the HBM read bandwidth)."""
    config = plan.config
    hidden, head_dim = config.hidden_size, config.head_dim
    q_dim, kv_dim = plan.heads_per_rank * head_dim, plan.kv_heads_per_rank * head_dim
    norms = 2 * hidden + (2 * head_dim if config.qk_norm else 0)
    elements = (q_dim + 2 * kv_dim) * hidden + hidden * q_dim + 3 * plan.intermediate_per_rank * hidden + norms
    return StepReadBytes(
        layer_weights=elements * dtype_bytes,
        layer_kv=2 * kv_dim * context_len * dtype_bytes,
        lm_head=len(plan.vocab(0)) * hidden * dtype_bytes,
        other=2 * hidden * dtype_bytes,
        num_layers=config.num_layers,
    )


def allreduce_bytes_per_step(config: ModelConfig, dtype_bytes: int) -> int:
    """The payload summed across ranks per decode step: two [H] vectors per layer (after O and
    after down). The argmax's (value, index) per rank is negligible beside it."""
    return 2 * config.num_layers * config.hidden_size * dtype_bytes
