"""Tiny random Hugging Face models for tests: `make_tiny_model(dir, family, **config_overrides)`.

Built with transformers itself (LlamaConfig / Qwen3Config + from_config, save_pretrained), so the
checkpoint is exactly what a real export looks like, plus the demo's byte-level BPE tokenizer and
its Llama-3-style chat template. Weights are scaled up from transformers' tiny default init so that
attention is far from uniform and every norm weight differs from one: a RoPE, mask or norm bug then
moves the logits visibly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megaserve.replicas.models.demo import (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    EOT_TOKEN,
    build_demo_tokenizer,
    write_tokenizer_files,
)

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.25,  # transformers' 0.02 would make attention nearly uniform here
}
NORM_WEIGHT_JITTER = 0.2


def make_tiny_model(
    directory: str | Path,
    family: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **config_overrides,
) -> Path:
    """Save a random `family` model ("llama" | "qwen3") with its tokenizer in `directory`.

    `config_overrides` go to the transformers config (e.g. num_key_value_heads=4, head_dim=32,
    tie_word_embeddings=True, rope_scaling={...}); `max_shard_size` (e.g. "100KB") shards the
    checkpoint with an index file. vocab_size must be at least 261 (the tokenizer's minimum).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config_class, model_class = FAMILIES[family]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    settings = TINY_SHAPE | config_overrides
    tokenizer = build_demo_tokenizer(settings["vocab_size"])
    settings.setdefault("bos_token_id", tokenizer.token_to_id(BOS_TOKEN))
    settings.setdefault("eos_token_id", [tokenizer.token_to_id(END_OF_TEXT_TOKEN), tokenizer.token_to_id(EOT_TOKEN)])

    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + NORM_WEIGHT_JITTER * torch.randn_like(parameter))
    model.to(dtype).save_pretrained(directory, max_shard_size=max_shard_size or "10GB")
    write_tokenizer_files(directory, tokenizer, model_max_length=settings["max_position_embeddings"])
    return directory


def sentencepiece_style_tokenizer(words: list[str]) -> Tokenizer:
    """A word-level tokenizer over `words` ("<unk>" first) that decodes as Llama 2's and Mistral's do:
    "▁" for a space, and the first token of a decoded string without its leading space."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return backend
