"""LoRA adapters that ``peft`` itself writes over the tests' tiny models, and peft's greedy outputs.

``peft_adapter_dir(base, name)`` saves the adapter ``ADAPTERS[name]`` (a ``LoraConfig`` with
``init_lora_weights=False``: A and B both random, so the delta is real) over the tiny model ``base``
(tests/tiny_models.py), once per session; ``peft_greedy`` is transformers + peft's greedy output with it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import Reference, _session_dir, greedy_reference, hf_model, tiny_model_dir

ADAPTERS: dict[str, dict[str, Any]] = {
    "r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r16": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "rslora": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    },
    "attn_only": {"r": 8, "lora_alpha": 16, "target_modules": r".*\.self_attn\.(q|k|v|o)_proj"},
    "all_linear": {"r": 8, "lora_alpha": 8, "target_modules": "all-linear"},
    "patterns": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "up_proj"],
        "rank_pattern": {"up_proj": 12},
        "alpha_pattern": {"v_proj": 2},
    },
}


def peft_adapter_dir(base: str, name: str, *, seed: int = 0, scale: float = 1.0) -> Path:
    """Adapter ``name`` over tiny model ``base``, written by peft (once per session, base, seed)."""
    return _adapter(base, name, seed, scale)


@functools.cache
def _adapter(base: str, name: str, seed: int, scale: float) -> Path:
    from peft import LoraConfig, get_peft_model

    model = _fresh(base)
    torch.manual_seed(1000 + seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **ADAPTERS[name])
    peft_model = get_peft_model(model, config)
    if scale != 1.0:
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.mul_(scale)
    out = _session_dir() / f"adapter-{base}-{name}-{seed}-{scale}"
    peft_model.save_pretrained(out)
    return out


def _fresh(base: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(base), dtype=torch.float32).eval()


@functools.cache
def peft_model(base: str, adapter: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(_fresh(base), str(adapter)).eval()


def peft_greedy(
    base: str, adapter: Path | None, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[Reference]:
    """Greedy outputs of transformers (+ peft with ``adapter``), one prompt at a time, in float32."""
    model = hf_model(base) if adapter is None else peft_model(base, adapter)
    return [greedy_reference(model, prompt, max_new_tokens) for prompt in prompts]
