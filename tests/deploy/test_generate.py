"""`megaserve generate`: in-process on any HF directory (checked against transformers), and
against a running server."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from megaserve.deploy import generate
from megaserve.deploy.cli import _parser
from megaserve.deploy.env import Environment
from megaserve.replicas import engines
from megaserve.replicas.models.demo import ensure_demo_model
from megaserve.replicas.protocol import FinishReason, StepOutput
from tests.model_factory import sentencepiece_style_tokenizer


@contextlib.contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stub server on a free local port, for as long as the block runs: its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def _generate(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "generate", *args, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout, parse_constant=_not_json)  # NaN and Infinity are Python's, not JSON's


def _not_json(constant: str) -> None:
    raise AssertionError(f"--json printed {constant}, which JSON does not have")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return str(ensure_demo_model(tmp_path_factory.mktemp("home")))


def test_in_process_greedy_matches_transformers(demo_dir):
    from transformers import AutoModelForCausalLM

    result = _generate("Tell me a story", "--model", demo_dir, "--engine", "torch", "--device", "cpu",
                       "--max-tokens", "12", "--ignore-eos")
    assert len(result["token_ids"]) == len(result["step_ms"]) == 12
    assert result["finish_reason"] == "length"
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    prompt = torch.tensor([result["prompt_token_ids"]])
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              attention_mask=torch.ones_like(prompt))
    assert result["token_ids"] == expected[0, prompt.shape[1]:].tolist()


def test_in_process_seeded_sampling_is_reproducible_and_follows_the_seed_and_temperature(demo_dir):
    # The demo model is so sure of its next token (mostly new lines, ~38 logits above the next) that at
    # temperature 1 every seed draws the greedy tokens; at 10 its draws spread, so the seed shows.
    args = ("hello", "--model", demo_dir, "--device", "cpu", "--max-tokens", "16", "--ignore-eos")
    seeded = _generate(*args, "--temperature", "10", "--seed", "7")["token_ids"]
    assert seeded == _generate(*args, "--temperature", "10", "--seed", "7")["token_ids"]
    assert seeded != _generate(*args, "--temperature", "10", "--seed", "8")["token_ids"]
    assert seeded != _generate(*args, "--temperature", "0")["token_ids"]


def _generate_fails(*args: str, printed: str = "") -> str:
    """stderr of a `megaserve generate` that exits 2 with one message, having printed `printed`."""
    done = subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == printed
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--url", "http://127.0.0.1:1", "--engine", "megakernel"), "--engine and --device choose the in-process engine"),
    (("--device", "cpu"), "--engine and --device choose the in-process engine"),  # the server by default
    (("--model", "somewhere", "--tier", "latency"), "--tier asks a server for a tier: give it with --url"),
])
def test_a_flag_of_the_other_mode_is_refused_not_ignored(args, message):
    assert _generate_fails("hi", *args).startswith(f"megaserve generate: {message}")


def test_a_model_directory_that_does_not_exist_is_named_as_such(tmp_path):
    error = _generate_fails("hi", "--model", str(tmp_path / "nothing-here"))
    assert f"--model {tmp_path / 'nothing-here'} does not exist" in error
    (tmp_path / "a-file").write_text("")
    error = _generate_fails("hi", "--model", str(tmp_path / "a-file"))
    assert f"--model {tmp_path / 'a-file'} is not a directory" in error


def test_a_model_directory_without_its_files_is_a_one_line_error(tmp_path):
    error = _generate_fails("hi", "--model", str(tmp_path))
    assert (f"--model {tmp_path} is not a complete model folder: no config.json; no tokenizer.json; no "
            f"model.safetensors or model.safetensors.index.json in {tmp_path}") in error  # as megaserve up says


def test_a_request_the_engine_refuses_is_a_one_line_error(demo_dir):
    assert "max_tokens must be at least 1" in _generate_fails("hi", "--model", demo_dir, "--max-tokens", "0")
    too_long = _generate_fails("hi", "--model", demo_dir, "--device", "cpu", "--max-tokens", "5000")
    assert "maximum context length is 2048 tokens" in too_long  # the demo model's positions


class ScriptedEngine:
    """An engine stand-in (no model, no device) that streams `outputs` and records its shutdown."""

    def __init__(self, outputs: list[StepOutput]) -> None:
        self.outputs = outputs
        self.shut_down = False

    def validate(self, request) -> None:
        pass

    async def generate(self, request):
        for output in self.outputs:
            yield output

    async def shutdown(self) -> None:
        self.shut_down = True


def _run_in_process(monkeypatch, tmp_path, model_dir: str, outputs: list[StepOutput], *argv: str):
    """`generate hi --model model_dir *argv` in this process on a ScriptedEngine: its exit code, the
    engine, and what create_engine was given."""
    engine = ScriptedEngine(outputs)
    created: dict = {}

    def create_engine(kind, **settings):
        created.update(settings, kind=kind)
        return engine

    monkeypatch.setattr(engines, "create_engine", create_engine)
    args = _parser().parse_args(["generate", "hi", "--model", model_dir, *argv])
    env = Environment(home=tmp_path, kernel_cache=tmp_path / "kernels", api_keys=())
    return generate.run_in_process(args, env), engine, created


ONE_TOKEN = StepOutput(token_ids=[65], step_seconds=[0.001], finish_reason=FinishReason.LENGTH)


def test_an_engine_that_fails_mid_stream_is_a_one_line_error_and_is_shut_down(monkeypatch, tmp_path, demo_dir,
                                                                                 capsys):
    failed = StepOutput(token_ids=[], step_seconds=[], finish_reason=FinishReason.ABORT, error="the GPU fell off")
    code, engine, _ = _run_in_process(monkeypatch, tmp_path, demo_dir,
                                      [StepOutput(token_ids=[65], step_seconds=[0.001]), failed])
    assert code == 2 and engine.shut_down
    assert "megaserve generate: torch engine failed mid-stream: the GPU fell off" in capsys.readouterr().err


def test_the_text_goes_on_from_the_prompt_where_the_decoder_strips_a_string_s_first_space(
        monkeypatch, tmp_path, demo_dir, capsys):
    # A SentencePiece decoder (Llama 2, Mistral) drops a string's first space: decoded alone, " Paris"
    # would come out as "Paris", glued to the prompt.
    model = tmp_path / "model"
    shutil.copytree(demo_dir, model)
    sentencepiece_style_tokenizer(["<unk>", "▁hi", "▁Paris", "▁is"]).save(str(model / "tokenizer.json"))
    paris_is = StepOutput(token_ids=[2, 3], step_seconds=[0.001, 0.001], finish_reason=FinishReason.LENGTH)
    for argv, printed in (([], " Paris is"), (["--json"], None)):
        code, _, _ = _run_in_process(monkeypatch, tmp_path, str(model), [paris_is], *argv)
        out = capsys.readouterr().out
        assert code == 0
        assert (json.loads(out)["text"] if printed is None else out) == " Paris is", out


@pytest.mark.parametrize(("argv", "device"), [([], "cuda"), (["--device", "cuda:1"], "cuda:1")])
def test_the_megakernel_runs_on_the_device_asked_for(monkeypatch, tmp_path, demo_dir, argv, device):
    code, engine, created = _run_in_process(monkeypatch, tmp_path, demo_dir, [ONE_TOKEN], "--engine", "megakernel",
                                            "--json", *argv)
    assert code == 0 and engine.shut_down
    assert created["kind"] == "megakernel" and created["device"] == device


class FailingStreamHandler(http.server.BaseHTTPRequestHandler):
    """A server whose generation fails after its 200, as the router reports a replica's failure."""

    def do_GET(self):  # /v1/models
        self._send(200, "application/json", json.dumps({"data": [{"id": "m"}]}))

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        error = {"error": {"message": "the replica died", "type": "server_error", "param": None, "code": None}}
        self._send(200, "text/event-stream", f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n")

    def _send(self, status: int, content_type: str, text: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args) -> None:
        pass


def test_a_stream_that_fails_after_its_200_is_an_error():
    with _serving(FailingStreamHandler) as url:
        error = _generate_fails("hi", "--url", url)
    assert "failed mid-stream: the replica died" in error


class StreamingHandler(FailingStreamHandler):
    """A server that streams a two-piece chat answer as the router does, the usage chunk last."""

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in self.chunks)
        self._send(200, "text/event-stream", events + "data: [DONE]\n\n")


def test_against_a_server_the_json_has_the_text_and_finish_reason():
    with _serving(StreamingHandler) as url:
        result = _generate("hi", "--url", url)
    assert result["text"] == "Hello" and result["finish_reason"] == "length"
    assert result["completion_tokens"] == 2


class PathsHandler(StreamingHandler):
    """StreamingHandler that answers only the OpenAI API's paths from the root, and keeps them."""

    paths: list[str] = []

    def do_GET(self):
        self.paths.append(self.path)
        if self.path == "/v1/models":
            super().do_GET()
        else:
            self._send(404, "application/json", json.dumps({"detail": "Not Found"}))

    def do_POST(self):
        self.paths.append(self.path)
        super().do_POST()


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_the_url_is_the_server_s_root_or_its_openai_base_url(suffix):
    # `megaserve up` prints the base URL (root + /v1), as the OpenAI SDK takes it
    PathsHandler.paths = []
    with _serving(PathsHandler) as url:
        result = _generate("hi", "--url", url + suffix)
    assert result["text"] == "Hello"
    assert PathsHandler.paths == ["/v1/models", "/v1/chat/completions"]


class NoTextHandler(StreamingHandler):
    """A stream whose one token decodes to no text (the model stopped at once)."""

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}]


def test_a_stream_without_text_has_no_token_times_and_its_json_stays_json():
    with _serving(NoTextHandler) as url:
        result = _generate("hi", "--url", url)
    assert result["text"] == "" and result["completion_tokens"] == 1 and result["finish_reason"] == "stop"
    assert result["ttft_ms"] is None and result["ms_per_token_client"] is None


class AuthHandler(StreamingHandler):
    """StreamingHandler behind bearer-key auth, answering 401 as the router does otherwise."""

    key = "the-key"

    def do_GET(self):
        if self._authorized():
            super().do_GET()

    def do_POST(self):
        if self._authorized():
            super().do_POST()

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.key}":
            return True
        error = {"error": {"message": "a valid API key is required: Authorization: Bearer <key>",
                           "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        self._send(401, "application/json", json.dumps(error))
        return False


@pytest.fixture
def auth_url():
    with _serving(AuthHandler) as url:
        yield url


def test_a_401_without_a_key_says_to_give_one_with_api_key(auth_url, monkeypatch):
    monkeypatch.delenv("MEGASERVE_API_KEY", raising=False)
    error = _generate_fails("hi", "--url", auth_url)
    assert "answered 401" in error and "a valid API key is required" in error
    assert "give it a key it accepts with --api-key KEY (or MEGASERVE_API_KEY)" in error


def test_a_401_with_a_key_says_the_key_was_refused(auth_url, monkeypatch):
    monkeypatch.delenv("MEGASERVE_API_KEY", raising=False)
    error = _generate_fails("hi", "--url", auth_url, "--api-key", "wrong")
    assert "answered 401" in error and "the key given (--api-key or MEGASERVE_API_KEY) was refused" in error


def test_the_key_comes_from_megaserve_api_key_unless_api_key_gives_one(auth_url, monkeypatch):
    monkeypatch.setenv("MEGASERVE_API_KEY", AuthHandler.key)
    assert _generate("hi", "--url", auth_url)["text"] == "Hello"
    monkeypatch.setenv("MEGASERVE_API_KEY", "wrong")
    assert _generate("hi", "--url", auth_url, "--api-key", AuthHandler.key)["text"] == "Hello"


class BrokenServerHandler(http.server.BaseHTTPRequestHandler):
    """A server that answers 200 with something else than the OpenAI API: its path picks what."""

    answers = {
        "/html/v1/models": "<html>a proxy's login page</html>",
        "/empty/v1/models": json.dumps({"object": "list", "data": []}),
        "/cut/v1/models": json.dumps({"data": [{"id": "m"}]}),
    }

    events = {  # what the stream of each path sends after its 200
        "/cut": b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n',  # and stops short of its length
        "/error-text": b'data: {"error": "boom"}\n\n',
        "/array": b"data: [1, 2]\n\ndata: [DONE]\n\n",
        "/null-choices": b'data: {"choices": null}\n\ndata: [DONE]\n\n',
        "/choice-text": b'data: {"choices": ["Hel"]}\n\ndata: [DONE]\n\n',
        "/not-json": b"data: <b>busy</b>\n\ndata: [DONE]\n\n",
    }

    def do_GET(self):
        if self.path == "/latin-1/v1/models":  # a proxy's error page in another encoding
            page = "<p>Passerelle occupée</p>".encode("latin-1")
            self.send_response(502)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return
        self._send(self.answers.get(self.path, json.dumps({"data": [{"id": "m"}]})))

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(self.events[self.path.removesuffix("/v1/chat/completions")])

    def _send(self, text: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(("path", "message", "printed"), [
    ("html", "GET /v1/models's answer is not JSON: <html>a proxy's login page</html>", ""),
    ("empty", "/v1/models lists no model", ""),
    ("cut", "the stream ended before its [DONE]", "Hel"),  # what came is printed, then the error
    ("error-text", "failed mid-stream: boom", ""),
    ("array", "an event of the stream is not a completion chunk: [1, 2]", ""),
    ("null-choices", 'an event of the stream is not a completion chunk: {"choices": null}', ""),
    ("choice-text", "an event of the stream is not a completion chunk", ""),
    ("not-json", "an event of the stream is not JSON: <b>busy</b>", ""),
    ("latin-1", "answered 502: <p>Passerelle occup\ufffde</p>", ""),
])
def test_a_server_that_answers_something_else_is_a_one_line_error(path, message, printed):
    with _serving(BrokenServerHandler) as url:
        error = _generate_fails("hi", "--url", f"{url}/{path}", printed=printed)
    assert message in error
    assert error.startswith("\n") or not printed  # the message on a line of its own, after the text


def test_a_malformed_url_is_a_one_line_error():
    assert "ValueError" in _generate_fails("hi", "--url", "http://[::1")


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "foo"])
def test_a_url_without_its_scheme_is_refused_saying_to_add_it(url):
    error = _generate_fails("hi", "--url", url)
    assert f"--url {url} has no scheme: add it, --url http://{url}" in error


def test_a_url_of_another_scheme_is_refused():
    assert "--url ftp://h is not an http:// or https:// URL" in _generate_fails("hi", "--url", "ftp://h")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the torch engine runs there")
def test_a_cuda_device_without_a_gpu_is_a_one_line_error(demo_dir):
    error = _generate_fails("hi", "--model", demo_dir, "--device", "cuda")
    assert "cannot run the torch engine" in error and "'cuda' needs a CUDA GPU, and this torch sees none" in error


def test_an_unreachable_server_is_a_one_line_error():
    error = _generate_fails("hi", "--url", "http://127.0.0.1:1")
    assert "cannot reach http://127.0.0.1:1" in error


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the megakernel runs")
def test_the_megakernel_without_a_gpu_is_a_one_line_error(demo_dir):
    error = _generate_fails("hi", "--model", demo_dir, "--engine", "megakernel")
    assert "cannot run the megakernel engine" in error and "needs a CUDA GPU" in error


@pytest.mark.integration
def test_against_the_server_reports_the_tier(live_stack):
    result = _generate("hi", "--url", live_stack.base_url, "--tier", "latency", "--max-tokens", "5",
                       "--ignore-eos")
    assert result["tier"] == "latency"
    assert result["completion_tokens"] == 5 and result["finish_reason"] == "length"
    assert result["ttft_ms"] > 0
    assert result["engine_step_ms"] > 0  # the replica's own step time, reported by the router


def _ctrl_c_stops() -> None:
    """SIGINT's default in the child, as in a terminal, even where this test runs with it ignored
    (a shell's background job): Python then raises KeyboardInterrupt on it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class SlowStreamHandler(BrokenServerHandler):
    """A stream that sends one piece of text and then nothing, until the client leaves."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n')
        self.wfile.flush()
        time.sleep(30)


def test_ctrl_c_keeps_the_text_so_far_and_exits_130_without_a_traceback():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowStreamHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-m", "megaserve.deploy.cli", "generate", "hi", "--url",
                             f"http://127.0.0.1:{server.server_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_stops)
    try:
        assert proc.stdout.read(3) == "Hel"  # the stream has begun
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        server.shutdown()
    assert proc.returncode == 128 + signal.SIGINT
    assert err == "\nmegaserve generate: interrupted\n" and out == ""



def test_without_json_the_text_goes_to_stdout_and_one_summary_line_to_stderr():
    with _serving(StreamingHandler) as url:
        done = subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "generate", "hi", "--url", url],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "Hello"
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("[?] 2 tokens, first token ")  # the stub sends no tier
    assert " ms per token at the client, " in line and ", finish length, " in line and line.endswith(" s")


class PausingStreamHandler(StreamingHandler):
    """StreamingHandler that pauses after its first piece of text, time for the reader to leave."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for index, chunk in enumerate(self.chunks):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            if index == 1:
                time.sleep(0.5)
        self.wfile.write(b"data: [DONE]\n\n")


def test_a_reader_that_leaves_early_ends_it_quietly_with_sigpipe_s_status():
    with _serving(PausingStreamHandler) as url:
        proc = subprocess.Popen([sys.executable, "-m", "megaserve.deploy.cli", "generate", "hi", "--url", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.read(3) == "Hel"
            proc.stdout.close()  # as `| head -c 3` does
            err = proc.stderr.read()
            assert proc.wait(timeout=30) == 128 + signal.SIGPIPE
        finally:
            proc.kill()
    assert err == ""  # no traceback, and no "Exception ignored" from the interpreter's exit
