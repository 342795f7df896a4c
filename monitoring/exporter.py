"""One metrics endpoint per node, whichever megaserve process happens to hold its port.

Every megaserve process on a node (router, latency and throughput replicas) starts its environment
with `PROMETHEUS_MULTIPROC_DIR` pointing at the same node-local folder, and calls
`start_node_exporter(port)`. One of them binds the port and serves the folder's sum; the others
keep retrying in a daemon thread, so that when the holder dies (a replica restarts), another
takes the port over within `retry_seconds`. The thread that holds the port also retires the gauge
files of processes that no longer exist, so `livesum` gauges do not count dead replicas.

Where a node may host no megaserve process at all, yet is scraped (a Kubernetes pod, whose target
exists as long as the pod), `python -m megaserve.monitoring.exporter --host H --port P` serves the
folder for the node's whole life, the other processes waiting behind it (k8s/rayservice.yaml). In a
pod, SIGTERM comes to every container at once, while the Ray container drains its replicas for
minutes: with `--outlive-processes-in /proc` (the pod's shared PID namespace), the exporter answers
SIGTERM or SIGINT by serving on until no other process of the pod is left, then exits 0.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.exposition import MetricsHandler

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PROG = "python -m megaserve.monitoring.exporter"
RETRY_SECONDS = 5.0  # how soon a waiting process takes a freed port over
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OUTLIVE_CHECK_SECONDS = 1.0  # how often a stopping exporter looks whether the pod's processes are gone
PAUSE_PID = 1  # a pod's pause process, which outlives every container of the pod
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


def other_processes(proc_root: str, own_pid: int) -> list[int]:
    """The pids of the live processes that the proc filesystem at proc_root shows, but own_pid's
    and the pause process'."""
    pids = []
    for name in os.listdir(proc_root):
        if not name.isdigit() or int(name) in (own_pid, PAUSE_PID):
            continue
        try:
            with open(os.path.join(proc_root, name, "stat")) as stat:
                # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
                state = stat.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # it exited, and was reaped, since the listing
            continue
        if state != "Z":  # a zombie has exited already, its parent not having reaped it yet
            pids.append(int(name))
    return sorted(pids)


def _serve_until_stopped_and_alone(host: str, port: int, proc_root: str) -> int:
    # A plain flag, polled: a handler that set a threading.Event could deadlock on the Event's lock,
    # which the main thread holds inside Event.wait when the signal lands.
    stop_requested: list[int] = []
    for signum in STOP_SIGNALS:  # before serving: a stop that comes once the port answers is not lost
        signal.signal(signum, lambda received, _frame: stop_requested.append(received))
    serving = threading.Thread(target=_serve_forever, args=(host, port, RETRY_SECONDS), daemon=True)
    serving.start()
    while not stop_requested:
        if not serving.is_alive():
            return 1  # the port can never be bound (logged)
        time.sleep(OUTLIVE_CHECK_SECONDS)
    log.info("stopping once no other process is left in %s", proc_root)
    # The Ray container drains its replicas for minutes, and they record metrics until they exit.
    while other_processes(proc_root, os.getpid()):
        time.sleep(OUTLIVE_CHECK_SECONDS)
    log.info("no other process is left in %s; stopping", proc_root)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve the node's metrics folder (PROMETHEUS_MULTIPROC_DIR) on host:port in the foreground."""
    parser = argparse.ArgumentParser(prog=PROG, description=main.__doc__)
    parser.add_argument("--host", required=True, help="address to bind, e.g. 0.0.0.0 in a pod")
    parser.add_argument("--port", type=int, required=True, help="the config's metrics.port")
    parser.add_argument("--outlive-processes-in", metavar="PROC_ROOT",
                        help="on SIGTERM or SIGINT, serve on until the proc filesystem at PROC_ROOT shows no "
                             "process but this one and PID 1 (/proc in a pod with shareProcessNamespace); "
                             "without it, they stop the exporter at once")
    args = parser.parse_args(argv)
    folder = multiprocess_dir()
    if folder is None:  # it would serve this process' own, empty, registry: a target up for nothing
        print(f"{PROG}: set {MULTIPROC_ENV} to the node's metrics folder (the config's "
              "metrics.multiproc_dir)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(folder, exist_ok=True)
    if args.outlive_processes_in is not None:
        return _serve_until_stopped_and_alone(args.host, args.port, args.outlive_processes_in)
    _serve_forever(args.host, args.port, RETRY_SECONDS)
    return 1  # it returns only when the port can never be bound (logged)


if __name__ == "__main__":
    sys.exit(main())
