"""Tensor-parallel sharding: the split plan, the shards, and a TP greedy decode that equals the
unsharded reference, in one process and over real gloo processes.

Tolerance: in float32 the TP decode runs the reference decoder's own operations on the shards; it
differs only in where float32 sums are split: O and down are tp partial products added afterwards
instead of one dot product over all heads / the whole intermediate dimension (and the GEMMs block
differently on smaller shapes). Each such split changes a sum by ~1e-7 relative, a few ops deep
per layer, so REL_TOLERANCE = 1e-5 on the logits leaves ample room for rounding, while a wrong
head, KV-head or vocabulary mapping, or a missing partial, moves the logits by 1e-1 or more.
"""

from __future__ import annotations

import pytest
import torch

from .tp_reference import (
    LocalGroup,
    RankDecoder,
    combine_argmax,
    generate_local,
    local_argmax,
    run_gloo,
    tp_generate,
)
from megaserve.replicas.models import Model, ModelConfig, load_model
from megaserve.replicas.models.sharding import (
    ShardingError,
    allreduce_bytes_per_step,
    plan_sharding,
    shard_model,
    step_read_bytes,
)
from tests.model_factory import make_tiny_model

REL_TOLERANCE = 1e-5
TP_SIZES = (1, 2, 4, 8)
PROMPT_LENGTH = 8
NEW_TOKENS = 6
VOCAB = 509  # prime: no tp size divides it, so the last vocabulary slices are padded
SHAPE = {"vocab_size": VOCAB, "num_attention_heads": 8, "hidden_size": 128, "intermediate_size": 256}
CONFIGS = {
    "llama-gqa-2kv": ("llama", {"num_key_value_heads": 2}),  # tp 4 and 8 replicate the KV heads
    "llama-mha-tied": ("llama", {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    "qwen3-qk-norm-4kv": ("qwen3", {"num_key_value_heads": 4, "head_dim": 32, "hidden_size": 64}),
}
GLOO_CASES = (("llama-gqa-2kv", 4), ("qwen3-qk-norm-4kv", 2))

BF16_BYTES = 2
CONTEXT_LEN = 1024
MB = 1e6
HBM_READ_BYTES_PER_S = 4.44e12  # the best read rate measured on one H200 (ARCHITECTURE.md)
LLAMA_31 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "num_key_value_heads": 8,
            "head_dim": 128, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
LLAMA_31_8B = LLAMA_31 | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                          "num_attention_heads": 32}
LLAMA_31_70B = LLAMA_31 | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                           "num_attention_heads": 64}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """name -> folder of a tiny random checkpoint."""
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(name), family, **(SHAPE | overrides))
        for name, (family, overrides) in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def references(tiny_dirs):
    """name -> (model, prompt, greedy tokens, their logits [NEW_TOKENS, V]) of the unsharded decoder."""
    return {name: reference_greedy(load_model(path)) for name, path in tiny_dirs.items()}


def reference_greedy(model) -> tuple[Model, list[int], list[int], torch.Tensor]:
    prompt = torch.randint(0, VOCAB, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(max_batch=1, max_seq=PROMPT_LENGTH + NEW_TOKENS)
    step_ids, start, tokens, logits = prompt, 0, [], []
    for _ in range(NEW_TOKENS):
        positions = torch.arange(start, start + len(step_ids))[None]
        logits.append(model.forward(torch.tensor([step_ids]), positions, cache, torch.tensor([0]), last_only=True)[0])
        tokens.append(int(logits[-1].argmax()))
        start, step_ids = start + len(step_ids), [tokens[-1]]
    return model, prompt, tokens, torch.stack(logits)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp_decode_in_one_process_matches_reference(references, name, tp_size):
    model, prompt, tokens, logits = references[name]
    result = generate_local(model, tp_size, prompt, NEW_TOKENS, gather_logits=True)
    assert result.logits.shape == logits.shape == (NEW_TOKENS, VOCAB)
    assert rel_err(result.logits, logits) < REL_TOLERANCE
    assert result.tokens == tokens


@pytest.mark.parametrize(("name", "tp_size"), GLOO_CASES)
def test_tp_decode_over_gloo_processes_matches_reference(tiny_dirs, references, name, tp_size):
    _, prompt, tokens, logits = references[name]
    result = run_gloo(tiny_dirs[name], tp_size, prompt, NEW_TOKENS, gather_logits=True)
    assert rel_err(result.logits, logits) < REL_TOLERANCE
    assert result.tokens == tokens


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_shards_reassemble_the_model(references, tp_size):
    model = references["llama-gqa-2kv"][0]
    config, head_dim = model.config, model.config.head_dim
    shards = [shard_model(model, tp_size, rank) for rank in range(tp_size)]
    layer, pieces = model.layers[1], [shard.layers[1] for shard in shards]
    assert torch.equal(torch.cat([piece.wq for piece in pieces]), layer.wq)
    assert torch.equal(torch.cat([piece.wo for piece in pieces], dim=1), layer.wo)
    for attr in ("w_gate", "w_up"):
        assert torch.equal(torch.cat([getattr(piece, attr) for piece in pieces]), getattr(layer, attr))
    assert torch.equal(torch.cat([piece.w_down for piece in pieces], dim=1), layer.w_down)
    heads_per_rank, group = config.num_heads // tp_size, config.num_heads // config.num_kv_heads
    for rank, piece in enumerate(pieces):
        assert piece.wq.shape == (heads_per_rank * head_dim, config.hidden_size)
        assert piece.w_down.shape == (config.hidden_size, config.intermediate_size // tp_size)
        # Each rank's KV rows are those of the KV heads its query heads use: h // group.
        kv_heads = sorted({head // group for head in range(rank * heads_per_rank, (rank + 1) * heads_per_rank)})
        expected = torch.cat([layer.wk[head * head_dim:(head + 1) * head_dim] for head in kv_heads])
        assert torch.equal(piece.wk, expected)
    padded_heads = torch.cat([shard.lm_head for shard in shards])
    assert padded_heads.shape == (-(-VOCAB // tp_size) * tp_size, config.hidden_size)
    assert torch.equal(padded_heads[:VOCAB], model.lm_head)
    assert not padded_heads[VOCAB:].any()
    assert sum(shard.vocab_valid for shard in shards) == VOCAB


def test_plan_replicates_kv_heads_past_their_count():
    config = ModelConfig.from_hf_dict(LLAMA_31_8B | {"num_key_value_heads": 2})
    plan = plan_sharding(config, 8)  # 32 heads, 2 KV heads: 4 query heads per rank, group 16
    assert (plan.heads_per_rank, plan.kv_heads_per_rank, plan.kv_replicas) == (4, 1, 4)
    assert [plan.kv_heads(rank).start for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    split = plan_sharding(config, 2)
    assert (split.kv_heads_per_rank, split.kv_replicas, list(split.kv_heads(1))) == (1, 1, [1])
    assert plan.vocab(7) == range(7 * 16032, 128256) and plan.padded_vocab == 128256


@pytest.mark.parametrize(
    ("overrides", "tp_size", "message"),
    [
        ({"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128}, 8,
         r"num_attention_heads \(12\) is not divisible by tp_size \(8\)"),
        ({"num_attention_heads": 24, "num_key_value_heads": 3, "head_dim": 128}, 2,
         r"num_key_value_heads \(3\) and tp_size \(2\)"),
        ({"num_attention_heads": 24, "num_key_value_heads": 6, "head_dim": 128}, 4,
         r"num_key_value_heads \(6\) and tp_size \(4\)"),
        ({"intermediate_size": 14340}, 8, r"intermediate_size \(14340\) is not divisible by tp_size \(8\)"),
        ({}, 0, r"tp_size must be positive, got 0"),
    ],
)
def test_impossible_splits_are_refused_naming_the_numbers(overrides, tp_size, message):
    with pytest.raises(ShardingError, match=message):
        plan_sharding(ModelConfig.from_hf_dict(LLAMA_31_8B | overrides), tp_size)


def test_rank_out_of_range_is_refused(references):
    with pytest.raises(ShardingError, match=r"rank must be in \[0, 4\) for tp_size 4, got 4"):
        shard_model(references["llama-mha-tied"][0], 4, 4)


def test_generation_past_the_rank_caches_is_refused(references):
    model, prompt, _, _ = references["llama-mha-tied"]
    group = LocalGroup([RankDecoder(shard_model(model, 2, rank), max_seq=PROMPT_LENGTH) for rank in range(2)])
    with pytest.raises(ValueError, match=rf"prompt \({PROMPT_LENGTH}\) \+ max_new_tokens \(3\) - 1 exceeds max_seq"):
        tp_generate(group, prompt, 3)
    assert len(tp_generate(group, prompt, 1).tokens) == 1


def test_argmax_ties_go_to_the_lowest_token_id():
    # Ranks 1 and 3 share the top value: the lower token id (rank 1's) wins, as torch.argmax would.
    values, token_ids = torch.tensor([1.0, 3.0, 2.0, 3.0]), torch.tensor([5, 130, 260, 390])
    assert combine_argmax(values, token_ids) == 130
    # Within a rank the first maximum wins, offset by the rank's first token id.
    value, token_id = local_argmax(torch.tensor([0.5, 2.0, 2.0, -1.0]), vocab_start=64)
    assert (value.item(), token_id.item()) == (2.0, 65)
    full = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0, 2.0])
    slices = [local_argmax(part, start) for part, start in ((full[:2], 0), (full[2:4], 2), (full[4:], 4))]
    assert combine_argmax(*map(torch.cat, zip(*slices))) == int(full.argmax()) == 1


def test_padding_never_wins_the_argmax(references):
    model = references["llama-gqa-2kv"][0]
    shard = shard_model(model, 4, 3)  # vocabulary slice [384, 509) in 128 rows: 3 of padding
    assert (shard.vocab_start, shard.vocab_valid, shard.lm_head.shape[0]) == (384, 125, 128)
    decoder = RankDecoder(shard, max_seq=1)
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    # Every real row scores negative (row . norm(hidden) = -sum(norm_weight^2 hidden^2) / rms);
    # the zero padding rows would score 0.
    shard.lm_head[:shard.vocab_valid] = -(model.final_norm * hidden)
    logits = decoder.local_logits(hidden)
    assert (logits[:shard.vocab_valid] < 0).all() and torch.isneginf(logits[shard.vocab_valid:]).all()
    _, token_id = local_argmax(logits, shard.vocab_start)
    assert shard.vocab_start <= token_id.item() < shard.vocab_start + shard.vocab_valid


def test_step_bytes_per_rank_for_llama_31_8b_and_70b():
    """Per-rank HBM reads per decode step (bf16, context 1,024) and the all-reduce payload: the
    table goes to the report (pytest -s); the asserts pin it to ARCHITECTURE.md's 8B figures."""
    rows = []
    for name, raw in (("Llama-3.1-8B", LLAMA_31_8B), ("Llama-3.1-70B", LLAMA_31_70B)):
        config = ModelConfig.from_hf_dict(raw)
        whole = step_read_bytes(plan_sharding(config, 1), CONTEXT_LEN, BF16_BYTES)
        reduced = allreduce_bytes_per_step(config, BF16_BYTES)
        for tp_size in TP_SIZES:
            reads = step_read_bytes(plan_sharding(config, tp_size), CONTEXT_LEN, BF16_BYTES)
            # Everything but the replicated norms and embedding row divides by tp.
            assert abs(reads.total * tp_size / whole.total - 1) < 1e-3
            rows.append(f"{name:14} tp={tp_size}  layer {reads.layer_weights / MB:7.1f} MB"
                        f"  KV {reads.layer_kv / MB:4.2f} MB  LM head {reads.lm_head / MB:7.1f} MB"
                        f"  step {reads.total / MB:8.1f} MB"
                        f" = {reads.total / HBM_READ_BYTES_PER_S * 1e6:6.0f} us  all-reduce {reduced / MB:.2f} MB"
                        f" in {2 * config.num_layers} sums")
        if name == "Llama-3.1-8B":
            assert round(whole.layer_weights / MB, 1) == 436.2
            assert round(whole.layer_kv / MB, 1) == 4.2
            assert round(whole.lm_head / MB) == 1051
            assert reduced == 2 * 32 * 4096 * BF16_BYTES
    print("\n" + "\n".join(rows))
