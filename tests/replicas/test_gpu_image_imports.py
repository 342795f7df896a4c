"""Engines, models, kernels, `megaserve generate --model` and `megaserve bench` must run where
only torch, cuda-python, safetensors, tokenizers and transformers exist (the GPU image): no Ray,
pydantic, FastAPI or a web server. Checked in a subprocess where importing those fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from megaserve.replicas.models.demo import ensure_demo_model

BLOCKED = ("ray", "pydantic", "fastapi", "starlette", "uvicorn", "httpx", "openai")

BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ImportError(f"{{name}} is not on the GPU image")
    sys.meta_path.insert(0, Blocker())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_the_blocker_really_blocks():
    done = _run("import ray")
    assert done.returncode != 0 and "not on the GPU image" in done.stderr


def test_engines_models_kernels_and_bench_import_without_the_serving_stack():
    done = _run("""
        import megaserve.replicas.engines.torch_engine, megaserve.replicas.engines.megakernel_engine
        import megaserve.replicas.models, megaserve.replicas.sampling, megaserve.replicas.bench
        import megaserve.kernels.build, megaserve.kernels.launcher, megaserve.router.tokenizer
        import megaserve.deploy.cli, megaserve.deploy.generate
        import importlib, pkgutil
        for package in ("megaserve.replicas.engines", "megaserve.kernels"):  # every engine and kernel module
            for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
                importlib.import_module(module.name)
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_generate_in_process_runs_without_the_serving_stack(tmp_path):
    model_dir = ensure_demo_model(tmp_path)
    done = _run(f"""
        from megaserve.deploy.cli import main
        raise SystemExit(main(["generate", "hi", "--model", {str(model_dir)!r}, "--device", "cpu",
                               "--max-tokens", "3", "--json"]))
    """)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) <= 3 and result["prompt_token_ids"]
