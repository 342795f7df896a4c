"""MEGASERVE_* environment variables, read in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaserve.deploy.cli import main
from megaserve.deploy.env import Environment


def test_defaults_live_under_the_user_cache(monkeypatch):
    for name in ("MEGASERVE_HOME", "MEGASERVE_KERNEL_CACHE", "MEGASERVE_API_KEYS", "MEGASERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    env = Environment.read()
    assert env.home == Path.home() / ".cache" / "megaserve"
    assert env.kernel_cache == env.home / "kernels"
    assert env.api_keys == () and env.api_key is None


def test_variables_override_and_keys_are_split_and_trimmed(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASERVE_HOME", str(tmp_path))
    monkeypatch.delenv("MEGASERVE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("MEGASERVE_API_KEYS", " key-a, ,key-b ")
    env = Environment.read()
    assert env.home == tmp_path and env.kernel_cache == tmp_path / "kernels"
    assert env.api_keys == ("key-a", "key-b")


@pytest.mark.parametrize(("value", "key"), [(" client-key ", "client-key"), ("", None), (" ", None)])
def test_the_client_key_is_trimmed_and_an_empty_one_is_none(monkeypatch, value, key):
    monkeypatch.setenv("MEGASERVE_API_KEY", value)
    assert Environment.read().api_key == key


def test_a_relative_path_is_made_absolute_here(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGASERVE_HOME", "rel/home")
    monkeypatch.setenv("MEGASERVE_KERNEL_CACHE", "~/kernels")
    env = Environment.read()
    assert env.home == tmp_path / "rel" / "home"
    assert env.kernel_cache == Path.home() / "kernels"


def test_a_home_of_no_such_user_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("MEGASERVE_HOME", "~no-such-user-here/cache")
    with pytest.raises(ValueError, match="MEGASERVE_HOME='~no-such-user-here/cache'"):
        Environment.read()
    assert main(["generate", "hi", "--url", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("megaserve: MEGASERVE_HOME='~no-such-user-here/cache'")


@pytest.mark.parametrize("value", ["", " ", ",", " , "])
def test_keys_set_to_no_key_are_refused_by_name_not_taken_as_auth_off(monkeypatch, capsys, value):
    # An empty Secret value is a mistake, not a wish to serve without auth (that is an unset variable).
    monkeypatch.setenv("MEGASERVE_API_KEYS", value)
    with pytest.raises(ValueError, match="MEGASERVE_API_KEYS is set but holds no key"):
        Environment.read()
    assert main(["up", "no-such-config.yaml"]) == 2
    assert capsys.readouterr().err.startswith("megaserve: MEGASERVE_API_KEYS is set but holds no key")


@pytest.mark.parametrize("value", ["k1,sécret", "k1,tab\tkey"])
def test_keys_outside_printable_ascii_are_refused(monkeypatch, value):
    # Headers reach the app decoded as latin-1: a UTF-8 client could never send a matching key.
    monkeypatch.setenv("MEGASERVE_API_KEYS", value)
    with pytest.raises(ValueError, match="MEGASERVE_API_KEYS holds a key with characters outside printable ASCII"):
        Environment.read()


def test_a_client_command_leaves_the_server_s_keys_unread(monkeypatch, capsys):
    # The server's setting in the same shell, empty or not, is no business of a client's.
    monkeypatch.setenv("MEGASERVE_API_KEYS", "")
    assert Environment.read(serving=False).api_keys == ()
    assert main(["generate", "hi", "--url", "http://127.0.0.1:1"]) != 0  # nothing listens there
    assert "MEGASERVE_API_KEYS" not in capsys.readouterr().err
