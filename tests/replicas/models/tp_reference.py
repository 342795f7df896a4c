"""Tensor-parallel greedy decode on the CPU: the oracle that a multi-GPU megakernel must match.

Every rank holds its shard (`replicas/models/sharding.py`) and its own KV cache for the KV heads it holds,
and runs one step exactly as a GPU of the group would:

    hidden = embed[token]                                   [T, H], the same on every rank
    for each layer:
        hidden += SUM over ranks (attention of its heads @ its wo columns)    all-reduce 1
        hidden += SUM over ranks (its MLP slice @ its w_down columns)        all-reduce 2
    local = norm(hidden[-1]) @ its lm_head slice            [V_pad/tp], padding rows -> -inf
    (value, token id) of its local max -> gathered -> the max over ranks, lowest token id on ties

The per-rank math is the reference decoder's own (its attention and MLP run on the rank's shapes);
only the sums and the argmax are new. Every rank must add the partials in the same order, so that
the replicated hidden state stays bit-identical across ranks (a diverging copy in bf16 could flip
a later argmax on one rank only).

The ranks can be hosted two ways, through one loop (`tp_generate`):
  - `LocalGroup`: one process hosts every rank and adds their partials in rank order (fast tests);
  - `DistributedGroup`: one process per rank over torch.distributed, so the sums are real
    all-reduces and the argmax a real all-gather; `run_gloo` spawns tp_size CPU processes on gloo.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megaserve.replicas.models.decoder import (
    EMBED_NAME,
    FINAL_NORM_NAME,
    LAYER_NAMES,
    LAYER_PREFIX,
    LM_HEAD_NAME,
    Model,
    load_model,
)
from megaserve.replicas.models.rope import rope_cos_sin
from megaserve.replicas.models.sharding import RankShard, shard_model

GLOO_BACKEND = "gloo"
STORE_FILE = "rendezvous"  # the file:// store the spawned ranks meet at
RESULT_FILE = "rank{}.pt"
SLOT = 0  # batch 1: the one KV-cache row


@dataclass
class TPResult:
    tokens: list[int]  # the greedy tokens, one per step
    logits: torch.Tensor | None  # [steps, V] float32: each step's gathered logits, when asked for


class RankDecoder:
    """One rank: its shard, its KV cache, and the partial results of its stages."""

    def __init__(self, shard: RankShard, max_seq: int) -> None:
        self.shard = shard
        # The reference decoder on this rank's shapes, used only for its per-layer math
        # (its forward() would skip the sums across ranks, so it is never called).
        tensors = {EMBED_NAME: shard.embed, FINAL_NORM_NAME: shard.final_norm, LM_HEAD_NAME: shard.lm_head}
        for index, layer in enumerate(shard.layers):
            prefix = LAYER_PREFIX.format(index)
            tensors |= {prefix + name: getattr(layer, attr) for attr, name in LAYER_NAMES.items()
                        if getattr(layer, attr) is not None}
        self._math = Model(shard.plan.local_config(), tensors)
        self.cache = self._math.new_cache(max_batch=1, max_seq=max_seq)  # [1, kv_per_rank, max_seq, D]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._math.embed[input_ids]  # [1, T, H]

    def attention_partial(self, index: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share of the attention output [1, T, H]; caches their keys and values."""
        math, layer = self._math, self._math.layers[index]
        context_len = int(positions[0, -1]) + 1  # positions run consecutively: the last is the highest
        causal_mask = torch.arange(context_len) <= positions[:, None, :, None]  # [1, 1, T, context_len]
        cos, sin = rope_cos_sin(math.rope_inv_freq, positions, math.dtype)
        return math.attention(
            layer, math.rms_norm(hidden, layer.attn_norm), cos, sin, self.cache.k[index], self.cache.v[index],
            torch.tensor([SLOT]), positions, causal_mask,
        )

    def mlp_partial(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's intermediate slice's share of the MLP output [1, T, H]."""
        layer = self._math.layers[index]
        return self._math.mlp(layer, self._math.rms_norm(hidden, layer.mlp_norm))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [vocab_per_rank] of this rank's vocabulary slice for hidden [H]; padding is -inf."""
        logits = F.linear(self._math.rms_norm(hidden, self._math.final_norm), self._math.lm_head).float()
        logits[self.shard.vocab_valid:] = float("-inf")
        return logits


def local_argmax(logits: torch.Tensor, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's candidate: its max logit [1] and that token's global id [1] (the first on ties)."""
    index = torch.argmax(logits).reshape(1)
    return logits[index], index + vocab_start


def combine_argmax(values: torch.Tensor, token_ids: torch.Tensor) -> int:
    """The greedy token from every rank's candidate, values [tp] and token_ids [tp]: the highest
    value, and on a tie the lowest token id, as torch.argmax over the whole vocabulary would."""
    return int(token_ids[values == values.max()].min())


class LocalGroup:
    """Every rank in this process; a sum adds the partials in rank order."""

    def __init__(self, ranks: list[RankDecoder]) -> None:
        self.ranks = ranks

    def sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        total = partials[0]
        for partial in partials[1:]:
            total = total + partial
        return total

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors


class DistributedGroup:
    """One rank in this process, the others in theirs, joined by the default process group."""

    def __init__(self, rank: RankDecoder) -> None:
        self.ranks = [rank]

    def sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        (total,) = partials
        dist.all_reduce(total)  # SUM, in place
        return total

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        (tensor,) = tensors
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return gathered


def tp_generate(
    group: LocalGroup | DistributedGroup, prompt: list[int], max_new_tokens: int, *, gather_logits: bool = False
) -> TPResult:
    """Greedy tokens after `prompt`: a prefill step of the whole prompt, then one token per step.

    The group's ranks must have been built with max_seq >= len(prompt) + max_new_tokens - 1.
    `gather_logits` also gathers every step's full logits (for checking; a GPU group would not).
    """
    first = group.ranks[0]
    max_seq, plan = first.cache.max_seq, first.shard.plan
    if not prompt or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got {len(prompt)} and {max_new_tokens}")
    if len(prompt) + max_new_tokens - 1 > max_seq:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) - 1 exceeds max_seq {max_seq}")
    tokens, step_logits, step_ids, start = [], [], prompt, 0
    for _ in range(max_new_tokens):
        positions = torch.arange(start, start + len(step_ids))[None]  # [1, T]
        hidden = first.embed(torch.tensor([step_ids]))  # every hosted rank holds the same replicated state
        for index in range(plan.config.num_layers):
            hidden = hidden + group.sum([rank.attention_partial(index, hidden, positions) for rank in group.ranks])
            hidden = hidden + group.sum([rank.mlp_partial(index, hidden) for rank in group.ranks])
        local = [rank.local_logits(hidden[0, -1]) for rank in group.ranks]
        candidates = [local_argmax(logits, rank.shard.vocab_start) for logits, rank in zip(local, group.ranks)]
        values = group.gather([value for value, _ in candidates])
        token_ids = group.gather([token_id for _, token_id in candidates])
        tokens.append(combine_argmax(torch.cat(values), torch.cat(token_ids)))
        if gather_logits:
            step_logits.append(torch.cat(group.gather(local))[: plan.config.vocab_size])
        start, step_ids = start + len(step_ids), [tokens[-1]]
    return TPResult(tokens, torch.stack(step_logits) if gather_logits else None)


def generate_local(
    model: Model, tp_size: int, prompt: list[int], max_new_tokens: int, *, gather_logits: bool = False
) -> TPResult:
    """`tp_generate` with all tp_size ranks of `model` in this process."""
    max_seq = len(prompt) + max_new_tokens
    ranks = [RankDecoder(shard_model(model, tp_size, rank), max_seq) for rank in range(tp_size)]
    return tp_generate(LocalGroup(ranks), prompt, max_new_tokens, gather_logits=gather_logits)


def run_gloo(
    model_dir: str | Path,
    tp_size: int,
    prompt: list[int],
    max_new_tokens: int,
    *,
    dtype: torch.dtype | None = None,
    gather_logits: bool = False,
) -> TPResult:
    """`tp_generate` with one CPU process per rank, joined by gloo; each loads `model_dir` itself.

    Every rank computes the greedy tokens itself (as each GPU must, to feed its next step); they
    must all agree, or this raises.
    """
    with tempfile.TemporaryDirectory() as scratch:
        settings = (tp_size, str(model_dir), prompt, max_new_tokens, dtype, gather_logits, scratch)
        mp.spawn(_gloo_rank, args=settings, nprocs=tp_size)
        results = [torch.load(Path(scratch) / RESULT_FILE.format(rank)) for rank in range(tp_size)]
    disagreeing = [rank for rank, result in enumerate(results) if result["tokens"] != results[0]["tokens"]]
    if disagreeing:
        raise RuntimeError(f"ranks {disagreeing} chose other tokens than rank 0: the replicated state diverged")
    return TPResult(results[0]["tokens"], results[0]["logits"])


def _gloo_rank(
    rank: int,
    tp_size: int,
    model_dir: str,
    prompt: list[int],
    max_new_tokens: int,
    dtype: torch.dtype | None,
    gather_logits: bool,
    scratch: str,
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))  # the ranks share this machine's cores
    store = Path(scratch) / STORE_FILE
    dist.init_process_group(GLOO_BACKEND, init_method=store.as_uri(), rank=rank, world_size=tp_size)
    try:
        model = load_model(model_dir, dtype=dtype)
        decoder = RankDecoder(shard_model(model, tp_size, rank), len(prompt) + max_new_tokens)
        result = tp_generate(DistributedGroup(decoder), prompt, max_new_tokens, gather_logits=gather_logits)
        torch.save({"tokens": result.tokens, "logits": result.logits}, Path(scratch) / RESULT_FILE.format(rank))
    finally:
        dist.destroy_process_group()
