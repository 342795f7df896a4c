"""A live stack for integration tests: a real Ray cluster running the real Serve app on the demo
model, and a real Prometheus scraping it. Started once per test session, on loopback and free ports.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from megaserve.monitoring.promql import METRICS_JOB, RAY_JOB

SCRAPE_INTERVAL_SECONDS = 1
STARTUP_TIMEOUT_SECONDS = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
class Prometheus:
    url: str
    process: subprocess.Popen
    folder: Path

    @classmethod
    def start(cls, jobs: dict[str, list[str]]) -> "Prometheus":
        """Scrape `jobs`: job name -> host:port targets."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("the `prometheus` binary is missing (Debian package prometheus)")
        folder = Path(tempfile.mkdtemp(prefix="megaserve-prometheus-"))
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_SECONDS}s",
                       "evaluation_interval": f"{SCRAPE_INTERVAL_SECONDS}s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()],
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))
        port = free_port()
        process = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: urllib.request.urlopen(url + "/-/ready", timeout=2).status == 200,
                   60, "Prometheus to be ready")
        return cls(url, process, folder)

    def query(self, promql: str) -> list[dict]:
        """Instant query through Prometheus' HTTP API; returns the result vector."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        if body["status"] != "success":
            raise AssertionError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class LiveStack:
    base_url: str
    metrics_port: int
    ray_metrics_port: int
    prometheus: Prometheus
    home: Path

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
    wait_until(lambda: urllib.request.urlopen(base_url + "/health", timeout=5).status == 200,
               STARTUP_TIMEOUT_SECONDS, "the router's /health")
    # The job names the dashboards, the alert rules and k8s/podmonitor.yaml use.
    prometheus = Prometheus.start({METRICS_JOB: [f"127.0.0.1:{metrics_port}"],
                                   RAY_JOB: [f"127.0.0.1:{ray_metrics_port}"]})
    return LiveStack(base_url, metrics_port, ray_metrics_port, prometheus, home)


def stop_stack(stack: LiveStack) -> None:
    import ray
    from ray import serve

    stack.prometheus.stop()
    serve.shutdown()
    ray.shutdown()
