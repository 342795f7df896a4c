"""Fixtures shared across the test tree."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from megaserve.replicas.source_tree import import_installed_namesakes

REPO_ROOT = Path(__file__).resolve().parents[1]
# Python (`python -m pytest`) and pytest put the repository's root first on sys.path, so that
# `tests.*` imports: its folders would hide installed distributions of their names (see
# replicas/source_tree.py) for every test module that imports one.
SHADOWED_DISTRIBUTIONS = import_installed_namesakes(REPO_ROOT)

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
    "routing": {"latency_wait_seconds": 0.2, "spillover": True, "retry_after_seconds": 2,
                "cors_allowed_origins": ["https://chat.example.com"]},
}


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    """The real app on Ray Serve plus a real Prometheus scraping it (see tests/live.py)."""
    from tests.live import start_stack, stop_stack

    stack = start_stack(LIVE_APP_ARGS, tmp_path_factory.mktemp("megaserve-home"))
    yield stack
    stop_stack(stack)
