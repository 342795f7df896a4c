"""Read a Hugging Face safetensors checkpoint: one `model.safetensors`, or shards listed in
`model.safetensors.index.json`. Files are memory-mapped (safetensors `safe_open`), so only the
tensors asked for are read, each once; nothing touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megaserve.replicas.protocol import CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

from .config import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint whose files cannot be read, or whose tensors do not match what the config says."""


class Checkpoint:
    """Tensor name -> lazily read tensor, over one or several open safetensors files."""

    def __init__(self, files: dict[str, object]) -> None:
        self._files = files  # tensor name -> the open safe_open handle holding it

    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._files[name].get_tensor(name)
        if not tensor.dtype.is_floating_point:  # .to() would turn integers (a quantized layout) into numbers
            raise CheckpointError(f"tensor {name!r} is {tensor.dtype}; weights must be floating-point")
        return tensor.to(device=device, dtype=dtype)


@contextmanager
def open_checkpoint(path: str | Path) -> Iterator[Checkpoint]:
    """Open every safetensors file of the checkpoint in `path` (memory-mapped) for the block."""
    path = Path(path)
    with ExitStack() as stack:
        files: dict[str, object] = {}
        for file_name, tensor_names in _shards(path).items():
            try:
                handle = stack.enter_context(safe_open(path / file_name, framework="pt", device="cpu"))
            except SafetensorError as error:  # truncated, empty or not safetensors at all
                raise CheckpointError(f"{path / file_name} is not a readable safetensors file: {error}") from None
            present = set(handle.keys())
            for name in tensor_names if tensor_names is not None else present:
                if name not in present:
                    raise CheckpointError(f"{INDEX_FILE} puts tensor {name!r} in {file_name}, which lacks it")
                files[name] = handle
        yield Checkpoint(files)


def model_folder_problem(path: str | Path) -> str | None:
    """What keeps `path` from being a model folder that megaserve can serve (its config, tokenizer and
    readable safetensors weights), said after the path ("does not exist", ...); None if nothing."""
    path = Path(path)
    if not path.is_dir():
        return "is not a directory" if path.exists() else "does not exist"
    problems = [f"no {name}" for name in (CONFIG_FILE, TOKENIZER_FILE) if not (path / name).is_file()]
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE):  # the small ones
        if (path / name).is_file():
            try:
                read_json_object(path / name)
            except (OSError, ValueError) as error:
                problems.append(str(error))
    try:
        with open_checkpoint(path):  # reads each safetensors file's header, no tensor
            pass
    except (OSError, CheckpointError) as error:
        problems.append(str(error))
    return f"is not a complete model folder: {'; '.join(problems)}" if problems else None


def _shards(path: Path) -> dict[str, list[str] | None]:
    """File name -> the tensor names the index assigns to it (None: every tensor in the file)."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path} is not a safetensors index: {type(error).__name__}: {error}"
                                  ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
        shards: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            shards.setdefault(file_name, []).append(name)
        for file_name in shards:
            if not (path / file_name).is_file():
                raise FileNotFoundError(f"{INDEX_FILE} in {path} names {file_name}, which does not exist")
        return shards
    if (path / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
