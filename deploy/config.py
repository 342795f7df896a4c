"""The app config: one pydantic schema for `megaserve up`, `serve run/deploy` args and KubeRay.

A YAML file (deploy/local.yaml, deploy/h200.yaml, deploy/gb300.yaml) is a Ray Serve config whose
application `args` are an `AppConfig`. Every field has a description; cross-field rules live in
validators so that a bad config fails before anything starts, with a message naming the field.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import urllib.parse
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from megaserve.deploy.sglang_server_args import SERVER_ARGS_FIELDS, SGLANG_VERSION, server_arg_type_problem
from megaserve.replicas.engines.sglang_engine import OWNED_ARGS as SGLANG_OWNED_ARGS
from megaserve.replicas.engines.sglang_engine import check_engine_args as check_sglang_args
from megaserve.replicas.protocol import CoalescePolicy
from megaserve.router.settings import (
    ANY_ORIGIN,
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_LATENCY_MAX_PROMPT_TOKENS,
    DEFAULT_LATENCY_WAIT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RETRY_AFTER_SECONDS,
)

DEMO_MODEL_NAME = "megaserve-demo"
MAX_PORT = 65535  # TCP's
TP_SIZES = (1, 2, 4, 8)  # GPUs of one node that a replica's tensor-parallel group may span
# Longer than a whole 32K-token generation at the megakernel's 8B step time (~4 ms, docs/perf.md);
# raise it for longer generations, or a batched tier's slower steps.
DEFAULT_GRACEFUL_SHUTDOWN_SECONDS = 300.0
DEFAULT_COALESCE = CoalescePolicy()  # the engines' own yield rule, unless a tier sets its own
# throughput fields for engine sglang alone
SGLANG_ONLY_FIELDS = {"sglang_metrics", "sglang_mem_fraction_static", "sglang_args"}


class _Strict(BaseModel):
    # strict: no true as 1, no "2" as 2; no inf or nan in a float field (YAML's .inf and .nan), which
    # would pass its bounds or fail them only where the value is used
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _absolute(path: str) -> str:
    # Replicas and the metrics exporter run in Ray's working directories on every node, not the one
    # the config was written in, and nothing expands `~` there.
    if not os.path.isabs(path):
        raise ValueError(f"must be an absolute path (every node reads it from its own working directory), "
                         f"got {path!r}")
    return path


AbsolutePath = Annotated[str, AfterValidator(_absolute)]

RAY_RESOURCE_UNIT = 0.0001  # Ray counts a resource in ten-thousandths


def _ray_resource(quantity: float) -> float:
    # Ray refuses a nonzero request below its unit, but only once the replica is placed.
    if 0 < quantity < RAY_RESOURCE_UNIT:
        raise ValueError(f"Ray cannot reserve less than {RAY_RESOURCE_UNIT:g} of a resource, got {quantity:g}")
    return quantity


RayQuantity = Annotated[float, AfterValidator(_ray_resource)]


def _ray_label_selector(selector: dict[str, str]) -> dict[str, str]:
    # Ray's own check, which it runs only once the replica is placed (the app would fail to deploy).
    from ray._private.label_utils import validate_label_selector

    problem = validate_label_selector(selector)
    if problem is not None:
        raise ValueError(problem)
    return selector


RayLabelSelector = Annotated[dict[str, str], AfterValidator(_ray_label_selector)]

DEFAULT_PORTS = {"http": 80, "https": 443}  # a browser leaves these out of an Origin
DNS_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


def _serialized_origin(origin: str) -> str | None:
    """`origin` as a browser serializes it (scheme://host[:port], lower case, IDNA hosts as
    punycode, IP addresses in their one canonical form), or None where it is no http(s) origin."""
    parts = urllib.parse.urlsplit(origin)
    try:
        port, host = parts.port, parts.hostname or ""
    except ValueError:  # a port that is no number, or out of range
        return None
    if parts.scheme not in DEFAULT_PORTS or port == 0:
        return None
    if parts.netloc.startswith("["):
        if "%" in host:  # a zone id: no browser sends one
            return None
        try:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            return None
    elif (last_label := host.split(".")[-1]).isdigit() or last_label.startswith("0x"):  # an IPv4 address
        try:
            host = str(ipaddress.IPv4Address(host))
        except ValueError:
            return None
    else:
        try:
            host = host.encode("idna").decode("ascii")  # a Unicode name as its punycode
        except UnicodeError:
            return None
        if not DNS_NAME.fullmatch(host):
            return None
    default = port is None or port == DEFAULT_PORTS[parts.scheme]
    return f"{parts.scheme}://{host}" + ("" if default else f":{port}")


def _cors_origin(origin: str) -> str:
    # CORS compares the browser's Origin header as text: an origin written any other way (a path,
    # a trailing slash, capitals, the scheme's own port, a Unicode host, a wildcard) would match no
    # request, silently.
    if origin != ANY_ORIGIN and (serialized := _serialized_origin(origin)) != origin:
        hint = f" (a browser sends {serialized!r})" if serialized else ""
        raise ValueError(f"{origin!r} is not an origin as a browser sends it{hint}: http(s)://host, lower "
                         f"case, a port only where it is not the scheme's, no path, e.g. "
                         f"'https://chat.example.com'; or {ANY_ORIGIN!r}")
    return origin


CorsOrigin = Annotated[str, AfterValidator(_cors_origin)]


MEGAKERNEL_DTYPES = ("auto", "bfloat16")  # the kernel is written for bf16; auto loads bf16 there


class ModelSpec(_Strict):
    name: str = Field(
        DEMO_MODEL_NAME, min_length=1,
        description="Model name served on /v1/models and matched against the request's `model`.",
    )
    path: AbsolutePath | None = Field(
        None,
        description="Hugging Face-format model directory (config.json, safetensors, tokenizer.json), "
        "an absolute path readable on every node. None serves the embedded demo model, created on first use.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight and activation dtype; `auto` takes the config's torch_dtype "
        "on GPU and float32 on CPU.",
    )
    max_context: int | None = Field(
        None, gt=1, description="Longest prompt + generation in tokens; None uses the model's "
        "max_position_embeddings (capped by each tier's max_seq_len).",
    )


class TierCommon(_Strict):
    enabled: bool = Field(True, description="Deploy this tier at all.")
    num_replicas: int = Field(1, ge=1, description="Replicas of this tier.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the engine runs.")
    tp_size: int = Field(
        1, ge=1, description="GPUs per replica, reserved as one tensor-parallel group (cuda only). "
        "SGLang drives all of them; the megakernel engine drives the first (its tensor-parallel form "
        "is not built yet, and the builder warns); the torch engine runs on one, so it takes 1.",
    )
    nodes_per_replica: int = Field(
        1, ge=1, description="Nodes one replica's tensor-parallel group spans, each giving "
        "tp_size / nodes_per_replica GPUs: e.g. 2 GB300 trays of 4 GPUs for TP8 (cuda only).",
    )
    accelerator_type: str | None = Field(
        None, min_length=1,  # "" would be a resource no node has: the replicas would wait for ever
        description="Ray accelerator label the replica must land on, e.g. `H200`, `GB300`.",
    )
    label_selector: RayLabelSelector | None = Field(
        None, description="Ray node labels every node of a replica must carry, e.g. "
        "`{megaserve.io/tier: latency}` to keep a tier on its own KubeRay worker group.",
    )
    cpus_per_replica: RayQuantity = Field(1.0, gt=0, description="CPUs reserved per replica.")
    max_seq_len: int = Field(
        2048, ge=16, description="KV-cache length per sequence (prompt + generated tokens)."
    )
    coalesce_seconds: float = Field(
        DEFAULT_COALESCE.seconds, ge=0, le=1.0,
        description="Stream tokens back at most this often after the first (see the yield rule).",
    )
    coalesce_tokens: int = Field(
        DEFAULT_COALESCE.tokens, ge=1, description="Or as soon as this many tokens are pending."
    )
    graceful_shutdown_seconds: float = Field(
        DEFAULT_GRACEFUL_SHUTDOWN_SECONDS, gt=0,
        description="How long a stopping replica (a rolling update, a scale-down, `serve shutdown`, a "
        "drained node) lets its running generations finish before Serve kills it: at least the longest "
        "generation (max_seq_len tokens at the tier's step time). The router waits as long as the "
        "longest of its tiers. Serve's own default, 20 s, cut longer generations off.",
    )

    @model_validator(mode="after")
    def _gpu_rules(self):
        if self.device == "cpu" and self.tp_size != 1:
            raise ValueError("tp_size > 1 needs device: cuda")
        if self.tp_size not in TP_SIZES:
            raise ValueError(f"tp_size must be one of {', '.join(map(str, TP_SIZES))}, got {self.tp_size}")
        if self.device == "cpu" and self.accelerator_type is not None:
            raise ValueError("accelerator_type is only meaningful with device: cuda")
        if self.device == "cpu" and self.nodes_per_replica != 1:
            raise ValueError("nodes_per_replica > 1 needs device: cuda")
        if self.tp_size % self.nodes_per_replica:
            raise ValueError(f"tp_size ({self.tp_size}) must split evenly over nodes_per_replica "
                             f"({self.nodes_per_replica})")
        return self

    @property
    def gpus_per_node(self) -> int:
        """GPUs the replica takes on each of its nodes (0 on cpu)."""
        return self.tp_size // self.nodes_per_replica if self.device == "cuda" else 0


class LatencyTier(TierCommon):
    engine: Literal["auto", "megakernel", "torch"] = Field(
        "auto", description="Batch-1 engine: `megakernel` (CUDA), `torch` (reference), or `auto`: "
        "megakernel on cuda, torch on cpu.",
    )

    @model_validator(mode="after")
    def _engine_rules(self):
        if self.engine == "megakernel" and self.device != "cuda":
            raise ValueError("latency.engine megakernel needs latency.device: cuda")
        if self.nodes_per_replica > 1 and self.resolved_engine != "megakernel":
            raise ValueError("latency.nodes_per_replica > 1 needs engine megakernel (the torch "
                             "engine runs on one device)")
        if self.tp_size > 1 and self.resolved_engine == "torch":
            raise ValueError("latency.tp_size > 1 needs engine megakernel: the torch engine runs on one "
                             "device, and the other GPUs of the group would stay idle")
        return self

    @property
    def resolved_engine(self) -> str:
        if self.engine == "auto":
            return "megakernel" if self.device == "cuda" else "torch"
        return self.engine


class ThroughputTier(TierCommon):
    engine: Literal["torch", "sglang"] = Field(
        "torch", description="Batched engine: `torch` (continuous batching, CPU or GPU) or "
        "`sglang` (stock SGLang, cuda only, `pip install 'megaserve[sglang]'` on every GPU node).",
    )
    max_batch: int = Field(
        8, ge=1, description="Sequences decoded together per replica (torch: its KV slots; "
        "sglang: its max_running_requests).",
    )
    max_ongoing_requests: int = Field(
        32, ge=1, description="Requests a replica accepts at once (running + queued inside it).",
    )
    sglang_metrics: bool = Field(
        True, description="engine sglang: SGLang's own Prometheus metrics (`sglang:*`, its "
        "enable_metrics), written to metrics.multiproc_dir and served on metrics.port beside "
        "megaserve's.",
    )
    sglang_mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="engine sglang: the share of each GPU's memory SGLang takes for "
        "the weights and its KV-cache pool (its mem_fraction_static); unset, SGLang sizes it from the "
        "GPU and tp_size. Lower it when other processes share the GPUs.",
    )
    sglang_args: dict[str, object] = Field(
        default_factory=dict, description="engine sglang: further `sglang.Engine` keyword "
        "arguments (SGLang ServerArgs fields, e.g. chunked_prefill_size, "
        "enable_deterministic_inference for seeded sampling); a key that is not a ServerArgs field of "
        "the pinned SGLang is refused, as is a value of another type than a scalar field's, and so are the ones megaserve sets: model_path (model.path), "
        "tp_size, context_length (max_seq_len), dtype (model.dtype), max_running_requests (max_batch), "
        "enable_metrics (sglang_metrics), mem_fraction_static (sglang_mem_fraction_static), "
        "skip_tokenizer_init; also those that place SGLang on other GPUs or nodes than the replica "
        "holds (dp_size, pp_size, nnodes, ...), and a schedule_policy that priority scheduling (on "
        "unless enable_priority_scheduling: false) does not take.",
    )

    @model_validator(mode="after")
    def _engine_rules(self):
        if self.engine == "sglang" and self.device != "cuda":
            raise ValueError("throughput.engine sglang needs throughput.device: cuda")
        if self.nodes_per_replica > 1:
            raise ValueError(f"throughput.nodes_per_replica > 1 is not supported by engine "
                             f"{self.engine}: its tensor-parallel group runs on one node")
        sglang_only = sorted(SGLANG_ONLY_FIELDS & self.model_fields_set)
        if self.engine != "sglang" and sglang_only:
            raise ValueError(f"{', '.join('throughput.' + f for f in sglang_only)}: only used with "
                             f"engine: sglang")
        owned = sorted(set(SGLANG_OWNED_ARGS) & set(self.sglang_args))
        if owned:
            raise ValueError(f"throughput.sglang_args must not set {owned}: megaserve sets them from "
                             f"the config (see the field's description)")
        unknown = sorted(set(self.sglang_args) - SERVER_ARGS_FIELDS)
        if unknown:
            raise ValueError(f"throughput.sglang_args: {'; '.join(_unknown_server_arg(key) for key in unknown)}")
        mistyped = [problem for key, value in sorted(self.sglang_args.items())
                    if (problem := server_arg_type_problem(key, value)) is not None]
        if mistyped:
            raise ValueError(f"throughput.sglang_args: {'; '.join(mistyped)}")
        try:
            check_sglang_args(self.sglang_args)
        except ValueError as error:
            raise ValueError(f"throughput.sglang_args: {error}") from None
        if self.max_ongoing_requests < self.max_batch:
            raise ValueError("throughput.max_ongoing_requests must be >= max_batch")
        if self.tp_size > 1 and self.engine == "torch":
            raise ValueError("throughput.tp_size > 1 needs engine sglang: the torch engine runs on one "
                             "device, and the other GPUs of the group would stay idle")
        return self


def _unknown_server_arg(key: str) -> str:
    close = difflib.get_close_matches(key, SERVER_ARGS_FIELDS)
    hint = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
    return f"{key!r} is not a ServerArgs field of SGLang {SGLANG_VERSION}{hint}"


class Routing(_Strict):
    latency_max_prompt_tokens: int = Field(
        DEFAULT_LATENCY_MAX_PROMPT_TOKENS, ge=1,
        description="`auto` requests with longer prompts go to the throughput tier.",
    )
    latency_wait_seconds: float = Field(
        DEFAULT_LATENCY_WAIT_SECONDS, ge=0, le=60,
        description="How long a latency request waits for a free latency "
        "replica before it spills over (or is rejected).",
    )
    spillover: bool = Field(
        True, description="Send latency requests to the throughput tier when every latency "
        "replica stays busy past latency_wait_seconds; else reject them with 429.",
    )
    retry_after_seconds: int = Field(
        DEFAULT_RETRY_AFTER_SECONDS, ge=0,
        description="Retry-After header value on 429 / 503 responses."
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="Larger request bodies get 413."
    )
    body_timeout_seconds: float = Field(
        DEFAULT_BODY_TIMEOUT_SECONDS, gt=0, description="A request body that has not fully arrived "
        "this many seconds after the headers gets 408 (a slow client holds a connection and one of "
        "the router's ongoing requests meanwhile). The default lets the default max_body_bytes "
        "arrive at 1 Mbit/s.",
    )
    router_replicas: int = Field(
        1, ge=1, description="Router (HTTP ingress) replicas. Each admits its share of every tier's "
        "capacity (3 latency replicas over 2 routers: 2 and 1), at least one slot, so that every "
        "router can use every tier: with fewer latency replicas than routers, a batch-1 replica may "
        "get a second request, which then waits behind the first instead of spilling over.",
    )
    cors_allowed_origins: list[CorsOrigin] = Field(
        default_factory=list, description="Origins whose browser pages may call the API (CORS), "
        "as a browser sends them (`https://chat.example.com`, with a port where it is not the "
        "scheme's), or `*` alone for any. Empty (the default): no CORS headers, so browsers refuse "
        "calls from other origins (vLLM and SGLang allow any by default; a local server that any web "
        "page could call is what this default avoids).",
    )
    router_cpus: RayQuantity = Field(
        0.0, ge=0, description="CPUs each router replica reserves (a Ray resource, not a limit). At 0 "
        "Ray may place routers on any node, a head started with num-cpus 0 included (KubeRay's "
        "advice), where they would share its CPUs with the GCS; k8s/rayservice.yaml reserves 1, "
        "which keeps them on the workers.",
    )

    @model_validator(mode="after")
    def _any_origin_alone(self):
        if ANY_ORIGIN in self.cors_allowed_origins and len(self.cors_allowed_origins) > 1:
            raise ValueError(f"cors_allowed_origins: {ANY_ORIGIN!r} allows every origin; list it alone")
        return self


class Metrics(_Strict):
    port: int = Field(
        9400, ge=1, le=MAX_PORT, description="Per-node metrics endpoint (served by one megaserve "
        "process per node, summing every process' metrics). Neither Serve's HTTP port (refused "
        "where the app is built) nor Ray's metrics export port on a node megaserve runs on (a "
        "warning where the app is built, which cannot know those nodes).",
    )
    multiproc_dir: AbsolutePath = Field(
        "/tmp/megaserve-metrics", description="Node-local folder where every megaserve process "
        "writes its metrics (PROMETHEUS_MULTIPROC_DIR).",
    )
    bind_host: str = Field(
        "127.0.0.1", description="Address the metrics endpoint binds; 0.0.0.0 in a cluster (:: for IPv6, the "
        "family of the address it resolves to first).",
    )


class AppConfig(_Strict):
    model: ModelSpec = Field(default_factory=ModelSpec, description="What to serve.")
    latency: LatencyTier = Field(
        default_factory=LatencyTier, description="Batch-1 replicas for `priority` requests."
    )
    throughput: ThroughputTier = Field(
        default_factory=ThroughputTier, description="Batched replicas for everything else."
    )
    routing: Routing = Field(default_factory=Routing, description="Tier policy and limits.")
    metrics: Metrics = Field(default_factory=Metrics, description="Where metrics are served.")

    @model_validator(mode="after")
    def _tiers(self):
        if not (self.latency.enabled or self.throughput.enabled):
            raise ValueError("at least one of latency.enabled / throughput.enabled must be true")
        if (self.latency.enabled and self.latency.resolved_engine == "megakernel"
                and self.model.dtype not in MEGAKERNEL_DTYPES):
            raise ValueError(f"the megakernel engine (latency.engine on cuda) runs bfloat16 weights, not "
                             f"model.dtype {self.model.dtype}: use auto or bfloat16, or latency.engine: torch")
        if self.model.max_context is not None:
            for name in ("latency", "throughput"):
                tier = getattr(self, name)
                if tier.enabled and tier.max_seq_len < self.model.max_context:
                    raise ValueError(
                        f"{name}.max_seq_len ({tier.max_seq_len}) is shorter "
                        f"than model.max_context ({self.model.max_context})"
                    )
        return self

    @property
    def router_graceful_shutdown_seconds(self) -> float:
        """How long a stopping router lets its streams run: as long as the longest of its tiers'."""
        return max(tier.graceful_shutdown_seconds for tier in (self.latency, self.throughput) if tier.enabled)
