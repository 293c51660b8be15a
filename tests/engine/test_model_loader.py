"""Config parsing and the model fingerprint that keys the block-hash namespace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.hashing import HashNamespace, hash_blocks
from engine.model import fingerprint as fp
from engine.model.config import ModelConfig, ModelConfigError, RopeConfig
from engine.model.loader import inspect_model_folder
from engine.model.make_model import TinyLlamaSpec, make_model
from tests.tiny_models import TINY_PDKV_SPEC

SPEC = TinyLlamaSpec(**TINY_PDKV_SPEC)
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def test_same_model_same_fingerprint_regardless_of_folder_or_writer(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", SPEC)
    b = make_model(tmp_path / "b", SPEC)
    config = json.loads((b / "config.json").read_text())
    config["transformers_version"] = "9.9.9"  # re-saved by another library version: same model
    (b / "config.json").write_text(json.dumps(config))
    assert inspect_model_folder(a).fingerprint == inspect_model_folder(b).fingerprint
    assert inspect_model_folder(a).fingerprint.startswith("LlamaForCausalLM:")


def test_other_weights_or_config_other_fingerprint(tmp_path: Path) -> None:
    base = inspect_model_folder(make_model(tmp_path / "a", SPEC)).fingerprint
    reseeded = make_model(tmp_path / "b", TinyLlamaSpec(**{**TINY_PDKV_SPEC, "seed": 5}))
    assert inspect_model_folder(reseeded).fingerprint != base
    edited = tmp_path / "c"
    shutil.copytree(tmp_path / "a", edited)
    config = json.loads((edited / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (edited / "config.json").write_text(json.dumps(config))
    assert inspect_model_folder(edited).fingerprint != base


def test_different_models_never_share_block_hashes(tmp_path: Path) -> None:
    tokens = list(range(64))
    hashes = []
    for seed in (0, 1):
        folder = make_model(tmp_path / f"m{seed}", TinyLlamaSpec(**{**TINY_PDKV_SPEC, "seed": seed}))
        ns = HashNamespace(model_fingerprint=inspect_model_folder(folder).fingerprint, block_size=16)
        hashes.append(hash_blocks(tokens, namespace=ns))
    assert not set(hashes[0]) & set(hashes[1])


def test_sampled_digest_above_the_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_model(tmp_path / "a", SPEC)
    weights = folder / "model.safetensors"
    full = fp.weights_digest([weights])
    monkeypatch.setattr(fp, "FULL_HASH_LIMIT", 1)
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 4096)
    monkeypatch.setattr(fp, "SAMPLES_PER_FILE", 4)
    sampled = fp.weights_digest([weights])
    assert sampled != full and sampled == fp.weights_digest([weights])
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last sample covers the end of the file
    weights.write_bytes(bytes(data))
    assert fp.weights_digest([weights]) != sampled


def test_rope_dialects_parse_alike() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5 = ModelConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert v4.rope == v5.rope == RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64)
    linear = ModelConfig.from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope == RopeConfig(10000.0, "linear", 2.0)


def test_unsupported_rope_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="rope_type 'yarn' is not supported"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_sliding_windows_per_family() -> None:
    mistral = ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.sliding_windows == (32, 32, 32, 32)
    qwen_off = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32})
    assert qwen_off.sliding_windows == (None,) * 4 and qwen_off.qkv_bias and not qwen_off.o_bias
    qwen_on = ModelConfig.from_hf(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 32,
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    )
    assert qwen_on.sliding_windows == (None, None, 32, 32)


def test_eos_list_and_missing_fields() -> None:
    assert ModelConfig.from_hf({**BASE, "eos_token_id": [7, 9]}).eos_token_ids == (7, 9)
    incomplete = {k: v for k, v in BASE.items() if k != "hidden_size"}
    with pytest.raises(ModelConfigError, match="'hidden_size' is missing"):
        ModelConfig.from_hf(incomplete, source="x/config.json")
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) must be a multiple"):
        ModelConfig.from_hf({**BASE, "num_key_value_heads": 3})


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "a", SPEC)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [SPEC.eos_token_id, 7]}))
    assert inspect_model_folder(folder).config.eos_token_ids == (SPEC.eos_token_id, 7)
