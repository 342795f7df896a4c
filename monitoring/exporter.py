"""One metrics endpoint per node, whichever megaserve process happens to hold its port.

Every megaserve process on a node (router, latency and throughput replicas) starts its environment
with `PROMETHEUS_MULTIPROC_DIR` pointing at the same node-local folder, and calls
`start_node_exporter(port)`. One of them binds the port and serves the folder's sum; the others
keep retrying in a daemon thread, so that when the holder dies (a replica restarts), another
takes the port over within `retry_seconds`. The thread that holds the port also retires the gauge
files of processes that no longer exist, so `livesum` gauges do not count dead replicas.

Where a node may host no megaserve process at all, yet is scraped (a Kubernetes pod, whose target
exists as long as the pod), `python -m megaserve.monitoring.exporter --host H --port P` serves the
folder for the node's whole life, the other processes waiting behind it (k8s/rayservice.yaml).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.exposition import MetricsHandler

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PROG = "python -m megaserve.monitoring.exporter"
RETRY_SECONDS = 5.0  # how soon a waiting process takes a freed port over
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live\w+?_(\d+)\.db$")

log = logging.getLogger(__name__)
_started: set[tuple[str, int]] = set()
_lock = threading.Lock()


def multiprocess_dir() -> str | None:
    """The node-local folder all processes write to, or None when this process records alone."""
    return os.environ.get(MULTIPROC_ENV) or None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def retire_dead_processes(folder: str) -> list[int]:
    """Remove the live-gauge files of processes that have exited; returns their pids."""
    dead = set()
    for name in os.listdir(folder):
        match = _LIVE_GAUGE_FILE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in dead:
        multiprocess.mark_process_dead(pid, folder)
    return sorted(dead)


def _registry() -> CollectorRegistry:
    folder = multiprocess_dir()
    if folder is None:
        from prometheus_client import REGISTRY

        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=folder)
    return registry


def _serve_forever(host: str, port: int, retry_seconds: float) -> None:
    registry = _registry()
    handler = MetricsHandler.factory(registry)
    waiting = False
    while True:
        try:
            server = ThreadingHTTPServer((host, port), handler)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:  # a wrong host or a privileged port: no retry helps
                log.error("cannot serve node metrics on %s:%d: %s", host, port, error)
                return
            if not waiting:  # said once: normally another megaserve process of this node holds it
                log.info("node metrics port %s:%d is taken; taking it over when it frees up (if no "
                         "megaserve process on this node serves it, another program holds it)", host, port)
                waiting = True
            time.sleep(retry_seconds)
            continue
        log.info("serving node metrics on %s:%d", host, port)
        folder = multiprocess_dir()
        if folder is not None:
            janitor = threading.Thread(
                target=_retire_forever, args=(folder, retry_seconds), daemon=True
            )
            janitor.start()
        server.serve_forever()


def _retire_forever(folder: str, period_seconds: float) -> None:
    while True:
        retire_dead_processes(folder)
        time.sleep(period_seconds)


def start_node_exporter(host: str, port: int, retry_seconds: float = RETRY_SECONDS) -> None:
    """Serve this node's metrics on host:port from this process, now or once the port frees up.

    Idempotent per (host, port) within a process. Returns at once; the work is a daemon thread.
    """
    folder = multiprocess_dir()
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    with _lock:
        if (host, port) in _started:
            return
        _started.add((host, port))
    threading.Thread(
        target=_serve_forever, args=(host, port, retry_seconds), daemon=True,
        name=f"megaserve-metrics-{port}",
    ).start()


def main(argv: list[str] | None = None) -> int:
    """Serve the node's metrics folder (PROMETHEUS_MULTIPROC_DIR) on host:port in the foreground."""
    parser = argparse.ArgumentParser(prog=PROG, description=main.__doc__)
    parser.add_argument("--host", required=True, help="address to bind, e.g. 0.0.0.0 in a pod")
    parser.add_argument("--port", type=int, required=True, help="the config's metrics.port")
    args = parser.parse_args(argv)
    folder = multiprocess_dir()
    if folder is None:  # it would serve this process' own, empty, registry: a target up for nothing
        print(f"{PROG}: set {MULTIPROC_ENV} to the node's metrics folder (the config's "
              "metrics.multiproc_dir)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(folder, exist_ok=True)
    _serve_forever(args.host, args.port, RETRY_SECONDS)
    return 1  # it returns only when the port can never be bound (logged)


if __name__ == "__main__":
    sys.exit(main())
