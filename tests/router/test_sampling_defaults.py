"""Where a request leaves temperature, top_p or top_k out, it samples as the model's
generation_config.json recommends (vLLM's default), else with OpenAI's defaults."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncGenerator

import httpx
import pytest

from megaserve.replicas.protocol import FinishReason, GenerateRequest, StepOutput, Tier
from megaserve.router.settings import OPENAI_SAMPLING_DEFAULTS, sampling_defaults

from megaserve.router.app import create_app

from .conftest import MODEL, router_settings, serving

QWEN3_RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


class RecordingBackend:
    """Answers one token and keeps the requests it got."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StepOutput, None]:
        self.requests.append(request)
        yield StepOutput([5], [0.001], FinishReason.LENGTH)

    async def healthy_replicas(self) -> int:
        return 1


@pytest.mark.parametrize(("generation_config", "expected"), [
    ({"eos_token_id": 2} | QWEN3_RECOMMENDED, QWEN3_RECOMMENDED),
    ({"temperature": 0.7}, OPENAI_SAMPLING_DEFAULTS | {"temperature": 0.7}),
    ({"temperature": 9.0, "top_p": 0, "top_k": 2.5}, OPENAI_SAMPLING_DEFAULTS),  # out of range, not an int
    ({"temperature": True}, OPENAI_SAMPLING_DEFAULTS),
    (None, OPENAI_SAMPLING_DEFAULTS),  # no file
])
def test_the_model_s_recommended_sampling_is_read_with_openai_s_as_fallback(tmp_path, generation_config, expected):
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    assert sampling_defaults(str(tmp_path)) == expected


def test_a_request_samples_as_the_model_recommends_unless_it_says_otherwise(demo_model_dir, tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(demo_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(config | QWEN3_RECOMMENDED))
    backend = RecordingBackend()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "service_tier": "priority"}
    with serving(create_app(router_settings(str(model_dir)), {Tier.LATENCY: backend}, tokenizer)) as url:
        for body in (chat, chat | {"temperature": 1.2, "top_p": 0.5, "top_k": -1}):
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    recommended, explicit = (request.sampling for request in backend.requests)
    assert (recommended.temperature, recommended.top_p, recommended.top_k) == (0.6, 0.95, 20)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.2, 0.5, 0)
