"""Which tier serves a request, and whether it may start now.

Choosing (first match wins):
  1. the body's `service_tier`: "priority" or "fast" (OpenAI's alias of it) -> latency;
     "default", "flex" or "scale" -> throughput
     (reason "requested"). This is OpenAI's own field, so a client's explicit choice is honoured
     over any header a gateway adds;
  2. the header `x-megaserve-tier: latency|throughput` (reason "header"), e.g. set per customer
     by a gateway; it decides whenever the body says "auto" or nothing;
  3. the policy for "auto": more than one choice (n > 1, or a completion batch of prompts) ->
     throughput (reason "n"); a prompt longer than `latency_max_prompt_tokens` (a batch's longest)
     -> throughput (reason "prompt_length"); else latency ("policy").

Admitting: the router counts the requests (one slot per choice) it has in flight on each tier
against the tier's capacity, scaled by the share of the tier's replicas that are healthy (with one
of two latency replicas restarting, one request runs there and the next spills over instead of
queueing behind the restart at the replica's handle), and of those slots its own share when it is
one of several routers (`router_share`, by its rank, read at every resize). A latency request that
finds no free slot waits up to `latency_wait_seconds` in FIFO order, then spills over to throughput
(reason "spillover") if `spillover` is on and throughput has a healthy replica, else is refused as
latency's. Throughput never spills to latency: a batch-1 replica is too precious for work that asked
for bulk service. A deployment of one tier serves every request on that tier (reason "only_tier"
when it asked for the other). Refusals: 429 when the slots are taken, 503 when the tier has no
healthy replica, both with Retry-After; 400 when the choices are more than any router's share of
the tier ever runs at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from megaserve.monitoring.metrics import QUEUE_DEPTH, ROUTED_REQUESTS
from megaserve.replicas.protocol import Tier
from megaserve.router.backend import Backend
from megaserve.router.errors import APIError, busy, invalid
from megaserve.router.settings import THROUGHPUT_WAIT_SECONDS, RouterSettings, router_share

TIER_HEADER = "x-megaserve-tier"
ECHOED_HEADER_CHARS = 64  # of a refused header value, in the error: a client may send kilobytes
RouterPosition = Callable[[], tuple[int, int]]  # () -> (rank, routers): this router among its replicas
SERVICE_TIER_TO_TIER = {"priority": Tier.LATENCY, "fast": Tier.LATENCY, "default": Tier.THROUGHPUT,
                        "flex": Tier.THROUGHPUT, "scale": Tier.THROUGHPUT}
OTHER_TIER = {Tier.LATENCY: Tier.THROUGHPUT, Tier.THROUGHPUT: Tier.LATENCY}


def single_router() -> tuple[int, int]:
    """The position of a router that admits alone: rank 0 of 1."""
    return 0, 1


@dataclass(frozen=True)
class Route:
    tier: Tier
    reason: str  # requested | header | policy | prompt_length | n | spillover | only_tier


def choose_tier(
    settings: RouterSettings, service_tier: str | None, header: str | None, prompt_tokens: int, n: int
) -> Route:
    """The tier a request asks for, before load is considered (see the module docstring)."""
    if service_tier in SERVICE_TIER_TO_TIER:
        return Route(SERVICE_TIER_TO_TIER[service_tier], "requested")
    if header is not None:
        try:
            return Route(Tier(header.strip().lower()), "header")
        except ValueError:
            raise invalid(
                f"header {TIER_HEADER} must be 'latency' or 'throughput', got {header[:ECHOED_HEADER_CHARS]!r}"
                + ("..." if len(header) > ECHOED_HEADER_CHARS else ""),
                param=TIER_HEADER,
            ) from None
    if n > 1:
        return Route(Tier.THROUGHPUT, "n")
    if prompt_tokens > settings.latency_max_prompt_tokens:
        return Route(Tier.THROUGHPUT, "prompt_length")
    return Route(Tier.LATENCY, "policy")


class TierSlots:
    """A counting semaphore over one tier's capacity that takes several slots at once, FIFO."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        # each waiter's slots and its future: True once granted, False once they can never fit
        self._waiters: deque[tuple[int, asyncio.Future[bool]]] = deque()

    def _fits(self, slots: int) -> bool:
        return self.in_flight + slots <= self.capacity

    def resize(self, capacity: int) -> None:
        """Count against `capacity` from now on; requests in flight above it finish as they are, and
        waiters for more slots than it holds are refused at once (they would block those behind)."""
        self.capacity = capacity
        self._wake()

    def take_now(self, slots: int) -> bool:
        """Take `slots` if they are free and nobody waits for them."""
        if self._waiters or not self._fits(slots):
            return False
        self.in_flight += slots
        return True

    async def wait_for(self, slots: int, wait_seconds: float) -> bool:
        """Take `slots` within `wait_seconds`, behind earlier waiters; False if they never came."""
        if wait_seconds <= 0 or slots > self.capacity:
            return False
        waiter = (slots, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        granted = False
        try:
            await asyncio.wait((waiter[1],), timeout=wait_seconds)
            granted = waiter[1].done() and waiter[1].result()
            return granted
        finally:
            if not waiter[1].done():
                waiter[1].cancel()
                self._waiters.remove(waiter)
                self._wake()  # those queued behind this one may fit now
            elif waiter[1].result() and not granted:  # granted in the same moment this task was cancelled
                self.give_back(slots)

    def give_back(self, slots: int) -> None:
        self.in_flight -= slots
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            slots, future = self._waiters[0]
            if slots <= self.capacity and not self._fits(slots):
                return  # the head waits for slots to come back, and the rest behind it
            self._waiters.popleft()
            granted = slots <= self.capacity
            self.in_flight += slots if granted else 0
            future.set_result(granted)


class Lease:
    """Slots held on one tier for one request; `release` gives them back exactly once."""

    def __init__(self, slots: TierSlots, count: int, route: Route) -> None:
        self._slots, self._count, self.route = slots, count, route
        self._held = True

    @property
    def tier(self) -> Tier:
        return self.route.tier

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.give_back(self._count)


class Admission:
    """Admits requests to tiers under the capacities of `settings`."""

    def __init__(self, settings: RouterSettings, backends: Mapping[Tier, Backend],
                 position: RouterPosition = single_router) -> None:
        self.settings = settings
        self.backends = backends
        self.position = position
        # (the capacity with every replica healthy, the replicas it counts) per tier
        self._full = {
            Tier.LATENCY: (settings.latency_capacity if Tier.LATENCY in backends else 0, settings.latency_replicas),
            Tier.THROUGHPUT: (settings.throughput_capacity if Tier.THROUGHPUT in backends else 0,
                              settings.throughput_replicas),
        }
        self.slots = {tier: TierSlots(capacity) for tier, (capacity, _) in self._full.items()}
        self._wait_seconds = {
            Tier.LATENCY: settings.latency_wait_seconds,
            Tier.THROUGHPUT: THROUGHPUT_WAIT_SECONDS,
        }

    def deployed(self, tier: Tier) -> bool:
        return tier in self.backends and self._full[tier][0] > 0

    async def healthy(self, tier: Tier) -> bool:
        """Whether `tier` has a healthy replica; its slots are resized to the healthy ones' share."""
        if not self.deployed(tier):
            return False
        capacity, replicas = self._full[tier]
        healthy = min(await self.backends[tier].healthy_replicas(), replicas)
        healthy_slots = -(-capacity * healthy // replicas)  # a healthy replica keeps a slot
        rank, routers = self.position()
        self.slots[tier].resize(router_share(healthy_slots, routers, rank))
        return healthy > 0

    async def admit(self, route: Route, slots: int, choices_param: str = "n") -> Lease:
        """A lease on `route.tier`, on the other tier if that one alone is deployed, on throughput
        after spillover, or an APIError (429/503; 400 naming `choices_param` for more choices than
        the tier ever runs at once)."""
        if not self.deployed(route.tier):
            route = Route(OTHER_TIER[route.tier], "only_tier")
        if route.tier is Tier.LATENCY:
            healthy = await self.healthy(Tier.LATENCY)
            if healthy and await self._take(Tier.LATENCY, slots):
                return self._routed(route, slots)
            if not (self.settings.spillover and self.deployed(Tier.THROUGHPUT) and await self.healthy(Tier.THROUGHPUT)):
                # nowhere to spill over to: the latency tier's own answer (429 when it is only busy)
                raise self._refusal(Tier.LATENCY, slots, choices_param, unavailable=not healthy)
            route = Route(Tier.THROUGHPUT, "spillover")
        elif not await self.healthy(Tier.THROUGHPUT):
            raise self._refusal(Tier.THROUGHPUT, slots, choices_param, unavailable=True)
        if await self._take(Tier.THROUGHPUT, slots):
            return self._routed(route, slots)
        raise self._refusal(Tier.THROUGHPUT, slots, choices_param, unavailable=False)

    async def _take(self, tier: Tier, slots: int) -> bool:
        if self.slots[tier].take_now(slots):
            return True
        depth = QUEUE_DEPTH.labels(tier=tier.value, model=self.settings.model_name)
        depth.inc()
        try:
            return await self.slots[tier].wait_for(slots, self._wait_seconds[tier])
        finally:
            depth.dec()

    def _routed(self, route: Route, slots: int) -> Lease:
        ROUTED_REQUESTS.labels(tier=route.tier.value, model=self.settings.model_name, reason=route.reason).inc()
        return Lease(self.slots[route.tier], slots, route)

    def _refusal(self, tier: Tier, slots: int, choices_param: str, *, unavailable: bool) -> APIError:
        _, routers = self.position()
        capacity = router_share(self._full[tier][0], routers, 0)  # the most any router ever runs
        if not unavailable and slots > capacity:  # waiting, or another router, would never help
            return invalid(f"the request asks for {slots} choices (n, for each prompt of a batch) but the "
                           f"{tier.value} tier runs at most {capacity} at once; ask for fewer", choices_param)
        state = "has no healthy replica" if unavailable else "is at capacity"
        return busy(f"the {tier.value} tier {state}; retry later",
                    self.settings.retry_after_seconds, unavailable=unavailable)
