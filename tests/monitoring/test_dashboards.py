"""Grafana dashboards: committed JSON is what the generator builds, and every query returns data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from megaserve.monitoring import dashboards, metrics
from tests import prometheus_server

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
RECORDER = Path(__file__).with_name("recorder.py")
# Grafana's $__rate_interval is at least 4 scrape intervals; the tests scrape every second.
RATE_WINDOW = "15s"
DATA_TIMEOUT_SECONDS = 60.0
# Recorded only by speculative decoding, which no engine runs yet: no panel to fill.
NOT_ON_DASHBOARDS = {"megaserve_speculative_accepted_tokens"}


def _dashboards() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in dashboards.render().items()}


def _panels():
    for name, board in _dashboards().items():
        for panel in board["panels"]:
            if panel["type"] != "row":
                yield name, panel


def _megaserve_queries():
    """Queries over megaserve_* metrics; Ray's own are checked against the live app
    (test_dashboards_live.py)."""
    for name, panel in _panels():
        for target in panel["targets"]:
            if "ray_serve_" not in target["expr"]:
                yield pytest.param(target["expr"],
                                   id=f"{name}:{panel['title']}:{target['refId']}")


def test_committed_files_are_what_the_generator_builds():
    for path, text in dashboards.expected_files(K8S).items():
        assert path.read_text() == text, f"{path} is stale: run --write"
    check = subprocess.run(
        [sys.executable, "-m", "megaserve.monitoring.dashboards", "--check", "--k8s-dir", str(K8S)],
        capture_output=True, text=True,
    )
    assert check.returncode == 0, check.stderr


def test_check_reports_a_stale_file(tmp_path):
    assert dashboards.main(["--write", "--k8s-dir", str(tmp_path)]) == 0
    (tmp_path / dashboards.CONFIGMAP_FILE).write_text("stale\n")
    assert dashboards.main(["--check", "--k8s-dir", str(tmp_path)]) == 1


def test_without_the_sdk_the_generator_names_the_extra_that_installs_it():
    # As on a README install (no extras): None in sys.modules makes the SDK's import fail.
    without_sdk = ("import runpy, sys; sys.modules['grafana_foundation_sdk'] = None; "
                   "runpy.run_module('megaserve.monitoring.dashboards', run_name='__main__')")
    check = subprocess.run([sys.executable, "-c", without_sdk, "--check", "--k8s-dir", str(K8S)],
                           capture_output=True, text=True)
    assert check.returncode == 2
    assert check.stderr.startswith("python -m megaserve.monitoring.dashboards: ") and "Traceback" not in check.stderr
    assert check.stderr.strip().endswith('pip install -e ".[dashboards]"') and len(check.stderr.splitlines()) == 1


def test_data_source_is_a_template_variable_never_a_fixed_uid():
    for name, board in _dashboards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["model"]["datasource"]["uid"] == "${datasource}"
    for name, panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, name


def test_every_metric_appears_on_a_dashboard():
    exprs = " ".join(t["expr"] for _, panel in _panels() for t in panel["targets"])
    defined = {
        family.name for metric in vars(metrics).values()
        if isinstance(metric, MetricWrapperBase) for family in metric.describe()
    }
    assert {"megaserve_step_duration_seconds", "megaserve_queue_depth"} <= defined
    assert sorted(n for n in defined - NOT_ON_DASHBOARDS if n not in exprs) == []


def test_panels_do_not_overlap():
    for name, board in _dashboards().items():
        cells = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= dashboards.GRID_WIDTH, panel["title"]
            area = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
            assert not cells & area, f"{name}: {panel.get('title')} overlaps another panel"
            cells |= area


def substitute(expr: str) -> str:
    """A panel query as Grafana sends it with `All` models selected."""
    return (expr.replace("$__rate_interval", RATE_WINDOW)
            .replace("$model", dashboards.MODEL_ALL))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Prometheus scraping a process that records the megaserve metrics of a steady workload."""
    if prometheus_server.binary() is None:
        pytest.skip("prometheus is not installed (CI installs the Debian package)")
    workdir = tmp_path_factory.mktemp("prometheus")
    port = prometheus_server.free_port()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(workdir / "multiproc"))
    recorder = subprocess.Popen([sys.executable, str(RECORDER), str(port)], env=env,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert recorder.stdout.readline().strip() == "ready"
        jobs = {"megaserve": [f"127.0.0.1:{port}"]}
        with prometheus_server.running(jobs, workdir) as server:
            yield server
    finally:
        recorder.kill()
        recorder.wait()


def _finite_samples(server: prometheus_server.Prometheus, expr: str) -> list[float]:
    values = [float(sample["value"][1]) for sample in server.query(expr)]
    return [v for v in values if math.isfinite(v)]


@pytest.mark.parametrize("expr", list(_megaserve_queries()))
def test_panel_query_returns_data(recorded, expr):
    query = substitute(expr)
    deadline = time.monotonic() + DATA_TIMEOUT_SECONDS
    while not (samples := _finite_samples(recorded, query)):
        assert time.monotonic() < deadline, f"no data for {query}"
        time.sleep(1.0)
    assert all(v >= 0 for v in samples)


def test_the_test_extra_pins_the_dashboards_extra_s_sdk_alike():
    # Listed twice, not as "megaserve[dashboards]": a self-reference needs a recent pip. The tests
    # build the dashboards with the pin they ship with.
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["dashboards"]) <= set(extras["test"])
