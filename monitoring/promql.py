"""PromQL building blocks shared by the Grafana dashboards and the alert rules.

Scrape jobs are a contract between whoever configures Prometheus (the PodMonitors in k8s/, a
static config on a plain Ray cluster, the tests) and the queries here: the node exporters of
`monitoring.exporter` are scraped as job `megaserve`, Ray's own metrics export port as job `ray`.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

METRICS_JOB = "megaserve"  # every node's megaserve exporter (the config's metrics.port, /metrics)
RAY_JOB = "ray"  # every node's Ray metrics export port (ray_serve_*, ms-based)


def rate(series: str, selector: str, window: str) -> str:
    """Per-second rate of a counter (or a histogram's _count/_sum/_bucket) over `window`."""
    return f"rate({series}{{{selector}}}[{window}])"


def summed_rate(series: str, selector: str, window: str, by: tuple[str, ...]) -> str:
    return f"sum by ({', '.join(by)}) ({rate(series, selector, window)})"


def histogram_quantile(quantile: float, histogram: str, selector: str, window: str,
                       by: tuple[str, ...]) -> str:
    """The `quantile` of a histogram over `window`, one series per combination of `by` labels."""
    return (
        f"histogram_quantile({quantile}, "
        f"{summed_rate(histogram + '_bucket', selector, window, (*by, 'le'))})"
    )


def fraction_above(histogram: str, threshold_seconds: float, selector: str, window: str,
                   by: tuple[str, ...]) -> str:
    """Fraction of a histogram's observations above `threshold_seconds` (a bucket edge)."""
    # `le` is matched as text: spell the edge the way prometheus_client writes it (1.0, not 1).
    edge = floatToGoString(threshold_seconds)
    within = summed_rate(histogram + "_bucket", f'{selector}, le="{edge}"', window, by)
    total = summed_rate(histogram + "_count", selector, window, by)
    return f"(1 - {within} / {total})"
