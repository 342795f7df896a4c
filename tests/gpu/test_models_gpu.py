"""The reference decoder on CUDA in bf16: close to transformers on the same weights, and a decode
step with a caller-given context_len has no host sync, so it replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megaserve.replicas.models import load_model

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEVICE = "cuda"
PROMPT_LENGTH = 200
# bf16 keeps 8 mantissa bits; we and transformers round the same ops in the same order, but
# cuBLAS and SDPA may pick different kernels (split-K, another attention backend) for different
# call shapes, so each side rounds differently: allow 2% relative.
BF16_REL_TOLERANCE = 2e-2
DECODE_STEPS = 8


def _ids(count: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, count), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_bf16_prefill_tracks_transformers(tiny_model_dir):
    ours = load_model(tiny_model_dir, DEVICE)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE).eval()
    assert ours.dtype == torch.bfloat16
    input_ids = _ids(PROMPT_LENGTH, ours.config.vocab_size)
    logits = ours.forward(input_ids, torch.arange(PROMPT_LENGTH, device=DEVICE)[None], ours.new_cache(1, 256),
                          torch.tensor([0], device=DEVICE))
    with torch.no_grad():
        reference = theirs(input_ids).logits.float()
    assert _rel_err(logits, reference) < BF16_REL_TOLERANCE


def test_decode_step_with_context_len_replays_from_a_cuda_graph(tiny_model_dir):
    model = load_model(tiny_model_dir, DEVICE)
    max_seq = PROMPT_LENGTH + DECODE_STEPS
    eager_cache, graph_cache = model.new_cache(1, max_seq), model.new_cache(1, max_seq)
    slot = torch.tensor([0], device=DEVICE)
    prompt = _ids(PROMPT_LENGTH, model.config.vocab_size)
    for cache in (eager_cache, graph_cache):
        model.forward(prompt, torch.arange(PROMPT_LENGTH, device=DEVICE)[None], cache, slot)

    token = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    position = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)

    def step() -> torch.Tensor:
        return model.forward(token, position, graph_cache, slot, last_only=True, context_len=max_seq)

    position.fill_(PROMPT_LENGTH)  # warm up on a side stream, writing the position the graph rewrites
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_logits = step()

    next_token = 3
    for offset in range(DECODE_STEPS):
        token.fill_(next_token)
        position.fill_(PROMPT_LENGTH + offset)
        graph.replay()
        eager = model.forward(token.clone(), position.clone(), eager_cache, slot, last_only=True)
        assert _rel_err(graph_logits, eager) < BF16_REL_TOLERANCE, f"step {offset}"
        next_token = int(eager.argmax())
