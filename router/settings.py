"""What the router needs to know, as one frozen dataclass; the deploy config maps onto it.

Plain stdlib so that the router's policy can be built and tested without Ray or a config file.
Capacities are the tiers' whole: with several router replicas, each admits its share
(`router_share`, which the router's admission applies with its Serve replica rank).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from megaserve.replicas.protocol import CONFIG_FILE, GENERATION_CONFIG_FILE, is_integer, is_number

# OpenAI's sampling defaults (top_k is an extension: 0 keeps every token), and the range a model's
# generation_config.json value must be in to replace one.
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (0, 2**31 - 1)}

# Defaults of the deploy config too (deploy/config.py reads them from here).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token prompt of plain text fits well below
DEFAULT_LATENCY_MAX_PROMPT_TOKENS = 4096
DEFAULT_LATENCY_WAIT_SECONDS = 0.05  # a few batch-1 steps: spill over rather than queue long
DEFAULT_RETRY_AFTER_SECONDS = 1
# The whole body must arrive within this: the default limit's 4 MB takes 34 s at 1 Mbit/s. A client
# that sends slower holds a connection and one of the router replica's ongoing requests (Serve's
# max_ongoing_requests) until it is done.
DEFAULT_BODY_TIMEOUT_SECONDS = 60.0
# A throughput request finds a slot at once or gets 429: its replicas queue in their own engine
# (max_ongoing_requests), so a wait at the router would only add latency.
THROUGHPUT_WAIT_SECONDS = 0.0
ANY_ORIGIN = "*"  # as the one entry of cors_allowed_origins: a browser page of any origin may call


@dataclass(frozen=True)
class RouterSettings:
    model_name: str  # the name clients pass as `model` and see in /v1/models
    model_dir: str  # Hugging Face folder the tokenizer and chat template are read from
    max_context: int  # prompt + generated tokens must fit in this (the replicas' context)
    # requests each tier runs at once (latency: replicas x 1, batch-1; throughput: replicas x max
    # ongoing); a router that is one of several admits its share (router_share)
    latency_capacity: int
    throughput_capacity: int
    latency_replicas: int = 1  # the replicas latency_capacity counts; fewer healthy ones, less capacity
    throughput_replicas: int = 1  # the same for throughput_capacity
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # accepted bearer tokens; empty disables auth
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    body_timeout_seconds: float = DEFAULT_BODY_TIMEOUT_SECONDS  # bodies slower than this get 408
    # service_tier "auto": longer prompts go to throughput
    latency_max_prompt_tokens: int = DEFAULT_LATENCY_MAX_PROMPT_TOKENS
    latency_wait_seconds: float = DEFAULT_LATENCY_WAIT_SECONDS  # how long a latency request waits for a free slot
    spillover: bool = True  # a latency request that waited in vain runs on throughput instead of 429
    retry_after_seconds: int = DEFAULT_RETRY_AFTER_SECONDS  # Retry-After header of 429 and 503 answers
    created: int = 0  # Unix time shown as the model's `created` in /v1/models
    # origins whose browser pages may call the API (CORS); "*": any; empty: no CORS headers at all
    cors_allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        for name in ("latency_capacity", "throughput_capacity", "latency_max_prompt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("latency_replicas", "throughput_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.throughput_capacity == 0 and self.latency_capacity == 0:
            raise ValueError("at least one tier needs capacity")
        if self.latency_wait_seconds < 0:
            raise ValueError(f"latency_wait_seconds must be >= 0, got {self.latency_wait_seconds}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not self.body_timeout_seconds > 0:
            raise ValueError(f"body_timeout_seconds must be positive, got {self.body_timeout_seconds}")
        if self.retry_after_seconds < 0:
            raise ValueError(f"retry_after_seconds must be >= 0, got {self.retry_after_seconds}")


def capped_by_model(settings: RouterSettings) -> RouterSettings:
    """`settings` with max_context at most the model's max_position_embeddings, read from its
    config.json where the router reads the tokenizer (the replicas cap their context by it too;
    the app may be built on a node without the model); unchanged when the file says nothing."""
    try:
        config = json.loads((Path(settings.model_dir) / CONFIG_FILE).read_text())
        limit = int(config["max_position_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        return settings
    return dataclasses.replace(settings, max_context=min(settings.max_context, limit))


def sampling_defaults(model_dir: str) -> dict[str, float]:
    """What a request samples with where it leaves temperature, top_p or top_k out: the model's
    generation_config.json values, as vLLM applies them by default (`--generation-config auto`;
    Qwen3 asks for temperature 0.6, top_p 0.95, top_k 20), else OpenAI's defaults. A value of the
    wrong type or out of range is ignored, as is a file that cannot be read."""
    try:
        raw = json.loads((Path(model_dir) / GENERATION_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        raw = {}
    defaults = dict(OPENAI_SAMPLING_DEFAULTS)
    for name, (low, high) in SAMPLING_RANGES.items():
        value = raw.get(name) if isinstance(raw, dict) else None
        typed = is_integer(value) if name == "top_k" else is_number(value)
        if typed and low <= value <= high:
            defaults[name] = value
    return defaults


def router_share(total: int, routers: int, rank: int) -> int:
    """Router `rank`'s share of a tier's `total` slots when `routers` routers admit to it: an even
    split with the remainder going to the lowest ranks, so that together the routers admit exactly
    what the tier runs (3 batch-1 replicas over 2 routers: 2 and 1). With fewer slots than routers,
    each router keeps one so that every router can use every tier; two requests can then meet at
    one replica, and the second waits in Serve's queue for the first to finish."""
    if routers < 1 or rank < 0:
        raise ValueError(f"a router share needs routers >= 1 and rank >= 0, got {routers} and {rank}")
    if total == 0:
        return 0
    return max(1, total // routers + (1 if rank < total % routers else 0))
