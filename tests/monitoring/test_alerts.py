"""Alert rules: generated files are current, promtool accepts them, and they fire when they should."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megaserve.monitoring import alerts, metrics

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (CI installs prometheus)"
)


def test_committed_files_are_what_the_generator_builds():
    for path, text in alerts.expected_files(K8S).items():
        assert path.read_text() == text, f"{path} is stale: run {alerts.PROG} --write"
    check = subprocess.run(
        [sys.executable, "-m", "megaserve.monitoring.alerts", "--check", "--k8s-dir", str(K8S)],
        capture_output=True, text=True,
    )
    assert check.returncode == 0, check.stderr


def test_prometheus_rule_carries_exactly_the_rule_file_groups():
    rule_file = yaml.safe_load(alerts.RULES_FILE.read_text())
    manifest = yaml.safe_load((K8S / alerts.PROMETHEUS_RULE_FILE).read_text())
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == rule_file["groups"]


def test_every_alert_has_a_severity_and_a_summary():
    rules = [rule for group in alerts.rule_groups() for rule in group["rules"]]
    assert {r["alert"] for r in rules} >= {
        "MegaserveLatencyTierStepSLOBurn", "MegaserveLatencyTierTTFTSLOBurn",
        "MegaserveLatencySpillover", "MegaserveReplicasFailingHealthChecks", "MegaserveReplicasBelowTarget",
        "MegaserveDeploymentUnhealthy", "MegaserveApplicationUnhealthy", "MegaserveMetricsTargetDown",
        "MegaserveMetricsNotScraped",
    }
    for rule in rules:
        # kube-prometheus-stack's names, which a cluster's Alertmanager routes already match
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_the_status_values_are_ray_serve_s():
    from ray.serve.schema import ApplicationStatus

    assert ApplicationStatus.DEPLOY_FAILED.to_numeric() == alerts.APPLICATION_DEPLOY_FAILED
    assert ApplicationStatus.UNHEALTHY.to_numeric() == alerts.APPLICATION_UNHEALTHY


def test_an_slo_threshold_must_be_a_bucket_edge():
    with pytest.raises(ValueError, match="not a bucket edge"):
        alerts.LatencySLO("X", "x", "megaserve_step_duration_seconds", 'tier="latency"',
                          threshold_seconds=0.0123, objective=0.99, buckets=metrics.STEP_BUCKETS)
    with pytest.raises(ValueError, match="objective"):
        alerts.LatencySLO("X", "x", "megaserve_step_duration_seconds", 'tier="latency"',
                          threshold_seconds=0.01, objective=1.0, buckets=metrics.STEP_BUCKETS)


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run(["promtool", "check", "rules", str(alerts.RULES_FILE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    result = subprocess.run(["promtool", "test", "rules", str(UNIT_TESTS)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
