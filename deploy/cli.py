"""`megaserve`: up | generate | bench.

Every heavy import is lazy: `generate --model` and `bench` run on GPU machines that have torch and
cuda-python but no Ray, pydantic or FastAPI, so those are imported only by the commands that
need them (`up`, `generate --url`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from megaserve.deploy.env import Environment

DEFAULT_URL = "http://127.0.0.1:8000"
MAX_PORT = 65535
INTERRUPTED_EXIT = 128 + signal.SIGINT  # a shell's exit status for a process that SIGINT stopped
READER_GONE_EXIT = 128 + signal.SIGPIPE  # ... and for one that wrote to a pipe whose reader had left


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {text!r}") from None
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 1-{MAX_PORT}, got {port}")
    return port


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds are a number, got {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return seconds


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


class _ModeFlag(argparse.Action):
    """Stores the value as usual and notes the flag as given (in `given_flags`): each of these
    flags serves one mode of `generate`, and is refused with the other rather than ignored."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_flags = {*getattr(namespace, "given_flags", ()), option_string}


def _flags_of_the_other_mode(args: argparse.Namespace) -> str | None:
    """Why `generate`'s flags do not go together, or None."""
    given = getattr(args, "given_flags", set())
    if args.model is None and given & {"--engine", "--device"}:
        return "--engine and --device choose the in-process engine: give them with --model, not with a server"
    if args.model is not None and "--tier" in given:
        return "--tier asks a server for a tier: give it with --url, not with --model"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start a local Ray cluster and serve the app until Ctrl-C")
    up.add_argument("config", nargs="?", help="Serve config YAML (default: the embedded CPU demo)")
    up.add_argument("--host", type=_host, help="override http_options.host")
    up.add_argument("--port", type=_port, help="override http_options.port")
    up.add_argument("--timeout", type=_positive_seconds, default=600.0,
                    help="seconds to wait for every replica to become healthy (default: %(default)g)")

    gen = commands.add_parser("generate", help="generate from one prompt and stream the tokens")
    gen.add_argument("prompt", nargs="?", default="Hello!", help="the user message (chat template "
                     "applied) or, with --raw, the literal prompt (default: %(default)s)")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"a running server, its root or its OpenAI base URL (root/v1) (default "
                       f"{DEFAULT_URL} unless --model)")
    where.add_argument("--model", help="a Hugging Face-format model directory to run in-process")
    gen.add_argument("--engine", choices=("torch", "megakernel"), default="torch", action=_ModeFlag,
                     help="in-process engine (with --model; default: %(default)s)")
    gen.add_argument("--device", default=None, action=_ModeFlag,
                     help="in-process device (with --model; default: cuda if present)")
    gen.add_argument("--tier", choices=("latency", "throughput", "auto"), default="auto", action=_ModeFlag,
                     help="service tier to ask the server for (with --url; default: %(default)s)")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)d)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature (default: %(default)g, which is greedy; unlike the server's "
                     "default for a request that names none, the model's generation_config.json)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)g, off)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample from the k likeliest tokens (default: %(default)d, off)")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed of the sampling, for a repeatable draw at temperature > 0 (default: none)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate --max-tokens tokens, past the model's end-of-sequence tokens")
    gen.add_argument("--api-key", default=None,
                     help="bearer key for a server with auth on (default: $MEGASERVE_API_KEY, if set)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object instead of the stream: the text and finish reason; with "
                     "--model also the prompt and generated ids and per-step ms; with --url the tier, the token "
                     "count and latencies")

    bench = commands.add_parser("bench", help="benchmark engines side by side on the GPU",
                                add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = None if argv[:1] == ["bench"] else _parser().parse_args(argv)  # the benchmark owns its flags
    if args is not None and args.command == "generate" and (problem := _flags_of_the_other_mode(args)):
        print(f"megaserve generate: {problem}", file=sys.stderr)
        return 2
    try:
        env = Environment.read(serving=args is not None and args.command == "up")
    except ValueError as error:
        print(f"megaserve: {error}", file=sys.stderr)
        return 2
    if args is None:
        from megaserve.replicas.bench import main as bench_main

        return bench_main(argv[1:], kernel_cache=env.kernel_cache)
    if args.command == "up":
        from megaserve.deploy.local import serve_until_interrupted

        try:  # once Ray runs, Ctrl-C stops the app (exit 0); before, or while Ray starts, it ends here
            return serve_until_interrupted(args.config, args.host, args.port, args.timeout, env)
        except KeyboardInterrupt:
            print("\nmegaserve up: interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
    if args.command == "generate":
        from megaserve.deploy import generate

        try:
            if args.model:
                return generate.run_in_process(args, env)
            return generate.run_against_server(args, args.url or DEFAULT_URL, env)
        except KeyboardInterrupt:  # Ctrl-C: the stream so far stays on the screen, no traceback
            print("\nmegaserve generate: interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
        except BrokenPipeError:  # `generate | head`: the reader has what it wanted, which is no error
            # stdout to nowhere, or the interpreter's own flush at exit raises again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return READER_GONE_EXIT
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
