"""A real Prometheus server for tests: loopback, a free port, a throw-away storage folder."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

SCRAPE_INTERVAL_SECONDS = 1
START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 10.0
HTTP_TIMEOUT_SECONDS = 10.0


# Ports for test servers: above Ray's worker ports (10002-19999 by default) and below the kernel's
# ephemeral range (Linux: from 32768), which every port-0 bind draws from - and a Ray cluster
# starting up makes dozens of those, any of which could take a port picked that way before the
# server it was picked for binds it.
TEST_PORTS = range(20_000, 32_768)
PORT_ATTEMPTS = 100
_handed_out: set[int] = set()  # ports already given to a caller, which may not have bound them yet


def free_port() -> int:
    """A random port from TEST_PORTS that nothing is bound to now and no earlier call returned."""
    for port in random.sample(TEST_PORTS, PORT_ATTEMPTS):
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port among {PORT_ATTEMPTS} tries in {TEST_PORTS}")


def binary() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}",
                                    timeout=HTTP_TIMEOUT_SECONDS) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus answered {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result vector (or a one-element list for a scalar)."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] == "vector":
            return data["result"]
        return [{"metric": {}, "value": data["result"]}]

    def targets_up(self) -> dict[str, int]:
        """job -> number of healthy targets."""
        healthy: dict[str, int] = {}
        for target in self._get("/api/v1/targets", state="active")["activeTargets"]:
            job = target["labels"]["job"]
            healthy[job] = healthy.get(job, 0) + (target["health"] == "up")
        return healthy


@contextmanager
def running(jobs: dict[str, list[str]], workdir: Path) -> Iterator[Prometheus]:
    """Start Prometheus scraping `jobs` (job name -> host:port targets); stop it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_SECONDS}s",
                   "evaluation_interval": f"{SCRAPE_INTERVAL_SECONDS}s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    process = subprocess.Popen(
        [binary(), f"--config.file={config_file}", f"--web.listen-address=127.0.0.1:{port}",
         f"--storage.tsdb.path={workdir / 'data'}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"Prometheus exited: {(workdir / 'prometheus.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("Prometheus did not become ready") from None
                time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
