"""A static key/value cache: one [max_batch, num_kv_heads, max_seq, head_dim] tensor per layer for
keys and one for values, allocated once. A sequence owns one batch row (its "slot") for its whole
life; the token at position p of that sequence keeps its key and value at [slot, :, p].
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        max_batch: int,
        max_seq: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_batch < 1 or max_seq < 1:
            raise ValueError(f"max_batch and max_seq must be positive, got {max_batch}, {max_seq}")
        self.max_batch = max_batch
        self.max_seq = max_seq
        self.dtype = dtype
        shape = (max_batch, config.num_kv_heads, max_seq, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
