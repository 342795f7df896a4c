"""Rotary position embedding (RoFormer), in Hugging Face's convention.

The head dimension is split into two halves (not interleaved pairs): channel i and i + head_dim/2
rotate together by angle position * inv_freq[i]. Llama 3.1 rescales the frequencies once, up front
("llama3" rope type): wavelengths longer than the original context are slowed down by `factor`,
shorter ones than original_context / high_freq_factor are kept, and the band between is blended.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, with Llama 3.1 scaling applied when configured."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scaled(inv_freq, config.rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Between the two wavelengths, interpolate linearly (in original_context / wavelen) between
    # the slowed-down and the original frequency.
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] in `dtype` for positions [B, T]; angles computed in float32."""
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # both halves rotate by the same angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, head_dim] by cos, sin [B, T, head_dim]."""
    cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return x * cos + rotated_half * sin
