"""`ModelConfig`: the shape of a decoder-only model, read from a Hugging Face `config.json`.

Two families share one decoder (see `decoder.py`):
  - "llama": Llama 3 / 3.1 / 3.2 (`LlamaForCausalLM`), optionally with Llama 3.1's "llama3" RoPE
    frequency scaling.
  - "qwen3": Qwen3 dense (`Qwen3ForCausalLM`) = Llama plus an RMSNorm over each query and key head
    before RoPE, and a `head_dim` that need not equal hidden_size / num_heads.

Both the classic keys (`rope_theta`, `rope_scaling`, `torch_dtype`) written by real checkpoints and
transformers 5's (`rope_parameters`, `dtype`) are accepted. Anything this decoder does not implement
(attention bias, sliding windows, other RoPE types, other activations) is refused with a ValueError
that names the field, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol import CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, is_integer, is_number

# Hugging Face architecture name -> our family name.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# Defaults of the transformers config classes, for keys a checkpoint may leave out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    # Qwen3's head_dim is its own (transformers' Qwen3Config: 128), not hidden_size / heads
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128},
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DEFAULT_ROPE_TYPE = "default"
LLAMA3_ROPE_TYPE = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3", *LLAMA3_ROPE_KEYS}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each query/key head before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype: "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"torch_dtype {self.torch_dtype!r} is not one of {SUPPORTED_DTYPES}")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` of a Llama 3 or Qwen3 dense checkpoint. End-of-sequence ids
        are the union of config.json's, generation_config.json's and the tokenizer's `eos_token`,
        as vLLM stops on all three (Llama 3 Instruct lists <|eot_id|> only in generation_config;
        a fine-tune often sets its chat end, <|im_end|> say, only as the tokenizer's eos)."""
        config_path = Path(path) / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
        config = cls.from_hf_dict(read_json_object(config_path))
        return dataclasses.replace(config, eos_token_ids=hf_eos_token_ids(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        family = _family(raw)
        _refuse_unsupported(raw, family)
        defaults = FAMILY_DEFAULTS[family]

        def get(key: str, fallback: Any = None) -> Any:
            value = raw.get(key)
            if value is None:
                value = defaults.get(key, fallback)
            if value is None:
                raise ValueError(f"config.json lacks the required field {key!r}")
            return value

        def integer(key: str, fallback: int | None = None) -> int:
            return _integer(key, get(key, fallback))

        num_heads, hidden_size = integer("num_attention_heads"), integer("hidden_size")
        if num_heads < 1:  # before head_dim's fallback divides by it
            raise ValueError(f"config.json field 'num_attention_heads' must be positive, got {num_heads}")
        rope_theta, rope_scaling = _rope(raw, defaults["rope_theta"])
        return cls(
            family=family,
            vocab_size=integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=integer("num_key_value_heads", num_heads),
            head_dim=integer("head_dim", hidden_size // num_heads),
            rms_norm_eps=_number("rms_norm_eps", get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=integer("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=family == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError that names the file."""
    try:
        value = json.loads(path.read_bytes())
    except ValueError as error:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _integer(key: str, value: Any) -> int:
    if not is_integer(value):
        raise ValueError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _number(key: str, value: Any) -> float:
    if not is_number(value):
        raise ValueError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def _family(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ValueError(
            f"config.json field 'architectures' is {architectures!r}; "
            f"supported: exactly one of {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architectures[0]]


def _refuse_unsupported(raw: dict[str, Any], family: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' is {raw['hidden_act']!r}; only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise ValueError(f"config.json field {flag!r} is true; this decoder does not support it")
    if family == "llama" and raw.get("sliding_window"):
        raise ValueError("config.json field 'sliding_window' is set; this decoder does not support it")
    layer_types = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"config.json field 'layer_types' is {layer_types!r}; only full_attention is supported")


def _rope(raw: dict[str, Any], default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either `rope_parameters` (transformers 5) or the classic
    `rope_theta` + `rope_scaling` keys."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # transformers' precedence
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope parameters must be an object (rope_scaling or rope_parameters), "
                         f"got {params!r}")
    params = dict(params)
    if params and not all(isinstance(value, (int, float, str)) for value in params.values()):
        raise ValueError(f"config.json rope parameters {params!r} are per layer type; not supported")
    theta = _number("rope_theta", params.pop("rope_theta", None) or raw.get("rope_theta") or default_theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or DEFAULT_ROPE_TYPE
    if rope_type == DEFAULT_ROPE_TYPE:
        return theta, None
    if rope_type != LLAMA3_ROPE_TYPE:
        raise ValueError(
            f"config.json field 'rope_scaling.rope_type' is {rope_type!r}; "
            f"supported: {DEFAULT_ROPE_TYPE!r}, {LLAMA3_ROPE_TYPE!r}"
        )
    missing = [key for key in LLAMA3_ROPE_KEYS if key not in params]
    if missing:
        raise ValueError(f"config.json field 'rope_scaling' lacks {missing} for rope_type 'llama3'")
    scaling = {"rope_type": LLAMA3_ROPE_TYPE,
               **{key: _number(f"rope_scaling.{key}", params[key]) for key in LLAMA3_ROPE_KEYS}}
    original = scaling["original_max_position_embeddings"]
    if original != int(original):
        raise ValueError(f"config.json field 'rope_scaling.original_max_position_embeddings' must be a "
                         f"whole number, got {original!r}")
    scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling


def hf_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids of the checkpoint in `path`, of any architecture: config.json's,
    then generation_config.json's, then the tokenizer's `eos_token`, each once."""
    path = Path(path)
    ids = _token_ids(read_json_object(path / CONFIG_FILE).get("eos_token_id"), CONFIG_FILE)
    if (path / GENERATION_CONFIG_FILE).is_file():
        generation = read_json_object(path / GENERATION_CONFIG_FILE)
        ids += _token_ids(generation.get("eos_token_id"), GENERATION_CONFIG_FILE)
    return tuple(dict.fromkeys(ids + _tokenizer_eos_id(path)))


def _tokenizer_eos_id(path: Path) -> tuple[int, ...]:
    """The id of tokenizer_config.json's `eos_token` in tokenizer.json (a special token is one of
    its added tokens), or () where either file or the token is missing."""
    if not (path / TOKENIZER_CONFIG_FILE).is_file() or not (path / TOKENIZER_FILE).is_file():
        return ()
    eos = read_json_object(path / TOKENIZER_CONFIG_FILE).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos  # an AddedToken dict, or the text
    tokenizer = read_json_object(path / TOKENIZER_FILE)
    ids = [token["id"] for token in tokenizer.get("added_tokens", []) if token.get("content") == eos]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if not ids and isinstance(vocab, dict) and eos in vocab:
        ids = [vocab[eos]]
    return tuple(ids[:1]) if eos is not None else ()


def _token_ids(value: int | list[int] | None, file_name: str = CONFIG_FILE) -> tuple[int, ...]:
    """An `eos_token_id` field: an id, a list of ids, or absent."""
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if not all(is_integer(token) and token >= 0 for token in ids):
        raise ValueError(f"{file_name} field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(ids)
