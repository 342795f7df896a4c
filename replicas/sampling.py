"""Next-token selection on the device, for a batch of rows with their own sampling parameters.

Per row: greedy (argmax), or temperature, then top-k, then top-p (nucleus), then a draw. Every
step runs as tensor ops on the logits' device with no host sync: the parameters live on the
device (`SamplingRows`, built once when a request is admitted, gathered per step), and which
stages run at all is decided from host-side flags computed at the same time.

The draw is Gumbel-max: the chosen token is argmax(logits / T + g) over the kept tokens, with
g = -log(-log(u)) and u uniform in (0, 1). A row with a seed takes its u from a counter-based
hash of (seed, position of the token being generated, vocabulary index), so its draws are the
same on every run whatever else shares the batch, and so are its tokens wherever its logits are:
in float32 (the CPU default); not always in bf16, where the batch's longest row sets the attention's
padded length and the rounding of its sums (as in vLLM, which promises no batch invariance either).
A row without a seed takes u from a `torch.Generator`.

`sample` is also the batch-1 path for engines that produce logits for one sequence (the
megakernel engine's sampled decoding): `SamplingRows.build([params], vocab_size, device)` once
per request, then `sample(logits[None], rows, position_tensor)` each step.

`token_logprobs` gives the chosen tokens' logprobs and each row's most likely tokens, from the raw
logits (before temperature, top-k and top-p: vLLM's default), for the rows whose request asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .protocol import SamplingParams, TokenLogprob

# 32-bit hashing in int64 tensors: values stay below 2**32 and products below 2**63, so no op
# relies on integer overflow (torch's right shift is arithmetic, its overflow undefined).
MASK32 = 0xFFFFFFFF
HALF_BITS = 16
HALF_MASK = 0xFFFF
# The two multipliers of Chris Wellons' "lowbias32" integer hash (good avalanche, 2 rounds).
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
HASH_SHIFTS = (16, 15, 16)
# u = (top 23 bits of the hash + 0.5) / 2**23 lies in (0, 1) in float32, whose 24 significant bits
# hold every such value exactly; with 24 hash bits the largest, (2**24 - 0.5) / 2**24, would round
# to 1.0, whose Gumbel noise is +inf and outweighs the -inf of a token filtered out by top-k/top-p.
UNIFORM_BITS = 23
# Domain separation for the three hash inputs, so that (seed, position, token) never alias.
SEED_HIGH_SALT = 0x9E3779B9
POSITION_SALT = 0x85EBCA77


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), split in 16-bit halves so nothing overflows."""
    low = x * (constant & HALF_MASK)  # < 2**48
    high = ((x * (constant >> HALF_BITS)) & HALF_MASK) << HALF_BITS  # < 2**32
    return (low + high) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of the int64 tensor x (elements in [0, 2**32))."""
    x = x ^ (x >> HASH_SHIFTS[0])
    x = _mul32(x, HASH_MULTIPLIERS[0])
    x = x ^ (x >> HASH_SHIFTS[1])
    x = _mul32(x, HASH_MULTIPLIERS[1])
    return x ^ (x >> HASH_SHIFTS[2])


def seeded_uniform(
    seed_low: torch.Tensor, seed_high: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """u in (0, 1), float32 [B, V], a pure function of (seed, position, token index) per row.

    seed_low, seed_high: [B] int64, the two 32-bit halves of each row's seed; positions: [B] int64.
    """
    row_key = hash32(seed_low ^ hash32((seed_high ^ SEED_HIGH_SALT) ^ hash32(positions ^ POSITION_SALT)))
    token_key = hash32(torch.arange(vocab_size, device=positions.device, dtype=torch.int64))
    bits = hash32(row_key[:, None] ^ token_key[None, :]) >> (32 - UNIFORM_BITS)  # [B, V]
    return (bits.to(torch.float32) + 0.5) / float(1 << UNIFORM_BITS)


@dataclass
class SamplingRows:
    """The sampling parameters of B rows, as [B] tensors on the device plus host-side flags."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (never divides by zero)
    top_k: torch.Tensor  # [B] int64; vocab_size where top-k is off
    top_p: torch.Tensor  # [B] float32
    seed_low: torch.Tensor  # [B] int64, low 32 bits of the seed (0 where unseeded)
    seed_high: torch.Tensor  # [B] int64, high 32 bits
    seeded: torch.Tensor  # [B] bool
    greedy: torch.Tensor  # [B] bool
    # Host-side: which stages this batch needs, known without looking at the device.
    all_greedy: bool
    needs_filter: bool  # some sampled row has top-k or top-p
    any_seeded: bool  # some sampled row has a seed
    any_unseeded: bool  # some sampled row has none

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab_size: int, device: str | torch.device
    ) -> SamplingRows:
        """One row per entry of `params`; one small host-to-device copy per field."""
        seeds = [(p.seed or 0) % (1 << 64) for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=tensor([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            seed_low=tensor([seed & MASK32 for seed in seeds], torch.int64),
            seed_high=tensor([seed >> 32 for seed in seeds], torch.int64),
            seeded=tensor([p.seed is not None for p in params], torch.bool),
            greedy=tensor([p.greedy for p in params], torch.bool),
            **_stage_flags(params, vocab_size),
        )


def _stage_flags(params: Sequence[SamplingParams], vocab_size: int) -> dict[str, bool]:
    """The host-side flags of `SamplingRows` for rows with these parameters."""
    sampled = [p for p in params if not p.greedy]
    return {
        "all_greedy": not sampled,
        "needs_filter": any(0 < p.top_k < vocab_size or p.top_p < 1 for p in sampled),
        "any_seeded": any(p.seed is not None for p in sampled),
        "any_unseeded": any(p.seed is None for p in sampled),
    }


class SamplingTable:
    """Per-slot parameters for an engine with `num_slots` KV-cache rows: written once when a
    request is admitted to a slot, gathered on the device for each step's rows."""

    def __init__(self, num_slots: int, vocab_size: int, device: str | torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._params: list[SamplingParams] = [SamplingParams(temperature=0)] * num_slots
        self._rows = SamplingRows.build(self._params, vocab_size, device)

    def assign(self, slot: int, params: SamplingParams) -> None:
        """Write the parameters of the request admitted to `slot` (a few scalar copies)."""
        self._params[slot] = params
        one = SamplingRows.build([params], self.vocab_size, self.device)
        for name in ("temperature", "top_k", "top_p", "seed_low", "seed_high", "seeded", "greedy"):
            getattr(self._rows, name)[slot] = getattr(one, name)[0]

    def gather(self, slots: list[int], slot_index: torch.Tensor) -> SamplingRows:
        """The rows of `slots` (host list) in that order; slot_index is the same ids on the device."""
        rows = self._rows
        return SamplingRows(
            temperature=rows.temperature[slot_index],
            top_k=rows.top_k[slot_index],
            top_p=rows.top_p[slot_index],
            seed_low=rows.seed_low[slot_index],
            seed_high=rows.seed_high[slot_index],
            seeded=rows.seeded[slot_index],
            greedy=rows.greedy[slot_index],
            **_stage_flags([self._params[slot] for slot in slots], self.vocab_size),
        )


def _keep_mask(scaled: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[B, V] bool: the tokens that survive top-k, then top-p over the top-k renormalized; the most
    likely token always survives."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    # Top-k keeps every token tied with the k-th largest logit, as vLLM does (bf16 logits tie often);
    # a cut at rank k would pick among the tied tokens by id. kth: [B, 1].
    kth = sorted_logits.gather(-1, rows.top_k[:, None] - 1)
    keep_sorted = sorted_logits >= kth
    probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    # Keep a token while the mass strictly before it is below top_p.
    keep_sorted &= (torch.cumsum(probs, dim=-1) - probs) < rows.top_p[:, None]
    # A top_p below float32's range (1e-300) is stored as 0.0 and keeps nothing above: the top token stays
    # anyway, as in vLLM, so that no row is left all -inf (whose argmax is token 0 whatever the logits).
    keep_sorted[:, 0] = True
    return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _unseeded_uniform(batch: int, vocab_size: int, device: torch.device, generator: torch.Generator | None
                      ) -> torch.Tensor:
    """[B, V] uniform in (0, 1), as the seeded noise is. torch.rand's [0, 1) gives an exact 0 now and
    then (2^-24 per draw on the CPU), whose Gumbel noise is -inf: a row whose filter kept one token
    would then be all -inf, and its argmax token 0, a token the filter had removed."""
    uniform = torch.rand((batch, vocab_size), device=device, generator=generator)
    return uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)


def sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row: logits [B, V] float32, positions [B] int64 (the position the new
    token will take in its sequence, which keys the seeded noise) -> token ids [B] int64, on the
    logits' device and without a host sync."""
    greedy_tokens = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy_tokens
    scaled = logits / rows.temperature[:, None]
    if rows.needs_filter:
        scaled = scaled.masked_fill(~_keep_mask(scaled, rows), float("-inf"))
    batch, vocab_size = logits.shape
    if rows.any_seeded and rows.any_unseeded:
        random = _unseeded_uniform(batch, vocab_size, logits.device, generator)
        seeded = seeded_uniform(rows.seed_low, rows.seed_high, positions, vocab_size)
        uniform = torch.where(rows.seeded[:, None], seeded, random)
    elif rows.any_seeded:
        uniform = seeded_uniform(rows.seed_low, rows.seed_high, positions, vocab_size)
    else:
        uniform = _unseeded_uniform(batch, vocab_size, logits.device, generator)
    gumbel = -torch.log(-torch.log(uniform))
    sampled_tokens = (scaled + gumbel).argmax(dim=-1)
    return torch.where(rows.greedy, greedy_tokens, sampled_tokens)


# A top-k of one row of a vocabulary runs on a few SMs (~0.17 ms for 128K on an H200): split it in
# TOP_K_GROUPS rows, take each one's k, then the k of those candidates. Vocabularies are padded to a
# multiple of 64 or 128 for the GEMMs (Llama 3's 128,256, Qwen3's 151,936); another takes torch's.
TOP_K_GROUPS = 128


def _top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(values, k) of each row of values [A, V], as [A, k] values and indices."""
    rows, vocab = values.shape
    width = vocab // TOP_K_GROUPS
    if vocab % TOP_K_GROUPS or k > width:  # no padding: a padded column could be picked in a row of -infs
        return values.topk(k, dim=-1)
    group_values, group_ids = values.view(rows * TOP_K_GROUPS, width).topk(k, dim=-1)  # [A * G, k]
    offsets = torch.arange(0, vocab, width, device=values.device).repeat(rows)[:, None]
    candidates = (group_ids + offsets).view(rows, TOP_K_GROUPS * k)
    top_values, picks = group_values.view(rows, TOP_K_GROUPS * k).topk(k, dim=-1)
    return top_values, candidates.gather(-1, picks)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Per row of logits [B, V] and its chosen token (tokens [B], an integer dtype): its logprob and its
    `tops[row]` most likely tokens, or None where `tops[row]` is None (the request asked for none).
    One top-k over the rows that asked, and one copy to the host: on the latency tier this runs after
    every step of a request that asks, so each kernel and sync counts (tens of microseconds each)."""
    asked = [row for row, top in enumerate(tops) if top is not None]
    if not asked:
        return [None] * len(tops)
    if len(asked) < len(tops):  # a batch where only some rows asked: theirs alone
        rows = torch.tensor(asked, device=logits.device)
        logits, tokens = logits[rows], tokens[rows]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [A, V]
    columns = [logprobs.gather(-1, tokens.long()[:, None])]  # [A, 1]: the chosen tokens'
    count = max(tops[row] for row in asked)
    if count:
        top_values, top_ids = _top_k(logprobs, count)  # [A, K], most likely first
        columns += [top_values, top_ids.float()]  # ids below 2**24, as every vocabulary's, are exact in float32
    host = torch.cat(columns, dim=-1).tolist()  # [A, 1 + 2K]: the one copy to the host
    out: list[TokenLogprob | None] = [None] * len(tops)
    for row, values in zip(asked, host):
        top = tops[row]
        out[row] = TokenLogprob(values[0], tuple(zip(map(int, values[1 + count:1 + count + top]), values[1:1 + top])))
    return out
