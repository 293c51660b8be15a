"""The kit's LoRA adapter for its tiny model: a PEFT folder written once per process, whose output
differs from the base model's -- so an engine that runs it and is offered the base model's blocks (a
connector whose keys leave the adapter out) computes other tokens than its reference."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from connectors.testing.workload import KIT_MODEL_SPEC

ADAPTER_NAME = "kit-adapter"
RANK = 4


@functools.cache
def kit_adapter_dir() -> Path:
    """q_proj and v_proj of every layer, rank 4, weights wide enough to move the greedy tokens."""
    spec = KIT_MODEL_SPEC
    folder = Path(tempfile.mkdtemp(prefix="pdkv-conformance-adapter-"))
    atexit.register(shutil.rmtree, folder, True)
    head_dim = spec.hidden // spec.heads
    outs = {"q_proj": spec.heads * head_dim, "v_proj": spec.kv_heads * head_dim}
    rng = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(spec.layers):
        for module, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, spec.hidden, generator=rng) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=rng) * 0.5
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(outs)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def adapter_options() -> dict[str, Any]:
    """The engine options that serve the kit's adapter."""
    return {"loras": ((ADAPTER_NAME, str(kit_adapter_dir())),), "enable_lora": True}
