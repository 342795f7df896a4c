"""MEGASERVE_* environment variables, read in one place."""

from __future__ import annotations

from pathlib import Path

from megaserve.deploy.env import Environment


def test_defaults_live_under_the_user_cache(monkeypatch):
    for name in ("MEGASERVE_HOME", "MEGASERVE_KERNEL_CACHE", "MEGASERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    env = Environment.read()
    assert env.home == Path.home() / ".cache" / "megaserve"
    assert env.kernel_cache == env.home / "kernels"
    assert env.api_keys == ()


def test_variables_override_and_keys_are_split_and_trimmed(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASERVE_HOME", str(tmp_path))
    monkeypatch.delenv("MEGASERVE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("MEGASERVE_API_KEYS", " key-a, ,key-b ")
    env = Environment.read()
    assert env.home == tmp_path and env.kernel_cache == tmp_path / "kernels"
    assert env.api_keys == ("key-a", "key-b")
