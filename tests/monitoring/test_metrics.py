"""The router's counters and histograms exist at zero for every label set from the start, so that
Prometheus' rate() and increase() count their first increments and observations; its queue depths
too, so that an empty queue reads 0."""

from __future__ import annotations

import pytest

from megaserve.monitoring.metrics import (
    BUSY_REPLICAS,
    FINISH_REASONS,
    FINISHED_REQUESTS,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    PROMPT_TOKENS,
    QUEUE_DEPTH,
    REJECTED_REQUESTS,
    REJECTION_REASONS,
    ROUTE_REASONS,
    ROUTED_REQUESTS,
    REQUEST_DURATION,
    RUNNING_REQUESTS,
    TIME_TO_FIRST_TOKEN,
    start_router_series,
)

MODEL = "series-at-start"
TIERS = ("latency", "throughput")


def _totals(counter) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for m in counter.collect() for s in m.samples
            if s.name.endswith("_total") and s.labels.get("model") == MODEL}


def test_every_label_set_of_the_router_counters_starts_at_zero():
    start_router_series(MODEL, TIERS)
    expected = {
        PROMPT_TOKENS: [{"tier": t} for t in TIERS],
        GENERATION_TOKENS: [{"tier": t} for t in TIERS],
        ROUTED_REQUESTS: [{"tier": t, "reason": r} for t in TIERS for r in ROUTE_REASONS],
        FINISHED_REQUESTS: [{"tier": t, "finish_reason": r} for t in TIERS for r in FINISH_REASONS],
        REJECTED_REQUESTS: [{"reason": r} for r in REJECTION_REASONS],
    }
    for counter, label_sets in expected.items():
        totals = _totals(counter)
        assert set(totals) == {tuple(sorted((labels | {"model": MODEL}).items())) for labels in label_sets}
        assert set(totals.values()) == {0.0}


def test_every_label_set_of_the_router_histograms_starts_at_zero():
    start_router_series(MODEL, TIERS)
    for histogram in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, REQUEST_DURATION):
        counts = {s.labels["tier"]: s.value for m in histogram.collect() for s in m.samples
                  if s.name.endswith("_count") and s.labels.get("model") == MODEL}
        assert counts == {tier: 0.0 for tier in TIERS}, histogram


@pytest.mark.parametrize("gauge", [QUEUE_DEPTH, RUNNING_REQUESTS, BUSY_REPLICAS], ids=lambda g: g._name)
def test_every_tier_s_gauges_read_zero_from_the_router_s_start(gauge):
    # Summed over live processes: with no replica alive (all restarting) the router's 0 remains.
    start_router_series(MODEL, TIERS)
    values = {s.labels["tier"]: s.value for m in gauge.collect() for s in m.samples if s.labels.get("model") == MODEL}
    assert values == {tier: 0.0 for tier in TIERS}


def test_the_label_values_are_every_one_the_router_uses():
    """A reason added to the router but not to these constants would start without its zero."""
    import re
    from pathlib import Path

    from megaserve.replicas.protocol import FinishReason
    from megaserve.router import generation

    router = Path(generation.__file__).parent
    text = "\n".join(path.read_text() for path in router.glob("*.py"))
    assert set(re.findall(r'Route\(.*, "(\w+)"\)', text)) == set(ROUTE_REASONS)  # one call per line
    rejections = re.findall(r'reason: str = "(\w+)"|reason="(\w+)"', text)  # the default, and each given
    assert {value for pair in rejections for value in pair if value} == set(REJECTION_REASONS)
    assert {reason.value for reason in FinishReason} | {generation.CANCELLED, generation.FAILED} == set(FINISH_REASONS)
