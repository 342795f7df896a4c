"""deploy/local.yaml with Ray's own tools: `serve deploy` against a `ray start --head` cluster,
and `serve run`; each answers the real OpenAI SDK. Token authentication stays on."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from megaserve.deploy.local import load_serve_config
from tests.live import free_port, tiers_are_healthy, wait_until

pytestmark = pytest.mark.integration
STARTUP_SECONDS = 240


def _config_file(tmp_path: Path) -> tuple[Path, int]:
    """local.yaml with free ports, so the test never collides with anything on the machine."""
    config = load_serve_config(None)
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["metrics"] = {
        "port": free_port(), "bind_host": "127.0.0.1", "multiproc_dir": str(tmp_path / "metrics")}
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def _ask(port: int) -> str:
    wait_until(lambda: tiers_are_healthy(f"http://127.0.0.1:{port}", ["latency", "throughput"]),
               STARTUP_SECONDS, "both tiers' /health", interval=1.0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="megaserve-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        service_tier="priority")
    return raw.headers["x-megaserve-tier"]


@pytest.fixture
def ray_env(tmp_path):
    return dict(os.environ, MEGASERVE_HOME=str(tmp_path / "home"), RAY_AUTH_MODE="token")


def _kill_session(proc: subprocess.Popen) -> None:
    """End a process started in a session of its own, and everything it started (only those:
    `ray stop` would stop every Ray cluster on the machine)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_serve_deploy_against_ray_start_head(tmp_path, ray_env):
    bin_dir = Path(sys.executable).parent
    path, port = _config_file(tmp_path)
    gcs, dashboard = free_port(), free_port()
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", "--port", str(gcs),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
         "--num-cpus", "4", "--disable-usage-stats"],
        env=ray_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{dashboard}", timeout=5).status == 200,
                   STARTUP_SECONDS, "the head's dashboard", interval=1.0)
        deploy = subprocess.run(
            [str(bin_dir / "serve"), "deploy", str(path), "--address", f"http://127.0.0.1:{dashboard}"],
            env=ray_env, capture_output=True, text=True, timeout=120)
        assert deploy.returncode == 0, deploy.stderr
        assert _ask(port) == "latency"
    finally:
        _kill_session(head)


def test_serve_run(tmp_path, ray_env):
    path, port = _config_file(tmp_path)
    serve = shutil.which("serve", path=str(Path(sys.executable).parent))
    # RAY_ADDRESS=local: a cluster of its own, never one a `ray start` left on the machine.
    proc = subprocess.Popen([serve, "run", str(path)], env=dict(ray_env, RAY_ADDRESS="local"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _ask(port) == "latency"
    finally:
        _kill_session(proc)
