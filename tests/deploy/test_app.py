"""The whole product on a real Ray Serve app (demo model, CPU), driven by the real OpenAI SDK,
scraped by a real Prometheus."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "megaserve-demo"
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(live_stack):
    return openai.OpenAI(base_url=live_stack.openai_base_url, api_key="unused", max_retries=0)


@pytest.fixture
def aclient(live_stack):
    return openai.AsyncOpenAI(base_url=live_stack.openai_base_url, api_key="unused",
                              max_retries=0)


def _chat(tier: str, **kwargs):
    return dict(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                service_tier=tier, **kwargs)


@pytest.mark.parametrize("service_tier, tier", [("priority", "latency"), ("default", "throughput")])
def test_streamed_chat_completion_from_each_tier_echoes_the_tier(client, service_tier, tier):
    raw = client.chat.completions.with_raw_response.create(
        **_chat(service_tier, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert raw.headers["x-megaserve-tier"] == tier
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish and finish[-1] in ("stop", "length")
    assert usage.completion_tokens >= 1 and usage.prompt_tokens > 0
    assert {c.service_tier for c in chunks} == {service_tier}
    whole = client.chat.completions.create(**_chat(service_tier, max_tokens=12, temperature=0))
    assert text == whole.choices[0].message.content  # the chunks add up to the greedy answer
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("service_tier, tier", [("priority", "latency"), ("flex", "throughput")])
def test_non_streamed_completion_from_each_tier(client, service_tier, tier):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
        extra_body={"service_tier": service_tier, "ignore_eos": True},
    )
    assert raw.headers["x-megaserve-tier"] == tier
    completion = raw.parse()
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"


def test_greedy_is_identical_on_both_tiers(client):
    texts = {
        tier: client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0,
                                        extra_body={"service_tier": tier, "ignore_eos": True})
        .choices[0].text
        for tier in ("priority", "default")
    }
    assert texts["priority"] == texts["default"]


def test_models_endpoint_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_serve_s_proxy_hands_a_browser_s_preflight_to_the_router(live_stack):
    origin = "https://chat.example.com"  # the live app's cors_allowed_origins (tests/conftest.py)
    preflight = httpx.options(live_stack.openai_base_url + "/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin


async def _hold_latency_replica(aclient, started: asyncio.Event):
    stream = await aclient.chat.completions.create(**_chat("priority", stream=True, **LONG))
    async for _ in stream:
        started.set()
    return True


async def test_busy_latency_tier_spills_over_to_throughput(aclient, live_stack):
    started = asyncio.Event()
    holder = asyncio.create_task(_hold_latency_replica(aclient, started))
    await asyncio.wait_for(started.wait(), 60)
    raw = await aclient.chat.completions.with_raw_response.create(
        **_chat("priority", max_tokens=4))
    assert raw.headers["x-megaserve-tier"] == "throughput"
    assert await asyncio.wait_for(holder, 120)


async def test_saturated_tiers_answer_429_with_retry_after(live_stack):
    async with httpx.AsyncClient(base_url=live_stack.base_url, timeout=120) as http:
        # Long enough to outlast the three spillover waits below on a fast CPU (~2 ms a token).
        body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 1000,
                "ignore_eos": True}
        # capacity: 1 latency slot + 2 throughput slots; hold all three, then ask once more.
        holders = []
        for _ in range(3):
            request = http.build_request("POST", "/v1/completions", json=body)
            response = await http.send(request, stream=True)
            assert response.status_code == 200
            holders.append(response)
        refused = await http.post("/v1/completions", json={**body, "stream": False,
                                                            "max_tokens": 2})
        for response in holders:
            await response.aclose()
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) == 2
    assert refused.json()["error"]["type"]


SLOT_FREED_SECONDS = 10.0  # how long the router may take to give a departed client's slot back


async def _wait_for_free_latency_slots(base_url: str) -> None:
    """Until the router holds no latency slot (polled: a fixed sleep is too short on a loaded machine)."""
    deadline = time.monotonic() + SLOT_FREED_SECONDS
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        while (await http.get("/health")).json()["tiers"]["latency"]["in_flight"] != 0:
            assert time.monotonic() < deadline, "the latency slot was not given back"
            await asyncio.sleep(0.05)


async def test_client_disconnect_frees_the_latency_replica(aclient, live_stack):
    async with httpx.AsyncClient(base_url=live_stack.base_url, timeout=120) as http:
        body = {"model": MODEL, "prompt": "x", "stream": True, "service_tier": "priority",
                "max_tokens": 1000, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["x-megaserve-tier"] == "latency"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        # The stream is closed: the replica must stop decoding at once, so a new priority
        # request is served by the latency tier instead of spilling over.
        await _wait_for_free_latency_slots(live_stack.base_url)
        raw = await aclient.completions.with_raw_response.create(
            model=MODEL, prompt="y", max_tokens=2, extra_body={"service_tier": "priority"})
        assert raw.headers["x-megaserve-tier"] == "latency"


async def test_client_leaving_a_non_streamed_request_frees_the_latency_slot(aclient, live_stack):
    """The router gives back the slot of a client that left before its answer was ready, so the
    next priority request is served by the latency tier instead of spilling over."""
    timeout = httpx.Timeout(120, read=0.5)  # far shorter than 1,000 tokens take on the CPU
    async with httpx.AsyncClient(base_url=live_stack.base_url, timeout=timeout) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000,
                                                     "service_tier": "priority", "ignore_eos": True})
    await _wait_for_free_latency_slots(live_stack.base_url)
    raw = await aclient.completions.with_raw_response.create(
        model=MODEL, prompt="y", max_tokens=2, extra_body={"service_tier": "priority"})
    assert raw.headers["x-megaserve-tier"] == "latency"


@pytest.mark.parametrize("content, headers, status", [
    (b"{not json", {"content-type": "application/json"}, 400),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), {}, 400),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), {}, 404),
    (json.dumps({"model": MODEL, "messages": []}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 0}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 10**6}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "prompt": "word " * 5000}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "service_tier": "turbo"}).encode(), {}, 400),
    (b'{"model": "megaserve-demo", "prompt": "\xff\xfe"}', {}, 400),
    (b"x" * (5 << 20), {}, 413),  # over the 4 MiB default limit
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(live_stack, client,
                                                                     content, headers, status):
    path = "/v1/completions" if b'"prompt"' in content else "/v1/chat/completions"
    response = httpx.post(live_stack.base_url + path, content=content,
                          headers={"content-type": "application/json", **headers}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


def test_prometheus_holds_step_histograms_from_both_tiers_and_routing_counters(live_stack, client):
    for tier in ("priority", "default"):
        client.completions.create(model=MODEL, prompt="metrics", max_tokens=4,
                                  extra_body={"service_tier": tier})
    prometheus = live_stack.prometheus

    def phases_by_tier():
        result = prometheus.query(
            'sum by (tier, phase) (megaserve_step_duration_seconds_count{model="%s"})' % MODEL)
        return {(r["metric"]["tier"], r["metric"]["phase"]) for r in result}

    deadline = time.monotonic() + 30
    while not {("latency", "decode"), ("throughput", "decode"), ("latency", "prefill"),
               ("throughput", "prefill")} <= phases_by_tier():
        assert time.monotonic() < deadline, phases_by_tier()
        time.sleep(1)
    routed = prometheus.query("sum by (tier, reason) (megaserve_routed_requests_total)")
    assert {r["metric"]["tier"] for r in routed} == {"latency", "throughput"}
    ttft = prometheus.query("megaserve_time_to_first_token_seconds_count")
    assert ttft and sum(float(r["value"][1]) for r in ttft) > 0


async def test_a_replica_dying_mid_stream_ends_it_with_an_error_event(live_stack):
    import ray

    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if "LatencyReplica" in a["name"]]
    async with httpx.AsyncClient(base_url=live_stack.base_url, timeout=120) as http:
        body = {"model": MODEL, "prompt": "x", "stream": True, "service_tier": "priority",
                "max_tokens": 1000, "ignore_eos": True}
        events = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["x-megaserve-tier"] == "latency"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
        assert events[-1] == "[DONE]"  # after the error event, as after any stream
        error = json.loads(events[-2])["error"]
        # the cause (Ray's actor death) is for the router's log; the client is told to retry, and the id
        assert "replica that took the request stopped" in error["message"] and error["type"]
        assert f"request id {json.loads(events[0])['id']}" in error["message"]
        # Serve replaces the replica; the latency tier serves again (later tests need it).
        deadline = time.monotonic() + 120
        while True:
            answer = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "y", "max_tokens": 1, "service_tier": "priority"})
            if answer.status_code == 200 and answer.headers["x-megaserve-tier"] == "latency":
                break
            assert time.monotonic() < deadline, answer.text
            await asyncio.sleep(1)
