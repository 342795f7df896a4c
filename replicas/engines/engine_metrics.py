"""What every engine records about itself, through the metric objects of `monitoring.metrics`:
the duration of each prefill and decode step, the requests it is generating, and whether it is busy.

Gauges move by inc/dec rather than set, so several engines in one process (tests, a node's
worker that hosts two replicas) add up instead of overwriting each other.
"""

from __future__ import annotations

import time

from megaserve.monitoring.metrics import BUSY_REPLICAS, RUNNING_REQUESTS, STEP_DURATION

PREFILL = "prefill"
DECODE = "decode"


class EngineMetrics:
    """The metrics of one engine, labelled once with its tier and model. Not thread-safe: call
    it from the one thread (or event loop) that runs the engine's steps."""

    def __init__(self, tier: str, model: str) -> None:
        self._prefill = STEP_DURATION.labels(tier=tier, model=model, phase=PREFILL)
        self._decode = STEP_DURATION.labels(tier=tier, model=model, phase=DECODE)
        self._running = RUNNING_REQUESTS.labels(tier=tier, model=model)
        self._busy = BUSY_REPLICAS.labels(tier=tier, model=model)
        self.running = 0
        self._progress_at = time.monotonic()  # the last step or admission

    def prefill_step(self, seconds: float) -> None:
        self._prefill.observe(seconds)
        self._progress_at = time.monotonic()

    def decode_step(self, seconds: float) -> None:
        self._decode.observe(seconds)
        self._progress_at = time.monotonic()

    def seconds_without_progress(self) -> float:
        """How long requests have been running with no step finished; 0 while none runs. (Read from
        another thread for health: a float and an int, each read whole.)"""
        return time.monotonic() - self._progress_at if self.running else 0.0

    def request_started(self) -> None:
        self._progress_at = time.monotonic()
        if self.running == 0:
            self._busy.inc()
        self.running += 1
        self._running.inc()

    def request_ended(self) -> None:
        self.running -= 1
        self._running.dec()
        if self.running == 0:
            self._busy.dec()
