"""Tiny models for tests: random Hugging Face checkpoints (and transformers reference outputs), and a
small model written by pdkv's own make-model.

transformers is a test-only dependency: only this module (and tests) import it.  Models are written once
per test session into a temporary folder (``tiny_model_dir(name)``), in the Hugging Face format pdkv
loads (``save_pretrained`` with safetensors, optionally sharded).  ``hf_greedy`` runs transformers'
``generate`` on the same folder and returns tokens, logprobs and the smallest top-1/top-2 logit margin
seen, so a test can assert that greedy decoding is well defined (no near-ties) before comparing.
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Small enough to run in milliseconds, large enough to have GQA (4 query heads share 2 KV heads).
BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Wider than the default 0.02 so the logits of a random model are spread out: no near-ties.
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@dataclass(frozen=True)
class Variant:
    family: str
    overrides: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    max_shard_size: str | None = None
    # Rewrite config.json the way transformers 4.x wrote it (rope_theta + rope_scaling at the top level).
    legacy_rope_keys: bool = False


VARIANTS: dict[str, Variant] = {
    "llama": Variant("llama"),
    "llama3_rope": Variant("llama", (("rope_parameters", LLAMA3_ROPE),), legacy_rope_keys=True),
    "llama_linear_rope": Variant(
        "llama", (("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),)
    ),
    "llama_tied": Variant("llama", (("tie_word_embeddings", True),)),
    # the same weights with room for a 2000-token stream (the failover tests kill its node mid-stream)
    "llama_long": Variant("llama", (("max_position_embeddings", 4096),)),
    "llama_sharded": Variant("llama", max_shard_size="40KB"),
    "mistral": Variant("mistral", (("sliding_window", None),)),
    "mistral_window": Variant("mistral", (("sliding_window", 8),)),
    "qwen2": Variant("qwen2", (("tie_word_embeddings", False),)),
    # head_dim 32: the smallest the native prefill attention takes (engine/csrc/paged_prefill.c)
    "llama_hd32": Variant("llama", (("hidden_size", 128), ("intermediate_size", 256))),
    "mistral_window_hd32": Variant(
        "mistral", (("hidden_size", 128), ("intermediate_size", 256), ("sliding_window", 8))
    ),
    # deterministic mode's tests: SmolLM2-135M's layer shapes (its down projection [1536 -> 576] is one
    # oneDNN blocks by the row count), two layers, room for 2048-token chunks
    "llama_smol_shapes": Variant(
        "llama",
        (
            ("hidden_size", 576),
            ("intermediate_size", 1536),
            ("num_attention_heads", 9),
            ("num_key_value_heads", 3),
            ("max_position_embeddings", 4096),
        ),
    ),
}


def _classes(family: str) -> tuple[Any, Any]:
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]


@functools.cache
def _session_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pdkv-tiny-models-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def build_hf_model(variant: Variant) -> Any:
    config_cls, model_cls = _classes(variant.family)
    config = config_cls(**{**BASE, **dict(variant.overrides)})
    torch.manual_seed(variant.seed)
    model = model_cls(config).to(torch.float32).eval()
    return model


@functools.cache
def tiny_model_dir(name: str) -> Path:
    """The folder of variant ``name`` (see ``VARIANTS``), written once per session."""
    variant = VARIANTS[name]
    out = _session_dir() / name
    model = build_hf_model(variant)
    kwargs = {"max_shard_size": variant.max_shard_size} if variant.max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if variant.legacy_rope_keys:
        _rewrite_legacy_rope(out / "config.json")
    mark_random(out)
    return out


def mark_random(folder: Path) -> None:
    """Say in ``config.json`` that this checkpoint has random weights and no tokenizer.json on purpose:
    pdkv then gives it a byte-level tokenizer instead of refusing the folder."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw["pdkv_random_model"] = {"written_by": "tests/tiny_models.py"}
    path.write_text(json.dumps(raw, indent=2))


def _rewrite_legacy_rope(path: Path) -> None:
    raw = json.loads(path.read_text())
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    path.write_text(json.dumps(raw, indent=2))


@functools.cache
def hf_model(name: str, dtype: str = "float32") -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(name), dtype=getattr(torch, dtype)
    ).eval()


def hf_logits(name: str, dtype: str, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' logits ``[len(token_ids), vocab]`` (as float32) over ``token_ids`` in one forward, the
    model's weights in ``dtype``: a teacher-forced reference for outputs pdkv produced."""
    with torch.inference_mode():
        return hf_model(name, dtype)(torch.tensor([list(token_ids)])).logits[0].float()


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    logprobs: list[float]
    min_margin: float  # smallest top-1 minus top-2 logit over the generated positions


def hf_greedy(name: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reference]:
    """transformers' greedy ``generate``, one prompt at a time (no padding: the exact reference)."""
    return [_hf_greedy_one(name, tuple(p), max_new_tokens) for p in prompts]


@functools.cache
def _hf_greedy_one(name: str, prompt: tuple[int, ...], max_new_tokens: int) -> Reference:
    return greedy_reference(hf_model(name), prompt, max_new_tokens)


def greedy_reference(model: Any, prompt: Sequence[int], max_new_tokens: int) -> Reference:
    """``model``'s (transformers, or peft over it) greedy ``generate`` of one unpadded prompt."""
    input_ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(out.logits, dim=1)[0].float()  # [new, vocab]
    logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    top2 = logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    return Reference(tokens, logprobs, margin)


def pdkv_tiny_model_dir(**spec: Any) -> Path:
    """A model written by pdkv's make-model (with a real BPE tokenizer), once per session and spec."""
    return _pdkv_tiny(tuple(sorted(spec.items())))


@functools.cache
def _pdkv_tiny(spec_items: tuple[tuple[str, Any], ...]) -> Path:
    from engine.model.make_model import TinyLlamaSpec, make_model

    spec = TinyLlamaSpec(**{**TINY_PDKV_SPEC, **dict(spec_items)})
    name = "pdkv-" + "-".join(f"{k}{v}" for k, v in spec_items) if spec_items else "pdkv-default"
    return make_model(_session_dir() / name, spec)


# A make-model spec small enough for unit tests (the CLI default is 4 layers, hidden 256).
TINY_PDKV_SPEC: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 384}


def random_prompts(lengths: Sequence[int], *, seed: int, vocab: int = BASE["vocab_size"]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
