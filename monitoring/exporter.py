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
SIGTERM or SIGINT by serving on until every process that recorded into the folder and the raylet
have exited, then for `--linger-seconds` more (a scrape interval, so that their last values are
scraped), and exits 0. The raylet, because a pod may run no recording process (the second tray of a
TP8 replica holds only a bundle) and still be scraped while it drains: it lives until the drain is
over, after which Ray stops the pod's other processes. Other processes of the pod (a service mesh's
sidecars, which Kubernetes may stop last) do not hold it up. Without that flag, SIGTERM or SIGINT
(Ctrl-C) stops it at once, and it exits 0 as well.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, multiprocess
from prometheus_client.exposition import MetricsHandler

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PROG = "python -m megaserve.monitoring.exporter"
TCP_PORTS = range(1, 2**16)  # 0 would bind a port that nobody is told
RETRY_SECONDS = 5.0  # how soon a waiting process takes a freed port over
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OUTLIVE_CHECK_SECONDS = 1.0  # how often a stopping exporter looks whether the processes it outlives are gone
RAYLET = "raylet"  # the Ray node's process, as the proc filesystem names it (after its executable)
STOP_CHECK_SECONDS = 0.2  # how soon a stop signal (or a port it can never bind) ends the serving
# A connection's longest silence (before its request, or within it) before it is closed: each one
# holds a thread, and prometheus_client's handler kept an idle one for ever (300 idle connections:
# 300 threads). A scrape sends its request as soon as it connects.
IDLE_CONNECTION_SECONDS = 10.0
_GAUGE_MODES = "|".join(sorted(Gauge._MULTIPROC_MODES))
# prometheus_client's "<kind>_<pid>.db", one per kind and process: a counter, histogram or summary,
# or "gauge_<multiprocess_mode>". Nothing else in the folder, which the user names, is ours.
RECORDER_FILE = re.compile(rf"^(?:counter|histogram|summary|gauge_(?:{_GAUGE_MODES}))_(\d+)\.db$")
GAUGE_FILE = re.compile(rf"^gauge_(?:{_GAUGE_MODES})_(\d+)\.db$")

log = logging.getLogger(__name__)
_started: set[tuple[str, int]] = set()
_lock = threading.Lock()
# Held by a scrape from its listing of the folder to its last read, and by the janitor's sweep:
# prometheus_client skips a file gone in between for `live*` gauges only, and re-raises for the
# others (SGLang's `mostrecent` ones), which fails the whole scrape. Scrapes queue behind each other
# too, for the milliseconds that one takes.
_gauge_files_lock = threading.Lock()


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
    """Remove the gauge files of processes that have exited, whatever their multiprocess mode; returns
    their pids. A gauge is a process' present state, which ends with it: SGLang's own gauges (its
    running and queued requests, in this folder too) are `mostrecent`, which prometheus_client would
    go on serving from a dead process' file. Counters, histograms and summaries stay: their sums over
    every process that ever ran must never go down."""
    dead = set()
    with _gauge_files_lock:
        for name in os.listdir(folder):
            match = GAUGE_FILE.match(name)
            if match and not _pid_alive(int(match.group(1))):
                dead.add(int(match.group(1)))
                try:
                    os.remove(os.path.join(folder, name))
                except FileNotFoundError:  # another exporter of the node retired it first
                    pass
    return sorted(dead)


class _FolderCollector(multiprocess.MultiProcessCollector):
    """The folder's sum, read while no janitor of this process retires a gauge file of it."""

    def collect(self):
        with _gauge_files_lock:
            return super().collect()  # reads every file before it returns


def _registry() -> CollectorRegistry:
    folder = multiprocess_dir()
    if folder is None:
        from prometheus_client import REGISTRY

        return REGISTRY
    registry = CollectorRegistry()
    _FolderCollector(registry, path=folder)
    return registry


def listening_family(host: str, port: int) -> socket.AddressFamily:
    """The address family of a server listening at host:port: that of host's first passive address
    (IPv6 for "::" or "::1", IPv4 for "0.0.0.0"), as prometheus_client's own server picks it.
    Raises socket.gaierror (an OSError) for a host that does not resolve."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]


class _MetricsServer(ThreadingHTTPServer):
    """ThreadingHTTPServer on host's own address family: http.server's own is IPv4 only, so an IPv6
    bind_host would fail to bind."""

    def __init__(self, host: str, port: int, handler) -> None:
        self.address_family = listening_family(host, port)
        super().__init__((host, port), handler)


def _serve_forever(host: str, port: int, retry_seconds: float) -> None:
    registry = _registry()
    handler = type("MetricsHandlerWithTimeout", (MetricsHandler.factory(registry),),
                   {"timeout": IDLE_CONNECTION_SECONDS})
    waiting = False
    while True:
        try:
            server = _MetricsServer(host, port, handler)
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


def _running_in(proc_root: str, pid: int, named: str | None = None) -> bool:
    """Whether the process runs (as `named`, when given), as the proc filesystem at proc_root shows it."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
            before_state, _, after_name = stat.read().rpartition(")")
    except (FileNotFoundError, ProcessLookupError):  # it exited, and was reaped (or never ran here)
        return False
    name, state = before_state.partition("(")[2], after_name.split()[0]
    # a zombie has exited already, its parent not having reaped it yet
    return state != "Z" and named in (None, name)


def recording_processes(folder: str, proc_root: str, own_pid: int) -> list[int]:
    """The pids of the processes that have recorded into the metrics folder and still run, as the
    proc filesystem at proc_root shows them, but own_pid."""
    pids = set()
    for name in os.listdir(folder):
        match = RECORDER_FILE.match(name)
        if match and int(match.group(1)) != own_pid:
            pids.add(int(match.group(1)))
    return sorted(pid for pid in pids if _running_in(proc_root, pid))


def raylets(proc_root: str) -> list[int]:
    """The pids of the raylets that run, as the proc filesystem at proc_root shows them."""
    pids = (int(entry) for entry in os.listdir(proc_root) if entry.isdigit())
    return sorted(pid for pid in pids if _running_in(proc_root, pid, named=RAYLET))


def _serve_until_stopped(host: str, port: int, proc_root: str | None, linger_seconds: float) -> int:
    # A plain flag, polled: a handler that set a threading.Event could deadlock on the Event's lock,
    # which the main thread holds inside Event.wait when the signal lands. Handling SIGINT too (rather
    # than Python's KeyboardInterrupt) makes Ctrl-C a clean stop, not a traceback from wherever it lands.
    stop_requested: list[int] = []
    for signum in STOP_SIGNALS:  # before serving: a stop that comes once the port answers is not lost
        signal.signal(signum, lambda received, _frame: stop_requested.append(received))
    serving = threading.Thread(target=_serve_forever, args=(host, port, RETRY_SECONDS), daemon=True)
    serving.start()
    while not stop_requested:
        if not serving.is_alive():
            return 1  # the port can never be bound (logged)
        time.sleep(STOP_CHECK_SECONDS)
    if proc_root is None:  # no --outlive-processes-in: nothing to wait for
        return 0
    folder = multiprocess_dir()
    log.info("stopping once the processes recording into %s and the raylet have exited (as %s shows them)",
             folder, proc_root)
    # The Ray container drains its replicas for minutes, and they record metrics until they exit; the
    # raylet lives as long as the drain, on a pod that hosts no recording process too.
    while recording_processes(folder, proc_root, os.getpid()) or raylets(proc_root):
        time.sleep(OUTLIVE_CHECK_SECONDS)
    log.info("no process recording into %s nor a raylet is left; stopping in %g s", folder, linger_seconds)
    time.sleep(linger_seconds)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve the node's metrics folder (PROMETHEUS_MULTIPROC_DIR) on host:port in the foreground."""
    parser = argparse.ArgumentParser(prog=PROG, description=main.__doc__)
    parser.add_argument("--host", required=True, help="address to bind, e.g. 0.0.0.0 in a pod")
    parser.add_argument("--port", type=int, required=True, help="the config's metrics.port")
    parser.add_argument("--outlive-processes-in", metavar="PROC_ROOT",
                        help="on SIGTERM or SIGINT, serve on until the proc filesystem at PROC_ROOT shows none "
                             "of the processes that recorded into the folder running, nor a raylet (/proc in a "
                             "pod with shareProcessNamespace); without it, they stop the exporter at once")
    parser.add_argument("--linger-seconds", type=float, default=0.0,
                        help="with --outlive-processes-in: serve this much longer once those processes have "
                             "exited, so that a scrape reads their last values (at least the scrape interval)")
    args = parser.parse_args(argv)
    if args.port not in TCP_PORTS:  # past them the bind raised in the serving thread
        parser.error(f"argument --port: a port is {TCP_PORTS[0]}-{TCP_PORTS[-1]}, got {args.port}")
    if not math.isfinite(args.linger_seconds) or args.linger_seconds < 0:  # time.sleep raises on nan and inf
        parser.error(f"--linger-seconds must be a number of seconds, 0 or more, not {args.linger_seconds:g}")
    if args.linger_seconds and args.outlive_processes_in is None:
        parser.error("--linger-seconds needs --outlive-processes-in: without it a stop signal stops at once")
    folder = multiprocess_dir()
    if folder is None:  # it would serve this process' own, empty, registry: a target up for nothing
        print(f"{PROG}: set {MULTIPROC_ENV} to the node's metrics folder (the config's "
              "metrics.multiproc_dir)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(folder, exist_ok=True)
    return _serve_until_stopped(args.host, args.port, args.outlive_processes_in, args.linger_seconds)


if __name__ == "__main__":
    sys.exit(main())
