"""`megaserve up`: a local Ray cluster in this process, the app from a Serve config, until Ctrl-C.

The config file is an ordinary Ray Serve config (the same file works with `serve run` and
`serve deploy`); with none, the packaged `local.yaml` serves the embedded demo model on the CPU
with one replica of each tier on 127.0.0.1:8000. Ray's token authentication stays on.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megaserve.deploy.config import MAX_PORT, AppConfig
from megaserve.deploy.env import Environment

STATUS_POLL_SECONDS = 0.5
# Serve's HTTP proxy answers this path with the routes it serves now, {route prefix: app name}. An
# app is RUNNING in serve.status() before the proxy has its route: a request then gets 404.
ROUTES_PATH = "/-/routes"
ROUTES_TIMEOUT_SECONDS = 2.0
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # bound to all: ask locally
PROC_ROOT = "/proc"  # this node's processes, the megaserve ones among them
DRAIN_MARGIN_SECONDS = 5.0  # Serve's own steps past the replicas' graceful time, as the apps are deleted
RUNNING, DEPLOY_FAILED = "RUNNING", "DEPLOY_FAILED"  # Serve's ApplicationStatus values


# What `megaserve up` applies of a Serve config; anything else is refused rather than silently
# dropped (`serve run FILE` and `serve deploy FILE` apply the whole file).
APPLIED_CONFIG_KEYS = frozenset({"applications", "http_options", "proxy_location"})
APPLIED_APPLICATION_KEYS = frozenset({"name", "route_prefix", "import_path", "args"})


def load_serve_config(path: str | None) -> dict[str, Any]:
    """The Serve config as a dict: the file at `path`, or the packaged local.yaml."""
    if path is None:
        text = resources.files("megaserve.deploy").joinpath("local.yaml").read_text()
    else:
        text = Path(path).read_text()
    config = yaml.safe_load(text)
    name = path or "local.yaml"
    if not isinstance(config, dict) or not isinstance(config.get("applications"), list) or not config["applications"]:
        raise ValueError(f"{name}: a Serve config needs an `applications` list")
    for app in config["applications"]:
        if not isinstance(app, dict) or not isinstance(app.get("import_path"), str):
            raise ValueError(f"{name}: every application needs an `import_path` (module:builder)")
    ignored = sorted(set(config) - APPLIED_CONFIG_KEYS) + sorted(
        {f"applications[].{key}" for app in config["applications"] for key in set(app) - APPLIED_APPLICATION_KEYS})
    if ignored:
        raise ValueError(f"{name}: megaserve up does not apply {', '.join(ignored)}; run the file with "
                         "`serve run` or `serve deploy`, which do")
    from ray.serve.schema import ServeDeploySchema  # pydantic, no cluster: what `serve deploy` checks

    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValidationError as error:
        raise ValueError(f"{name}: {describe(error)}") from None
    if isinstance(config.get("http_options"), dict):  # as Serve reads them: port "8000" is 8000
        given = set(config["http_options"])
        config["http_options"] = schema.http_options.model_dump(include=given)
    return config


def describe(error: ValidationError) -> str:
    """A pydantic error on one line: each problem as `field.path: message`."""
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


def app_configs_of(config: dict[str, Any], name: str) -> list[AppConfig]:
    """Each application's `args` as an AppConfig; a bad one is refused naming the file and the app."""
    configs = []
    for app in config["applications"]:
        try:
            configs.append(AppConfig.model_validate(app.get("args") or {}))
        except ValidationError as error:
            raise ValueError(f"{name}: application {app.get('name', 'default')!r}: {describe(error)}") from None
    return configs


def _say(message: str) -> None:
    print(f"megaserve: {message}", flush=True)


def refuse_unservable_model_dirs(app_configs: list[AppConfig]) -> None:
    """Refuse a model.path that cannot be served before Ray starts: every replica would fail to
    start on it, each with its own traceback, the megakernel's after loading the weights onto the
    GPU. `megaserve up` runs one node, so the path is here."""
    from megaserve.kernels.shape import KernelShape, UnsupportedShapeError
    from megaserve.replicas.models import ModelConfig
    from megaserve.replicas.models.checkpoint import model_folder_problem

    for app in app_configs:
        if app.model.path is None:  # the demo model, whose shape the megakernel runs
            continue
        problem = model_folder_problem(app.model.path)
        if problem is not None:
            raise ValueError(f"model.path {app.model.path} {problem}")
        if app.latency.enabled and app.latency.resolved_engine == "megakernel":
            try:
                KernelShape.from_config(ModelConfig.from_hf_dir(app.model.path))
            except UnsupportedShapeError as error:
                raise ValueError(f"model.path {app.model.path}: the megakernel (the latency tier's engine on "
                                 f"cuda) cannot run this model: {error}; serve it with latency.engine: torch"
                                 ) from None


def refuse_what_this_machine_cannot_run(app_configs: list[AppConfig], gpus_here: int, cpus_here: int) -> None:
    """Refuse tiers that `megaserve up`'s one node cannot place: more GPUs or CPUs than it has (every
    app's together), a replica spread over several nodes, SGLang where it is not installed. Serve
    would wait for them for `--timeout` seconds, and then say only that the app did not start."""
    from megaserve.replicas.engines.sglang_engine import INSTALL_HINT

    gpus: dict[str, int] = {}  # what each tier reserves, by its name in the messages
    cpus: dict[str, float] = {}
    for index, app in enumerate(app_configs):
        prefix = f"applications[{index}]." if len(app_configs) > 1 else ""
        tiers = {name: tier for name, tier in (("latency", app.latency), ("throughput", app.throughput))
                 if tier.enabled}
        for name, tier in tiers.items():
            if tier.nodes_per_replica > 1:
                raise ValueError(f"{prefix}{name}.nodes_per_replica is {tier.nodes_per_replica}, but megaserve up "
                                 "runs one node; deploy multi-node replicas on a Ray cluster")
            if tier.gpus_per_node:
                gpus[f"{prefix}{name} (num_replicas x tp_size)"] = tier.num_replicas * tier.gpus_per_node
            cpus[f"{prefix}{name} (num_replicas x cpus_per_replica)"] = tier.num_replicas * tier.cpus_per_replica
        cpus[f"{prefix}routing (router_replicas x router_cpus)"] = (app.routing.router_replicas
                                                                   * app.routing.router_cpus)
        if "throughput" in tiers and app.throughput.engine == "sglang" and not importlib.util.find_spec("sglang"):
            raise ValueError(f"{prefix}throughput.engine is sglang, and SGLang is not installed here: {INSTALL_HINT}")
    if sum(gpus.values()) > gpus_here:
        asked = " + ".join(f"{count} for {name}" for name, count in gpus.items())
        raise ValueError(f"the tiers need {asked} GPUs, and this machine has {gpus_here}")
    if sum(cpus.values()) > cpus_here:
        asked = " + ".join(f"{count:g} for {name}" for name, count in cpus.items() if count)
        raise ValueError(f"the tiers reserve {asked} CPUs, and this machine has {cpus_here}")


def gpus_on_this_machine() -> int:
    """The CUDA devices this process can use (CUDA_VISIBLE_DEVICES applied), as the engines see them."""
    import torch

    return torch.cuda.device_count()


def refuse_a_taken_http_port(host: str, port: int) -> None:
    """Refuse an HTTP address that something listens on before Ray starts, not after (serve.start
    would raise the proxy's failure, with tracebacks). The probe sets SO_REUSEADDR, as Serve's proxy
    does, so that the connections of a run that just stopped (TIME_WAIT) do not count, but not
    SO_REUSEPORT, which the proxy sets too: with it, a second Serve would share a port that another
    one listens on, and the two would split its requests."""
    error = _bind_error(host, port)
    if error is not None and error.errno == errno.EADDRINUSE:
        raise ValueError(f"the HTTP port {port} on {host} is in use; stop what holds it or give "
                         f"another (--port or http_options.port)")
    if error is not None:
        raise ValueError(f"cannot listen on the HTTP address {host}:{port}: {error.strerror or error}")


def refuse_metrics_in_use(app_configs: list[AppConfig]) -> None:
    """Refuse a metrics port or folder that a running megaserve on this node already uses (two runs
    on the defaults): this run would wipe the other's metrics files, and its own exporter would wait
    behind the other's port, so neither would be served right."""
    from megaserve.monitoring.exporter import listening_family, recording_processes

    folder_of_port: dict[int, str] = {}
    for index, app in enumerate(app_configs):
        # One exporter serves a port, from one folder: an app of another folder on it goes unserved.
        other = folder_of_port.setdefault(app.metrics.port, app.metrics.multiproc_dir)
        if other != app.metrics.multiproc_dir:
            raise ValueError(f"applications[{index}] serves its metrics on metrics.port {app.metrics.port} from "
                             f"metrics.multiproc_dir {app.metrics.multiproc_dir}, and an earlier application "
                             f"from {other}: give them one folder, or each a port of its own")
    for app in app_configs:
        folder = app.metrics.multiproc_dir
        running = recording_processes(folder, PROC_ROOT, os.getpid()) if os.path.isdir(folder) else []
        if running:
            raise ValueError(f"metrics.multiproc_dir {folder} holds the metrics of running processes (pids "
                             f"{', '.join(map(str, running))}): another megaserve on this node? Stop it, or give "
                             "this one a metrics.multiproc_dir and metrics.port of its own")
        # the exporter sets SO_REUSEADDR too, and binds with the host's own address family
        error = _bind_error(app.metrics.bind_host, app.metrics.port, listening_family)
        if error is not None and error.errno == errno.EADDRINUSE:
            raise ValueError(f"metrics.port {app.metrics.port} on {app.metrics.bind_host} is in use: another "
                             "megaserve on this node? Stop it, or give this one a metrics.port of its own")
        if error is not None:  # the node exporter would log it and serve nothing
            raise ValueError(f"cannot serve the metrics on {app.metrics.bind_host}:{app.metrics.port} "
                             f"(metrics.bind_host, metrics.port): {error.strerror or error}")


def _uvicorn_family(host: str, port: int) -> socket.AddressFamily:
    """The address family Serve's proxy (uvicorn) listens with: IPv6 for a host with a colon."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind_error(host: str, port: int,
                family: Callable[[str, int], socket.AddressFamily] = _uvicorn_family) -> OSError | None:
    """Why a listening socket with SO_REUSEADDR, of the address family that the server at host:port
    would use (`family`), could not be bound there now, or None if it could: a port whose last
    connections linger (TIME_WAIT) is not taken."""
    try:
        with socket.socket(family(host, port), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:  # socket.gaierror too: a host that does not resolve
        return error
    return None


def _prepare_node(app_configs: list[AppConfig], env: Environment) -> None:
    """Fresh metrics folders (counters restart with the cluster) and the demo model, made once
    here rather than raced by every replica."""
    from megaserve.monitoring.exporter import RECORDER_FILE

    for app in app_configs:
        folder = Path(app.metrics.multiproc_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"metrics.multiproc_dir {folder} cannot be created: {error.strerror or error}") from None
        for stale in folder.iterdir():  # only prometheus_client's files: the folder is the user's to name
            if RECORDER_FILE.match(stale.name):
                stale.unlink()
        if app.model.path is None:
            from megaserve.replicas.models.demo import ensure_demo_model

            _say(f"demo model at {ensure_demo_model(env.home)}")


def _builder(import_path: str):
    """The application builder an `import_path` names: `module:attribute`, or as Serve also reads
    it, `module.attribute`."""
    module, _, attr = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as error:  # ValueError: an empty module name
        raise ValueError(f"import_path {import_path!r} names no application builder: {error}") from None


def app_urls(http: dict[str, Any], applications: list[dict[str, Any]]) -> list[str]:
    """The OpenAI base URL of each application that has a route (route_prefix null: none)."""
    base = _base_url(http["host"], http["port"])
    prefixes = (app.get("route_prefix", "/") for app in applications)
    return [f"{base}{prefix.rstrip('/')}/v1" for prefix in prefixes if prefix is not None]


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets


def proxy_routes_apps(http: dict[str, Any], names: list[str]) -> bool:
    """Whether the HTTP proxy on this node routes every app of `names` (False while it cannot
    answer)."""
    url = _base_url(WILDCARD_HOSTS.get(http["host"], http["host"]), http["port"])
    try:
        with urllib.request.urlopen(url + ROUTES_PATH, timeout=ROUTES_TIMEOUT_SECONDS) as response:
            routed = set(json.loads(response.read()).values())
    except (OSError, ValueError):  # not listening yet, 503 while unhealthy, or not JSON
        return False
    return set(names) <= routed


def _deployment_progress(status) -> str:
    parts = []
    for app_name, app in status.applications.items():
        for name, dep in app.deployments.items():
            parts.append(f"{name}={dep.status.value}")
        parts.insert(0, f"app {app_name}: {app.status.value}")
    return ", ".join(parts)


def serve_until_interrupted(config_path: str | None, host: str | None, port: int | None,
                            timeout: float, env: Environment) -> int:
    started = time.monotonic()
    # Before anything imports Ray (reading the config imports ray.serve.schema): Ray fixes its auth
    # mode at import, and the cluster it starts inherits this environment.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:  # a bad config is reported before Ray starts, in one message
        config = load_serve_config(config_path)
        applications = config["applications"]
        app_configs = app_configs_of(config, config_path or "local.yaml")
        http = dict(config.get("http_options") or {})
        http["host"] = host if host is not None else http.get("host", "127.0.0.1")
        http["port"] = port if port is not None else http.get("port", 8000)
        if not 1 <= http["port"] <= MAX_PORT:  # Serve takes any integer; 0 would be a port nobody is told
            raise ValueError(f"http_options.port must be 1-{MAX_PORT}, got {http['port']}")
        builders = [_builder(app["import_path"]) for app in applications]
        for app_config in app_configs:
            if app_config.metrics.port == http["port"]:
                raise ValueError(f"metrics.port {app_config.metrics.port} is the HTTP port too; give it another")
        refuse_unservable_model_dirs(app_configs)
        # os.cpu_count: the most CPUs Ray's local node can have (a cgroup quota may give it fewer)
        refuse_what_this_machine_cannot_run(app_configs, gpus_on_this_machine(), os.cpu_count() or 1)
        if config.get("proxy_location") != "Disabled":  # no proxy, nothing listens on the port
            refuse_a_taken_http_port(http["host"], http["port"])
        refuse_metrics_in_use(app_configs)
        _prepare_node(app_configs, env)
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"megaserve up: {error}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    _say(f"starting Ray (auth mode: {os.environ['RAY_AUTH_MODE']})")
    try:
        ray.init(address="local",  # always a fresh cluster of its own, never a running one
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
    except KeyboardInterrupt:  # Ctrl-C while Ray starts: stop what of it has started
        ray.shutdown()
        raise
    # After ray.init, whose own SIGTERM handler (exit 15, Ray shut down at exit) it replaces: from
    # here on SIGTERM stops the app as Ctrl-C does, while it deploys or once it serves.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _say("starting Serve")
    names: list[str] = []  # the apps submitted
    ready = False  # every app ran and its URL was printed: only then can requests be running to drain
    try:
        try:
            serve.start(http_options=http, proxy_location=config.get("proxy_location"))
        except Exception as error:  # noqa: BLE001 - e.g. the port taken since it was checked: say so, exit 1
            _say(f"starting Serve failed: {getattr(error, 'cause', error)}")  # a RayTaskError's own error
            return 1
        names = [app.get("name", "default") for app in applications]
        try:  # submitted, not awaited: this thread watches them come up and can stop at once
            serve.run_many([serve.RunTarget(target=builder(app_config), name=name,
                                            route_prefix=app.get("route_prefix", "/"))
                            for app, builder, app_config, name in zip(applications, builders, app_configs, names)],
                           wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        except Exception as error:  # noqa: BLE001 - a builder or Serve refused the app: say so, exit 1
            _say(f"deploying failed: {error}")
            return 1
        deadline = time.monotonic() + timeout  # --timeout: for the replicas, not for Ray's start
        # ready once the proxy routes them too (none to wait for without a proxy)
        routed_names = [] if config.get("proxy_location") == "Disabled" else [
            name for app, name in zip(applications, names) if app.get("route_prefix", "/") is not None]
        last = ""
        while True:
            if stop.is_set():  # SIGTERM while deploying: stop now, not once the app is ready
                _say("asked to stop before the app was ready")
                return 0
            status = serve.status()
            progress = _deployment_progress(status)
            if progress != last:
                _say(progress)
                last = progress
            states = [status.applications[n].status.value if n in status.applications else "" for n in names]
            running = all(state == RUNNING for state in states)
            if running and (not routed_names or proxy_routes_apps(http, routed_names)):
                break
            if DEPLOY_FAILED in states or time.monotonic() > deadline:
                _say("the app did not start; see the messages above and Ray's logs")
                return 1
            time.sleep(STATUS_POLL_SECONDS)
        urls = ", ".join(app_urls(http, applications)) or "no HTTP routes"
        metrics = ", ".join(f"{c.metrics.bind_host}:{c.metrics.port}" for c in app_configs)
        _say(f"ready in {time.monotonic() - started:.1f} s: {urls} (metrics on {metrics}); Ctrl-C stops")
        ready = True
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        _say("stopping")
        if ready:  # a start that failed or was stopped drains nothing: a replica never placed would
            # hold the apps' deletion for its whole graceful_shutdown_seconds
            _drain(names, max(c.router_graceful_shutdown_seconds for c in app_configs))
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # raised in the main thread, wherever the drain is waiting


def _drain(names: list[str], graceful_seconds: float) -> None:
    """Delete the apps before Serve shuts down: Serve then stops each replica as on a scale-down, its
    running generations finishing (within graceful_shutdown_seconds) while the proxy still streams
    them; serve.shutdown alone kills the proxy first and cuts every stream off. A second Ctrl-C,
    or a second SIGTERM (a supervisor's that gave up waiting), stops at once."""
    from ray import serve

    if not names:
        return
    deadline = time.monotonic() + graceful_seconds + DRAIN_MARGIN_SECONDS
    try:  # from the message on, a second Ctrl-C or SIGTERM lands here
        signal.signal(signal.SIGTERM, _interrupt)
        _say(f"letting running requests finish (up to {graceful_seconds:g} s; Ctrl-C again stops at once)")
        for name in names:
            serve.delete(name, _blocking=False)
        while time.monotonic() < deadline and set(names) & set(serve.status().applications):
            time.sleep(STATUS_POLL_SECONDS)
    except KeyboardInterrupt:
        _say("stopping at once")
