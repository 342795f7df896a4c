"""The real OpenAI Python SDK against the router (uvicorn on 127.0.0.1, real engines)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from megaserve.router.backend import EngineBackend

from .conftest import MODEL

API_KEY = "sk-test"
THROUGHPUT_SLOTS = 4  # conftest's throughput_capacity: all of them at once, none refused


@pytest.fixture
def client(serve_router, engines) -> openai.OpenAI:
    url = serve_router({tier: EngineBackend(engine) for tier, engine in engines.items()}, api_keys=(API_KEY,))
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def test_chat_streaming_with_usage_and_the_tier(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=6, stream=True, stream_options={"include_usage": True}, service_tier="priority",
        temperature=0, extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-megaserve-tier"] == "latency"
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].timing["time_to_first_token_seconds"] > 0  # the extension field survives
    assert {chunk.service_tier for chunk in chunks} == {"priority"}


def test_completion_and_models(client):
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                           extra_body={"service_tier": "flex", "ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    assert completion.service_tier == "flex"
    assert [model.id for model in client.models.list()] == [MODEL]


def test_a_batch_of_prompts(client):
    completion = client.completions.create(model=MODEL, prompt=["Once upon a time", "The quick brown fox"],
                                           max_tokens=3, n=2, temperature=0, extra_body={"ignore_eos": True})
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    texts = [choice.text for choice in completion.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's two choices agree
    assert completion.usage.completion_tokens == 4 * 3


def test_vllm_s_text_and_id_extensions_through_extra_body(client):
    """As vLLM's users send them: the SDK keeps the answer's extra fields as attributes."""
    completion = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0, stop=["xo"],
        extra_body={"ignore_eos": True, "return_token_ids": True, "include_stop_str_in_output": True})
    choice = completion.choices[0]
    assert choice.text == "oxo" and choice.finish_reason == "stop"  # the demo model's greedy "ox", "ox", ...
    assert len(choice.token_ids) == completion.usage.completion_tokens == 2
    assert len(choice.prompt_token_ids) == completion.usage.prompt_tokens


def test_logprobs_parse_into_the_sdk_s_types(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert [len(entry.top_logprobs) for entry in content] == [2, 2, 2]
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0,
                                           logprobs=1, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text and len(logprobs.token_logprobs) == 3
    assert all(logprobs.tokens[i] in top for i, top in enumerate(logprobs.top_logprobs))


def test_sdk_exceptions_for_refusals(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert bad.value.code == "context_length_exceeded"
    wrong_key = openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


async def test_async_client_concurrent_requests(serve_router, engines):
    url = serve_router({tier: EngineBackend(engine) for tier, engine in engines.items()},
                       throughput_capacity=THROUGHPUT_SLOTS)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    completions = await asyncio.gather(*[
        client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=3,
                                 extra_body={"service_tier": "default", "ignore_eos": True})
        for i in range(THROUGHPUT_SLOTS)
    ])
    assert [c.usage.completion_tokens for c in completions] == [3] * THROUGHPUT_SLOTS
    assert len({c.id for c in completions}) == THROUGHPUT_SLOTS
    await client.close()
