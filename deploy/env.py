"""The one typed place for environment variables: all of them start with `MEGASERVE_`.

Plain stdlib on purpose: `megaserve generate` and `megaserve bench` run on GPU machines that have
torch and cuda-python but no pydantic or Ray. Everything below deploy/ receives these values as
explicit arguments; nothing else reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "MEGASERVE_"


def _path(name: str, default: Path) -> Path:
    value = os.environ.get(PREFIX + name)
    return Path(value).expanduser() if value else default


def _int(name: str, default: int) -> int:
    value = os.environ.get(PREFIX + name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{PREFIX}{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class Environment:
    """Settings that belong to the machine rather than to one app config."""

    home: Path  # MEGASERVE_HOME: demo model, kernel cache, local metrics folder
    kernel_cache: Path  # MEGASERVE_KERNEL_CACHE: compiled cubins by source hash + arch + shape
    metrics_port: int  # MEGASERVE_METRICS_PORT: the node's metrics endpoint
    api_keys: tuple[str, ...]  # MEGASERVE_API_KEYS: comma-separated; empty disables auth

    @classmethod
    def read(cls) -> "Environment":
        home = _path("HOME", Path.home() / ".cache" / "megaserve")
        keys = tuple(k.strip() for k in os.environ.get(PREFIX + "API_KEYS", "").split(",") if k.strip())
        return cls(
            home=home,
            kernel_cache=_path("KERNEL_CACHE", home / "kernels"),
            metrics_port=_int("METRICS_PORT", 9400),
            api_keys=keys,
        )
