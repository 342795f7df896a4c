"""The node exporter: several processes, one port, their metrics summed, take-over on death."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.request

import prometheus_client
import pytest
from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict

from megaserve.monitoring import exporter
from megaserve.monitoring.exporter import (
    OUTLIVE_CHECK_SECONDS,
    RECORDER_FILE,
    listening_family,
    raylets,
    recording_processes,
    retire_dead_processes,
    start_node_exporter,
)
from tests.live import UNASSIGNED_ADDRESS, free_port, has_ipv6_loopback, wait_until


RECORDER = textwrap.dedent("""
    import sys, time
    from prometheus_client import Gauge
    from megaserve.monitoring import metrics
    from megaserve.monitoring.exporter import start_node_exporter
    port, tokens = int(sys.argv[1]), int(sys.argv[2])
    metrics.GENERATION_TOKENS.labels(tier="latency", model="m").inc(tokens)
    metrics.BUSY_REPLICAS.labels(tier="latency", model="m").set(1)
    metrics.KERNEL_LAUNCHES_PER_STEP.labels(tier="latency", model="m", engine=f"e{tokens}").set(tokens)
    metrics.STEP_DURATION.labels(tier="latency", model="m", phase="decode").observe(0.0004)
    # as SGLang declares its gauges (`sglang:num_running_reqs`), recorded into the same folder
    Gauge("sglang:num_running_reqs", "running", ["engine"], multiprocess_mode="mostrecent").labels(
        engine=f"e{tokens}").set(tokens)
    start_node_exporter("127.0.0.1", port, retry_seconds=0.2)
    print("ready", flush=True)
    time.sleep(600)
""")


EVERY_KIND = textwrap.dedent("""
    from prometheus_client import Counter, Gauge, Histogram, Summary
    Counter("c", "c").inc()
    Histogram("h", "h").observe(1)
    Summary("s", "s").observe(1)
    for mode in sorted(Gauge._MULTIPROC_MODES):
        Gauge(f"g_{mode}", "g", multiprocess_mode=mode).set(1)
""")


def test_every_file_prometheus_client_writes_is_a_recorder_s_and_names_its_pid(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    subprocess.run([sys.executable, "-c", EVERY_KIND], env=env, check=True)
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == 3 + len(prometheus_client.Gauge._MULTIPROC_MODES)  # one file per kind
    pids = {RECORDER_FILE.match(name).group(1) for name in names}
    assert len(pids) == 1 and pids != {str(os.getpid())}
    for name in ("app.db", "counter_x.db", "cache_12.db", "gauge_12.db", "counter_12.db.bak"):
        assert not RECORDER_FILE.match(name), name


def _scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture
def recorders(tmp_path):
    port = free_port()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"))
    procs = []

    def start(tokens: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", RECORDER, str(port), str(tokens)],
                                env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        procs.append(proc)
        return proc

    yield port, start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_one_port_serves_the_sum_of_every_process(recorders):
    port, start = recorders
    start(3)
    start(4)
    tokens = 'megaserve_generation_tokens_total{model="m",tier="latency"}'
    samples = wait_until(lambda: (s := _scrape(port)).get(tokens) == 7 and s, 20, "the sum")
    assert samples['megaserve_busy_replicas{model="m",tier="latency"}'] == 2
    bucket = 'megaserve_step_duration_seconds_bucket{le="0.0005",model="m",phase="decode",tier="latency"}'
    assert samples[bucket] == 2


def test_another_process_takes_over_and_dead_gauges_are_retired(recorders):
    port, start = recorders
    first = start(3)
    start(4)
    busy = 'megaserve_busy_replicas{model="m",tier="latency"}'
    wait_until(lambda: _scrape(port).get(busy) == 2, 20, "both processes")
    first.kill()
    first.wait()
    # Whichever process held the port, the survivor serves within the retry period, and the dead
    # process' live gauge no longer counts; its counter increments stay (counters are totals).
    samples = wait_until(lambda: (s := _scrape(port)).get(busy) == 1 and s, 20, "the take-over")
    assert samples['megaserve_generation_tokens_total{model="m",tier="latency"}'] == 7
    launches = 'megaserve_kernel_launches_per_step{{engine="e{}",model="m",tier="latency"}}'
    assert samples[launches.format(4)] == 4 and launches.format(3) not in samples
    running = 'sglang:num_running_reqs{{engine="e{}"}}'  # a gauge of another mode than ours goes too
    assert samples[running.format(4)] == 4 and running.format(3) not in samples


# A process that recorded one SGLang-style gauge (`mostrecent`, not `live*`) and exited.
DEAD_GAUGE_RECORDER = textwrap.dedent("""
    import sys
    from prometheus_client import Gauge
    Gauge("sglang:num_running_reqs", "running", multiprocess_mode="mostrecent").set(int(sys.argv[1]))
""")
JANITOR_HELD_OFF_SECONDS = 0.5  # how long a scrape's read may hold the janitor off before the race is forced


def _dead_gauge_file(folder, running_requests: int):
    subprocess.run([sys.executable, "-c", DEAD_GAUGE_RECORDER, str(running_requests)],
                   env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder)), check=True)
    (gauge,) = folder.glob("gauge_mostrecent_*.db")
    return gauge


def test_a_scrape_reads_the_gauge_files_it_listed_though_the_janitor_retires_them_meanwhile(tmp_path, monkeypatch):
    # prometheus_client lists the folder, then reads each file: a file gone in between is skipped for
    # `live*` gauges only and re-raised for any other mode, which would answer the scrape HTTP 500.
    folder, port = tmp_path / "metrics", free_port()
    folder.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    retired_at_start = _dead_gauge_file(folder, running_requests=1)
    # A janitor period longer than the test: the one sweep after the start is the only one of its own.
    start_node_exporter("127.0.0.1", port, retry_seconds=600)
    wait_until(lambda: not retired_at_start.exists(), 20, "the janitor's first sweep")
    _dead_gauge_file(folder, running_requests=2)
    janitors = []
    listing = multiprocess.glob.glob

    def list_then_retire(pattern: str) -> list[str]:
        # The worst ordering: the janitor sweeps between the listing and the reads.
        files = listing(pattern)
        janitor = threading.Thread(target=retire_dead_processes, args=(str(folder),))
        janitor.start()
        janitor.join(JANITOR_HELD_OFF_SECONDS)
        janitors.append(janitor)
        return files

    monkeypatch.setattr(multiprocess, "glob", types.SimpleNamespace(glob=list_then_retire))
    assert _scrape(port)['sglang:num_running_reqs'] == 2  # read as listed, not a 500
    janitors[0].join()
    assert not list(folder.glob("gauge_*.db"))  # and retired once the scrape had read it
    assert 'sglang:num_running_reqs' not in _scrape(port)


def test_a_host_it_cannot_bind_is_logged_once_not_retried(caplog):
    with caplog.at_level(logging.ERROR, logger="megaserve.monitoring.exporter"):
        start_node_exporter(UNASSIGNED_ADDRESS, free_port(), retry_seconds=0.05)
        wait_until(lambda: caplog.records, 10, "the error")
        time.sleep(0.3)  # several retry periods
    assert len(caplog.records) == 1
    assert f"cannot serve node metrics on {UNASSIGNED_ADDRESS}" in caplog.records[0].getMessage()


def test_a_port_held_by_another_program_is_logged_once_while_it_waits(caplog):
    with socket.socket() as holder, caplog.at_level(logging.INFO, logger="megaserve.monitoring.exporter"):
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start_node_exporter("127.0.0.1", port, retry_seconds=0.05)
        wait_until(lambda: caplog.records, 10, "the message")
        time.sleep(0.3)  # several retry periods
    waiting = [r for r in caplog.records if "is taken" in r.getMessage()]
    assert len(waiting) == 1 and f"127.0.0.1:{port}" in waiting[0].getMessage()


def test_starting_the_exporter_twice_on_one_port_starts_one_thread(caplog, monkeypatch):
    # A second call (a replica that builds its engine again) must not start a thread that waits on the
    # port this process holds already, saying it "is taken" by another process.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    port = free_port()
    with caplog.at_level(logging.INFO, logger="megaserve.monitoring.exporter"):
        start_node_exporter("127.0.0.1", port, retry_seconds=0.05)
        start_node_exporter("127.0.0.1", port, retry_seconds=0.05)
        wait_until(lambda: any("serving node metrics" in r.getMessage() for r in caplog.records), 10, "the serving")
        time.sleep(0.3)  # several retry periods
    assert len([t for t in threading.enumerate() if t.name == f"megaserve-metrics-{port}"]) == 1
    assert not [r for r in caplog.records if "is taken" in r.getMessage()]
    assert _scrape(port)  # and the one thread serves


def test_an_idle_connection_is_closed_and_scrapes_go_on(caplog, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(exporter, "IDLE_CONNECTION_SECONDS", 0.2)
    port = free_port()
    with caplog.at_level(logging.INFO, logger="megaserve.monitoring.exporter"):
        start_node_exporter("127.0.0.1", port, retry_seconds=0.05)
        wait_until(lambda: any("serving node metrics" in r.getMessage() for r in caplog.records), 10, "the serving")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # and a request never sent
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request never finished
    for connection in [*idle, half]:
        connection.settimeout(5.0)  # far past the idle limit: a connection kept open fails here
        assert connection.recv(1024) == b""  # closed by the exporter
        connection.close()
    assert _scrape(port)


@pytest.mark.parametrize(("host", "family"), [("::", socket.AF_INET6), ("::1", socket.AF_INET6),
                                              ("0.0.0.0", socket.AF_INET), ("127.0.0.1", socket.AF_INET)])
def test_the_listening_family_is_the_host_s_own(host, family):
    assert listening_family(host, 9400) == family


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_host_is_served(caplog, monkeypatch):
    # http.server's own server is IPv4 only: "::1" failed to bind, and nothing served the metrics.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    port = free_port()
    with caplog.at_level(logging.INFO, logger="megaserve.monitoring.exporter"):
        start_node_exporter("::1", port, retry_seconds=0.05)
        wait_until(lambda: any("serving node metrics" in r.getMessage() for r in caplog.records), 10, "the serving")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(name.startswith("python_info") for name in _scrape(port, "[::1]"))


def _exporter(port: int, env: dict[str, str], *args: str, host: str = "127.0.0.1") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megaserve.monitoring.exporter", "--host", host,
                             "--port", str(port), *args], env=env, stderr=subprocess.PIPE, text=True)


def _fake_process(proc_root, pid: int, comm: str, state: str = "S") -> None:
    """An entry of a proc filesystem, as Linux writes /proc/<pid>/stat (fields past the ppid cut)."""
    (proc_root / str(pid)).mkdir(parents=True)
    (proc_root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")


def test_the_standalone_exporter_serves_the_folder_with_no_megaserve_process_and_after_them(
        recorders, tmp_path):
    port, start = recorders
    exporter = _exporter(port, dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics")))
    try:
        # Up before any megaserve process runs on the node (a pod whose tray hosts none stays up).
        wait_until(lambda: _scrape(port) == {}, 20, "the exporter")
        recorder = start(3)  # its own exporter thread waits behind the standalone one
        busy = 'megaserve_busy_replicas{model="m",tier="latency"}'
        wait_until(lambda: _scrape(port).get(busy) == 1, 20, "the recorder's metrics")
        recorder.kill()
        recorder.wait()
        samples = wait_until(lambda: (s := _scrape(port)).get(busy) is None and s, 20, "the retirement")
        assert samples['megaserve_generation_tokens_total{model="m",tier="latency"}'] == 3
        assert exporter.poll() is None
    finally:
        exporter.kill()
        exporter.wait()


def test_the_standalone_exporter_refuses_to_run_without_the_metrics_folder():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    exporter = _exporter(free_port(), env)
    _, stderr = exporter.communicate(timeout=60)
    assert exporter.returncode == 2
    assert "set PROMETHEUS_MULTIPROC_DIR to the node's metrics folder" in stderr


def _recorded(folder, *names: str) -> None:
    """Empty metric files, as prometheus_client's multiprocess mode makes and names them: "<kind>_<pid>.db"."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        MmapedDict(str(folder / name)).close()


def test_the_recording_processes_are_the_running_writers_of_the_folder_but_itself(tmp_path):
    proc, folder = tmp_path / "proc", tmp_path / "metrics"
    _fake_process(proc, 1, "pause")
    _fake_process(proc, 7, "python")  # the exporter itself
    _fake_process(proc, 20, "ray::Replica")
    _fake_process(proc, 21, "ray::Router) Z (x")  # a comm may hold ") Z (": the state follows the last ")"
    _fake_process(proc, 22, "ray::IDLE", state="Z")  # exited, not yet reaped
    _fake_process(proc, 30, "envoy")  # a mesh sidecar: it never records, so it holds nothing up
    (proc / "self").mkdir()
    _recorded(folder, "counter_7.db", "counter_20.db", "histogram_20.db", "gauge_livesum_21.db",
              "histogram_22.db", "counter_23.db",  # 23 exited and was reaped
              "gauge_all_24.db.tmp", "notes.txt")
    assert recording_processes(str(folder), str(proc), own_pid=7) == [20, 21]


def test_the_raylets_are_the_running_processes_of_that_name(tmp_path):
    _fake_process(tmp_path, 1, "pause")
    _fake_process(tmp_path, 40, "raylet")
    _fake_process(tmp_path, 41, "raylet", state="Z")  # exited, not yet reaped
    _fake_process(tmp_path, 42, "ray::IDLE")
    _fake_process(tmp_path, 43, "raylet) (x")  # not a raylet: the name is all between the parentheses
    (tmp_path / "self").mkdir()
    assert raylets(str(tmp_path)) == [40]


def test_the_recording_processes_of_the_real_proc_filesystem_leave_out_exited_ones(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _recorded(tmp_path, f"counter_{child.pid}.db")
        assert recording_processes(str(tmp_path), "/proc", os.getpid()) == [child.pid]
        child.kill()
        wait_until(lambda: not recording_processes(str(tmp_path), "/proc", os.getpid()), 10, "the zombie left out")
        assert child.poll() is not None  # it was a zombie until now
        assert recording_processes(str(tmp_path), "/proc", os.getpid()) == []
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_standalone_exporter_serves_until_the_recording_processes_exit_and_lingers(tmp_path, stop):
    # A pod with shareProcessNamespace: the pause process, the exporter, a replica of the Ray
    # container, which drains for minutes after the SIGTERM that all containers get, and a mesh's
    # native sidecar, which Kubernetes stops only after every regular container has exited.
    proc, folder, port, linger = tmp_path / "proc", tmp_path / "metrics", free_port(), 2.0
    _fake_process(proc, 1, "pause")
    exporter = _exporter(port, dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder)),
                         "--outlive-processes-in", str(proc), "--linger-seconds", str(linger))
    try:
        _fake_process(proc, exporter.pid, "python")
        _fake_process(proc, 4242, "ray::Replica")
        _fake_process(proc, 5555, "envoy")
        _recorded(folder, "counter_4242.db")
        wait_until(lambda: _scrape(port) == {}, 20, "the exporter")
        exporter.send_signal(stop)
        deadline = time.monotonic() + 3  # several checks of the recording processes
        while time.monotonic() < deadline:
            assert _scrape(port) == {}
            time.sleep(0.2)
        assert exporter.poll() is None
        shutil.rmtree(proc / "4242")
        gone = time.monotonic()
        time.sleep(linger / 2)  # well inside the linger, past one check of the processes
        assert _scrape(port) == {}
        _, stderr = exporter.communicate(timeout=10)
        assert exporter.returncode == 0, stderr
        assert time.monotonic() - gone >= linger
    finally:
        exporter.kill()
        exporter.wait()


def _named_process(folder, comm: str) -> subprocess.Popen:
    """A real process that /proc names comm, as it names a program after its executable's file."""
    executable = folder / comm
    executable.symlink_to(sys.executable)
    return subprocess.Popen([str(executable), "-c", "import time; time.sleep(600)"])


def _pod_view(proc_root, *pids: int) -> None:
    """A proc filesystem that shows only these real processes, as a pod's shared PID namespace would."""
    proc_root.mkdir(exist_ok=True)
    for pid in pids:
        (proc_root / str(pid)).symlink_to(f"/proc/{pid}")


def test_a_stopped_standalone_exporter_serves_while_the_pod_s_raylet_drains_with_nothing_recording(tmp_path):
    # The second tray of a TP8 replica: its Ray container holds a bundle and records no metrics, yet its
    # raylet drains for minutes after the SIGTERM, and the pod, still scraped, lives as long. A mesh's
    # sidecar, which Kubernetes stops after the Ray container, holds nothing up.
    proc, folder, port, linger = tmp_path / "proc", tmp_path / "metrics", free_port(), 1.0
    raylet, sidecar = _named_process(tmp_path, "raylet"), _named_process(tmp_path, "envoy")
    exporter = _exporter(port, dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder)),
                         "--outlive-processes-in", str(proc), "--linger-seconds", str(linger))
    try:
        _pod_view(proc, exporter.pid, raylet.pid, sidecar.pid)
        wait_until(lambda: _scrape(port) == {}, 20, "the exporter")
        exporter.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + linger + 3 * OUTLIVE_CHECK_SECONDS  # past where it stopped on its own
        while time.monotonic() < deadline:
            assert _scrape(port) == {}
            time.sleep(0.2)
        raylet.kill()  # the drain is over: the raylet exits, and Ray stops the node's other processes
        raylet.wait()
        _, stderr = exporter.communicate(timeout=10)
        assert exporter.returncode == 0, stderr
        assert sidecar.poll() is None
    finally:
        for process in (exporter, raylet, sidecar):
            process.kill()
            process.wait()


@pytest.mark.parametrize("args, message", [
    *[(["--linger-seconds", value, "--outlive-processes-in", "/proc"], "--linger-seconds must be a number of "
       "seconds, 0 or more") for value in ("-1", "nan", "inf")],
    (["--linger-seconds", "5"], "--linger-seconds needs --outlive-processes-in"),
])
def test_a_linger_it_cannot_honour_is_refused(tmp_path, args, message):
    exporter = _exporter(free_port(), dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path)), *args)
    _, stderr = exporter.communicate(timeout=60)
    assert exporter.returncode == 2
    assert message in stderr


@pytest.mark.parametrize("port", ["0", "70000"])
def test_a_port_it_cannot_serve_on_is_refused_by_name(tmp_path, port):
    # 0 would bind a port that nobody is told; past 65535 the bind raised in the serving thread
    exporter = _exporter(port, dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path)))
    try:
        _, stderr = exporter.communicate(timeout=20)  # refused at once; before, it served
    finally:
        exporter.kill()  # one that serves after all
    assert exporter.returncode == 2
    assert "argument --port:" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_without_outliving_a_stop_signal_stops_the_standalone_exporter_at_once(tmp_path, stop):
    # A run on a node (or a terminal) that shares its PID namespace with every other process.
    port = free_port()
    exporter = _exporter(port, dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics")))
    try:
        wait_until(lambda: _scrape(port) == {}, 20, "the exporter")
        exporter.send_signal(stop)
        _, stderr = exporter.communicate(timeout=10)
    finally:
        exporter.kill()
        exporter.wait()
    assert exporter.returncode == 0, stderr  # a stop asked for, as with --outlive-processes-in
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_an_outliving_exporter_that_cannot_bind_its_host_exits_1(tmp_path):
    exporter = _exporter(free_port(), dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics")),
                         "--outlive-processes-in", str(tmp_path), host=UNASSIGNED_ADDRESS)
    _, stderr = exporter.communicate(timeout=60)
    assert exporter.returncode == 1
    assert f"cannot serve node metrics on {UNASSIGNED_ADDRESS}" in stderr
