"""`megaserve up` refuses a bad Serve config, argument or model folder in one message, before Ray starts."""

from __future__ import annotations

import http.server
import importlib.util
import json
import socket
import threading
import subprocess
import sys

import pytest
import yaml

from megaserve.deploy.config import AppConfig
from megaserve.deploy.env import Environment
from megaserve.deploy.builder import build_app
from megaserve.deploy.local import (
    ROUTES_PATH,
    proxy_routes_apps,
    _builder,
    _prepare_node,
    app_urls,
    refuse_a_taken_http_port,
    refuse_metrics_in_use,
    refuse_unservable_model_dirs,
    refuse_what_this_machine_cannot_run,
)
from tests.live import UNASSIGNED_ADDRESS, free_port, has_ipv6_loopback
from tests.model_factory import make_tiny_model

BUILDER = "megaserve.deploy.builder:build_app"


def _up(config_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "up", str(config_path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("config", "message"), [
    (None, "No such file or directory"),
    ("applications: [\n", "while parsing"),
    (yaml.safe_dump({"http_options": {"port": 8000}}), "a Serve config needs an `applications` list"),
    (yaml.safe_dump({"applications": [{"name": "x"}]}), "every application needs an `import_path`"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "args": {"latency": {"tp_size": 0}}}]}),
     "application 'default': latency.tp_size: Input should be greater than or equal to 1"),
    (yaml.safe_dump({"proxy_location": "Everywhere", "applications": [{"import_path": BUILDER}]}),
     "proxy_location: Input should be 'Disabled', 'HeadOnly' or 'EveryNode'"),
    (yaml.safe_dump({"http_options": [8000], "applications": [{"import_path": BUILDER}]}),
     "http_options: Input should be a valid dictionary"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER}, {"import_path": BUILDER}]}),
     'Found multiple configs for application "default"'),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "args": {"metrics": {"port": 8000}}}]}),
     "metrics.port 8000 is the HTTP port too"),
    (yaml.safe_dump({"http_options": {"port": "8000"},  # Serve reads it as the number
                     "applications": [{"import_path": BUILDER, "args": {"metrics": {"port": 8000}}}]}),
     "metrics.port 8000 is the HTTP port too"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "runtime_env": {"pip": ["x"]},
                                       "deployments": [{"name": "RouterDeployment"}]}],
                     "logging_config": {"encoding": "JSON"}}),
     "megaserve up does not apply logging_config, applications[].deployments, applications[].runtime_env; "
     "run the file with `serve run`"),
    (yaml.safe_dump({"http_options": {"port": 70000}, "applications": [{"import_path": BUILDER}]}),
     "http_options.port must be 1-65535, got 70000"),
    (yaml.safe_dump({"http_options": {"port": 0}, "applications": [{"import_path": BUILDER}]}),
     "http_options.port must be 1-65535, got 0"),
    (yaml.safe_dump({"applications": [{"import_path": "megaserve.deploy.builder:no_such_builder"}]}),
     "import_path 'megaserve.deploy.builder:no_such_builder' names no application builder"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "args": {"latency": {
        "device": "cuda", "tp_size": 8, "num_replicas": 64}}}]}),
     "the tiers need 512 for latency (num_replicas x tp_size) GPUs, and this machine has"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "args": {"latency": {"cpus_per_replica": 100000}}}]}),
     "the tiers reserve 100000 for latency (num_replicas x cpus_per_replica)"),
], ids=["missing-file", "bad-yaml", "no-applications", "no-import-path", "invalid-app-config", "serve-schema",
        "http-options-not-a-mapping", "two-default-apps", "metrics-port-is-http-port",
        "metrics-port-is-http-port-as-text", "not-applied", "http-port-past-tcp", "http-port-0", "no-such-builder",
        "more-gpus-than-here", "more-cpus-than-here"])
def test_a_bad_config_is_one_message_and_exit_code_2(tmp_path, config, message):
    path = tmp_path / "serve.yaml"
    if config is not None:
        path.write_text(config)
    done = _up(path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "starting Ray" not in done.stdout


def test_a_metrics_folder_that_cannot_be_made_is_one_message(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"port": free_port()},  # ports are checked before the folder
                                    "applications": [{"import_path": BUILDER, "args": {"metrics": {
                                        "port": free_port(), "multiproc_dir": str(taken)}}}]}))
    done = _up(path)
    assert done.returncode == 2
    assert "File exists" in done.stderr and "Traceback" not in done.stderr
    assert "starting Ray" not in done.stdout


def test_a_model_path_without_a_model_is_one_message_naming_what_is_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"import_path": BUILDER,
                                                      "args": {"model": {"path": str(empty)}}}]}))
    done = _up(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (f"model.path {empty} is not a complete model folder: no config.json; no tokenizer.json; "
            f"no model.safetensors or model.safetensors.index.json in {empty}") in done.stderr
    assert "starting Ray" not in done.stdout


def test_an_http_port_in_use_is_one_message(tmp_path):
    with socket.socket() as holder:  # another server, listening on the port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": port},
                                        "applications": [{"import_path": BUILDER}]}))
        done = _up(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"megaserve up: the HTTP port {port} on 127.0.0.1 is in use" in done.stderr
    assert "starting Ray" not in done.stdout


def test_the_port_of_a_run_that_just_stopped_is_free_and_another_serve_s_is_taken():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its port keeps a connection in TIME_WAIT
        client.close()
    refuse_a_taken_http_port("127.0.0.1", port)
    with socket.socket() as proxy:  # Serve's proxy sets both: a second proxy would share its port
        proxy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        proxy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        proxy.bind(("127.0.0.1", port))
        proxy.listen()
        with pytest.raises(ValueError, match=f"the HTTP port {port} on 127.0.0.1 is in use"):
            refuse_a_taken_http_port("127.0.0.1", port)


def _config_with_metrics(tmp_path, metrics: dict):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": free_port()},
                                    "applications": [{"import_path": BUILDER, "args": {"metrics": metrics}}]}))
    return path


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not has_ipv6_loopback(), reason="this machine has no IPv6 loopback"))])
def test_a_metrics_port_in_use_is_one_message(tmp_path, host):
    # the exporter binds with the host's own address family, and so does the check
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as holder:  # another megaserve's exporter
        holder.bind((host, 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _up(_config_with_metrics(tmp_path, {"port": port, "bind_host": host,
                                                   "multiproc_dir": str(tmp_path / "metrics")}))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"megaserve up: metrics.port {port} on {host} is in use" in done.stderr
    assert "starting Ray" not in done.stdout


def test_two_apps_on_one_metrics_port_share_its_folder(tmp_path):
    # The port's one exporter serves one folder: the second app's metrics would never be scraped.
    port = free_port()
    apps = [AppConfig.model_validate({"metrics": {"port": port, "multiproc_dir": str(tmp_path / name)}})
            for name in ("a", "a", "b")]
    refuse_metrics_in_use(apps[:2])
    with pytest.raises(ValueError, match=rf"applications\[2\] serves its metrics on metrics.port {port} from "
                                         rf"metrics.multiproc_dir {tmp_path / 'b'}, and an earlier application "
                                         rf"from {tmp_path / 'a'}"):
        refuse_metrics_in_use(apps)


def test_a_metrics_folder_that_cannot_be_created_is_named_by_its_field(tmp_path):
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "metrics"  # under a file: no folder can be made there
    done = _up(_config_with_metrics(tmp_path, {"port": free_port(), "bind_host": "127.0.0.1",
                                               "multiproc_dir": str(folder)}))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"megaserve up: metrics.multiproc_dir {folder} cannot be created: Not a directory" in done.stderr
    assert "starting Ray" not in done.stdout


@pytest.mark.parametrize("host", [UNASSIGNED_ADDRESS, "no-such-host.invalid"])
def test_a_metrics_address_that_cannot_be_served_is_one_message(tmp_path, host):
    port = free_port()
    done = _up(_config_with_metrics(tmp_path, {"port": port, "bind_host": host,
                                               "multiproc_dir": str(tmp_path / "metrics")}))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (f"megaserve up: cannot serve the metrics on {host}:{port} (metrics.bind_host, metrics.port): "
            in done.stderr)
    assert "starting Ray" not in done.stdout


def test_a_metrics_folder_that_running_processes_record_into_is_refused_and_kept(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    recorder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (folder / f"counter_{recorder.pid}.db").write_bytes(b"")  # as prometheus_client names its files
        done = _up(_config_with_metrics(tmp_path, {"port": free_port(), "bind_host": "127.0.0.1",
                                                   "multiproc_dir": str(folder)}))
    finally:
        recorder.kill()
        recorder.wait()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"holds the metrics of running processes (pids {recorder.pid})" in done.stderr
    assert (folder / f"counter_{recorder.pid}.db").exists()  # the other run's metrics are left alone
    assert "starting Ray" not in done.stdout


def _app_serving(model_path) -> AppConfig:
    return AppConfig.model_validate({"model": {"path": str(model_path)}})


def test_a_fresh_start_clears_only_prometheus_client_s_files_from_the_metrics_folder(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    stale = ["counter_12.db", "histogram_12.db", "gauge_livesum_12.db", "gauge_mostrecent_7.db"]
    the_user_s = ["app.db", "counter_x.db", "cache_12.db", "gauge_12.db", "notes.txt"]
    for name in stale + the_user_s:
        (folder / name).write_bytes(b"")
    app = AppConfig.model_validate({"model": {"path": str(tmp_path / "model")},
                                    "metrics": {"multiproc_dir": str(folder)}})
    _prepare_node([app], Environment(home=tmp_path / "home", kernel_cache=tmp_path / "kernels",
                                     api_keys=()))
    assert sorted(p.name for p in folder.iterdir()) == sorted(the_user_s)


def test_an_incomplete_model_path_is_refused_by_what_it_lacks(tmp_path):
    model = make_tiny_model(tmp_path / "model", max_shard_size="100KB")
    refuse_unservable_model_dirs([_app_serving(model)])  # complete: nothing to refuse
    (model / "tokenizer.json").unlink()
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=f"model.path {model} is not a complete model folder: no tokenizer.json; "
                                         f"model.safetensors.index.json in {model} names {shard.name}, which does not "
                                         "exist"):
        refuse_unservable_model_dirs([_app_serving(model)])
    with pytest.raises(ValueError, match=f"model.path {tmp_path / 'nothing-here'} does not exist"):
        refuse_unservable_model_dirs([_app_serving(tmp_path / "nothing-here")])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=f"model.path {tmp_path / 'a-file'} is not a directory"):
        refuse_unservable_model_dirs([_app_serving(tmp_path / "a-file")])


def test_a_model_the_megakernel_cannot_run_is_refused_where_the_latency_tier_would_run_it(tmp_path):
    model = make_tiny_model(tmp_path / "model")  # head_dim 16: the kernel takes 64, 128 or 256
    on_cuda = {"model": {"path": str(model)}, "latency": {"device": "cuda"}}
    with pytest.raises(ValueError, match=f"model.path {model}: the megakernel .* cannot run this model: head_dim 16 "
                                         "is not supported.*; serve it with latency.engine: torch"):
        refuse_unservable_model_dirs([AppConfig.model_validate(on_cuda)])
    # the torch engine runs it, on cuda or on the cpu
    refuse_unservable_model_dirs([AppConfig.model_validate(on_cuda | {"latency": {"device": "cuda",
                                                                                  "engine": "torch"}})])
    refuse_unservable_model_dirs([_app_serving(model)])
    supported = make_tiny_model(tmp_path / "kernel-shaped", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=64)
    refuse_unservable_model_dirs([AppConfig.model_validate(on_cuda | {"model": {"path": str(supported)}})])


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "0"], "argument --port: a port is 1-65535, got 0"),
    (["--port", "99999"], "argument --port: a port is 1-65535, got 99999"),
    (["--port", "http"], "argument --port: a port is a number, got 'http'"),
    (["--host", ""], "argument --host: must not be empty"),
    (["--timeout", "-5"], "argument --timeout: must be more than 0 seconds, got -5"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    from megaserve.deploy.cli import _parser

    with pytest.raises(SystemExit) as exit_info:  # the parser alone: an accepted argument starts nothing
        _parser().parse_args(["up", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("import_path", [BUILDER, "megaserve.deploy.builder.build_app"])
def test_an_import_path_names_its_builder_with_a_colon_or_as_serve_also_reads_it_a_dot(import_path):
    assert _builder(import_path) is build_app


def test_each_app_s_url_carries_its_route_prefix_and_an_app_without_a_route_has_none():
    http = {"host": "127.0.0.1", "port": 8000}
    apps = [{"import_path": BUILDER}, {"route_prefix": "/mega/"}, {"route_prefix": None}]
    assert app_urls(http, apps) == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/mega/v1"]


def _cuda_app(**tiers) -> AppConfig:
    return AppConfig.model_validate({name: {"device": "cuda"} | tier for name, tier in tiers.items()})


def test_tiers_that_fit_this_machine_s_gpus_are_let_through_and_one_gpu_more_is_refused():
    app = _cuda_app(latency={"num_replicas": 2, "tp_size": 2}, throughput={"engine": "torch"})
    refuse_what_this_machine_cannot_run([app], gpus_here=5, cpus_here=64)
    with pytest.raises(ValueError, match=r"need 4 for latency \(num_replicas x tp_size\) \+ 1 for throughput "
                                         r"\(num_replicas x tp_size\) GPUs, and this machine has 4"):
        refuse_what_this_machine_cannot_run([app], gpus_here=4, cpus_here=64)


def test_every_app_s_gpus_count_together():
    # Two apps of one GPU each on a one-GPU machine: the second would wait for a GPU until the timeout.
    apps = [_cuda_app(latency={}, throughput={"enabled": False})] * 2
    refuse_what_this_machine_cannot_run(apps, gpus_here=2, cpus_here=64)
    with pytest.raises(ValueError, match=r"need 1 for applications\[0\]\.latency \(num_replicas x tp_size\) \+ "
                                         r"1 for applications\[1\]\.latency \(num_replicas x tp_size\) GPUs, and "
                                         r"this machine has 1"):
        refuse_what_this_machine_cannot_run(apps, gpus_here=1, cpus_here=64)


def test_tiers_that_reserve_more_cpus_than_this_machine_has_are_refused():
    app = AppConfig.model_validate({"latency": {"num_replicas": 2, "cpus_per_replica": 1.5},
                                    "throughput": {"cpus_per_replica": 0.5},
                                    "routing": {"router_replicas": 2, "router_cpus": 0.25}})
    refuse_what_this_machine_cannot_run([app], gpus_here=0, cpus_here=4)  # 3 + 0.5 + 0.5
    with pytest.raises(ValueError, match=r"reserve 3 for latency \(num_replicas x cpus_per_replica\) \+ 0\.5 for "
                                         r"throughput \(num_replicas x cpus_per_replica\) \+ 0\.5 for routing "
                                         r"\(router_replicas x router_cpus\) CPUs, and this machine has 3"):
        refuse_what_this_machine_cannot_run([app], gpus_here=0, cpus_here=3)


@pytest.mark.parametrize("tiers, message", [
    ({"latency": {"tp_size": 8, "nodes_per_replica": 2}},
     "latency.nodes_per_replica is 2, but megaserve up runs one node"),
    ({"throughput": {"engine": "sglang"}},
     "throughput.engine is sglang, and SGLang is not installed here: pip install"),
])
def test_what_one_node_cannot_place_is_refused_before_ray_starts(tiers, message, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else find_spec(name, *a))
    with pytest.raises(ValueError, match=message):
        refuse_what_this_machine_cannot_run([_cuda_app(**tiers)], gpus_here=8, cpus_here=64)


class _RoutesProxy(http.server.BaseHTTPRequestHandler):
    """Answers ROUTES_PATH as Serve's proxy does: the server's `routes` as JSON, or `status`."""

    def do_GET(self) -> None:
        status, routes = self.server.status, self.server.routes
        body = json.dumps(routes).encode() if self.path == ROUTES_PATH and status == 200 else b"not ready"
        self.send_response(status if self.path == ROUTES_PATH else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_up_is_ready_only_once_the_proxy_routes_every_app():
    assert not proxy_routes_apps({"host": "127.0.0.1", "port": free_port()}, ["default"])  # nothing listens
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RoutesProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bound_to_all = {"host": "0.0.0.0", "port": server.server_address[1]}  # asked on the loopback
        server.status, server.routes = 503, {}
        assert not proxy_routes_apps(bound_to_all, ["default"])  # the proxy is not healthy yet
        server.status = 200
        assert not proxy_routes_apps(bound_to_all, ["default"])  # RUNNING, but not routed yet
        server.routes = {"/": "default"}
        assert proxy_routes_apps(bound_to_all, ["default"])
        assert not proxy_routes_apps(bound_to_all, ["default", "second"])
    finally:
        server.shutdown()
        server.server_close()


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["reading the config", "starting Ray"])
def test_ctrl_c_before_the_app_runs_stops_what_started_and_exits_130_without_a_traceback(
        tmp_path, monkeypatch, capsys, where):
    import ray

    from megaserve.deploy import cli, local

    monkeypatch.setenv("MEGASERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # up sets it for Ray: restored after the test
    stopped = []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append("ray"))
    if where == "reading the config":
        monkeypatch.setattr(local, "load_serve_config", _interrupt)
    else:
        monkeypatch.setattr(ray, "init", _interrupt)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"port": free_port()}, "applications": [{
        "import_path": BUILDER, "args": {"metrics": {"port": free_port(),
                                                     "multiproc_dir": str(tmp_path / "metrics")}}}]}))
    assert cli.main(["up", str(path)]) == cli.INTERRUPTED_EXIT
    assert capsys.readouterr().err.strip() == "megaserve up: interrupted"
    assert stopped == ([] if where == "reading the config" else ["ray"])  # what started of Ray is stopped
