"""The one typed place for environment variables: all of them start with `MEGASERVE_`.

Plain stdlib on purpose: `megaserve generate` and `megaserve bench` run on GPU machines that have
torch and cuda-python but no pydantic or Ray. Everything below deploy/ receives these values as
explicit arguments; nothing else reads a `MEGASERVE_` variable. Variables of megaserve's
dependencies are set elsewhere, by their owners' rules, and are no settings of megaserve's:
PROMETHEUS_MULTIPROC_DIR (set for every replica from `metrics.multiproc_dir` by the builder; read by
prometheus_client, and by the node exporter to find the same folder), RAY_AUTH_MODE (`megaserve up`
turns Ray's token authentication on unless it is set),
NCCL_NVLS_ENABLE and TORCH_SYMM_MEM_DISABLE_MULTICAST (NVLink multicast off in GPU replicas, the
builder's GPU_PROCESS_ENV) and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN (in a throughput replica,
by the SGLang engine, so that SGLang takes the context length megaserve gives it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "MEGASERVE_"


def _path(name: str, default: Path) -> Path:
    value = os.environ.get(PREFIX + name)
    if not value:
        return default
    try:
        path = Path(value).expanduser()
    except RuntimeError as error:  # ~user of no such user
        raise ValueError(f"{PREFIX}{name}={value!r}: {error}") from None
    return path.absolute()  # handed to replicas, which run in other working directories


def _api_keys() -> tuple[str, ...]:
    name = PREFIX + "API_KEYS"
    value = os.environ.get(name)
    if value is None:
        return ()
    keys = tuple(key.strip() for key in value.split(",") if key.strip())
    if not keys:  # an empty Secret, say: taken as "no keys", it would open the API to everyone
        raise ValueError(f"{name} is set but holds no key ({value!r}): set it to comma-separated bearer "
                         f"keys, or unset it to serve without auth")
    if not all(key.isascii() and key.isprintable() for key in keys):
        # HTTP header values reach the app decoded as latin-1: a UTF-8 client could never match such a key
        raise ValueError(f"{name} holds a key with characters outside printable ASCII: bearer keys must be "
                         f"printable ASCII")
    return keys


@dataclass(frozen=True)
class Environment:
    """Settings that belong to the machine rather than to one app config."""

    home: Path  # MEGASERVE_HOME: the demo model and the kernel cache
    kernel_cache: Path  # MEGASERVE_KERNEL_CACHE: compiled cubins by source hash + arch + shape
    api_keys: tuple[str, ...]  # MEGASERVE_API_KEYS: comma-separated; unset: () and no auth
    # MEGASERVE_API_KEY: the key a client (`megaserve generate --url`) sends when --api-key gives none;
    # unset or empty: none. A default, so that a server-side Environment need not name it.
    api_key: str | None = None

    @classmethod
    def read(cls, serving: bool = True) -> "Environment":
        """The environment's settings. A process that builds no server (`megaserve generate`, `bench`)
        reads with serving=False: it leaves MEGASERVE_API_KEYS unread, so that a server's setting in
        the same shell, empty or not, does not stop a client."""
        home = _path("HOME", Path.home() / ".cache" / "megaserve")
        return cls(
            home=home,
            kernel_cache=_path("KERNEL_CACHE", home / "kernels"),
            api_keys=_api_keys() if serving else (),
            api_key=os.environ.get(PREFIX + "API_KEY", "").strip() or None,
        )
