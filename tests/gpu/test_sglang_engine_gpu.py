"""SGLangEngine on a real `sglang.Engine` (pip install 'megaserve[sglang]') and a CUDA GPU: greedy
tokens equal to the reference forward's, the yield rule, abort on client disconnect, health, shutdown.

Skipped without SGLang or CUDA. SGLang's CUDA wheels (and their CUDA torch) are not installed on
this project's CI or GPU machines, so this has not been run there; tests/replicas/engines/
test_sglang_api.py checks the same calls against the pinned release's source instead. Run it in a
pytest process of its own: SGLang's shutdown ends every child process of the process that started
it (a Serve replica is a process of its own).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Checked before any other import: GPU machines without SGLang may lack the test extras too.
if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
    pytest.skip("needs SGLang and a CUDA GPU", allow_module_level=True)

import pytest_asyncio  # noqa: E402

from megaserve.replicas.engines.sglang_engine import SGLangEngine  # noqa: E402
from megaserve.replicas.protocol import CoalescePolicy, FinishReason, GenerateRequest, SamplingParams  # noqa: E402
from tests.gpu.reference import reference_greedy  # noqa: E402
from tests.model_factory import make_tiny_model  # noqa: E402

DEVICE = "cuda"
# head_dim 64, GQA 4: a shape SGLang's kernels take. Float32 weights, run in float32 with SGLang's
# PyTorch attention, so that greedy tokens can be compared exactly with the float32 reference.
INIT_GAIN = 1.6  # initializer_range = INIT_GAIN / sqrt(hidden): sharp attention (see conftest.py)
HIDDEN = 256
SHAPE = {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 64, "initializer_range": INIT_GAIN / HIDDEN**0.5}
SGLANG_ARGS = {"attention_backend": "torch_native", "mem_fraction_static": 0.3}
PROMPT = (5, 17, 99, 3, 42)
GENERATED = 12
LONG = 400  # tokens: long enough to still be running when the client leaves
# One SGLang for the module, on one event loop: its TokenizerManager stays on the loop it first ran on.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-sglang"), "llama", seed=3, **SHAPE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    engine = SGLangEngine(model_dir, max_seq=512, max_batch=8, dtype="float32", engine_args=SGLANG_ARGS,
                          coalesce=CoalescePolicy(seconds=0.005, tokens=4), model_name="tiny-sglang")
    yield engine
    await engine.shutdown()


def _request(name: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(name, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def test_greedy_tokens_match_the_reference_and_follow_the_yield_rule(engine, model_dir):
    items = [item async for item in engine.generate(_request("greedy", GENERATED))]
    assert len(items[0].token_ids) == 1
    assert all(len(item.token_ids) <= 4 for item in items)
    assert [t for item in items for t in item.token_ids] == reference_greedy(model_dir, PROMPT, GENERATED)
    assert items[-1].finish_reason == FinishReason.LENGTH and items[-1].prompt_tokens == len(PROMPT)


async def test_a_client_that_leaves_frees_sglang_for_the_next_request(engine):
    stream = engine.generate(_request("leaves", LONG))
    await anext(stream)
    await stream.aclose()
    assert (await engine.health()).running_requests == 0
    items = [item async for item in engine.generate(_request("next", GENERATED))]
    assert items[-1].finish_reason == FinishReason.LENGTH


async def test_health_generates_one_token(engine):
    health = await engine.health()
    assert health.healthy, health.detail
