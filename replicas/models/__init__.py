"""Model families (Llama 3, Qwen3 dense): config, safetensors loading, the reference decoder with a
static KV cache, and the embedded demo model."""

from .checkpoint import CheckpointError
from .config import ModelConfig
from .decoder import Layer, Model, load_model
from .kv_cache import KVCache

__all__ = ["CheckpointError", "KVCache", "Layer", "Model", "ModelConfig", "load_model"]
