"""A live stack for integration tests: a real Ray cluster running the real Serve app on the demo
model, and a real Prometheus scraping it. Started once per test session, on loopback and free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from megaserve.monitoring.promql import METRICS_JOB, RAY_JOB
from tests.prometheus_server import Prometheus, free_port, running

STARTUP_TIMEOUT_SECONDS = 240
UNASSIGNED_ADDRESS = "192.0.2.1"  # TEST-NET-1 (RFC 5737): no interface of this machine has it


def has_ipv6_loopback() -> bool:
    """Whether a socket can listen on ::1 here (a container may have IPv6 switched off)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def tiers_are_healthy(base_url: str, tiers: list[str]) -> bool:
    """Whether the router's /health says every one of `tiers` has a healthy replica: a 200 alone
    means one of them has, and a priority request sent then may spill over to throughput."""
    with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
        health = json.load(response)["tiers"]
    return all(health[tier]["healthy"] for tier in tiers)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = predicate()
            if result:
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class LiveStack:
    base_url: str
    metrics_port: int
    ray_metrics_port: int
    prometheus: Prometheus
    home: Path
    cleanup: contextlib.ExitStack  # stops Prometheus

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"


def start_stack(app_args: dict, home: Path) -> LiveStack:
    """Ray (token auth on) + Serve app from `app_args` (an AppConfig dict) + Prometheus."""
    # Token auth on (tests/conftest.py sets the session's token before Ray is first imported).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    os.environ["MEGASERVE_HOME"] = str(home)
    import ray
    from ray import serve

    from megaserve.deploy.builder import build_app
    from megaserve.deploy.config import AppConfig

    http_port, metrics_port, ray_metrics_port = free_port(), free_port(), free_port()
    args = dict(app_args)
    args["metrics"] = {"port": metrics_port, "bind_host": "127.0.0.1",
                       "multiproc_dir": str(home / "metrics")}
    config = AppConfig.model_validate(args)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _metrics_export_port=ray_metrics_port,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "token"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(build_app(config), name="megaserve", route_prefix="/")
    base_url = f"http://127.0.0.1:{http_port}"
    enabled = [name for name in ("latency", "throughput") if getattr(config, name).enabled]
    wait_until(lambda: tiers_are_healthy(base_url, enabled), STARTUP_TIMEOUT_SECONDS, "every tier's /health")
    # The job names the dashboards, the alert rules and k8s/podmonitor.yaml use.
    cleanup = contextlib.ExitStack()
    prometheus = cleanup.enter_context(running(
        {METRICS_JOB: [f"127.0.0.1:{metrics_port}"], RAY_JOB: [f"127.0.0.1:{ray_metrics_port}"]},
        home / "prometheus"))
    return LiveStack(base_url, metrics_port, ray_metrics_port, prometheus, home, cleanup)


def stop_stack(stack: LiveStack) -> None:
    import ray
    from ray import serve

    stack.cleanup.close()
    serve.shutdown()
    ray.shutdown()
