"""The embedded demo model "megaserve-demo": a tiny Llama-3-family model that megaserve builds on
first use, so that the whole product runs on a laptop with no download.

Everything is deterministic (fixed seeds, a tokenizer trained on a fixed text) and written in
Hugging Face format, so it also loads with transformers' AutoModelForCausalLM and AutoTokenizer.
Its weights are random: it speaks gibberish, fast (a CPU decode step takes about a millisecond).
The shape mirrors Llama 3.2 (GQA, tied embeddings, "llama3" RoPE scaling) in miniature.
Bump DEMO_VERSION whenever anything here changes what is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEMO_NAME = "megaserve-demo"
DEMO_VERSION = 2  # v2: head_dim 64 (2 heads), a shape the decode megakernel runs
DEMO_SEED = 20261129

VOCAB_SIZE = 512  # BPE tokens + named special tokens + reserved special tokens
BYTE_TOKENS = 256
BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
NAMED_SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN)
RESERVED_TOKEN = "<|reserved_special_token_{}|>"
# The pre-tokenizer split of Llama 3 (tiktoken's cl100k pattern): contractions, words with one
# leading non-letter, numbers of up to three digits, punctuation runs, newlines, other spaces.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The text the BPE merges are learned from (any fixed text would do).
MERGE_CORPUS = """\
megaserve serves language models on Ray Serve in two tiers. The latency tier runs one request at a
time on a megakernel: every decode step is a single persistent launch that streams the weights
through the memory system once. The throughput tier batches many requests together. A router reads
each request, applies the chat template, tokenizes the prompt once, and picks the tier: a priority
request goes to the latency tier, a long prompt or a batch of samples goes to the throughput tier.
When every latency replica is busy, the request waits for a short while or spills over. Each replica
reports how long every step takes, and Prometheus scrapes those numbers so that Grafana can draw
them. The model reads the prompt, then writes one token after another until it is told to stop.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
The quick brown fox jumps over the lazy dog. 0123456789 1,000 tokens per second, 3.14159.
"""

CHAT_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') -}}
    {% endif %}
    {% if loop.first %}
        {{- bos_token -}}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}
    {{- message['content'] | trim -}}
    {{- '<|eot_id|>' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{% endif %}
"""

# Model shape: Llama 3.2 in miniature.
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_LAYERS = 4
NUM_HEADS = 2  # head_dim 64
NUM_KV_HEADS = 1
CONTEXT_LENGTH = 2048
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": CONTEXT_LENGTH // 4,
}
RMS_NORM_EPS = 1e-5
NORM_WEIGHT_JITTER = 0.1  # norm weights are 1 + this * noise, so that a skipped weight shows


def ensure_demo_model(home: Path) -> Path:
    """Return the demo model's folder under `home`/models, building it first if it is missing.

    Safe when several processes race: each builds in its own temporary folder and renames it into
    place; a rename that finds the folder already there means another process won, and its copy
    (identical, by determinism) is used.
    """
    target = Path(home) / "models" / f"{DEMO_NAME}-v{DEMO_VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_demo_model(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_demo_model(path: Path) -> None:
    """Write the demo model's files into the existing folder `path`."""
    tokenizer = build_demo_tokenizer()
    write_tokenizer_files(path, tokenizer, model_max_length=CONTEXT_LENGTH)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_ids = [tokenizer.token_to_id(END_OF_TEXT_TOKEN), tokenizer.token_to_id(EOT_TOKEN)]
    head_dim = HIDDEN_SIZE // NUM_HEADS
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": ROPE_SCALING,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "torch_dtype": "bfloat16",
    }
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_ids})
    save_file(_demo_weights(head_dim), path / "model.safetensors", metadata={"format": "pt"})


def _demo_weights(head_dim: int) -> dict[str, torch.Tensor]:
    """Fixed-seed random weights, bf16. Matrices ~ N(0, 1/fan_in) keep activations O(1); the
    embedding ~ N(0, 1) makes the tied head's logits spread widely, so greedy picks are clear."""
    generator = torch.Generator().manual_seed(DEMO_SEED)

    def matrix(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * std).to(torch.bfloat16)

    def norm_weight(size: int) -> torch.Tensor:
        return (1 + NORM_WEIGHT_JITTER * torch.randn(size, generator=generator)).to(torch.bfloat16)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return matrix(out_features, in_features, in_features**-0.5)

    q_dim, kv_dim = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    weights = {"model.embed_tokens.weight": matrix(VOCAB_SIZE, HIDDEN_SIZE, 1.0)}
    for index in range(NUM_LAYERS):
        prefix = f"model.layers.{index}."
        weights |= {
            prefix + "input_layernorm.weight": norm_weight(HIDDEN_SIZE),
            prefix + "self_attn.q_proj.weight": linear(q_dim, HIDDEN_SIZE),
            prefix + "self_attn.k_proj.weight": linear(kv_dim, HIDDEN_SIZE),
            prefix + "self_attn.v_proj.weight": linear(kv_dim, HIDDEN_SIZE),
            prefix + "self_attn.o_proj.weight": linear(HIDDEN_SIZE, q_dim),
            prefix + "post_attention_layernorm.weight": norm_weight(HIDDEN_SIZE),
            prefix + "mlp.gate_proj.weight": linear(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.up_proj.weight": linear(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.down_proj.weight": linear(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    weights["model.norm.weight"] = norm_weight(HIDDEN_SIZE)
    return weights


def build_demo_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A Llama-3-style byte-level BPE tokenizer of exactly `vocab_size` tokens: 256 byte tokens,
    merges learned from MERGE_CORPUS, then the named special tokens and reserved ones to fill up."""
    num_bpe = vocab_size - len(NAMED_SPECIAL_TOKENS)
    if num_bpe < BYTE_TOKENS:
        raise ValueError(f"vocab_size must be at least {BYTE_TOKENS + len(NAMED_SPECIAL_TOKENS)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(MERGE_CORPUS.splitlines(keepends=True), trainer=trainer)
    num_reserved = num_bpe - tokenizer.get_vocab_size()  # the merges may run out before num_bpe
    reserved = [RESERVED_TOKEN.format(i) for i in range(num_reserved)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in (*NAMED_SPECIAL_TOKENS, *reserved)])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def write_tokenizer_files(path: Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """tokenizer.json and a tokenizer_config.json with the Llama-3-style chat template."""
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
