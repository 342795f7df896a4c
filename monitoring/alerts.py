"""Prometheus alert rules for megaserve, generated into a rule file and a PrometheusRule.

Latency SLOs are alerted on by error-budget burn rate over two windows (the multiwindow,
multi-burn-rate alerts of Google's SRE workbook): a page when the last hour burns the budget
14.4 times too fast (2% of a 30-day budget gone) and the last 5 minutes still do, a ticket at 6
times over 6 hours and 30 minutes. The other rules watch spillover and the replicas themselves.

    python -m megaserve.monitoring.alerts --write [--k8s-dir k8s]   # regenerate
    python -m megaserve.monitoring.alerts --check [--k8s-dir k8s]   # exit 1 if stale
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from megaserve.monitoring import generated, metrics
from megaserve.monitoring.promql import METRICS_JOB, RAY_JOB, fraction_above

PROG = "python -m megaserve.monitoring.alerts"
RULES_FILE = Path(__file__).parent / "alerts" / "megaserve.rules.yaml"
PROMETHEUS_RULE_FILE = "prometheusrule.yaml"
PROMETHEUS_RULE_NAME = "megaserve"


@dataclass(frozen=True)
class LatencySLO:
    """`objective` of the observations of `histogram` (restricted by `selector`) take at most
    `threshold_seconds`, which must be one of the histogram's bucket edges."""

    alert: str
    summary: str
    histogram: str
    selector: str
    threshold_seconds: float
    objective: float
    buckets: tuple[float, ...]

    def __post_init__(self):
        if self.threshold_seconds not in self.buckets:
            raise ValueError(f"{self.alert}: {self.threshold_seconds} s is not a bucket edge of "
                             f"{self.histogram}; pick one of {self.buckets}")
        if not 0 < self.objective < 1:
            raise ValueError(f"{self.alert}: objective must lie in (0, 1), got {self.objective}")


# Severities as kube-prometheus-stack's Alertmanager config and the community mixins spell them, so
# that a cluster's existing routes take these alerts: `critical` pages someone now, `warning` files a
# ticket (the SRE workbook's page and ticket).
PAGE, TICKET = "critical", "warning"


@dataclass(frozen=True)
class BurnWindow:
    severity: str
    long: str
    short: str
    burn_rate: float
    hold: str  # `for:` of the alert


BURN_WINDOWS = (
    BurnWindow(PAGE, long="1h", short="5m", burn_rate=14.4, hold="2m"),
    BurnWindow(TICKET, long="6h", short="30m", burn_rate=6.0, hold="15m"),
)

# A batch-1 decode step reads every weight once: ~4 ms for an 8B model on one H200 (docs/perf.md),
# ~19 ms for the 70B of deploy/gb300.yaml (141 GB at ~92% of a GB300's 8 TB/s: the megakernel
# engine drives one GPU of its group). 30 ms means the replica is no longer the fast path it is
# sold as; a deployment of a smaller model tightens it (8B: 0.01).
DECODE_STEP_SLO = LatencySLO(
    alert="MegaserveLatencyTierStepSLOBurn",
    summary="Latency-tier decode steps are slower than {threshold} s too often",
    histogram="megaserve_step_duration_seconds",
    selector='tier="latency", phase="decode"',
    threshold_seconds=0.03,
    objective=0.99,
    buckets=metrics.STEP_BUCKETS,
)
TTFT_SLO = LatencySLO(
    alert="MegaserveLatencyTierTTFTSLOBurn",
    summary="Latency-tier time to first token exceeds {threshold} s too often",
    histogram="megaserve_time_to_first_token_seconds",
    selector='tier="latency"',
    threshold_seconds=0.5,
    objective=0.99,
    buckets=metrics.LATENCY_BUCKETS,
)
LATENCY_SLOS = (DECODE_STEP_SLO, TTFT_SLO)

# Latency-tier requests that ran on the throughput tier because every latency replica stayed
# busy: a sustained share this high means the latency tier needs more replicas.
SPILLOVER_RATIO = 0.1
SPILLOVER_WINDOW = "10m"
SPILLOVER_HOLD = "15m"
# Ray Serve's `serve_deployment_status` values (ray/serve/_private/deployment_state.py) and
# `serve_application_status` values (ApplicationStatus.to_numeric, ray/serve/schema.py).
DEPLOYMENT_FAILED, DEPLOYMENT_UNHEALTHY = 1, 2
APPLICATION_DEPLOY_FAILED, APPLICATION_UNHEALTHY = 1, 2
REPLICA_HOLD = "2m"
# Serve replaces a replica after this many failed health checks in a row
# (REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD in ray/serve/_private/constants.py).
HEALTH_CHECKS_TO_REPLACE = 3
HEALTH_CHECK_WINDOW = "15m"
# Fewer healthy replicas than the deployment's target for this long: longer than a GPU replica's
# start (k8s/rayservice.yaml's 70B over two nodes: weights from the volume, the kernel build in a
# fresh pod), so that a rolling update does not page.
BELOW_TARGET_HOLD = "15m"


def _number(value: float) -> str:
    return f"{value:.6g}"


def _burn_alert(slo: LatencySLO, window: BurnWindow) -> dict:
    budget = 1 - slo.objective
    limit = _number(window.burn_rate * budget)
    errors = {
        span: fraction_above(slo.histogram, slo.threshold_seconds, slo.selector, span, ("model",))
        for span in (window.long, window.short)
    }
    return {
        "alert": slo.alert,
        "expr": f"{errors[window.long]} > {limit}\nand\n{errors[window.short]} > {limit}\n",
        "for": window.hold,
        "labels": {"severity": window.severity},
        "annotations": {
            "summary": slo.summary.format(threshold=_number(slo.threshold_seconds)),
            "description": (
                f"{{{{ $labels.model }}}}: {{{{ $value | humanizePercentage }}}} of observations "
                f"over {window.long} exceed {_number(slo.threshold_seconds)} s, against an error "
                f"budget of {_number(budget * 100)}% ({_number(window.burn_rate)}x burn rate)."
            ),
        },
    }


def _spillover_alert() -> dict:
    spilled = (f'sum by (model) (rate(megaserve_routed_requests_total{{tier="throughput", reason="spillover"}}'
               f"[{SPILLOVER_WINDOW}]))")
    served = (f'sum by (model) (rate(megaserve_routed_requests_total{{tier="latency"}}'
              f"[{SPILLOVER_WINDOW}]))")
    return {
        "alert": "MegaserveLatencySpillover",
        "expr": f"{spilled}\n/\n({spilled} + {served})\n> {_number(SPILLOVER_RATIO)}\n",
        "for": SPILLOVER_HOLD,
        "labels": {"severity": TICKET},
        "annotations": {
            "summary": "Latency-tier requests keep spilling over to the throughput tier",
            "description": (
                "{{ $labels.model }}: {{ $value | humanizePercentage }} of latency-tier requests "
                f"ran on the throughput tier over {SPILLOVER_WINDOW}; add latency replicas."
            ),
        },
    }


def _replica_alerts() -> list[dict]:
    failures, window = "ray_serve_health_check_failures_total", HEALTH_CHECK_WINDOW
    return [
        # Not `ray_serve_deployment_replica_healthy == 0`: Serve stops a failing replica and its 0
        # leaves the export within a minute (measured on Ray 2.60), so that rule never fired. The
        # failure counters stay, and so does the target.
        {
            "alert": "MegaserveReplicasFailingHealthChecks",
            # Each replica's failures within the window, summed. The counter never expires, so only
            # what it grew by counts: since the window's start, where it was seen then (a series that
            # reset, its controller restarted, adds nothing); from 0, where it was not though its Ray
            # target was scraped (it appears at its replica's first failure, which increase() would
            # miss); from its first value in the window where nothing tells (a gap in the scrapes, a
            # Prometheus just started), so that a lifetime total from before does not count.
            "expr": (f"sum by (application, deployment) (\n"
                     f"    clamp_min({failures} - {failures} offset {window}, 0)\n"
                     f"  or\n"
                     f"    ({failures} and on (job, instance) (up offset {window} == 1))\n"
                     f"  or\n"
                     f"    ({failures} - min_over_time({failures}[{window}]))\n"
                     f")\n>= {HEALTH_CHECKS_TO_REPLACE}\n"),
            # The other health rules' hold: a count that one evaluation shows files no ticket. It only
            # delays one, as the failures stay in the count for the whole window.
            "for": REPLICA_HOLD,
            "labels": {"severity": TICKET},
            "annotations": {
                "summary": "Ray Serve replicas fail their health checks and are replaced",
                "description": "{{ $labels.application }}/{{ $labels.deployment }}: {{ $value }} failed "
                f"health checks in {HEALTH_CHECK_WINDOW} (Serve replaces a replica after "
                f"{HEALTH_CHECKS_TO_REPLACE} in a row): a wedged or crashing engine.",
                },
        },
        {
            "alert": "MegaserveReplicasBelowTarget",
            "expr": ("(\n  sum by (application, deployment) (ray_serve_deployment_replica_healthy)\n"
                     "  or 0 * max by (application, deployment) (ray_serve_autoscaling_target_replicas)\n)\n"
                     "< max by (application, deployment) (ray_serve_autoscaling_target_replicas)\n"),
            "for": BELOW_TARGET_HOLD,
            "labels": {"severity": PAGE},
            "annotations": {
                "summary": "A Ray Serve deployment runs fewer healthy replicas than it targets",
                "description": "{{ $labels.application }}/{{ $labels.deployment }} has had {{ $value }} "
                "healthy replicas, fewer than its target, for " + BELOW_TARGET_HOLD
                + ": replicas that cannot be placed (a lost GPU node) or keep failing to start.",
                },
        },
        {
            "alert": "MegaserveDeploymentUnhealthy",
            "expr": f"ray_serve_deployment_status >= {DEPLOYMENT_FAILED} "
                    f"<= {DEPLOYMENT_UNHEALTHY}\n",
            "for": REPLICA_HOLD,
            "labels": {"severity": PAGE},
            "annotations": {
                "summary": "A Ray Serve deployment is unhealthy or failed to deploy",
                "description": "{{ $labels.application }}/{{ $labels.deployment }} reports "
                "status {{ $value }} (1 deploy failed, 2 unhealthy).",
                },
        },
        {
            # An app whose build raised (a model.path with no model, an empty MEGASERVE_API_KEYS) has
            # no deployments, so none of the deployment rules above has a series to fire on.
            "alert": "MegaserveApplicationUnhealthy",
            # Ray marks an app failed or unhealthy whenever one of its deployments is: that one pages
            # as MegaserveDeploymentUnhealthy, so this rule only speaks for the app that has none.
            "expr": f"ray_serve_application_status >= {APPLICATION_DEPLOY_FAILED} "
                    f"<= {APPLICATION_UNHEALTHY}\n"
                    f"unless on (application) ray_serve_deployment_status >= {DEPLOYMENT_FAILED} "
                    f"<= {DEPLOYMENT_UNHEALTHY}\n",
            "for": REPLICA_HOLD,
            "labels": {"severity": PAGE},
            "annotations": {
                "summary": "A Ray Serve application failed to deploy or is unhealthy",
                "description": "{{ $labels.application }} reports status {{ $value }} (1 deploy failed, 2 "
                "unhealthy): `serve status` gives the reason, e.g. the error that its build raised.",
                },
        },
        {
            "alert": "MegaserveMetricsTargetDown",
            "expr": f'up{{job="{METRICS_JOB}"}} == 0\n',
            "for": REPLICA_HOLD,
            "labels": {"severity": PAGE},
            "annotations": {
                "summary": "A node's megaserve metrics endpoint does not answer",
                # Only a node with an exporter up for good may be a target, or this pages for ever:
                # on Kubernetes, a worker pod's exporter container, since a pod may host no megaserve
                # process (k8s/rayservice.yaml).
                "description": "{{ $labels.instance }} has not been scraped for " + REPLICA_HOLD
                + ": nothing on that node serves its megaserve metrics (on Kubernetes, the pod's "
                "megaserve-exporter container; elsewhere, any megaserve process), or the port is blocked.",
                },
        },
        {
            # The rules above see a target that is down, not one that was never scraped: a PodMonitor
            # that the Prometheus does not select (kube-prometheus-stack's release label) or a scrape
            # config without the job leaves every rule on that job's metrics silent.
            "alert": "MegaserveMetricsNotScraped",
            "expr": f'absent(up{{job="{METRICS_JOB}"}})\nor\nabsent(up{{job="{RAY_JOB}"}})\n',
            # as long as a GPU replica may take to start: worker pods still Pending are no targets
            "for": BELOW_TARGET_HOLD,
            "labels": {"severity": PAGE},  # every alert on the job is blind, worse than one target down
            "annotations": {
                "summary": "Prometheus scrapes no target of a job that megaserve's alerts and dashboards read",
                "description": "No target of job {{ $labels.job }} for " + BELOW_TARGET_HOLD
                + ": every alert on its metrics is blind. On Kubernetes, check that the Prometheus "
                "selects k8s/podmonitor.yaml, and that the worker pods are not all Pending (no GPU "
                "node for them); elsewhere, that its scrape config has the job.",
                },
        },
    ]


def rule_groups() -> list[dict]:
    return [
        {"name": "megaserve-slo",
         "rules": [_burn_alert(slo, window) for slo in LATENCY_SLOS for window in BURN_WINDOWS]},
        {"name": "megaserve-capacity", "rules": [_spillover_alert()]},
        {"name": "megaserve-health", "rules": _replica_alerts()},
    ]


def prometheus_rule() -> dict:
    """The same groups as a prometheus-operator PrometheusRule."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": PROMETHEUS_RULE_NAME, "labels": {"app.kubernetes.io/name": "megaserve"}},
        "spec": {"groups": rule_groups()},
    }


def expected_files(k8s_dir: Path | None) -> dict[Path, str]:
    files = {RULES_FILE: generated.to_yaml({"groups": rule_groups()}, f"{PROG} --write")}
    if k8s_dir is not None:
        files[k8s_dir / PROMETHEUS_RULE_FILE] = generated.to_yaml(
            prometheus_rule(), f"{PROG} --write --k8s-dir k8s")
    return files


def main(argv: list[str] | None = None) -> int:
    return generated.main(PROG, __doc__.splitlines()[0], expected_files, argv)


if __name__ == "__main__":
    sys.exit(main())
