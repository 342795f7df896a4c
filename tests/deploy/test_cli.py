"""`megaserve up` as a user runs it: a subprocess that serves, answers, and stops on Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
import yaml

from megaserve.deploy.cli import _parser
from megaserve.deploy.local import load_serve_config
from tests.live import free_port

STREAM_TOKENS = 1000  # the demo model on 2 CPU cores: a few seconds of decoding
LONG_STREAM_TOKENS = 2000  # the demo model's context's worth: far longer than a stop at once takes
STOP_AT_ONCE_SECONDS = 60  # Serve's and Ray's shutdown, on a loaded 2-core machine, without the drain
ROUTE_PREFIX = "/mega"  # not Serve's default "/": the URL that `up` prints must carry it


def _start_up(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    """`megaserve up` on the default config with the app at ROUTE_PREFIX, in a session of its own;
    returns it and its port."""
    config = load_serve_config(None)
    config["applications"][0]["route_prefix"] = ROUTE_PREFIX
    app = config["applications"][0]["args"]
    app["metrics"] = {"port": free_port(), "bind_host": "127.0.0.1",
                      "multiproc_dir": str(tmp_path / "metrics")}
    path = tmp_path / "up.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = dict(os.environ, MEGASERVE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1",
               RAY_AUTH_TOKEN=secrets.token_hex(16))
    env.pop("RAY_AUTH_MODE")  # as in a fresh shell: `megaserve up` turns token auth on itself
    proc = subprocess.Popen(
        [sys.executable, "-m", "megaserve.deploy.cli", "up", str(path), "--port", str(port), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    return proc, port


def _read_until(proc: subprocess.Popen, marker: str, lines: list[str]) -> None:
    """Append the output's lines to `lines` up to the first one that holds `marker`."""
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return


def _stop(proc: subprocess.Popen, signum: int, to_group: bool = False) -> str:
    """Send `signum` (to the process group that `megaserve up` leads, if `to_group`), wait for the
    exit, kill what the cluster left behind; returns the rest of the output."""
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    return _rest_of_output(proc)


def _rest_of_output(proc: subprocess.Popen) -> str:
    """Wait for `megaserve up` to exit, kill what the cluster left behind; returns the rest of the output."""
    try:
        rest, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rest


@pytest.mark.integration
def test_up_serves_the_demo_and_stops_on_ctrl_c_once_running_streams_finish(tmp_path):
    started = time.monotonic()
    proc, port = _start_up(tmp_path)
    lines: list[str] = []
    streamed: dict[str, object] = {}
    try:
        _read_until(proc, "ready in", lines)
        url = f"http://127.0.0.1:{port}{ROUTE_PREFIX}/v1"
        assert any(url in line for line in lines), "".join(lines)
        assert any("demo model at" in line for line in lines)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="megaserve-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        first_answer = time.monotonic() - started
        assert reply.choices[0].message.content is not None
        print(f"megaserve up: first request answered {first_answer:.1f} s after start")
        # A stream of several seconds on the CPU, running when Ctrl-C comes.
        first_chunk = threading.Event()

        def stream() -> None:
            chunks = client.chat.completions.create(
                model="megaserve-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=STREAM_TOKENS,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in chunks:
                first_chunk.set()
                if chunk.usage is not None:
                    streamed["usage"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    streamed["finish_reason"] = choice.finish_reason or streamed.get("finish_reason")

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert first_chunk.wait(60)
    finally:
        # As a terminal's Ctrl-C: to the whole foreground group, which holds the Ray processes that
        # `megaserve up` started (its GCS, raylet and agents); they must leave the drain to it.
        rest = _stop(proc, signal.SIGINT, to_group=True)
    streaming.join(10)
    assert proc.returncode == 0, "".join(lines) + rest
    assert streamed == {"finish_reason": "length", "usage": STREAM_TOKENS}, rest  # not cut off
    assert "megaserve: stopping" in rest and "letting running requests finish" in rest
    assert re.search(r"ready in \d+\.\d s", "".join(lines))


@pytest.mark.integration
def test_a_second_sigterm_during_the_drain_stops_at_once(tmp_path):
    proc, port = _start_up(tmp_path)
    lines: list[str] = []
    streamed: dict[str, object] = {}
    try:
        _read_until(proc, "ready in", lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}{ROUTE_PREFIX}/v1", api_key="x", max_retries=0)
        first_chunk = threading.Event()

        def stream() -> None:  # far longer than the test waits: the drain would wait for all of it
            chunks = client.completions.create(model="megaserve-demo", prompt="hi", max_tokens=LONG_STREAM_TOKENS,
                                               stream=True, extra_body={"ignore_eos": True})
            with contextlib.suppress(openai.APIError):  # cut off: what this test wants
                for chunk in chunks:
                    first_chunk.set()
                    streamed["finish_reason"] = chunk.choices[0].finish_reason or streamed.get("finish_reason")

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        assert first_chunk.wait(60)
        proc.send_signal(signal.SIGTERM)
        _read_until(proc, "letting running requests finish", lines)
        signalled = time.monotonic()
    finally:
        rest = _stop(proc, signal.SIGTERM)
    stopped_after = time.monotonic() - signalled
    assert proc.returncode == 0, "".join(lines) + rest
    assert "stopping at once" in rest
    assert streamed.get("finish_reason") is None  # the stream was cut, not waited for
    assert stopped_after < STOP_AT_ONCE_SECONDS, rest


@pytest.mark.integration
def test_up_stops_on_sigterm_while_it_is_still_deploying(tmp_path):
    proc, _ = _start_up(tmp_path)
    lines: list[str] = []
    try:
        _read_until(proc, "starting Serve", lines)
    finally:
        rest = _stop(proc, signal.SIGTERM)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "asked to stop before the app was ready" in rest and "ready in" not in output
    assert "megaserve: stopping" in rest


@pytest.mark.integration
def test_a_start_that_runs_out_of_time_exits_1_without_draining(tmp_path):
    # Nothing was served, so nothing is left to finish: a replica that was never placed used to hold
    # the exit for its whole graceful_shutdown_seconds (300 s by default).
    proc, _ = _start_up(tmp_path, "--timeout", "0.1")
    rest = _rest_of_output(proc)
    assert proc.returncode == 1, rest
    assert "the app did not start" in rest and "megaserve: stopping" in rest
    assert "letting running requests finish" not in rest


def _help(capsys, command: str) -> str:
    """The --help of a megaserve command, its whitespace (wrapped to the terminal's width) made single spaces."""
    with pytest.raises(SystemExit):
        _parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["up", "generate"])
def test_every_flag_says_what_it_does(command):
    subcommands = next(action for action in _parser()._actions if action.dest == "command")
    flags = subcommands.choices[command]._actions
    assert [action.option_strings for action in flags if not action.help] == []


def test_the_help_shows_the_defaults_and_that_temperature_0_is_greedy(capsys):
    generate = _help(capsys, "generate")
    assert "tokens to generate at most (default: 64)" in generate
    assert "with --raw, the literal prompt (default: Hello!)" in generate
    assert "sampling temperature (default: 0, which is greedy;" in generate
    assert "(default: 1, off)" in generate and "(default: 0, off)" in generate  # --top-p, --top-k
    assert "seconds to wait for every replica to become healthy (default: 600)" in _help(capsys, "up")
