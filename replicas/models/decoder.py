"""The reference decoder for Llama 3 and Qwen3 dense, in plain PyTorch: the oracle for every fast
path, and the TorchEngine's model. Numerics follow Hugging Face transformers (RMSNorm in float32,
RoPE in the model dtype with float32 angles, SDPA attention) so that logits match theirs.

One step, for tokens x at positions p of the sequences in cache rows `slots`:

    h = embed[x]
    for each layer:
        q, k, v = norm(h) @ wq, wk, wv          (Qwen3: RMSNorm each q and k head)
        q, k = rope(q, p), rope(k, p)
        cache[slot, :, p] = k, v
        h += softmax(q k_cache^T / sqrt(head_dim), causal by position) v_cache @ wo
        h += (silu(norm(h) @ w_gate) * (norm(h) @ w_up)) @ w_down
    logits = norm(h) @ lm_head

The weights are plain tensors with the names below; the CUDA megakernel reads them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import CheckpointError, open_checkpoint
from .config import ModelConfig
from .kv_cache import KVCache
from .rope import apply_rope, rope_cos_sin, rope_inv_freq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBED_NAME = "model.embed_tokens.weight"
FINAL_NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"
ROPE_BUFFER_SUFFIX = ".rotary_emb.inv_freq"  # a non-persistent buffer that older transformers saved
LAYER_PREFIX = "model.layers.{}."
# Our layer attribute -> its Hugging Face name under LAYER_PREFIX.
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
QK_NORM_ATTRS = ("q_norm", "k_norm")


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor  # [num_heads * head_dim, H]
    wk: torch.Tensor  # [num_kv_heads * head_dim, H]
    wv: torch.Tensor  # [num_kv_heads * head_dim, H]
    wo: torch.Tensor  # [H, num_heads * head_dim]
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    mlp_norm: torch.Tensor  # [H]
    w_gate: torch.Tensor  # [I, H]
    w_up: torch.Tensor  # [I, H]
    w_down: torch.Tensor  # [H, I]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, by Hugging Face name, with its shape."""
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    layer_shapes = {
        "attn_norm": (hidden,),
        "wq": (q_dim, hidden),
        "wk": (kv_dim, hidden),
        "wv": (kv_dim, hidden),
        "wo": (hidden, q_dim),
        "mlp_norm": (hidden,),
        "w_gate": (config.intermediate_size, hidden),
        "w_up": (config.intermediate_size, hidden),
        "w_down": (hidden, config.intermediate_size),
    }
    if config.qk_norm:
        layer_shapes |= {attr: (config.head_dim,) for attr in QK_NORM_ATTRS}
    shapes = {EMBED_NAME: (config.vocab_size, hidden), FINAL_NORM_NAME: (hidden,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD_NAME] = (config.vocab_size, hidden)
    for index in range(config.num_layers):
        prefix = LAYER_PREFIX.format(index)
        shapes |= {prefix + LAYER_NAMES[attr]: shape for attr, shape in layer_shapes.items()}
    return shapes


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None
) -> Model:
    """Load a Llama 3 / Qwen3 dense checkpoint in Hugging Face format from the folder `path`.

    `dtype` None means the checkpoint's own `torch_dtype`. Every tensor is checked against the
    config: a missing, unexpected or mis-shaped one raises CheckpointError naming it.
    """
    config = ModelConfig.from_hf_dir(path)
    dtype = _resolve_dtype(dtype or config.torch_dtype)
    device = torch.device(device)
    shapes = expected_shapes(config)
    with open_checkpoint(path) as checkpoint:
        present = checkpoint.names()
        missing = sorted(set(shapes) - present)
        # Some exporters also save the head of a tied model; it is the embedding, so unused. Older
        # exports save each layer's RoPE frequencies too; they follow from the config (vLLM skips them).
        unused = {LM_HEAD_NAME} if config.tie_word_embeddings else set()
        unused |= {name for name in present if name.endswith(ROPE_BUFFER_SUFFIX)}
        unexpected = sorted(present - set(shapes) - unused)
        if missing:
            raise CheckpointError(f"checkpoint in {path} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unexpected:
            raise CheckpointError(f"checkpoint in {path} has unexpected tensor(s) {unexpected[:3]}")
        for name, shape in shapes.items():
            if checkpoint.shape(name) != shape:
                raise CheckpointError(f"tensor {name!r} has shape {checkpoint.shape(name)}, expected {shape}")
        tensors = {name: checkpoint.read(name, device, dtype) for name in shapes}
    return Model(config, tensors)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class Model:
    """Weights as plain tensors plus the reference forward; build with `load_model`."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.embed = tensors[EMBED_NAME]  # [V, H]
        self.layers = [self._layer(tensors, index) for index in range(config.num_layers)]
        self.final_norm = tensors[FINAL_NORM_NAME]  # [H]
        self.lm_head = self.embed if config.tie_word_embeddings else tensors[LM_HEAD_NAME]  # [V, H]
        self.rope_inv_freq = rope_inv_freq(config).to(self.embed.device)  # [head_dim/2] float32
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    def _layer(self, tensors: dict[str, torch.Tensor], index: int) -> Layer:
        prefix = LAYER_PREFIX.format(index)
        return Layer(**{attr: tensors.get(prefix + name) for attr, name in LAYER_NAMES.items()})

    def new_cache(self, max_batch: int, max_seq: int) -> KVCache:
        """A KV cache on this model's device and dtype."""
        return KVCache(self.config, max_batch, max_seq, self.device, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        *,
        last_only: bool = False,
        context_len: int | None = None,
    ) -> torch.Tensor:
        """Run tokens input_ids [B, T] at positions [B, T] of the sequences in cache rows slots [B].

        Writes their keys and values into the cache, attends each token to its own row's keys at
        positions <= its own (rows may be at different positions), and returns float32 logits
        [B, T, V], or only the last token's [B, V] when `last_only` (prefill then never builds the
        [T, V] logits). Positions must be below cache.max_seq.

        Attention reads cache positions [0, context_len). None means positions.max() + 1, which
        costs one device-to-host sync; a caller that knows a bound (> every position, <= max_seq)
        passes it, and the step then has no sync at all and can be captured in a CUDA graph.
        """
        batch, length = input_ids.shape
        if positions.shape != input_ids.shape or slots.shape != (batch,):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and slots "
                f"{tuple(slots.shape)} must be [B, T], [B, T] and [B]"
            )
        if context_len is None:
            context_len = int(positions.max()) + 1
        if not 0 < context_len <= cache.max_seq:
            raise ValueError(f"context_len must be in [1, {cache.max_seq}] (the cache's max_seq), got {context_len}")
        key_positions = torch.arange(context_len, device=positions.device)
        causal_mask = key_positions <= positions[:, None, :, None]  # [B, 1, T, context_len]
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, self.dtype)  # [B, T, head_dim]

        hidden = self.embed[input_ids]  # [B, T, H]
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            attn_in = self.rms_norm(hidden, layer.attn_norm)
            attn_out = self.attention(layer, attn_in, cos, sin, k_cache, v_cache, slots, positions, causal_mask)
            hidden = hidden + attn_out
            hidden = hidden + self.mlp(layer, self.rms_norm(hidden, layer.mlp_norm))
        if last_only:
            hidden = hidden[:, -1]  # [B, H]
        return F.linear(self.rms_norm(hidden, self.final_norm), self.lm_head).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) in float32, cast back, times weight (as Hugging Face)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    def attention(
        self,
        layer: Layer,
        x: torch.Tensor,  # [B, T, H], normed
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [max_batch, num_kv_heads, max_seq, head_dim]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
        causal_mask: torch.Tensor,  # [B, 1, T, context_len]
    ) -> torch.Tensor:
        config = self.config
        batch, length, _ = x.shape
        q = F.linear(x, layer.wq).view(batch, length, config.num_heads, config.head_dim)
        k = F.linear(x, layer.wk).view(batch, length, config.num_kv_heads, config.head_dim)
        v = F.linear(x, layer.wv).view(batch, length, config.num_kv_heads, config.head_dim)
        if config.qk_norm:
            q = self.rms_norm(q, layer.q_norm)
            k = self.rms_norm(k, layer.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Advanced indices [B, 1] and [B, T] around a slice: the indexed view is [B, T, kv_heads, head_dim].
        k_cache[slots[:, None], :, positions] = k.to(k_cache.dtype)
        v_cache[slots[:, None], :, positions] = v.to(v_cache.dtype)
        context_len = causal_mask.shape[-1]
        keys = k_cache[slots, :, :context_len].to(q.dtype)  # [B, kv_heads, context_len, head_dim]
        values = v_cache[slots, :, :context_len].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=causal_mask,
            scale=config.head_dim**-0.5, enable_gqa=True,
        )  # [B, heads, T, head_dim]
        return F.linear(out.transpose(1, 2).reshape(batch, length, -1), layer.wo)

    def mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, layer.w_gate)) * F.linear(x, layer.w_up), layer.w_down)
