"""The engines behind `replicas.protocol.Engine`, created by name.

  torch       TorchEngine (torch_engine.py): the reference decoder on CPU or GPU, batch-1
              (`max_batch=1`) or continuously batched (`max_batch>1`).
  megakernel  MegakernelEngine (megakernel_engine.py): batch-1 CUDA decode through `kernels/`.
  sglang      SGLangEngine (sglang_engine.py): stock `sglang.Engine`, an optional extra.

Each engine module is imported only when asked for, so that a CPU machine never imports CUDA
code and a machine without SGLang can still run the others.
"""

from __future__ import annotations

from typing import Any

from ..protocol import CoalescePolicy, Engine

ENGINE_KINDS = ("torch", "megakernel", "sglang")


def create_engine(kind: str, **settings: Any) -> Engine:
    """Build the engine `kind` with `settings` as its keyword arguments (model_dir, device, ...).

    Settings may carry the yield rule's thresholds as plain numbers, `coalesce_seconds` and
    `coalesce_tokens` (how deploy configs spell them); they become the engine's `coalesce`.
    """
    _fold_coalesce_policy(settings)
    if kind == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(**settings)
    if kind == "megakernel":
        from .megakernel_engine import MegakernelEngine

        return MegakernelEngine(**settings)
    if kind == "sglang":
        from .sglang_engine import SGLangEngine

        return SGLangEngine(**settings)
    raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")


def _fold_coalesce_policy(settings: dict[str, Any]) -> None:
    flat = {key: settings.pop(f"coalesce_{key}") for key in ("seconds", "tokens") if f"coalesce_{key}" in settings}
    if not flat:
        return
    if "coalesce" in settings:
        raise ValueError("give either coalesce or coalesce_seconds/coalesce_tokens, not both")
    settings["coalesce"] = CoalescePolicy(**flat)
