"""k8s/: every manifest validates against its schema, and the pieces agree with each other
(serveConfigV2 is deploy/gb300.yaml, pods fit the replicas, the PodMonitor finds the ports)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve._private.constants import PROXY_MIN_DRAINING_PERIOD_S
from ray.serve.schema import ServeDeploySchema

from megaserve.deploy.config import AppConfig
from megaserve.monitoring import alerts, dashboards
from megaserve.monitoring.exporter import MULTIPROC_ENV
from megaserve.monitoring.promql import METRICS_JOB, RAY_JOB

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# CRD schemas are data kept beside the checkout (shared/schemas/README.md names their sources).
SCHEMAS = REPO.parent / "shared" / "schemas"
KUBERNETES_VERSION = "1.33"
GPU = "nvidia.com/gpu"
GPUS_PER_GB300_TRAY = 4
NVLINK_DOMAIN_LABEL = "nvidia.com/gpu.clique"  # one NVL72 rack's NVLink domain, per node
RAY_CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's label on every pod of a RayCluster
IMAGE_ARCH = "arm64"  # the image's one platform (docs/operations.md), Grace's
RAY_METRICS_PORT_NAME = "metrics"
MEGASERVE_METRICS_PORT_NAME = "megaserve"
# A container port's name is an IANA_SVC_NAME (k8s.io/apimachinery validation.IsValidPortName): the
# API server refuses a pod whose port name breaks it, which neither kubernetes-validate nor the
# CRD schemas check.
PORT_NAME_MAX_CHARS = 15
PORT_NAME_CHARSET = re.compile(r"[-a-z0-9]+")
LAST_APPLIED_ANNOTATION_LIMIT_BYTES = 256 * 1024
# Ray drains a node on SIGTERM for this long at most (ray_constants.py; Ray's default 30 s).
RAY_DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# The documents whose Kubernetes steps a reader follows, each with the heading of those steps.
KUBERNETES_STEPS = {"README.md": "## Deploy on Kubernetes (KubeRay)",
                    "docs/operations.md": "## Deploy on Kubernetes with KubeRay (GB300)"}
BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
NAMESPACE_STEP = re.compile(r"kustomize edit set namespace (\S+)")
SECRET_STEP = re.compile(r"kubectl -n (\S+) create secret \S+ (\S+)")
APPLY_STEP = re.compile(r"kubectl -n (\S+) apply -f - <<'(\w+)'\n(.*?)\n\2\n", re.S)
# RayService fields the CRD still accepts but KubeRay ignores (rayservice_types.go: "Deprecated: This
# field is not used anymore"): setting one only suggests a behaviour that does not exist.
IGNORED_RAYSERVICE_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
# KubeRay's readiness checks of a RayService worker (ray-operator utils/constant.go): the raylet
# through the dashboard agent's port, then the node's Serve proxy; each answers "success".
RAYLET_HEALTH_URL = "http://localhost:52365/api/local_raylet_healthz"
SERVE_PROXY_HEALTH_PATH = "/-/healthz"
HEALTH_CHECK = re.compile(r"wget --tries 1 -T (\d+) -q -O- (\S+) \| grep success")


def _documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _one(kind: str) -> dict:
    (doc,) = [d for d in _documents() if d["kind"] == kind]
    return doc


@functools.cache
def _load_crds() -> dict[tuple[str, str], dict]:
    schemas = {}
    for path in SCHEMAS.glob("*/*.yaml"):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def _crd_schemas() -> dict[tuple[str, str], dict]:
    if not SCHEMAS.is_dir():
        pytest.skip(f"CRD schemas not found at {SCHEMAS} (a `shared/schemas` folder beside the "
                    "checkout); see shared/schemas/README.md for their sources")
    return _load_crds()


def _validator(schema: dict) -> jsonschema.Validator:
    # OpenAPI v3 schemas are JSON Schema draft 4-7 in spirit; their `pattern`s are Go regexes,
    # which Python's `re` only compiles when a field using one is present.
    return jsonschema.Draft7Validator(_refusing_unknown_fields(schema))


def _refusing_unknown_fields(schema):
    """`schema` with unknown fields refused wherever it lists an object's properties, as the API
    server's strict field validation (kubectl's default) does; a CRD says so only implicitly, and
    left as it is, jsonschema would accept a misspelled field."""
    if isinstance(schema, list):
        return [_refusing_unknown_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _refusing_unknown_fields(value) for key, value in schema.items()}
    if ("properties" in strict and "additionalProperties" not in strict
            and not strict.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


def _app_config() -> tuple[dict, AppConfig]:
    serve_config = yaml.safe_load(_one("RayService")["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return serve_config, AppConfig.model_validate(app["args"])


def _cluster() -> dict:
    return _one("RayService")["spec"]["rayClusterConfig"]


def _pod_specs() -> dict[str, dict]:
    """Group name ('head' for the head) -> pod template spec."""
    cluster = _cluster()
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    return specs


def _worker_group(name: str) -> dict:
    (group,) = [g for g in _cluster()["workerGroupSpecs"] if g["groupName"] == name]
    return group


def _ray_container(pod_spec: dict) -> dict:
    return pod_spec["containers"][0]  # KubeRay runs Ray in a pod's first container


def _port_names(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _gpus(pod_spec: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in pod_spec["containers"])


def _containers(node) -> list[dict]:
    """Every container and init container anywhere in a manifest (all pod templates)."""
    if isinstance(node, list):
        return [c for item in node for c in _containers(item)]
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        if key in ("containers", "initContainers"):
            found.extend(value)
        found.extend(_containers(value))
    return found


def _port_name_problems(name: str) -> list[str]:
    """Why Kubernetes refuses `name` as a container port's name (none: it is a valid one)."""
    problems = []
    if len(name) > PORT_NAME_MAX_CHARS:
        problems.append(f"longer than {PORT_NAME_MAX_CHARS} characters")
    if not PORT_NAME_CHARSET.fullmatch(name):
        problems.append("not only a-z, 0-9 and '-'")
    if not re.search("[a-z]", name):
        problems.append("no letter")
    if "--" in name:
        problems.append("'--'")
    if name.startswith("-") or name.endswith("-"):
        problems.append("a leading or trailing '-'")
    return problems


def _objects(node) -> list[dict]:
    """`node` and every mapping nested in it."""
    if isinstance(node, list):
        return [o for item in node for o in _objects(item)]
    if not isinstance(node, dict):
        return []
    return [node] + [o for value in node.values() for o in _objects(value)]


def _used_secrets_and_claims() -> dict[str, set[str]]:
    """Kind -> names of the Secrets and PersistentVolumeClaims the manifests' pods need."""
    used = {"Secret": set(), "PersistentVolumeClaim": set()}
    for obj in _objects(_documents()):
        for key in ("secretKeyRef", "secretRef"):
            if key in obj:
                used["Secret"].add(obj[key]["name"])
        if "secretName" in obj.get("secret", {}):
            used["Secret"].add(obj["secret"]["secretName"])
        if "persistentVolumeClaim" in obj:
            used["PersistentVolumeClaim"].add(obj["persistentVolumeClaim"]["claimName"])
    return used


def _created_in(steps: str) -> dict[str, set[tuple[str, str]]]:
    """Kind -> (namespace, name) of each object a document's shell steps create."""
    created = {"Secret": set(), "PersistentVolumeClaim": set()}
    created["Secret"] |= set(SECRET_STEP.findall(steps))
    for namespace, _, manifest in APPLY_STEP.findall(steps):
        for obj in yaml.safe_load_all(manifest):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            created.setdefault(obj["kind"], set()).add((namespace, obj["metadata"]["name"]))
    return created


def _is_core(doc: dict) -> bool:
    return "." not in doc["apiVersion"].split("/")[0]  # v1, apps/v1; not ray.io/v1


@pytest.mark.parametrize("doc", [d for d in _documents() if not _is_core(d)],
                         ids=lambda doc: doc["kind"])
def test_custom_resources_validate_against_their_crd(doc):
    _validator(_crd_schemas()[(doc["apiVersion"], doc["kind"])]).validate(doc)


def test_core_kinds_validate_with_kubernetes_validate():
    core = [d for d in _documents() if _is_core(d)]
    assert {d["kind"] for d in core} == {"ConfigMap"}
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("group", ["head", "latency", "throughput"])
def test_every_pod_template_is_a_valid_pod(group):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": group},
           "spec": _pod_specs()[group]}
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(quantity: str) -> int:
    for suffix, factor in _BINARY_SUFFIXES.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


@pytest.mark.parametrize("group", ["head", "latency", "throughput"])
def test_every_pod_s_object_store_has_shared_memory_of_its_own(group):
    # A container's own /dev/shm is 64 MiB: Ray puts a larger object store on disk under /tmp, slowly.
    spec = _pod_specs()[group]
    mounts = {m["mountPath"]: m["name"] for m in _ray_container(spec).get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    if group == "head":  # Ray's default (30% of 32 GiB) would not fit the head's: it asks for less
        store = int(_cluster()["headGroupSpec"]["rayStartParams"]["object-store-memory"])
        assert store <= _bytes(shm["sizeLimit"])


def test_every_container_port_name_is_one_kubernetes_accepts():
    ports = [port for container in _containers(_documents()) for port in container.get("ports", [])]
    assert ports
    refused = {port["name"]: _port_name_problems(port["name"]) for port in ports if "name" in port}
    assert {name: problems for name, problems in refused.items() if problems} == {}


@pytest.mark.parametrize(("name", "valid"), [
    ("megaserve", True), ("metrics", True), ("gcs-server", True), ("h2c", True),
    ("megaserve-metrics", False), ("Metrics", False), ("9400", False), ("ray--metrics", False),
    ("-metrics", False), ("metrics-", False), ("", False),
])
def test_the_port_name_rule_refuses_what_kubernetes_refuses(name, valid):
    assert (not _port_name_problems(name)) == valid


def test_a_broken_manifest_is_caught():
    schemas = _crd_schemas()
    rayservice = _one("RayService")
    broken = {**rayservice, "spec": {**rayservice["spec"], "serveConfigV2": {"not": "a string"}}}
    with pytest.raises(jsonschema.ValidationError):
        _validator(schemas[("ray.io/v1", "RayService")]).validate(broken)


@pytest.mark.parametrize(("kind", "misspell"), [
    ("RayService", lambda spec: {**spec, "rayClusterConfig": {**spec["rayClusterConfig"], "workerGroupSpec": []}}),
    ("PodMonitor", lambda spec: {**spec, "podMetricsEndpoint": spec["podMetricsEndpoints"]}),
])
def test_a_misspelled_field_is_caught(kind, misspell):
    doc = _one(kind)
    schema = _crd_schemas()[(doc["apiVersion"], kind)]
    with pytest.raises(jsonschema.ValidationError, match="Additional properties are not allowed"):
        _validator(schema).validate({**doc, "spec": misspell(doc["spec"])})


def test_serve_config_is_deploy_gb300_yaml_and_parses_with_both_schemas():
    serve_config, config = _app_config()
    assert serve_config == yaml.safe_load((REPO / "deploy" / "gb300.yaml").read_text())
    ServeDeploySchema.model_validate(serve_config)
    assert serve_config["applications"][0]["import_path"] == "megaserve.deploy.builder:build_app"
    assert config.latency.resolved_engine == "megakernel"
    assert config.throughput.engine == "sglang"
    assert config.metrics.bind_host == "0.0.0.0"


def test_the_rayservice_sets_no_field_that_kuberay_ignores():
    assert not IGNORED_RAYSERVICE_FIELDS & set(_one("RayService")["spec"])


def test_stopping_pods_and_clusters_give_running_generations_the_config_s_graceful_time():
    _, config = _app_config()
    # the routers wait as long as the longest of their tiers (deploy/builder.py)
    graceful = max(tier.graceful_shutdown_seconds for tier in (config.latency, config.throughput)
                   if tier.enabled)
    # After an upgrade the old cluster still streams what it had started.
    assert _one("RayService")["spec"]["rayClusterDeletionDelaySeconds"] >= graceful
    for group, spec in _pod_specs().items():
        env = {var["name"]: var.get("value") for var in _ray_container(spec)["env"]}
        drain = float(env[RAY_DRAIN_TIMEOUT_ENV])
        # Serve stops a draining node's replicas by the drain's deadline less their graceful time,
        # and Kubernetes kills the pod once its grace period is over.
        assert graceful < drain < spec["terminationGracePeriodSeconds"], group


@pytest.mark.parametrize("group", ["latency", "throughput"])
def test_worker_readiness_checks_what_kuberay_checks_and_survives_one_slow_answer(group):
    serve_config, _ = _app_config()
    probe = _ray_container(_pod_specs()[group])["readinessProbe"]
    shell, flag, script = probe["exec"]["command"]
    assert (shell, flag) == ("bash", "-c")
    checks = HEALTH_CHECK.findall(script)
    assert " && ".join(f"wget --tries 1 -T {t} -q -O- {url} | grep success" for t, url in checks) == script
    proxy_url = f"http://localhost:{serve_config['http_options']['port']}{SERVE_PROXY_HEALTH_PATH}"
    assert [url for _, url in checks] == [RAYLET_HEALTH_URL, proxy_url]
    # Both answers fit in the probe's time, so a slow one fails the check rather than the probe.
    assert sum(int(t) for t, _ in checks) < probe["timeoutSeconds"]
    # One slow or lost answer leaves the pod in the Service (KubeRay's default drops it at once)...
    assert probe["failureThreshold"] > 1
    # ...and a draining proxy still leaves the Service while it takes requests.
    worst_removal = probe["failureThreshold"] * probe["periodSeconds"] + probe["timeoutSeconds"]
    assert worst_removal <= PROXY_MIN_DRAINING_PERIOD_S


def test_ray_token_authentication_stays_on():
    assert _cluster()["authOptions"]["mode"] == "token"


def test_every_pod_gets_the_router_s_api_keys_from_a_secret():
    # The keys are read where Serve builds the app; a pod without the Secret does not start, so the
    # API is never served without auth by mistake.
    groups = [_cluster()["headGroupSpec"], *_cluster()["workerGroupSpecs"]]
    for group in groups:
        container = _ray_container(group["template"]["spec"])
        keys = next(var for var in container["env"] if var["name"] == "MEGASERVE_API_KEYS")
        assert keys["valueFrom"] == {"secretKeyRef": {"name": "megaserve-api-keys", "key": "keys"}}


def test_head_has_no_gpus_and_takes_no_replicas():
    head = _cluster()["headGroupSpec"]
    assert _gpus(head["template"]["spec"]) == 0
    assert head["rayStartParams"]["num-cpus"] == "0"
    _, config = _app_config()
    assert config.routing.router_cpus > 0  # nor routers: an actor of 0 CPUs would fit on the head


@pytest.mark.parametrize("group", ["head", "latency", "throughput"])
def test_every_pod_runs_on_nodes_of_the_image_s_architecture(group):
    # The image is built for linux/arm64 only (docs/operations.md): a pod scheduled on an amd64
    # node fails with "exec format error", and arm64 nodes carry a taint that keeps others off.
    spec = _pod_specs()[group]
    assert spec["nodeSelector"]["kubernetes.io/arch"] == IMAGE_ARCH
    tolerated = {(t["key"], t.get("value")) for t in spec["tolerations"]}
    assert ("kubernetes.io/arch", IMAGE_ARCH) in tolerated


@pytest.mark.parametrize("group", ["latency", "throughput"])
def test_gb300_pods_take_whole_trays(group):
    spec = _pod_specs()[group]
    assert spec["nodeSelector"] == {"kubernetes.io/arch": IMAGE_ARCH,
                                    "nvidia.com/gpu.product": "NVIDIA-GB300"}
    tolerated = {(t["key"], t.get("value")) for t in spec["tolerations"]}
    assert (GPU, None) in tolerated
    container = _ray_container(spec)
    assert container["resources"]["requests"][GPU] == container["resources"]["limits"][GPU]
    assert _gpus(spec) == GPUS_PER_GB300_TRAY


def test_worker_groups_differ_only_in_their_labels_and_affinities():
    latency, throughput = (_pod_specs()[g] for g in ("latency", "throughput"))
    assert {k: v for k, v in latency.items() if k != "affinity"} == {
        k: v for k, v in throughput.items() if k != "affinity"}


@pytest.mark.parametrize("tier", ["latency", "throughput"])
def test_each_tier_fits_its_worker_group(tier):
    _, config = _app_config()
    settings = getattr(config, tier)
    group = _worker_group(tier)
    gpus_per_pod = _gpus(group["template"]["spec"])
    # Each of a replica's nodes is one whole pod, and the pods exactly hold the replicas.
    assert settings.gpus_per_node == gpus_per_pod
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["replicas"] == settings.num_replicas * settings.nodes_per_replica
    assert group["replicas"] * gpus_per_pod == settings.num_replicas * settings.tp_size
    assert settings.accelerator_type == "GB300"
    # The tier's Ray label selector picks exactly its own group's Ray nodes.
    assert settings.label_selector.items() <= group["labels"].items()
    for other in _cluster()["workerGroupSpecs"]:
        if other["groupName"] != tier:
            assert not settings.label_selector.items() <= other.get("labels", {}).items()


def test_tensor_parallel_groups_over_several_trays_stay_in_one_nvlink_domain():
    _, config = _app_config()
    assert config.latency.nodes_per_replica == 2  # TP8 over two trays: the case this guards
    spec = _pod_specs()["latency"]
    (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == NVLINK_DOMAIN_LABEL
    # Within the pod's own RayCluster: in an upgrade, the old cluster's pods must not pull the new
    # cluster's into the old, full clique.
    assert term["matchLabelKeys"] == [RAY_CLUSTER_LABEL]
    # The term selects every latency pod (so all of them share one clique) and no other pod.
    selector = term["labelSelector"]["matchLabels"].items()
    cluster = _cluster()
    templates = {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    templates["head"] = cluster["headGroupSpec"]["template"]
    matched = {name for name, t in templates.items() if selector <= t["metadata"]["labels"].items()}
    assert matched == {"latency"}


def test_throughput_pods_leave_the_latency_pods_nvlink_domain_its_trays_where_they_can():
    # A throughput replica fits one tray; the latency replicas' trays must all be in one domain.
    _, config = _app_config()
    assert config.throughput.nodes_per_replica == 1
    latency_affinity = _pod_specs()["latency"]["affinity"]["podAffinity"]
    (latency_term,) = latency_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    anti = _pod_specs()["throughput"]["affinity"]["podAntiAffinity"]
    # Preferred, not required: a cluster of one NVLink domain still schedules both tiers.
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    (preference,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preference["weight"] == 100  # the most a preference may weigh
    # Away from exactly the pods the latency pods gather around: the same domain, the same cluster.
    assert preference["podAffinityTerm"] == latency_term


@pytest.mark.parametrize("group", ["head", "latency", "throughput"])
def test_every_pod_serves_ray_s_metrics_export_port(group):
    params = _cluster()["headGroupSpec"] if group == "head" else _worker_group(group)
    ports = _port_names(_ray_container(_pod_specs()[group]))
    assert ports[RAY_METRICS_PORT_NAME] == int(params["rayStartParams"]["metrics-export-port"])


def test_only_pods_that_may_host_megaserve_processes_have_the_megaserve_metrics_port():
    # A scraped port that nothing serves is a target down for good, and MegaserveMetricsTargetDown
    # pages for it. The head hosts no router or replica (test_head_has_no_gpus_and_takes_no_replicas).
    with_port = {group for group, spec in _pod_specs().items()
                 if any(MEGASERVE_METRICS_PORT_NAME in _port_names(c) for c in spec["containers"])}
    assert with_port == {"latency", "throughput"}


@pytest.mark.parametrize("group", ["latency", "throughput"])
def test_an_exporter_serves_the_megaserve_metrics_port_for_the_pod_s_whole_life(group):
    # Not the megaserve processes themselves: a pod may host none (the second tray of a TP8 latency
    # replica holds only a placement-group bundle), yet it is scraped as long as it exists.
    _, config = _app_config()
    spec = _pod_specs()[group]
    ray_container = _ray_container(spec)
    (exporter,) = [c for c in spec["containers"] if MEGASERVE_METRICS_PORT_NAME in _port_names(c)]
    assert exporter is not ray_container and exporter["image"] == ray_container["image"]
    assert _port_names(exporter)[MEGASERVE_METRICS_PORT_NAME] == config.metrics.port
    assert exporter["command"] == ["python", "-m", "megaserve.monitoring.exporter",
                                   "--host", config.metrics.bind_host, "--port", str(config.metrics.port),
                                   "--outlive-processes-in", "/proc", "--linger-seconds", "20"]
    assert {"name": MULTIPROC_ENV, "value": config.metrics.multiproc_dir} in exporter["env"]
    # Both containers see the one in-memory folder every megaserve process of the pod writes, and the
    # exporter sees their processes, to retire the metrics of those that exited.
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (ray_container, exporter)]
    (volume_name,) = {m[config.metrics.multiproc_dir] for m in mounts}
    volume = next(v for v in spec["volumes"] if v["name"] == volume_name)
    assert volume["emptyDir"]["medium"] == "Memory"
    assert spec["shareProcessNamespace"] is True


@pytest.mark.parametrize("group", ["latency", "throughput"])
def test_a_stopping_pod_s_exporter_serves_until_its_megaserve_processes_exit_and_one_scrape_more(group):
    # Every container gets SIGTERM at once; Ray drains the pod's replicas for minutes, while Prometheus
    # still scrapes the terminating pod: an exporter gone at once pages (MegaserveMetricsTargetDown)
    # and loses the draining replicas' metrics. It sees their processes in the pod's shared /proc
    # (without sharing, it would see none and stop at once), and lingers a scrape interval after them.
    spec = _pod_specs()[group]
    (exporter,) = [c for c in spec["containers"] if MEGASERVE_METRICS_PORT_NAME in _port_names(c)]
    command = exporter["command"]
    assert command[command.index("--outlive-processes-in") + 1] == "/proc"
    assert spec["shareProcessNamespace"] is True
    linger = float(command[command.index("--linger-seconds") + 1])
    (endpoint,) = [e for e in _one("PodMonitor")["spec"]["podMetricsEndpoints"]
                   if e["port"] == MEGASERVE_METRICS_PORT_NAME]
    assert linger > _seconds(endpoint["interval"])
    # The replicas are gone by the drain's deadline at the latest; the linger must end before the kill.
    env = {var["name"]: var.get("value") for var in _ray_container(spec)["env"]}
    assert float(env[RAY_DRAIN_TIMEOUT_ENV]) + linger < spec["terminationGracePeriodSeconds"]


def test_no_container_can_gain_privileges_and_the_exporter_holds_none_and_writes_only_its_folder():
    containers = list(_containers(_documents()))
    assert containers and all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in containers)
    _, config = _app_config()
    for group in ("latency", "throughput"):
        (exporter,) = [c for c in _pod_specs()[group]["containers"] if MEGASERVE_METRICS_PORT_NAME in _port_names(c)]
        context = exporter["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"] and context["readOnlyRootFilesystem"] is True
        # it removes the metrics files of exited processes: its one writable mount is that folder
        (writable,) = [m for m in exporter["volumeMounts"] if not m.get("readOnly")]
        assert writable["mountPath"] == config.metrics.multiproc_dir


def _seconds(duration: str) -> float:
    """A Prometheus Operator duration of one unit ("15s", "1m") in seconds."""
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match.group(1)) * {"s": 1, "m": 60}[match.group(2)]


def test_pod_monitor_scrapes_the_metrics_ports_under_the_expected_jobs():
    monitor = _one("PodMonitor")["spec"]
    cluster = _cluster()
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        labels = template["metadata"]["labels"]
        assert monitor["selector"]["matchLabels"].items() <= labels.items()
    # An endpoint's `port` keeps only the pods with a port of that name: the workers for `megaserve`.
    endpoints = {e["port"]: e["relabelings"] for e in monitor["podMetricsEndpoints"]}
    for port, job in ((MEGASERVE_METRICS_PORT_NAME, METRICS_JOB), (RAY_METRICS_PORT_NAME, RAY_JOB)):
        running = _relabel(endpoints[port], {"__meta_kubernetes_pod_phase": "Running", "job": "podMonitor"})
        assert running is not None and running["job"] == job
        # While KubeRay's init container waits for the GCS (minutes at a cold start) the pod is Pending
        # and its ports answer nothing: as a target it would be down, and page.
        assert _relabel(endpoints[port], {"__meta_kubernetes_pod_phase": "Pending"}) is None


def _relabel(rules: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """A target's labels after Prometheus's relabeling (the replace and drop actions), None if dropped."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = ";".join(labels.get(name, "") for name in rule.get("sourceLabels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "drop":
            if match:
                return None
        elif action == "replace":
            if match:
                labels[rule["targetLabel"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
        else:
            raise AssertionError(f"no model of relabel action {action!r}")
    return labels


@pytest.mark.parametrize("document", KUBERNETES_STEPS)
def test_the_kubernetes_steps_create_every_secret_and_claim_the_pods_need(document):
    # A missing Secret or claim does not fail `kubectl apply`: the pods wait for it, forever.
    section = (REPO / document).read_text().split(KUBERNETES_STEPS[document] + "\n")[1].split("\n## ")[0]
    steps = "\n".join(BASH_BLOCK.findall(section))
    (namespace,) = NAMESPACE_STEP.findall(steps)
    created = _created_in(steps)
    used = _used_secrets_and_claims()
    assert used["Secret"] and used["PersistentVolumeClaim"]
    for kind, names in used.items():
        assert {(namespace, name) for name in names} <= created[kind], kind


def test_dashboards_config_map_is_for_grafanas_sidecar():
    configmap = _one("ConfigMap")
    assert configmap["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert configmap["data"] == dashboards.render()
    # `kubectl apply` keeps the whole object in an annotation, which may not exceed 256 KiB.
    size = len((K8S / dashboards.CONFIGMAP_FILE).read_bytes())
    assert size < LAST_APPLIED_ANNOTATION_LIMIT_BYTES, size


def test_prometheus_rule_is_the_generated_alert_rules():
    assert _one("PrometheusRule") == alerts.prometheus_rule()


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    images = {i["name"] for i in kustomization["images"]}
    containers = [c for spec in _pod_specs().values() for c in spec["containers"]]
    assert {c["image"].split(":")[0] for c in containers} == images
