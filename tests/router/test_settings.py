"""Router replicas' shares of the tiers' capacities (RouterSettings.for_router)."""

from __future__ import annotations

import pytest

from megaserve.router.settings import RouterSettings, router_share


@pytest.mark.parametrize("total, routers, shares", [
    (3, 2, [2, 1]),  # uneven: the remainder to the lowest ranks, never 2 + 2 for 3 batch-1 replicas
    (4, 2, [2, 2]),
    (64, 3, [22, 21, 21]),
    (1, 2, [1, 1]),  # fewer slots than routers: each router keeps one, to use every tier
    (0, 2, [0, 0]),
])
def test_routers_share_a_tier_without_admitting_more_than_it_runs(total, routers, shares):
    assert [router_share(total, routers, rank) for rank in range(routers)] == shares
    if total >= routers:
        assert sum(shares) == total


def test_a_rank_past_the_count_shares_like_its_slot():
    assert router_share(3, 2, 2) == router_share(3, 2, 0) == 2


@pytest.mark.parametrize("routers, rank", [(0, 0), (2, -1)])
def test_a_share_of_nonsense_is_refused(routers, rank):
    with pytest.raises(ValueError, match="routers >= 1 and rank >= 0"):
        router_share(3, routers, rank)


def test_for_router_takes_its_share_of_both_tiers_and_keeps_the_rest():
    whole = RouterSettings(model_name="m", model_dir="unused", max_context=2048, latency_capacity=3,
                           throughput_capacity=5, latency_replicas=3, throughput_replicas=1)
    first, second = whole.for_router(0, 2), whole.for_router(1, 2)
    assert (first.latency_capacity, first.throughput_capacity) == (2, 3)
    assert (second.latency_capacity, second.throughput_capacity) == (1, 2)
    assert first.latency_replicas == 3 and first.model_name == "m"  # what the shares count stays
