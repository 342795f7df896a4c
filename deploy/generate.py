"""`megaserve generate`: one prompt, tokens streamed as they come, with the tier and step latency.

Two ways: `--model DIR` runs an engine in this process (no Ray, no web stack: this is how any
Hugging Face-format directory is checked on a GPU machine, `--json` giving prompt and generated
ids and per-step ms), and `--url` asks a running server through its OpenAI API with plain stdlib
HTTP, printing the tier the router used.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from http import HTTPStatus

from megaserve.deploy.env import Environment

SSE_DATA = "data: "


def _prompt_ids(tokenizer, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt, add_special_tokens=True)
    return tokenizer.encode_chat([{"role": "user", "content": args.prompt}])


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_in_process(args: argparse.Namespace, env: Environment) -> int:
    from megaserve.replicas.engines import create_engine
    from megaserve.replicas.models.checkpoint import model_folder_problem
    from megaserve.replicas.protocol import EngineError, GenerateRequest, SamplingParams
    from megaserve.router.tokenizer import IncrementalDetokenizer, Tokenizer

    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    except EngineError as error:
        print(f"megaserve generate: {error}", file=sys.stderr)
        return 2
    problem = model_folder_problem(args.model)
    if problem is not None:
        print(f"megaserve generate: --model {args.model} {problem}", file=sys.stderr)
        return 2
    try:
        tokenizer = Tokenizer.from_dir(args.model)
        prompt_ids = _prompt_ids(tokenizer, args)
        # A KV cache for this one request, not for the model's whole context (131,072 positions of
        # Llama-3.1-8B would take 17 GB); the engine caps it at the model's positions.
        settings = ({"device": args.device or "cuda", "kernel_cache": str(env.kernel_cache)}
                    if args.engine == "megakernel" else {"device": args.device or _default_device(), "max_batch": 1})
        engine = create_engine(args.engine, model_dir=args.model, max_seq=len(prompt_ids) + sampling.max_tokens,
                               **settings)
    except (OSError, ValueError, RuntimeError) as error:  # no model there, a shape or device it cannot run
        print(f"megaserve generate: cannot run the {args.engine} engine on {args.model}: {error}", file=sys.stderr)
        return 2
    request = GenerateRequest(request_id="cli", prompt_token_ids=tuple(prompt_ids), sampling=sampling)
    try:
        engine.validate(request)
    except EngineError as error:
        print(f"megaserve generate: {error}", file=sys.stderr)
        return 2
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)  # the text goes on from the prompt's
    pieces: list[str] = []
    token_ids: list[int] = []
    step_ms: list[float] = []
    finish_reason = None

    async def consume() -> str | None:
        """Stream the tokens; the engine's error if it failed mid-stream. The engine is shut down
        either way (its threads and device memory are not left to the interpreter's exit)."""
        nonlocal finish_reason
        try:
            async for output in engine.generate(request):
                token_ids.extend(output.token_ids)
                step_ms.extend(s * 1e3 for s in output.step_seconds)
                text = "".join(detokenizer.push(t) for t in output.token_ids)
                if output.finish_reason is not None:
                    text += detokenizer.finish()
                pieces.append(text)
                if not args.json:
                    print(text, end="", flush=True)
                if output.finish_reason is not None:
                    finish_reason = output.finish_reason.value
                    if output.error:
                        return output.error
            return None
        finally:
            await engine.shutdown()

    error = asyncio.run(consume())
    if error is not None:  # as run_against_server reports a mid-stream error event
        print(f"\nmegaserve generate: {args.engine} engine failed mid-stream: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "engine": args.engine, "prompt_token_ids": prompt_ids, "token_ids": token_ids,
            "text": "".join(pieces), "finish_reason": finish_reason,
            "step_ms": [round(ms, 4) for ms in step_ms],
        }))
    else:
        decode = sorted(step_ms[1:]) or step_ms
        print(f"\n[{args.engine}] {len(token_ids)} tokens, prefill {step_ms[0]:.2f} ms, "
              f"decode step median {decode[len(decode) // 2]:.3f} ms, finish {finish_reason}",
              file=sys.stderr)
    return 0


def run_against_server(args: argparse.Namespace, url: str, env: Environment) -> int:
    if not url.lower().startswith(("http://", "https://")):  # urllib says "unknown url type", not what is missing
        problem = "is not an http:// or https:// URL" if "://" in url else f"has no scheme: add it, --url http://{url}"
        print(f"megaserve generate: --url {url} {problem}", file=sys.stderr)
        return 2
    api_key = args.api_key or env.api_key
    try:
        return _stream_from_server(args, _server_root(url), api_key)
    except urllib.error.HTTPError as error:
        hint = ""
        if error.code == HTTPStatus.UNAUTHORIZED:  # the server's message knows nothing of this CLI's flags
            hint = ("; the key given (--api-key or MEGASERVE_API_KEY) was refused" if api_key
                    else "; give it a key it accepts with --api-key KEY (or MEGASERVE_API_KEY)")
        body = error.read().decode(errors="replace")  # a proxy's error page need not be UTF-8
        print(f"megaserve generate: {url} answered {error.code}: {body}{hint}", file=sys.stderr)
    except urllib.error.URLError as error:
        print(f"megaserve generate: cannot reach {url}: {error.reason}", file=sys.stderr)
    except BrokenPipeError:  # our own stdout's reader left, not the server: the command line's to end
        raise
    except (ValueError, http.client.HTTPException, OSError) as error:  # a bad URL, an answer cut short
        print(f"megaserve generate: {url}: {type(error).__name__}: {error}", file=sys.stderr)
    except ServerAnswerError as error:
        print(f"megaserve generate: {url}: {error}", file=sys.stderr)
    return 2


def _server_root(url: str) -> str:
    """The server's root, the paths' prefix, from it or from its OpenAI base URL (the root and /v1:
    what `megaserve up` prints and the OpenAI SDK takes)."""
    return url.rstrip("/").removesuffix("/v1")


class ServerAnswerError(Exception):
    """The server answered 200 with something that is not what its OpenAI API sends."""


def _stream_from_server(args: argparse.Namespace, url: str, api_key: str | None) -> int:
    body: dict = {
        "model": _served_model(url, api_key),
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "stream": True, "stream_options": {"include_usage": True},
        "service_tier": {"latency": "priority", "throughput": "default"}.get(args.tier, "auto"),
    }
    if args.seed is not None:
        body["seed"] = args.seed
    if args.top_k:
        body["top_k"] = args.top_k
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.raw:
        path, body["prompt"] = "/v1/completions", args.prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": args.prompt}]
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers=_headers(api_key),
    )
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage = timing = finish_reason = None
    done = False
    with urllib.request.urlopen(request) as response:
        tier = response.headers.get("x-megaserve-tier", "?")
        for raw in response:
            line = raw.decode().strip()
            if line == SSE_DATA + "[DONE]":
                done = True
                continue
            if not line.startswith(SSE_DATA):
                continue
            chunk = _stream_chunk(line[len(SSE_DATA):])
            if "error" in chunk:  # a failure after the 200: the router's last event
                error = chunk["error"]
                message = (error.get("message") if isinstance(error, dict) else error) or "no message"
                print(f"\nmegaserve generate: {url} failed mid-stream: {message}", file=sys.stderr)
                return 2
            usage = chunk.get("usage") or usage
            timing = chunk.get("timing") or timing  # the router's extension, with usage
            for choice in chunk["choices"]:
                finish_reason = choice.get("finish_reason") or finish_reason
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    arrivals.append(time.perf_counter())
                    pieces.append(piece)
                    if not args.json:
                        print(piece, end="", flush=True)
    if not done:  # on a line of its own, after the text that came
        print(f"\nmegaserve generate: {url}: the stream ended before its [DONE]: the connection was cut",
              file=sys.stderr)
        return 2
    total = time.perf_counter() - started
    tokens = (usage or {}).get("completion_tokens", len(arrivals))
    # none without a piece of text (a stream whose tokens all decode to nothing): null in the JSON
    ttft = round((arrivals[0] - started) * 1e3, 2) if arrivals else None
    per_token = round((arrivals[-1] - arrivals[0]) / max(tokens - 1, 1) * 1e3, 3) if arrivals else None
    step = (timing or {}).get("mean_step_seconds")
    summary = {"tier": tier, "finish_reason": finish_reason, "completion_tokens": tokens, "ttft_ms": ttft,
               "ms_per_token_client": per_token, "total_s": round(total, 3),
               "engine_step_ms": None if step is None else round(step * 1e3, 3)}
    if args.json:
        print(json.dumps({**summary, "text": "".join(pieces)}))
    else:  # the text is on the screen already
        print(f"\n{_summary_line(summary)}", file=sys.stderr)
    return 0


def _summary_line(summary: dict) -> str:
    """One line for a person, as the in-process run prints: `[latency] 64 tokens, first token 21.3 ms,
    3.912 ms per token at the client, engine step 3.801 ms, finish length, 0.27 s`."""
    parts = [f"[{summary['tier']}] {summary['completion_tokens']} tokens"]
    if summary["ttft_ms"] is not None:
        parts.append(f"first token {summary['ttft_ms']:.1f} ms")
        parts.append(f"{summary['ms_per_token_client']:.3f} ms per token at the client")
    if summary["engine_step_ms"] is not None:
        parts.append(f"engine step {summary['engine_step_ms']:.3f} ms")
    parts.append(f"finish {summary['finish_reason']}")
    parts.append(f"{summary['total_s']:.2f} s")
    return ", ".join(parts)


def _stream_chunk(data: str) -> dict:
    """One event of a chat or text completion stream: an object with a list of choice objects (an
    `error` event may have none)."""
    chunk = _json_answer(data, "an event of the stream")
    if isinstance(chunk, dict) and "error" in chunk:
        return chunk
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not all(isinstance(choice, dict) for choice in choices):
        raise ServerAnswerError(f"an event of the stream is not a completion chunk: {data[:200]}")
    return chunk


def _json_answer(text: str, what: str) -> object:
    """`text` read as JSON; where it is not (a proxy's HTML page, a server of another API), an
    error that says which answer it was and shows its start."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ServerAnswerError(f"{what} is not JSON: {text[:200]}") from None


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _served_model(url: str, api_key: str | None) -> str:
    request = urllib.request.Request(url + "/v1/models", headers=_headers(api_key))
    with urllib.request.urlopen(request) as response:
        models = _json_answer(response.read().decode(errors="replace"), "GET /v1/models's answer")
    try:
        return models["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ServerAnswerError(f"/v1/models lists no model: {json.dumps(models)[:200]}") from None
