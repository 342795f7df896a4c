"""The reference decoder against Hugging Face transformers on the same random weights.

Tolerance: in float32 on CPU our forward runs the same operations as transformers' in the same
order, except that attention reads keys back from the cache through a boolean mask instead of
`is_causal`, and decode runs one query at a time; both change only the rounding of float32 sums
(relative error ~1e-7 per op, a few ops deep). Logits here have norms of order 1-10, so a
relative error of the whole logits tensor below REL_TOLERANCE = 1e-5 leaves room for that rounding
while any real bug (a wrong RoPE frequency, mask, norm or head mapping) shows as 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megaserve.replicas.models import KVCache, load_model
from tests.model_factory import make_tiny_model

REL_TOLERANCE = 1e-5
PROMPT_LENGTH = 24
DECODE_STEPS = 6
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so that the scaled band covers our positions
}

CONFIGS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama31-rope-scaling-sharded": ("llama", {"rope_scaling": LLAMA3_SCALING, "max_shard_size": "40KB"}),
    "qwen3-qk-norm-head-dim-32-tied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-mha-sharded": ("qwen3", {"num_key_value_heads": 4, "max_shard_size": "40KB"}),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(our model, transformers' model) of one config, on the same checkpoint."""
    family, overrides = CONFIGS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return load_model(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(count: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, count), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids).logits.float()


def test_checkpoint_layout(tiny):
    ours, _ = tiny
    config = ours.config
    assert ours.dtype == torch.float32
    assert (ours.lm_head is ours.embed) == config.tie_word_embeddings
    assert (ours.layers[0].q_norm is not None) == config.qk_norm
    assert ours.layers[0].wk.shape == (config.num_kv_heads * config.head_dim, config.hidden_size)


def test_prefill_matches_transformers(tiny):
    ours, hf_model = tiny
    input_ids = tokens(PROMPT_LENGTH, ours.config.vocab_size)
    cache = ours.new_cache(max_batch=2, max_seq=64)
    logits = ours.forward(input_ids, torch.arange(PROMPT_LENGTH)[None], cache, torch.tensor([1]))
    reference = hf_logits(hf_model, input_ids)
    assert logits.shape == reference.shape and logits.dtype == torch.float32
    assert rel_err(logits, reference) < REL_TOLERANCE


def test_decode_through_cache_matches_full_sequence(tiny):
    ours, hf_model = tiny
    total = PROMPT_LENGTH + DECODE_STEPS
    input_ids = tokens(total, ours.config.vocab_size, seed=1)
    reference = hf_logits(hf_model, input_ids)[0]  # [total, V]
    cache = ours.new_cache(max_batch=3, max_seq=64)
    slot = torch.tensor([2])
    prefill = ours.forward(input_ids[:, :PROMPT_LENGTH], torch.arange(PROMPT_LENGTH)[None], cache, slot, last_only=True)
    assert prefill.shape == (1, ours.config.vocab_size)
    assert rel_err(prefill[0], reference[PROMPT_LENGTH - 1]) < REL_TOLERANCE
    for position in range(PROMPT_LENGTH, total):
        step = ours.forward(input_ids[:, position : position + 1], torch.tensor([[position]]), cache, slot)
        assert step.shape == (1, 1, ours.config.vocab_size)
        assert rel_err(step[0, 0], reference[position]) < REL_TOLERANCE, f"decode at position {position}"


def test_chunked_prefill_matches_one_shot(tiny):
    """A prompt fed in chunks at increasing positions gives the logits of feeding it at once."""
    ours, hf_model = tiny
    input_ids = tokens(PROMPT_LENGTH, ours.config.vocab_size, seed=2)
    reference = hf_logits(hf_model, input_ids)[0]
    cache = ours.new_cache(max_batch=1, max_seq=PROMPT_LENGTH)
    for start, end in ((0, 7), (7, 8), (8, PROMPT_LENGTH)):
        chunk = ours.forward(input_ids[:, start:end], torch.arange(start, end)[None], cache, torch.tensor([0]))
        assert rel_err(chunk[0], reference[start:end]) < REL_TOLERANCE, f"chunk {start}:{end}"


def test_batched_decode_rows_at_different_positions_equal_single_rows(tiny):
    """Continuous batching: three sequences of different lengths in scattered slots, one step."""
    ours, _ = tiny
    vocab = ours.config.vocab_size
    lengths, slots = [5, 17, 11], [3, 0, 1]
    prompts = [tokens(length + 1, vocab, seed=10 + row) for row, length in enumerate(lengths)]

    batched_cache, single_cache = ours.new_cache(4, 32), ours.new_cache(4, 32)
    singles = []
    for prompt, length, slot in zip(prompts, lengths, slots):
        slot_tensor = torch.tensor([slot])
        for cache in (batched_cache, single_cache):
            ours.forward(prompt[:, :length], torch.arange(length)[None], cache, slot_tensor)
        singles.append(ours.forward(prompt[:, length:], torch.tensor([[length]]), single_cache, slot_tensor))

    batched = ours.forward(
        torch.cat([prompt[:, length:] for prompt, length in zip(prompts, lengths)]),
        torch.tensor(lengths)[:, None],
        batched_cache,
        torch.tensor(slots),
    )
    for row, single in enumerate(singles):
        assert rel_err(batched[row], single[0]) < REL_TOLERANCE
    # A caller-given bound on the context (no host sync) reads more, all masked: same logits.
    again = ours.forward(
        torch.cat([prompt[:, length:] for prompt, length in zip(prompts, lengths)]),
        torch.tensor(lengths)[:, None], batched_cache, torch.tensor(slots), context_len=batched_cache.max_seq,
    )
    assert rel_err(again, batched) < REL_TOLERANCE
    for layer in range(ours.config.num_layers):
        assert rel_err(batched_cache.k[layer], single_cache.k[layer]) < REL_TOLERANCE
        assert rel_err(batched_cache.v[layer], single_cache.v[layer]) < REL_TOLERANCE


def test_forward_rejects_mismatched_shapes(tiny):
    ours, _ = tiny
    cache = ours.new_cache(1, 8)
    with pytest.raises(ValueError, match="must be"):
        ours.forward(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="context_len"):
        ours.forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), cache, torch.tensor([0]),
                     context_len=9)


def test_kv_cache_shape():
    from megaserve.replicas.models import ModelConfig

    config = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 6,
    })
    cache = KVCache(config, max_batch=4, max_seq=32, device="cpu", dtype=torch.bfloat16)
    assert len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (4, 1, 32, 6) and cache.v[2].dtype == torch.bfloat16


def test_bfloat16_checkpoint_loads_in_its_own_dtype_and_tracks_transformers(tmp_path):
    """bf16 rounds each op to 8 bits of mantissa; we and transformers round the same ops, so the
    logits agree far more closely than bf16's precision alone would promise (< 1e-2 here)."""
    path = make_tiny_model(tmp_path, "llama", dtype=torch.bfloat16)
    ours = load_model(path)
    assert ours.dtype == torch.bfloat16 and ours.config.torch_dtype == "bfloat16"
    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    input_ids = tokens(PROMPT_LENGTH, ours.config.vocab_size)
    logits = ours.forward(input_ids, torch.arange(PROMPT_LENGTH)[None], ours.new_cache(1, 32), torch.tensor([0]))
    assert rel_err(logits, hf_logits(hf_model, input_ids)) < 1e-2
    assert load_model(path, dtype=torch.float32).dtype == torch.float32
