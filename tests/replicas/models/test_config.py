"""Reading config.json (classic and transformers-5 keys) and refusing what the decoder cannot run;
checkpoints whose tensors disagree with their config."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megaserve.replicas.models import CheckpointError, ModelConfig, load_model
from megaserve.replicas.models.checkpoint import model_folder_problem
from megaserve.replicas.models.demo import ensure_demo_model
from megaserve.replicas.models.rope import rope_inv_freq
from tests.model_factory import make_tiny_model

# The shape of Llama 3.1 8B's config.json, as published (classic keys).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
# The shape of Qwen3-0.6B's config.json, as published.
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama31_config():
    config = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert (config.family, config.num_layers, config.num_heads, config.num_kv_heads) == ("llama", 32, 32, 8)
    assert config.head_dim == 128 and not config.qk_norm and not config.tie_word_embeddings
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009) and config.torch_dtype == "bfloat16"


def test_qwen3_config():
    config = ModelConfig.from_hf_dict(QWEN3_06B)
    assert (config.family, config.head_dim, config.hidden_size // config.num_heads) == ("qwen3", 128, 64)
    assert config.qk_norm and config.tie_word_embeddings and config.rope_scaling is None
    assert config.eos_token_ids == (151645,) and config.rope_theta == 1e6


def test_transformers5_keys_read_like_classic_ones():
    """transformers 5 writes rope_parameters (with rope_theta inside) and dtype."""
    classic_keys = ("rope_scaling", "rope_theta", "torch_dtype")
    modern = {key: value for key, value in LLAMA31_8B.items() if key not in classic_keys}
    modern["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    modern["dtype"] = "bfloat16"
    assert ModelConfig.from_hf_dict(modern) == ModelConfig.from_hf_dict(LLAMA31_8B)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    # A merged or hand-edited export with both keys: transformers reads rope_scaling
    # (PreTrainedConfig.convert_rope_params_to_dict), so the reference and the fast paths must too.
    both = {**LLAMA31_8B, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert ModelConfig.from_hf_dict(both) == ModelConfig.from_hf_dict(LLAMA31_8B)
    hf = transformers.LlamaConfig(**copy.deepcopy(both))  # it writes rope_theta into the rope_scaling dict
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["rope_theta"] == 500000.0


def test_llama3_scaling_slows_only_long_wavelengths():
    scaled = rope_inv_freq(ModelConfig.from_hf_dict(LLAMA31_8B))
    plain = rope_inv_freq(ModelConfig.from_hf_dict({**LLAMA31_8B, "rope_scaling": None}))
    assert scaled.dtype == torch.float32 and scaled.shape == (64,)
    assert torch.equal(scaled[:10], plain[:10])  # high frequencies untouched
    assert torch.allclose(scaled[-10:], plain[-10:] / 8.0)  # low frequencies slowed by `factor`


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"hidden_size": None}, "hidden_size"),
        # wrong types: named, not a bare int() or arithmetic error, and never a bool or float taken as a count
        ({"hidden_size": "sixty-four"}, "'hidden_size' must be an integer, got 'sixty-four'"),
        ({"num_hidden_layers": 31.5}, "'num_hidden_layers' must be an integer"),
        ({"num_key_value_heads": True}, "'num_key_value_heads' must be an integer"),
        ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number"),
        ({"rope_theta": [5e5]}, "'rope_theta' must be a number"),
        ({"rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": "8"}}, "'rope_scaling.factor' must be a number"),
        ({"rope_scaling": {**LLAMA31_8B["rope_scaling"], "original_max_position_embeddings": 8192.5}},
         "'rope_scaling.original_max_position_embeddings' must be a whole number"),
        ({"eos_token_id": "</s>"}, "'eos_token_id' must be a token id or a list of them, got '</s>'"),
        ({"eos_token_id": [128001, -1]}, "'eos_token_id' must be a token id"),
        # a count of 0 is named before anything divides by it, whether head_dim is given or not
        ({"num_attention_heads": 0}, "'num_attention_heads' must be positive, got 0"),
        ({"num_attention_heads": 0, "head_dim": 128}, "'num_attention_heads' must be positive, got 0"),
        ({"rope_scaling": "llama3"}, "rope parameters must be an object"),
    ],
)
def test_unsupported_llama_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**LLAMA31_8B, **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_unsupported_qwen3_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**QWEN3_06B, **change})


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf_dir(tmp_path)


@pytest.fixture()
def checkpoint(tmp_path):
    """A tiny single-file checkpoint and its tensors, to be tampered with."""
    path = make_tiny_model(tmp_path / "model", "qwen3")
    return path, load_file(path / "model.safetensors")


def test_missing_tensor_is_named(checkpoint):
    path, tensors = checkpoint
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(checkpoint):
    path, tensors = checkpoint
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected.*q_proj\.bias"):
        load_model(path)


def test_saved_rope_frequencies_of_older_exports_are_skipped(checkpoint):
    path, tensors = checkpoint
    reference = load_model(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # derived from the config
    save_file(tensors, path / "model.safetensors")
    model = load_model(path)
    assert torch.equal(model.rope_inv_freq, reference.rope_inv_freq)


def test_misshaped_tensor_is_named(checkpoint):
    path, tensors = checkpoint
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(tensors, path / "model.safetensors")
    expected = r"model\.layers\.0\.mlp\.up_proj\.weight.*shape \(127, 64\), expected \(128, 64\)"
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)


def test_tied_checkpoint_that_also_saves_the_head_uses_the_embedding(tmp_path):
    path = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head is model.embed and model.embed.abs().sum() > 0


def test_sharded_index_naming_a_missing_shard(tmp_path):
    path = make_tiny_model(tmp_path, "llama", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(path)


@pytest.mark.parametrize(("damage", "message"), [
    ("index-without-weight-map", "is not a safetensors index: KeyError"),
    ("weight-map-a-list", "weight_map must map tensor names to file names"),
    ("truncated-shard", "is not a readable safetensors file"),
    ("empty-shard", "is not a readable safetensors file"),
])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, damage, message):
    path = make_tiny_model(tmp_path, "llama", max_shard_size="40KB")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = path / sorted(set(index["weight_map"].values()))[0]
    if damage == "index-without-weight-map":
        index_path.write_text(json.dumps({"metadata": {}}))
    elif damage == "weight-map-a-list":
        index_path.write_text(json.dumps({"weight_map": list(index["weight_map"])}))
    else:
        shard.write_bytes(shard.read_bytes()[:100] if damage == "truncated-shard" else b"")
    with pytest.raises(CheckpointError, match=message) as caught:
        load_model(path)
    assert str(index_path if "index" in damage or "map" in damage else shard) in str(caught.value)


def test_integer_weights_are_refused_by_name_not_turned_into_numbers(checkpoint):
    path, tensors = checkpoint
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)
    save_file(tensors, path / "model.safetensors")
    refusal = r"'model\.embed_tokens\.weight' is torch\.int32; weights must be floating-point"
    with pytest.raises(CheckpointError, match=refusal):
        load_model(path)


@pytest.mark.parametrize(("file_name", "text", "message"), [
    ("config.json", '{"architectures": [', "config.json is not valid JSON"),
    ("config.json", "[1, 2]", "config.json holds a JSON list, not an object"),
    ("generation_config.json", "{", "generation_config.json is not valid JSON"),
    ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json is not valid JSON"),
])
def test_a_broken_json_file_is_named_by_the_folder_check_and_the_loader(tmp_path, file_name, text, message):
    path = make_tiny_model(tmp_path / "m", "llama")
    assert model_folder_problem(path) is None
    target = path / file_name
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    problem = model_folder_problem(path)  # what `megaserve up` says before Ray starts
    assert problem is not None and str(target) in problem and message in problem
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


def test_eos_ids_include_generation_config_ones(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    config_eos = ModelConfig.from_hf_dir(path).eos_token_ids
    generation = {"eos_token_id": [config_eos[0], 5, 6]}
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert ModelConfig.from_hf_dir(path).eos_token_ids == config_eos + (5, 6)


def test_eos_ids_include_the_tokenizer_s_eos_token(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    chat_end = next(t for t in tokenizer["added_tokens"] if t["content"] != json.loads(
        (path / "tokenizer_config.json").read_text())["eos_token"])  # another special token
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(settings | {"eos_token": chat_end["content"]}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": 0}))  # a base model's id
    (path / "generation_config.json").unlink()
    assert ModelConfig.from_hf_dir(path).eos_token_ids == (0, chat_end["id"])  # as vLLM stops on both


def test_a_qwen3_config_without_head_dim_takes_qwen3s_default_not_hidden_over_heads():
    raw = dict(QWEN3_06B)
    del raw["head_dim"]
    raw |= {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert ModelConfig.from_hf_dict(raw).head_dim == 128  # transformers' Qwen3Config default
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 1, "num_attention_heads": 4}
    assert ModelConfig.from_hf_dict(llama).head_dim == 64  # Llama's is hidden_size / heads


def test_the_demo_model_stops_on_the_ids_transformers_stops_on(tmp_path):
    """generation_config.json's ids and the tokenizer's eos_token, as transformers reads them."""
    from transformers import AutoTokenizer, GenerationConfig

    demo = ensure_demo_model(tmp_path)
    listed = GenerationConfig.from_pretrained(demo).eos_token_id
    tokenizer_eos = AutoTokenizer.from_pretrained(demo).eos_token_id
    expected = set(listed if isinstance(listed, list) else [listed]) | {tokenizer_eos}
    assert len(expected) == 2  # <|end_of_text|> and <|eot_id|>: both sources count
    assert set(ModelConfig.from_hf_dir(demo).eos_token_ids) == expected
