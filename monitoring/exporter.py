"""One metrics endpoint per node, whichever megaserve process happens to hold its port.

Every megaserve process on a node (router, latency and throughput replicas) starts its environment
with `PROMETHEUS_MULTIPROC_DIR` pointing at the same node-local folder, and calls
`start_node_exporter(port)`. One of them binds the port and serves the folder's sum; the others
keep retrying in a daemon thread, so that when the holder dies (a replica restarts), another
takes the port over within `retry_seconds`. The thread that holds the port also retires the gauge
files of processes that no longer exist, so `livesum` gauges do not count dead replicas.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.exposition import MetricsHandler

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
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


def start_node_exporter(host: str, port: int, retry_seconds: float = 5.0) -> None:
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
