"""Grafana dashboards for megaserve, built with grafana-foundation-sdk and committed as JSON.

Two dashboards: *serving* (what clients see: requests by tier and routing reason, TTFT,
inter-token latency, tokens/s, queueing, Ray Serve's replica health) and *engines* (what replicas
do: per-step duration by tier and phase, steps/s, kernel launches per step). Every panel reads
its data source from the `datasource` template variable, so the JSON names no data source uid,
and filters models through the `model` variable.

    python -m megaserve.monitoring.dashboards --write [--k8s-dir k8s]   # regenerate
    python -m megaserve.monitoring.dashboards --check [--k8s-dir k8s]   # exit 1 if stale

`--k8s-dir` also renders the dashboards as a ConfigMap for Grafana's dashboard sidecar.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

PROG = "python -m megaserve.monitoring.dashboards"

try:
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as common_model
    from grafana_foundation_sdk.models import dashboard as model
except ImportError as error:
    if __name__ != "__main__":  # an importer (a test) sees the ImportError itself
        raise
    # Only regenerating the dashboards needs the SDK, so a plain install (the README's) lacks it.
    print(f"{PROG}: {error}: the dashboards extra installs grafana-foundation-sdk: "
          f'pip install -e ".[dashboards]"', file=sys.stderr)
    sys.exit(2)

from megaserve.monitoring import generated
from megaserve.monitoring.promql import METRICS_JOB, RAY_JOB, histogram_quantile, summed_rate

DASHBOARD_DIR = Path(__file__).parent / "dashboards"
CONFIGMAP_FILE = "grafana-dashboards.yaml"
CONFIGMAP_NAME = "megaserve-dashboards"
SIDECAR_LABEL = {"grafana_dashboard": "1"}  # what Grafana's dashboard sidecar watches for

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE_WINDOW = "$__rate_interval"  # Grafana picks >= 4 scrape intervals
MODEL_ALL = ".*"  # the `model` variable's All value: a regex matching every model
MODELS = 'model=~"$model"'
TAGS = ["megaserve"]
REFRESH = "30s"
TIME_RANGE = ("now-1h", "now")

GRID_WIDTH = 24
PANEL_HEIGHT = 8
HALF = GRID_WIDTH // 2
THIRD = GRID_WIDTH // 3


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def _quantiles(histogram: str, selector: str, by: tuple[str, ...],
               quantiles: tuple[float, ...]) -> list[Query]:
    legend_labels = " ".join("{{" + label + "}}" for label in by)
    return [
        Query(histogram_quantile(q, histogram, selector, RATE_WINDOW, by),
              f"{legend_labels} p{round(q * 100)}")
        for q in quantiles
    ]


def _panel(title: str, description: str, unit: str, queries: list[Query],
           width: int = HALF) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(PANEL_HEIGHT)
        .legend(common.VizLegendOptions().show_legend(True)
                .display_mode(common_model.LegendDisplayMode.LIST)
                .placement(common_model.LegendPlacement.BOTTOM))
        .tooltip(common.VizTooltipOptions().mode(common_model.TooltipDisplayMode.MULTI)
                 .sort(common_model.SortOrder.DESCENDING))
    )
    for index, query in enumerate(queries):
        panel.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend)
            .ref_id(chr(ord("A") + index))
        )
    return panel


def _variables() -> list:
    datasource = (
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
    )
    models = (
        dashboard.QueryVariable("model")
        .label("Model")
        .datasource(DATASOURCE)
        .query("label_values(megaserve_generation_tokens_total, model)")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(MODEL_ALL)
    )
    return [datasource, models]


def _dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh(REFRESH)
        .time(*TIME_RANGE)
        .timezone("browser")
        .variables(_variables())
    )


def serving() -> dashboard.Dashboard:
    by_tier = ("tier",)
    return (
        _dashboard("megaserve-serving", "megaserve / serving",
                   "Requests, latency and throughput by tier, as the router sees them.")
        .with_row(dashboard.Row("Requests"))
        .with_panel(_panel(
            "Requests routed, by tier and reason", "Why the router chose each tier: requested "
            "(service_tier), header, policy, prompt_length, n, spillover, only_tier (the other tier is "
            "not deployed).", "reqps",
            [Query(summed_rate("megaserve_routed_requests_total", MODELS, RATE_WINDOW,
                               ("tier", "reason")), "{{tier}} {{reason}}")]))
        .with_panel(_panel(
            "Spillover and rejections", "Latency requests sent to the throughput tier because "
            "every latency replica stayed busy, and requests the router refused.", "reqps",
            [Query(summed_rate("megaserve_routed_requests_total", f'{MODELS}, reason="spillover"',
                               RATE_WINDOW, ("tier",)), "spilled to {{tier}}"),
             Query(summed_rate("megaserve_rejected_requests_total", MODELS, RATE_WINDOW,
                               ("reason",)), "rejected: {{reason}}")]))
        .with_panel(_panel(
            "Finished requests, by finish reason", "OpenAI finish_reason per tier.", "reqps",
            [Query(summed_rate("megaserve_finished_requests_total", MODELS, RATE_WINDOW,
                               ("tier", "finish_reason")), "{{tier}} {{finish_reason}}")]))
        .with_panel(_panel(
            "End-to-end request latency", "From arrival at the router to the last token.", "s",
            _quantiles("megaserve_request_duration_seconds", MODELS, by_tier, (0.5, 0.99))))
        .with_row(dashboard.Row("Latency"))
        .with_panel(_panel(
            "Time to first token", "From arrival at the router to the first generated token.",
            "s", _quantiles("megaserve_time_to_first_token_seconds", MODELS, by_tier, (0.5, 0.99))))
        .with_panel(_panel(
            "Inter-token latency", "Time between a request's tokens as the router receives them, stalls included.", "s",
            _quantiles("megaserve_inter_token_latency_seconds", MODELS, by_tier, (0.5, 0.99))))
        .with_row(dashboard.Row("Throughput and load"))
        .with_panel(_panel(
            "Generated tokens/s, by tier",
            "Output tokens per second that reached the routers, summed over them (a stop string or a client that "
            "leaves can end a request a step or two after the last counted token), and prompt tokens of the "
            "requests sent to replicas.",
            "suffix:tok/s",
            [Query(summed_rate("megaserve_generation_tokens_total", MODELS, RATE_WINDOW, by_tier),
                   "{{tier}} generated"),
             Query(summed_rate("megaserve_prompt_tokens_total", MODELS, RATE_WINDOW, by_tier),
                   "{{tier}} prompt")]))
        .with_panel(_panel(
            "Queue depth and busy replicas", "Requests waiting at the router for a replica of "
            "a tier; replicas with a request in flight; requests being generated.", "short",
            [Query(f"sum by (tier) (megaserve_queue_depth{{{MODELS}}})", "{{tier}} queued"),
             Query(f"sum by (tier) (megaserve_busy_replicas{{{MODELS}}})", "{{tier}} busy replicas"),
             Query(f"sum by (tier) (megaserve_running_requests{{{MODELS}}})", "{{tier}} running")]))
        .with_row(dashboard.Row("Ray Serve"))
        .with_panel(_panel(
            "Healthy replicas, by deployment", "Ray Serve's own health checks "
            "(ray_serve_deployment_replica_healthy).", "short",
            [Query("sum by (application, deployment) (ray_serve_deployment_replica_healthy)",
                   "{{application}}/{{deployment}}")], width=THIRD))
        .with_panel(_panel(
            "Deployment status", "Ray Serve deployment status: 1 deploy failed, 2 unhealthy, "
            "3 updating, 4 upscaling, 5 downscaling, 6 healthy.", "short",
            [Query("max by (application, deployment) (ray_serve_deployment_status)",
                   "{{application}}/{{deployment}}")], width=THIRD))
        .with_panel(_panel(
            "Metrics targets up", "Scrape targets answering: megaserve node exporters and Ray's "
            "metrics export ports.", "short",
            [Query(f'sum by (job) (up{{job=~"{METRICS_JOB}|{RAY_JOB}"}})', "{{job}}")],
            width=THIRD))
    )


def engines() -> dashboard.Dashboard:
    phases = ("phase",)
    tier_phase = ("tier", "phase")
    steps = summed_rate("megaserve_step_duration_seconds_count", MODELS, RATE_WINDOW, tier_phase)
    step_seconds = summed_rate("megaserve_step_duration_seconds_sum", MODELS, RATE_WINDOW,
                               tier_phase)
    dash = _dashboard("megaserve-engines", "megaserve / engines",
                      "What replicas do per step: duration by tier and phase, kernel launches.")
    for tier in ("latency", "throughput"):
        selector = f'{MODELS}, tier="{tier}"'
        dash.with_panel(_panel(
            f"{tier.capitalize()} tier: step duration p50 / p90 / p99",
            f"One engine step of {tier} replicas (prefill of a prompt, or one decode step).", "s",
            _quantiles("megaserve_step_duration_seconds", selector, phases, (0.5, 0.9, 0.99))))
    return (
        dash
        .with_panel(_panel(
            "Steps/s, by tier and phase", "Engine steps per second summed over replicas. SGLang "
            "does not report its batch steps: its replicas record one step per token of each request "
            "(their rate is tokens/s); the first is the prefill, timed by SGLang's own stamps.",
            "ops", [Query(steps, "{{tier}} {{phase}}")]))
        .with_panel(_panel(
            "Kernel launches per decode step", "Measured once when each engine starts: a "
            "megakernel replica launches a handful, stock PyTorch hundreds.", "short",
            [Query(f"max by (tier, engine) (megaserve_kernel_launches_per_step{{{MODELS}}})",
                   "{{tier}} {{engine}}")]))
        .with_panel(_panel(
            "Mean step duration, by tier and phase", "Sum of step time over steps taken.", "s",
            [Query(f"{step_seconds} / {steps}", "{{tier}} {{phase}}")], width=GRID_WIDTH))
    )


DASHBOARDS = {"megaserve-serving.json": serving, "megaserve-engines.json": engines}


def render() -> dict[str, str]:
    """Dashboard file name -> its JSON text, byte for byte what is committed."""
    return {
        name: json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
        for name, build in DASHBOARDS.items()
    }


def configmap(rendered: dict[str, str]) -> str:
    """The dashboards as one ConfigMap that Grafana's sidecar loads (label grafana_dashboard)."""
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP_NAME, "labels": dict(SIDECAR_LABEL)},
        "data": rendered,
    }
    return generated.to_yaml(manifest, f"{PROG} --write --k8s-dir k8s")


def expected_files(k8s_dir: Path | None) -> dict[Path, str]:
    rendered = render()
    files = {DASHBOARD_DIR / name: text for name, text in rendered.items()}
    if k8s_dir is not None:
        files[k8s_dir / CONFIGMAP_FILE] = configmap(rendered)
    return files


def main(argv: list[str] | None = None) -> int:
    return generated.main(PROG, __doc__.splitlines()[0], expected_files, argv)


if __name__ == "__main__":
    sys.exit(main())
