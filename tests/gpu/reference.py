"""What the GPU tests compare with: the reference forward's greedy continuation, recomputed from
scratch at every step (no cache reuse, float32), the oracle of the GPU engines' greedy tokens; and
the reference decoder and the megakernel one step at a time, on a caller's cache.

Near ties. Two bf16 implementations of the same step round in different orders, and so does the
megakernel from one run to the next: its down projection adds the CTAs' fp32 shares atomically, in
arrival order (kernels/gemv.cuh), so a hidden value can round to the other bf16 neighbour. Where two
greedy choices differ, the logit gap between them must then be within TIE_NOISE_FACTOR x the largest
logit difference between the kernel and the bf16 reference at that step: a near tie that rounding
decides. A real bug (wrong token fed back, position, head, mask) moves logits by O(1).
"""

from __future__ import annotations

import torch

from megaserve.kernels.launcher import DecodeStep, store_transposed
from megaserve.replicas.models import load_model

DEVICE = "cuda"
TIE_NOISE_FACTOR = 2.0


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


def megakernel_model(model_dir):
    """The bf16 model with wo and w_down in the kernel's layout (the reference forward reads them too)."""
    model = load_model(model_dir, DEVICE, torch.bfloat16)
    store_transposed(model)
    return model


def prefill(model, cache, prompt) -> torch.Tensor:
    """The reference forward over `prompt` into cache row 0: the last position's logits, [V]."""
    ids = torch.tensor([list(prompt)], device=DEVICE)
    positions = torch.arange(len(prompt), device=DEVICE)[None]
    return model.forward(ids, positions, cache, torch.zeros(1, dtype=torch.long, device=DEVICE), last_only=True)[0]


def reference_step(model, cache, token: int, pos: int) -> torch.Tensor:
    """One reference decode step of `token` at `pos` on cache row 0: its logits, [V]."""
    ids = torch.tensor([[token]], device=DEVICE)
    positions = torch.tensor([[pos]], device=DEVICE)
    return model.forward(ids, positions, cache, torch.zeros(1, dtype=torch.long, device=DEVICE))[0, 0]


def kernel_step(step: DecodeStep, token: int, pos: int) -> torch.Tensor:
    """One megakernel launch of `token` at `pos`: a copy of its logits, [V]."""
    step.set_position(token, pos)
    step.launch()
    torch.cuda.synchronize()
    return step.logits.clone()


def tie_gap(logits: torch.Tensor, reference: torch.Tensor, chosen: int) -> tuple[float, float]:
    """How far `chosen` trails the best of `logits`, and the rounding noise it may trail by: the
    largest difference from the bf16 `reference` logits x TIE_NOISE_FACTOR (see the docstring)."""
    gap = (logits.max() - logits[chosen]).item()
    return gap, TIE_NOISE_FACTOR * (logits - reference).abs().max().item()
