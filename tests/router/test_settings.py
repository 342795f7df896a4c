"""Router settings: replicas' shares of the tiers' capacities (router_share), and what the settings refuse."""

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
    computed = [router_share(total, routers, rank) for rank in range(routers)]
    assert computed == shares
    if total >= routers:  # together the routers admit exactly what the tier runs
        assert sum(computed) == total


@pytest.mark.parametrize("routers, rank", [(0, 0), (2, -1)])
def test_a_share_of_nonsense_is_refused(routers, rank):
    with pytest.raises(ValueError, match="routers >= 1 and rank >= 0"):
        router_share(3, routers, rank)


def test_the_api_keys_stay_out_of_the_settings_repr():
    """Settings travel through Serve (logs of a failed replica start print its arguments)."""
    settings = RouterSettings(model_name="m", model_dir="/models/m", max_context=16, latency_capacity=1,
                              throughput_capacity=1, api_keys=("sk-secret-key",))
    assert "sk-secret-key" not in repr(settings) and settings.api_keys == ("sk-secret-key",)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_body_timeout_that_is_not_positive_is_refused(seconds):
    with pytest.raises(ValueError, match="body_timeout_seconds must be positive"):
        RouterSettings(model_name="m", model_dir="/models/m", max_context=16, latency_capacity=1,
                       throughput_capacity=1, body_timeout_seconds=seconds)
