"""Every dashboard query returns data from the real app on Ray Serve under a short real load."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import pytest

from megaserve.monitoring import dashboards
from tests.live import wait_until
from tests.prometheus_server import SCRAPE_INTERVAL_SECONDS

pytestmark = pytest.mark.integration

MODEL = "megaserve-demo"
# The whole load falls inside this window, however long the tests before this module ran.
RATE_WINDOW = "5m"
DATA_TIMEOUT_SECONDS = 30.0
FIRST_SCRAPE_TIMEOUT_SECONDS = 60.0
HOLD_TOKENS = 300
SHORT_TOKENS = 8
REQUESTS_PER_TIER = 3
# Prometheus' rate() needs a sample before an increase: a series first scraped at its final
# value shows no rate. The first round creates every series, the second one increments them.
ROUNDS = 2
PAUSE_SECONDS = 3 * SCRAPE_INTERVAL_SECONDS


def _queries() -> list:
    params = []
    for name, text in dashboards.render().items():
        for panel in json.loads(text)["panels"]:
            for target in panel.get("targets", []):
                params.append(pytest.param(target["expr"],
                                           id=f"{name}:{panel['title']}:{target['refId']}"))
    return params


async def _one_round(http: httpx.AsyncClient) -> None:
    """Both tiers, a spillover (the one latency replica held by a long stream), a rejection."""
    hold = {"model": MODEL, "prompt": "hold", "stream": True, "max_tokens": HOLD_TOKENS,
            "ignore_eos": True, "service_tier": "priority"}
    async with http.stream("POST", "/v1/completions", json=hold) as holder:
        assert holder.headers["x-megaserve-tier"] == "latency"
        lines = holder.aiter_lines()
        await anext(lines)
        spilled = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "spill", "max_tokens": SHORT_TOKENS,
            "service_tier": "priority"})
        assert spilled.headers["x-megaserve-tier"] == "throughput"
        async for _ in lines:
            pass
    invalid = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": 0})
    assert invalid.status_code == 400
    for tier in ("priority", "default") * REQUESTS_PER_TIER:
        done = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "load", "max_tokens": SHORT_TOKENS,
            "ignore_eos": True, "service_tier": tier})
        assert done.status_code == 200, done.text


async def _drive(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        for _ in range(ROUNDS):
            await _one_round(http)
            await asyncio.sleep(PAUSE_SECONDS)


@pytest.fixture(scope="module")
def loaded(live_stack):
    prometheus = live_stack.prometheus
    # Prometheus applies new targets a few seconds after it starts: load before its first scrape
    # would leave every series with a single value and no rate.
    wait_until(lambda: len(prometheus.query("up == 1")) == 2, FIRST_SCRAPE_TIMEOUT_SECONDS,
               "Prometheus' first scrape of the app's two metrics ports")
    asyncio.run(_drive(live_stack.base_url))
    return prometheus


@pytest.mark.parametrize("expr", _queries())
def test_panel_query_returns_data_from_the_live_app(loaded, expr):
    query = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", dashboards.MODEL_ALL)
    deadline = time.monotonic() + DATA_TIMEOUT_SECONDS
    while True:
        values = [float(sample["value"][1]) for sample in loaded.query(query)]
        if any(math.isfinite(v) for v in values):
            break
        assert time.monotonic() < deadline, f"no data for {query}"
        time.sleep(1.0)
    assert all(v >= 0 for v in values if math.isfinite(v))


def test_model_variable_lists_the_served_model(loaded):
    for text in dashboards.render().values():
        (variable,) = [v for v in json.loads(text)["templating"]["list"] if v["name"] == "model"]
        # Grafana's label_values(metric, label) is the label's values over the metric's series.
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]).groups()
        values = {sample["metric"][label] for sample in loaded.query(f"count by ({label}) ({metric})")}
        assert values == {MODEL}
