"""Load a Llama-family model from a local Hugging Face folder.  Nothing is ever downloaded.

A folder holds ``config.json`` and its weights as either one ``model.safetensors``, several shards listed
by ``model.safetensors.index.json``, or several ``*.safetensors`` files without an index.  Everything
that can be wrong with a folder is reported before any weight is read, with a message naming the file or
field: no folder, no ``config.json``, an unsupported architecture, no safetensors weights (PyTorch
``.bin`` files are refused rather than unpickled), a shard the index lists but the folder lacks, tensors
the checkpoint lacks or has in the wrong shape.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.fingerprint import model_fingerprint
from engine.model.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelFolder:
    """A checked model folder: its parsed config and weight files, not yet loaded."""

    path: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    weight_files: tuple[Path, ...]

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.config.architecture, self.raw_config, self.weight_files)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    fingerprint: str
    path: Path
    dtype: torch.dtype
    device: torch.device


def inspect_model_folder(path: str | Path) -> ModelFolder:
    """Validate ``path`` as a model folder without reading weights."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist or is not a directory")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    config = ModelConfig.from_hf(raw, source=str(config_path))
    config = _with_generation_eos(folder, config)
    return ModelFolder(folder, raw, config, _weight_files(folder))


def _with_generation_eos(folder: Path, config: ModelConfig) -> ModelConfig:
    """Chat checkpoints (Llama 3 Instruct) list extra EOS ids in ``generation_config.json``; honour them."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return config
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from exc
    extra = value if isinstance(value, list) else [value] if value is not None else []
    ids = list(config.eos_token_ids)
    for t in extra:
        if isinstance(t, int) and not isinstance(t, bool) and t >= 0 and t not in ids:
            ids.append(t)
    return dataclasses.replace(config, eos_token_ids=tuple(ids))


def _weight_files(folder: Path) -> tuple[Path, ...]:
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists weight files the folder lacks: {', '.join(missing)}")
        return tuple(folder / n for n in names)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return tuple(files)
    if any(folder.glob("*.bin")):
        raise FileNotFoundError(
            f"model folder {str(folder)!r} has only PyTorch .bin weights; pdkv reads *.safetensors "
            "(convert with transformers' save_pretrained(safe_serialization=True))"
        )
    raise FileNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")


def load_model(path: str | Path | ModelFolder, *, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Build the model for ``path`` on ``device`` in ``dtype`` and fill every parameter from its files."""
    folder = path if isinstance(path, ModelFolder) else inspect_model_folder(path)
    model = LlamaForCausalLM(folder.config, dtype=dtype, device=device)
    expected = model.expected_weight_names()
    loaded: set[str] = set()
    unknown: set[str] = set()
    for file in folder.weight_files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            got, bad = model.load_weights((name, f.get_tensor(name)) for name in names)
        loaded |= got
        unknown |= bad
    missing = expected - loaded
    if missing:
        raise ValueError(f"model folder {str(folder.path)!r} is missing weights: {_few(missing)}")
    # Rotary caches and the like are not weights; anything else unknown means another architecture.
    unknown = {n for n in unknown if not n.endswith("rotary_emb.inv_freq")}
    if unknown:
        raise ValueError(
            f"model folder {str(folder.path)!r} has weights a {folder.config.architecture} does not use: "
            f"{_few(unknown)}"
        )
    model.eval()
    return LoadedModel(model, folder.config, folder.fingerprint, folder.path, dtype, device)


def _few(names: set[str], limit: int = 5) -> str:
    ordered = sorted(names)
    more = f" (and {len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more
