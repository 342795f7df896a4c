"""A stand-in workload: records every megaserve metric the dashboards read, then serves them.

Run as `python recorder.py PORT`; prints `ready` once the node exporter is started. Used where
the live Ray Serve app is not needed (dashboard queries over megaserve_* metrics).
"""

from __future__ import annotations

import random
import sys
import time

from megaserve.monitoring import metrics
from megaserve.monitoring.exporter import start_node_exporter

MODEL = "recorded-model"
TIERS = ("latency", "throughput")
ROUTING_REASONS = ("requested", "policy", "spillover")
STEP_SECONDS = {"latency": 0.0006, "throughput": 0.004}
PREFILL_SECONDS = 0.02
TOKENS_PER_REQUEST = 16
PROMPT_TOKENS = 64
KERNEL_LAUNCHES = {"latency": ("megakernel", 3), "throughput": ("torch", 1400)}
PERIOD_SECONDS = 0.05


def record_one_request(tier: str, reason: str) -> None:
    step = STEP_SECONDS[tier]
    metrics.ROUTED_REQUESTS.labels(tier=tier, model=MODEL, reason=reason).inc()
    metrics.STEP_DURATION.labels(tier=tier, model=MODEL, phase="prefill").observe(PREFILL_SECONDS)
    for _ in range(TOKENS_PER_REQUEST):
        jittered = step * random.uniform(0.8, 1.5)
        metrics.STEP_DURATION.labels(tier=tier, model=MODEL, phase="decode").observe(jittered)
        metrics.INTER_TOKEN_LATENCY.labels(tier=tier, model=MODEL).observe(jittered)
    metrics.TIME_TO_FIRST_TOKEN.labels(tier=tier, model=MODEL).observe(PREFILL_SECONDS + step)
    metrics.REQUEST_DURATION.labels(tier=tier, model=MODEL).observe(
        PREFILL_SECONDS + step * TOKENS_PER_REQUEST)
    metrics.PROMPT_TOKENS.labels(tier=tier, model=MODEL).inc(PROMPT_TOKENS)
    metrics.GENERATION_TOKENS.labels(tier=tier, model=MODEL).inc(TOKENS_PER_REQUEST)
    metrics.FINISHED_REQUESTS.labels(tier=tier, model=MODEL, finish_reason="length").inc()


def main() -> None:
    port = int(sys.argv[1])
    for tier in TIERS:
        engine, launches = KERNEL_LAUNCHES[tier]
        metrics.KERNEL_LAUNCHES_PER_STEP.labels(tier=tier, model=MODEL, engine=engine).set(launches)
        metrics.BUSY_REPLICAS.labels(tier=tier, model=MODEL).set(1)
        metrics.RUNNING_REQUESTS.labels(tier=tier, model=MODEL).set(1)
        metrics.QUEUE_DEPTH.labels(tier=tier, model=MODEL).set(0)
    start_node_exporter("127.0.0.1", port, retry_seconds=0.2)
    print("ready", flush=True)
    while True:
        for tier in TIERS:
            record_one_request(tier, random.choice(ROUTING_REASONS))
        metrics.REJECTED_REQUESTS.labels(model=MODEL, reason="invalid").inc()
        time.sleep(PERIOD_SECONDS)


if __name__ == "__main__":
    main()
