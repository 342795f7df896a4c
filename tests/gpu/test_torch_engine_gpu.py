"""TorchEngine and the sampler on CUDA: the same tokens as the reference loop, continuous batching,
seeded sampling that matches the CPU bit for bit (the noise is integer hashing), and the step's
host syncs (pinned, non-blocking index uploads; one copy of the sampled ids)."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.protocol import GenerateRequest, SamplingParams
from megaserve.replicas.sampling import SamplingRows, sample
from tests.gpu.reference import reference_greedy
from tests.model_factory import make_tiny_model

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEVICE = "cuda"
PROMPTS = [(5, 17, 99, 3, 42), (7,) * 13, tuple(range(100, 140)), (1, 2, 3)]
GENERATED = 24
SYNCS_PER_STEP = 1  # the sampled ids' tolist(); decode passes context_len, so no positions.max()


@pytest.fixture(scope="module")
def fp32_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fp32"), "llama", seed=11)


def _request(prompt, name, **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(name, prompt, SamplingParams(max_tokens=GENERATED, ignore_eos=True, **sampling))


async def _tokens(engine, request) -> list[int]:
    return [t async for item in engine.generate(request) for t in item.token_ids]


def test_cuda_engine_batches_and_matches_the_reference(fp32_model_dir):
    together, seeded_alone, seeded_batched = asyncio.run(_batched_and_seeded(fp32_model_dir))
    for prompt, tokens in zip(PROMPTS, together, strict=True):
        assert tokens == reference_greedy(fp32_model_dir, prompt, GENERATED)
    assert seeded_alone == seeded_batched


async def _batched_and_seeded(model_dir):
    engine = TorchEngine(model_dir, device=DEVICE, dtype=torch.float32, max_batch=4, model_name="gpu-tiny")
    try:
        together = await asyncio.gather(*(_tokens(engine, _request(p, f"r{i}")) for i, p in enumerate(PROMPTS)))
        seeded = _request(PROMPTS[0], "seeded", temperature=1.0, top_p=0.9, seed=7)
        seeded_alone = await _tokens(engine, seeded)
        seeded_batched = (await asyncio.gather(_tokens(engine, seeded), *(
            _tokens(engine, _request(p, f"n{i}", temperature=1.0)) for i, p in enumerate(PROMPTS[1:])
        )))[0]
    finally:
        await engine.shutdown()
    return together, seeded_alone, seeded_batched


def test_seeded_sampling_on_cuda_equals_the_cpu():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=100 + i) for i in range(8)]
    positions = torch.arange(8) * 3
    on_cpu = sample(logits, SamplingRows.build(params, 1000, "cpu"), positions)
    on_gpu = sample(logits.to(DEVICE), SamplingRows.build(params, 1000, DEVICE), positions.to(DEVICE))
    assert torch.equal(on_cpu, on_gpu.cpu())


def test_each_step_syncs_at_most_twice(fp32_model_dir):
    """CUDA's sync debug mode warns at every synchronizing call (from any thread): a step may only
    wait for the model's positions.max() and for the copy of the sampled ids."""
    syncs = asyncio.run(_synchronizations(fp32_model_dir))
    print(f"{len(syncs)} syncs over {GENERATED} steps:", *sorted(set(syncs)), sep="\n")
    assert len(syncs) <= SYNCS_PER_STEP * GENERATED  # admission (parameter uploads) adds none


async def _synchronizations(model_dir) -> list[str]:
    engine = TorchEngine(model_dir, device=DEVICE, dtype=torch.float32, max_batch=2, model_name="gpu-sync")
    try:
        await _tokens(engine, _request(PROMPTS[0], "warm-up"))
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await _tokens(engine, _request(PROMPTS[1], "counted"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        await engine.shutdown()
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]
