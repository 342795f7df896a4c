"""Every bad request gets an OpenAI-style 4xx error JSON, never a 500, and the server keeps serving."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from megaserve.monitoring.metrics import REJECTED_REQUESTS
from megaserve.replicas.protocol import MAX_LOGPROBS
from megaserve.router.backend import EngineBackend
from megaserve.router.openai_schema import MAX_MESSAGES, MAX_STOP_CHARS

from .conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
LEFT_CLIENT_SETTLE_SECONDS = 0.5


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": HI, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


BAD_REQUESTS = {
    "malformed JSON": (CHAT, b'{"model": ', 400, None),
    "not an object": (CHAT, b"[1, 2]", 400, None),
    "non-UTF-8 bytes": (COMPLETIONS, b'{"model": "megaserve-demo", "prompt": "\xff\xfe"}', 400, None),
    "model not a string": (CHAT, json.dumps({"model": 7, "messages": HI}).encode(), 400, "model"),
    "unknown model": (CHAT, chat(model="gpt-5"), 404, "model"),
    "messages not a list": (CHAT, chat(messages="hi"), 400, "messages"),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages"),
    "more messages than the limit": (CHAT, chat(messages=HI * (MAX_MESSAGES + 1)), 400, "messages"),
    "unknown role": (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role"),
    "image content": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content.0"),
    "max_tokens as a string": (CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    "max_tokens zero": (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    "max_completion_tokens negative": (CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    "max_tokens past the context": (CHAT, chat(max_tokens=2040), 400, "max_tokens"),
    "max_completion_tokens past the context": (CHAT, chat(max_completion_tokens=2040), 400, "max_completion_tokens"),
    "prompt past the context": (COMPLETIONS, completion(prompt="hello " * 3000), 400, "prompt"),
    "empty prompt": (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    "batch with an empty prompt": (COMPLETIONS, completion(prompt=[[1], []]), 400, "prompt.1"),
    "batch of prompts with an id outside the vocabulary": (COMPLETIONS, completion(prompt=[[1], [10**6]]), 400,
                                                           "prompt.1"),
    "token id outside the vocabulary": (COMPLETIONS, completion(prompt=[1, 2, 10**6]), 400, "prompt"),
    "negative prompt token id": (COMPLETIONS, completion(prompt=[1, -2]), 400, "prompt"),
    "negative stop token id": (COMPLETIONS, completion(stop_token_ids=[3, -1]), 400, "stop_token_ids.1"),
    "unknown service_tier": (CHAT, chat(service_tier="turbo"), 400, "service_tier"),
    "stream as a string": (CHAT, chat(stream="yes"), 400, "stream"),
    "temperature too high": (CHAT, chat(temperature=3), 400, "temperature"),
    "temperature NaN": (CHAT, chat(temperature=float("nan")), 400, "temperature"),  # json.dumps writes NaN
    "top_p zero": (CHAT, chat(top_p=0), 400, "top_p"),
    "seed past 64 bits": (CHAT, chat(seed=2**63), 400, "seed"),
    "seed below 64 bits": (COMPLETIONS, completion(seed=-(2**63) - 1), 400, "seed"),
    "n zero": (CHAT, chat(n=0), 400, "n"),
    "n above the limit": (CHAT, chat(n=99), 400, "n"),
    "empty stop string": (CHAT, chat(stop=[""]), 400, "stop"),
    "too many stop strings": (CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    "a stop string too long": (COMPLETIONS, completion(stop=["end", "x" * (MAX_STOP_CHARS + 1)]), 400, "stop"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs past the limit": (CHAT, chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), 400, "top_logprobs"),
    "logprobs as a string": (CHAT, chat(logprobs="true"), 400, "logprobs"),
    "legacy logprobs past the limit": (COMPLETIONS, completion(logprobs=MAX_LOGPROBS + 1), 400, "logprobs"),
    "legacy logprobs as a boolean": (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    "legacy logprobs negative": (COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
    "tools given": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "an assistant message's tool_calls": (CHAT, chat(messages=[*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
        "messages.1.tool_calls"),
    "a penalty as a boolean equal to its neutral 0": (CHAT, chat(frequency_penalty=False), 400, "frequency_penalty"),
    "best_of as a boolean equal to its neutral 1": (COMPLETIONS, completion(best_of=True), 400, "best_of"),
    "best_of as a float equal to its neutral 1": (COMPLETIONS, completion(best_of=1.0), 400, "best_of"),
    "echo as a number equal to its neutral false": (COMPLETIONS, completion(echo=0), 400, "echo"),
    "add_generation_prompt as a number equal to true": (CHAT, chat(add_generation_prompt=1), 400,
                                                        "add_generation_prompt"),
    "vLLM's repetition_penalty": (CHAT, chat(repetition_penalty=1.3), 400, "repetition_penalty"),
    "vLLM's min_tokens": (COMPLETIONS, completion(min_tokens=5), 400, "min_tokens"),
    "vLLM's guided_choice": (CHAT, chat(guided_choice=["yes", "no"]), 400, "guided_choice"),
    "vLLM's structured_outputs": (COMPLETIONS, completion(structured_outputs={"regex": "[0-9]+"}), 400,
                                  "structured_outputs"),
    "vLLM's logits_processors": (COMPLETIONS, completion(logits_processors=["x"]), 400, "logits_processors"),
    "vLLM's add_special_tokens off for a prompt": (COMPLETIONS, completion(add_special_tokens=False), 400,
                                                   "add_special_tokens"),
    "vLLM's add_special_tokens on for chat": (CHAT, chat(add_special_tokens=True), 400, "add_special_tokens"),
    "vLLM's chat_template": (CHAT, chat(chat_template="{{ messages[0]['content'] }}"), 400, "chat_template"),
    "vLLM's chat_template_kwargs": (CHAT, chat(chat_template_kwargs={"enable_thinking": False}), 400,
                                    "chat_template_kwargs"),
    "vLLM's add_generation_prompt off": (CHAT, chat(add_generation_prompt=False), 400, "add_generation_prompt"),
    "vLLM's continue_final_message on": (CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    "OpenAI's reasoning_effort": (CHAT, chat(reasoning_effort="low"), 400, "reasoning_effort"),
    "OpenAI's verbosity": (CHAT, chat(verbosity="low"), 400, "verbosity"),
    "OpenAI's legacy function_call": (CHAT, chat(function_call={"name": "f"}), 400, "function_call"),
    "vLLM's return_token_ids as a string": (COMPLETIONS, completion(return_token_ids="true"), 400, "return_token_ids"),
    "vLLM's mm_processor_kwargs": (CHAT, chat(mm_processor_kwargs={"num_crops": 4}), 400, "mm_processor_kwargs"),
    "vLLM's documents for a RAG template": (CHAT, chat(documents=[{"title": "t", "text": "x"}]), 400, "documents"),
    "SGLang's regex": (COMPLETIONS, completion(regex="[0-9]+"), 400, "regex"),
    "SGLang's stop_regex": (CHAT, chat(stop_regex=["[0-9]{3}"]), 400, "stop_regex"),
    "SGLang's ebnf": (COMPLETIONS, completion(ebnf='root ::= "a"'), 400, "ebnf"),
    "SGLang's json_schema": (CHAT, chat(json_schema="{}"), 400, "json_schema"),
    "SGLang's no_stop_trim as a string": (COMPLETIONS, completion(no_stop_trim="yes"), 400, "no_stop_trim"),
    "vLLM's skip_special_tokens as a number": (CHAT, chat(skip_special_tokens=0), 400, "skip_special_tokens"),
    "SGLang's lora_path": (CHAT, chat(lora_path="adapter"), 400, "lora_path"),
    "stream_options without stream": (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
}


@pytest.mark.parametrize("path, content, status, param", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_gets_an_openai_error(router_url, path, content, status, param):
    response = httpx.post(router_url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("field, ids", [("prompt", lambda last: [1, last, 2]), ("stop_token_ids", lambda last: [last])],
                         ids=["prompt", "stop_token_ids"])
def test_token_ids_up_to_the_vocabulary_s_last_are_served_and_the_next_is_a_400(router_url, tokenizer, field, ids):
    vocab = tokenizer.vocab_size
    served = httpx.post(router_url + COMPLETIONS, content=completion(max_tokens=1, **{field: ids(vocab - 1)}))
    assert served.status_code == 200, served.text
    refused = httpx.post(router_url + COMPLETIONS, content=completion(max_tokens=1, **{field: ids(vocab)}))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and f"token id {vocab} is outside the vocabulary (size {vocab})" in error["message"]


def test_context_errors_carry_openai_code(router_url):
    error = httpx.post(router_url + CHAT, content=chat(max_tokens=4000)).json()["error"]
    assert error["code"] == "context_length_exceeded" and "2048" in error["message"]


def test_an_unsupported_field_is_named_as_the_error_s_param_and_code(router_url):
    error = httpx.post(router_url + COMPLETIONS, content=completion(echo=True)).json()["error"]
    assert error == {"message": "`echo` is not supported by this server", "type": "invalid_request_error",
                     "param": "echo", "code": "unsupported_parameter"}


def test_a_switch_implemented_one_way_is_refused_the_other_way_saying_which(router_url):
    error = httpx.post(router_url + CHAT, content=chat(add_generation_prompt=False)).json()["error"]
    assert error == {"message": "`add_generation_prompt` is not supported by this server except as true",
                     "type": "invalid_request_error", "param": "add_generation_prompt",
                     "code": "unsupported_parameter"}


def test_a_stop_string_too_long_is_refused_with_its_length(router_url):
    error = httpx.post(router_url + COMPLETIONS, content=completion(stop="x" * (MAX_STOP_CHARS + 1))).json()["error"]
    assert f"at most {MAX_STOP_CHARS} characters, got {MAX_STOP_CHARS + 1}" in error["message"]
    assert httpx.post(router_url + COMPLETIONS, content=completion(stop="x" * MAX_STOP_CHARS, max_tokens=1)).status_code == 200


def test_neutral_values_of_refused_fields_are_served(router_url):
    for path, content in ((CHAT, chat(max_tokens=1, add_generation_prompt=True, continue_final_message=False,
                                      add_special_tokens=False, chat_template_kwargs={}, logits_processors=[],
                                      no_stop_trim=False, reasoning_effort=None, function_call="none",
                                      documents=[], stop_regex=[], return_token_ids=False,
                                      frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1)),
                          (COMPLETIONS, completion(max_tokens=1, add_special_tokens=True, regex=None))):
        response = httpx.post(router_url + path, content=content)
        assert response.status_code == 200, response.text


def test_unknown_fields_are_ignored_and_named_in_the_log_but_openai_s_no_effect_fields_are_not(router_url, caplog):
    with caplog.at_level(logging.WARNING, logger="megaserve.router.app"):
        response = httpx.post(router_url + CHAT, content=chat(max_tokens=1, metadata={"k": "v"}, store=False,
                                                              frobnicate=3, max_token=5))
    assert response.status_code == 200, response.text
    [line] = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert line.endswith("fields it does not know: 'frobnicate', 'max_token'"), line


def test_the_tokenizer_endpoints_log_only_the_fields_nobody_defines(router_url, caplog):
    with caplog.at_level(logging.WARNING, logger="megaserve.router.app"):
        response = httpx.post(f"{router_url}/tokenize", json={
            "messages": HI, "tools": None, "continue_final_message": False, "chat_template_kwargs": {},
            "return_token_strs": None, "frobnicate": 1})
    assert response.status_code == 200, response.text
    [line] = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert line.endswith("/tokenize: served without fields it does not know: 'frobnicate'"), line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaserve.router.app"):
        response = httpx.post(f"{router_url}/tokenize", json={"prompt": "hi", "tools": [{"type": "function"}]})
    assert response.status_code == 200, response.text  # a prompt's count has no template to change
    [line] = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert line.endswith("fields it does not know: 'tools'"), line


def test_the_log_of_unknown_fields_is_bounded_however_many_a_client_sends(router_url, caplog):
    with caplog.at_level(logging.WARNING, logger="megaserve.router.app"):
        fields = {f"{i:02d}" + "x" * 1000: i for i in range(50)}
        response = httpx.post(router_url + COMPLETIONS, content=completion(max_tokens=1, **fields))
    assert response.status_code == 200, response.text
    [line] = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert line.endswith(" and 42 more") and line.count("'07" + "x" * 62 + "'") == 1 and "'08" not in line, line


def test_unknown_tier_header_is_a_400(router_url):
    response = httpx.post(router_url + CHAT, content=chat(max_tokens=1), headers={"x-megaserve-tier": "fast"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-megaserve-tier"


def test_wrong_content_type_is_415(router_url):
    response = httpx.post(router_url + CHAT, content=chat(), headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]


def test_a_body_without_content_type_is_read_as_json(router_url):
    response = httpx.post(router_url + CHAT, content=chat(max_tokens=1), headers={"content-type": ""})
    assert response.status_code == 200


def test_huge_bodies_are_413_declared_or_chunked(router_url):
    huge = b"x" * (5 << 20)
    declared = httpx.post(router_url + COMPLETIONS, content=huge)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit must hold while reading
        for _ in range(5):
            yield b"x" * (1 << 20)

    chunked = httpx.post(router_url + COMPLETIONS, content=chunks())
    assert chunked.status_code == 413


def test_unknown_paths_and_methods_answer_in_openai_shape(router_url):
    missing = httpx.get(router_url + "/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(router_url + CHAT)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
    # no redirect that takes its address from the Host header, for the client to re-send the prompt to
    slash = httpx.post(router_url + CHAT + "/", content=chat(), headers={"Host": "elsewhere.example"})
    assert slash.status_code == 404 and "location" not in slash.headers


def test_refusals_are_counted_and_the_server_keeps_serving(router_url):
    invalid = REJECTED_REQUESTS.labels(model=MODEL, reason="invalid")
    before = invalid._value.get()
    for path, content, _, _ in BAD_REQUESTS.values():
        httpx.post(router_url + path, content=content)
    assert invalid._value.get() == before + len(BAD_REQUESTS)
    served = httpx.post(router_url + CHAT, content=chat(max_tokens=2))
    assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"]


BODY_TIMEOUT_SECONDS = 0.5


def test_a_body_slower_than_the_timeout_is_408_and_closes_the_connection(serve_router, engines):
    """A client that sends its headers and then its body too slowly (a slowloris) gets 408 once the
    body timeout has passed, and the connection is closed; one that sends it in time is served."""
    url = serve_router({tier: EngineBackend(e) for tier, e in engines.items()},
                       body_timeout_seconds=BODY_TIMEOUT_SECONDS)
    timeouts = REJECTED_REQUESTS.labels(model=MODEL, reason="timeout")
    before = timeouts._value.get()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10 * BODY_TIMEOUT_SECONDS) as sock:
        started = time.monotonic()  # before the router can see the headers and start its clock
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        answer = b""
        while chunk := sock.recv(65536):  # until the router closes the connection
            answer += chunk
        waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and "10 bytes" in error["message"], error
    assert BODY_TIMEOUT_SECONDS <= waited < 8 * BODY_TIMEOUT_SECONDS
    assert timeouts._value.get() == before + 1

    def slow_but_in_time():  # the body in three parts, well within the timeout in all
        content = chat(max_tokens=1)
        for part in (content[:5], content[5:20], content[20:]):
            time.sleep(BODY_TIMEOUT_SECONDS / 10)
            yield part

    served = httpx.post(url + CHAT, content=slow_but_in_time())
    assert served.status_code == 200, served.text


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(router_url, caplog):
    host, port = router_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
    with caplog.at_level(logging.ERROR):
        time.sleep(LEFT_CLIENT_SETTLE_SECONDS)  # the router sees the connection close
        assert httpx.get(f"{router_url}/v1/models").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
