"""The reference forward's greedy continuation, recomputed from scratch at every step (no cache
reuse, float32): the oracle the GPU engines' greedy tokens are compared with."""

from __future__ import annotations

import torch

from megaserve.replicas.models import load_model


def reference_greedy(model_dir, prompt, count: int, device: str = "cuda") -> list[int]:
    model = load_model(model_dir, device, torch.float32)
    tokens = list(prompt)
    for _ in range(count):
        cache = model.new_cache(1, len(tokens))
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(len(tokens), device=device)[None]
        logits = model.forward(ids, positions, cache, torch.tensor([0], device=device), last_only=True)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt):]
