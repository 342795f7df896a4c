"""Fixtures shared across the test tree."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import secrets
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _import_installed_namesakes() -> list[str]:
    """Import, ahead of everything, each installed distribution's top-level module that one of the
    repository's folders would shadow; returns their names.

    Python (`python -m pytest`) and pytest put the repository's root first on sys.path so that
    `tests.*` imports, which makes its folders top-level packages too: `kernels/` then hides the
    Hugging Face `kernels` distribution, which transformers (5.25 on) imports whenever it is
    installed. Once the real module is in sys.modules, every later import of the name gets it."""
    outside = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != REPO_ROOT]
    installed = importlib.metadata.packages_distributions()
    shadowed = sorted(folder.name for folder in REPO_ROOT.iterdir()
                      if (folder / "__init__.py").is_file() and folder.name in installed and folder.name != "tests")
    inside, sys.path[:] = sys.path[:], outside
    try:
        for name in shadowed:
            sys.modules.pop(name, None)
            importlib.import_module(name)
    finally:
        sys.path[:] = inside
    return shadowed


SHADOWED_DISTRIBUTIONS = _import_installed_namesakes()

# Ray reads its auth mode when it is first imported, which some test modules do at collection:
# turn token authentication on here, before any of them, with a token of this test session's own
# (not the user's ~/.ray one, which a concurrent `ray start` could replace).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)

# A small live deployment: one latency replica (batch-1), one throughput replica with few slots,
# so that tests can saturate both tiers with a handful of concurrent requests.
LIVE_APP_ARGS = {
    "latency": {"device": "cpu", "cpus_per_replica": 0.5, "max_seq_len": 1024},
    "throughput": {"device": "cpu", "cpus_per_replica": 0.5, "max_seq_len": 1024,
                   "max_batch": 2, "max_ongoing_requests": 2},
    "routing": {"latency_wait_seconds": 0.2, "spillover": True, "retry_after_seconds": 2},
}


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    """The real app on Ray Serve plus a real Prometheus scraping it (see tests/live.py)."""
    from tests.live import start_stack, stop_stack

    stack = start_stack(LIVE_APP_ARGS, tmp_path_factory.mktemp("megaserve-home"))
    yield stack
    stop_stack(stack)
