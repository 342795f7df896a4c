"""Tier choice precedence, FIFO slot counting, spillover and refusals, over real engines."""

from __future__ import annotations

import asyncio

import pytest

from megaserve.monitoring.metrics import QUEUE_DEPTH, ROUTED_REQUESTS
from megaserve.replicas.engines.torch_engine import TorchEngine
from megaserve.replicas.protocol import Tier
from megaserve.router.backend import EngineBackend
from megaserve.router.errors import APIError
from megaserve.router.policy import Admission, Lease, Route, TierSlots, choose_tier
from megaserve.router.settings import RouterSettings

MODEL = "policy-test"


def settings(**overrides) -> RouterSettings:
    values = dict(model_name=MODEL, model_dir="unused", max_context=2048, latency_capacity=1,
                  throughput_capacity=2, latency_max_prompt_tokens=100, latency_wait_seconds=0.05,
                  retry_after_seconds=3)
    return RouterSettings(**(values | overrides))


@pytest.mark.parametrize("service_tier, header, prompt, n, expected", [
    ("priority", "throughput", 10, 1, Route(Tier.LATENCY, "requested")),
    ("default", "latency", 10, 1, Route(Tier.THROUGHPUT, "requested")),
    ("flex", None, 10, 1, Route(Tier.THROUGHPUT, "requested")),
    ("fast", "throughput", 10, 1, Route(Tier.LATENCY, "requested")),  # OpenAI's alias of priority
    ("scale", "latency", 10, 1, Route(Tier.THROUGHPUT, "requested")),
    ("auto", "throughput", 10, 1, Route(Tier.THROUGHPUT, "header")),
    (None, " Latency ", 500, 4, Route(Tier.LATENCY, "header")),
    ("auto", None, 10, 2, Route(Tier.THROUGHPUT, "n")),
    (None, None, 101, 1, Route(Tier.THROUGHPUT, "prompt_length")),
    (None, None, 100, 1, Route(Tier.LATENCY, "policy")),
])
def test_body_beats_header_beats_policy(service_tier, header, prompt, n, expected):
    assert choose_tier(settings(), service_tier, header, prompt, n) == expected


def test_unknown_tier_header_is_a_400():
    with pytest.raises(APIError) as caught:
        choose_tier(settings(), None, "fastest", 10, 1)
    assert caught.value.status == 400 and caught.value.param == "x-megaserve-tier"
    assert "'fastest'" in caught.value.message


def test_a_long_unknown_tier_header_is_not_echoed_whole():
    with pytest.raises(APIError) as caught:
        choose_tier(settings(), None, "x" * 60_000, 10, 1)
    assert caught.value.status == 400 and len(caught.value.message) < 200
    assert caught.value.message.endswith("'x" + "x" * 63 + "'...")


async def test_slots_are_granted_in_arrival_order_and_a_timeout_gives_nothing():
    slots = TierSlots(capacity=2)
    assert slots.take_now(2)
    big = asyncio.create_task(slots.wait_for(2, wait_seconds=5))
    small = asyncio.create_task(slots.wait_for(1, wait_seconds=5))
    await asyncio.sleep(0.01)
    slots.give_back(1)  # one free slot: `small` fits but must not pass `big`, which came first
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done()
    slots.give_back(1)
    assert await big and not small.done()
    assert slots.in_flight == 2
    assert not slots.take_now(1)  # `small` waits, so a newcomer may not barge in
    slots.give_back(2)
    assert await small and slots.in_flight == 1
    assert not await slots.wait_for(2, wait_seconds=0.02) and slots.in_flight == 1


async def test_a_newcomer_may_not_take_free_slots_while_an_earlier_request_waits():
    """Capacity 3, two slots held, a request for 2 waits: one slot is free, but it is the waiter's
    to take once the next comes back, so a newcomer for 1 is refused rather than served first."""
    slots = TierSlots(capacity=3)
    assert slots.take_now(2)
    waiter = asyncio.create_task(slots.wait_for(2, wait_seconds=5))
    await asyncio.sleep(0.01)
    assert not waiter.done() and slots.in_flight == 2  # one slot free, the waiter needs two
    assert not slots.take_now(1)
    assert slots.in_flight == 2
    slots.give_back(1)
    assert await asyncio.wait_for(waiter, 1) and slots.in_flight == 3


async def test_a_waiter_cancelled_while_queued_leaves_no_trace():
    slots = TierSlots(capacity=1)
    assert slots.take_now(1)
    waiter = asyncio.create_task(slots.wait_for(1, wait_seconds=5))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slots.give_back(1)
    assert slots.in_flight == 0 and slots.take_now(1)


def backends(engines) -> dict[Tier, EngineBackend]:
    return {tier: EngineBackend(engine) for tier, engine in engines.items()}


def routed(tier: Tier, reason: str) -> float:
    return ROUTED_REQUESTS.labels(tier=tier.value, model=MODEL, reason=reason)._value.get()


async def test_full_latency_tier_waits_then_spills_over(engines):
    admission = Admission(settings(), backends(engines))
    held = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    assert held.tier is Tier.LATENCY
    before = routed(Tier.THROUGHPUT, "spillover")
    waiting = asyncio.create_task(admission.admit(Route(Tier.LATENCY, "requested"), 1))
    await asyncio.sleep(0.01)
    assert QUEUE_DEPTH.labels(tier="latency", model=MODEL)._value.get() == 1
    spilled = await waiting
    assert spilled.route == Route(Tier.THROUGHPUT, "spillover")
    assert routed(Tier.THROUGHPUT, "spillover") == before + 1
    assert QUEUE_DEPTH.labels(tier="latency", model=MODEL)._value.get() == 0


async def test_a_slot_freed_within_the_wait_keeps_the_request_on_latency(engines):
    admission = Admission(settings(latency_wait_seconds=5), backends(engines))
    held = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    waiting = asyncio.create_task(admission.admit(Route(Tier.LATENCY, "policy"), 1))
    await asyncio.sleep(0.01)
    held.release()
    held.release()  # releasing twice gives back one slot, not two
    assert (await waiting).tier is Tier.LATENCY
    assert admission.slots[Tier.LATENCY].in_flight == 1


async def test_both_tiers_full_is_429_with_retry_after(engines):
    admission = Admission(settings(), backends(engines))
    leases = [await admission.admit(Route(Tier.LATENCY, "policy"), 1),
              await admission.admit(Route(Tier.THROUGHPUT, "policy"), 2)]
    for route in (Route(Tier.LATENCY, "policy"), Route(Tier.THROUGHPUT, "requested")):
        with pytest.raises(APIError) as caught:
            await admission.admit(route, 1)
        assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "3"}
        assert caught.value.reason == "saturated"
    for lease in leases:
        lease.release()


async def test_without_spillover_a_full_latency_tier_is_429(engines):
    admission = Admission(settings(spillover=False), backends(engines))
    lease = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    with pytest.raises(APIError) as caught:
        await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    assert caught.value.status == 429 and "latency" in caught.value.message
    lease.release()


async def test_a_tier_without_healthy_replicas_is_503_or_spilled(demo_model_dir, engines):
    stopped = TorchEngine(demo_model_dir)
    await stopped.shutdown()
    dead_latency = {Tier.LATENCY: EngineBackend(stopped), Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])}
    spilled = await Admission(settings(), dead_latency).admit(Route(Tier.LATENCY, "policy"), 1)
    assert spilled.route.reason == "spillover"
    with pytest.raises(APIError) as caught:
        await Admission(settings(spillover=False), dead_latency).admit(Route(Tier.LATENCY, "policy"), 1)
    assert caught.value.status == 503 and caught.value.headers["Retry-After"] == "3"
    dead_throughput = {Tier.LATENCY: EngineBackend(engines[Tier.LATENCY]), Tier.THROUGHPUT: EngineBackend(stopped)}
    admission = Admission(settings(), dead_throughput)
    lease = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    with pytest.raises(APIError) as caught:  # latency is only busy, and there is nowhere to spill over to
        await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    assert caught.value.status == 429 and "latency tier is at capacity" in caught.value.message
    lease.release()
    only_dead = {Tier.THROUGHPUT: EngineBackend(stopped)}
    with pytest.raises(APIError) as caught:
        await Admission(settings(), only_dead).admit(Route(Tier.THROUGHPUT, "policy"), 1)
    assert caught.value.status == 503 and caught.value.reason == "unavailable"



async def test_a_one_tier_deployment_serves_everything_on_its_tier_and_is_429_when_full(engines):
    for tier, other in ((Tier.LATENCY, Tier.THROUGHPUT), (Tier.THROUGHPUT, Tier.LATENCY)):
        only = {tier: EngineBackend(engines[tier])}
        admission = Admission(settings(spillover=False, **{f"{other.value}_capacity": 0}), only)
        leases = [await admission.admit(Route(other, "requested"), 1)]
        assert leases[0].route == Route(tier, "only_tier")
        while admission.slots[tier].take_now(1):  # fill the tier
            leases.append(Lease(admission.slots[tier], 1, Route(tier, "policy")))
        for route in (Route(tier, "policy"), Route(other, "requested")):
            with pytest.raises(APIError) as caught:
                await admission.admit(route, 1)
            assert caught.value.status == 429 and tier.value in caught.value.message
        for lease in leases:
            lease.release()


async def test_more_choices_than_the_tier_ever_runs_at_once_is_a_400_not_a_429(engines):
    admission = Admission(settings(), backends(engines))
    for route in (Route(Tier.THROUGHPUT, "n"), Route(Tier.LATENCY, "header")):  # the latter spills over
        with pytest.raises(APIError) as caught:
            await admission.admit(route, 3)
        assert caught.value.status == 400 and caught.value.param == "n"
        assert "throughput" in caught.value.message and "2" in caught.value.message
    assert admission.slots[Tier.THROUGHPUT].in_flight == 0


async def test_more_choices_than_any_router_s_share_ever_runs_is_a_400(engines):
    """5 throughput slots over 2 routers, 3 and 2: n = 4 never runs (400); n = 3 runs on the first
    router, so the second answers 429, which a client retries, not 400."""
    admission = Admission(settings(throughput_capacity=5), backends(engines), position=lambda: (1, 2))
    for n, status in ((4, 400), (3, 429)):
        with pytest.raises(APIError) as caught:
            await admission.admit(Route(Tier.THROUGHPUT, "n"), n)
        assert caught.value.status == status
    assert admission.slots[Tier.THROUGHPUT].in_flight == 0


class ReplicaCountBackend(EngineBackend):
    """A real engine behind a tier whose healthy replica count the test sets."""

    def __init__(self, engine, healthy: int) -> None:
        super().__init__(engine)
        self.healthy = healthy

    async def healthy_replicas(self) -> int:
        return self.healthy


async def test_capacity_follows_the_healthy_replicas(engines):
    """Two latency replicas, one restarting: one request runs on latency and the next spills over
    (rather than queueing at the handle behind the restart); back to two, two run there again."""
    latency = ReplicaCountBackend(engines[Tier.LATENCY], healthy=1)
    admission = Admission(settings(latency_capacity=2, latency_replicas=2),
                          {Tier.LATENCY: latency, Tier.THROUGHPUT: EngineBackend(engines[Tier.THROUGHPUT])})
    first = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    second = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    assert first.tier is Tier.LATENCY and second.route == Route(Tier.THROUGHPUT, "spillover")
    assert admission.slots[Tier.LATENCY].capacity == 1
    latency.healthy = 2
    third = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    assert third.tier is Tier.LATENCY and admission.slots[Tier.LATENCY].in_flight == 2
    latency.healthy = 5  # more than configured (a replica starting beside one stopping): still 2
    with pytest.raises(APIError) as caught:
        await Admission(settings(latency_capacity=2, latency_replicas=2, spillover=False),
                        {Tier.LATENCY: latency}).admit(Route(Tier.LATENCY, "policy"), 3)
    assert caught.value.status == 400 and "2" in caught.value.message  # n beyond the full tier
    for lease in (first, second, third):
        lease.release()


@pytest.mark.parametrize("capacity, replicas, healthy, expected", [
    (3, 2, 1, 2),  # 1.5 slots per healthy replica: rounded up
    (1, 2, 1, 1),  # rounding down would leave the healthy replica no slot at all
    (5, 3, 2, 4),  # 3.33
    (4, 2, 1, 2),  # exact: nothing to round
])
async def test_the_healthy_share_of_a_tier_s_slots_is_rounded_up(engines, capacity, replicas, healthy, expected):
    latency = ReplicaCountBackend(engines[Tier.LATENCY], healthy=healthy)
    admission = Admission(settings(latency_capacity=capacity, latency_replicas=replicas), {Tier.LATENCY: latency})
    assert await admission.healthy(Tier.LATENCY)
    assert admission.slots[Tier.LATENCY].capacity == expected


async def test_routers_share_the_healthy_slots_by_their_rank_read_at_every_resize(engines):
    """4 latency replicas, 3 of them healthy, over 2 routers: 2 and 1 (each rounding its own share
    of the healthy slots up would admit 2 + 2 to 3 replicas). A rank that Serve renumbers counts
    from the next resize on."""
    latency = ReplicaCountBackend(engines[Tier.LATENCY], healthy=3)
    position = {"rank": 0}
    admissions = [
        Admission(settings(latency_capacity=4, latency_replicas=4), {Tier.LATENCY: latency},
                  position=lambda rank=rank: (rank, 2))
        for rank in range(2)
    ]
    renumbered = Admission(settings(latency_capacity=4, latency_replicas=4), {Tier.LATENCY: latency},
                           position=lambda: (position["rank"], 2))
    for admission in (*admissions, renumbered):
        assert await admission.healthy(Tier.LATENCY)
    assert [a.slots[Tier.LATENCY].capacity for a in admissions] == [2, 1]
    assert renumbered.slots[Tier.LATENCY].capacity == 2
    position["rank"] = 1
    await renumbered.healthy(Tier.LATENCY)
    assert renumbered.slots[Tier.LATENCY].capacity == 1


async def test_n_within_the_full_tier_but_beyond_its_healthy_share_is_busy_not_invalid(engines):
    latency = ReplicaCountBackend(engines[Tier.LATENCY], healthy=1)
    admission = Admission(settings(latency_capacity=4, latency_replicas=4, spillover=False), {Tier.LATENCY: latency})
    with pytest.raises(APIError) as caught:
        await admission.admit(Route(Tier.LATENCY, "header"), 2)
    assert caught.value.status == 429 and caught.value.reason == "saturated"
    assert admission.slots[Tier.LATENCY].in_flight == 0


async def test_a_waiter_gets_the_slot_that_a_recovered_replica_brings(engines):
    latency = ReplicaCountBackend(engines[Tier.LATENCY], healthy=1)
    admission = Admission(settings(latency_capacity=2, latency_replicas=2, latency_wait_seconds=5),
                          {Tier.LATENCY: latency})
    held = await admission.admit(Route(Tier.LATENCY, "policy"), 1)
    waiting = asyncio.create_task(admission.admit(Route(Tier.LATENCY, "policy"), 1))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    latency.healthy = 2
    assert await admission.healthy(Tier.LATENCY)  # the next health read resizes the slots
    assert (await asyncio.wait_for(waiting, 1)).tier is Tier.LATENCY
    for lease in (held, waiting.result()):
        lease.release()


async def test_a_waiter_that_no_longer_fits_is_refused_and_blocks_nobody():
    """Capacity 2, one slot held, a request for 2 waits; the capacity shrinks to 1 (a replica went
    down): the waiter is refused at once, and the slot given back goes to the next request."""
    slots = TierSlots(capacity=2)
    assert slots.take_now(1)
    big = asyncio.create_task(slots.wait_for(2, wait_seconds=5))
    await asyncio.sleep(0.01)
    slots.resize(1)
    assert await asyncio.wait_for(big, 1) is False and slots.in_flight == 1
    slots.give_back(1)
    assert slots.take_now(1) and slots.in_flight == 1


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="at least one tier"):
        settings(latency_capacity=0, throughput_capacity=0)
    with pytest.raises(ValueError, match="latency_wait_seconds"):
        settings(latency_wait_seconds=-1)
    with pytest.raises(ValueError, match="throughput_replicas must be at least 1"):
        settings(throughput_replicas=0)
