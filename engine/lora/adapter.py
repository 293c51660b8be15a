"""LoRA adapters from PEFT folders: read, check against the base model, and identify by content.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as ``peft`` saves them.  What is
served: ``peft_type`` LORA on any of q/k/v/o/gate/up/down (``target_modules`` as a list of names, one
regular expression, or ``all-linear``; ``exclude_modules`` and ``layers_to_transform`` narrow it), ``r``,
``lora_alpha``, ``use_rslora``, ``rank_pattern`` and ``alpha_pattern``.  What changes the output and is
not served is refused by name before anything is used: ``use_dora``, ``modules_to_save``, ``bias`` other
than ``none``, ``lora_bias``, ``fan_in_fan_out``, ``target_parameters``, ``trainable_token_indices``, an
``init_lora_weights`` that rewrites the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: the adapter is
for that rewritten base), any other key set to something but nothing (``alora_invocation_tokens``,
``use_qalora``, ``layer_replication``, ... and keys of PEFT versions to come) unless it is known to leave
inference alone (``_INERT``), a target outside those seven (``lm_head``, ``embed_tokens``), a rank above
the engine's ``max_lora_rank``, tensors that are missing, extra or of the wrong shape, a missing or
truncated file.

The adapter's identity (``AdapterId``: name and digest) is what every cache key carries: the digest is
SHA-256 over the canonical form of everything that changes its output -- each module's rank and scaling
and its A and B tensors' dtype, shape and bytes -- so other weights under the same name are another
adapter, and the same weights saved twice (another JSON key order, another file layout) are the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.hashing import AdapterId
from engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The modules an adapter may target, in the order the engine applies them; HF names under a layer.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PEFT_PREFIX = "base_model.model."
_NAME = re.compile(r"[^\s]{1,128}")

# Fields that would change the output and are not served: refused when set to anything but these.
_REFUSED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "layers_pattern": (None, "layers", ["layers"]),  # the base model's own layer list: the same layers
}
# What the loader reads (the docstring's served fields).
_SERVED = frozenset(
    {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "layers_to_transform"}
    | {"rank_pattern", "alpha_pattern"}
)
# Keys that leave inference alone (metadata, training-only settings, and sub-settings of refused switches).
_INERT = frozenset(
    {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode"}
    | {"lora_dropout", "megatron_config", "megatron_core", "qalora_group_size", "ensure_weight_tying"}
)
# PEFT's initializations: those that rewrite the base weights leave an adapter made for that new base
# (unless converted at save, which writes an ordinary adapter and init_lora_weights true).
_INIT_SERVED = (True, False, "gaussian", "eva", "orthogonal")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the field or file and why."""


@dataclass(frozen=True)
class ModuleDelta:
    """One module's update: ``y += scaling * (x @ A.T) @ B.T``; A [r, in], B [out, r]."""

    rank: int
    scaling: float
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter, its tensors on the CPU: ``deltas[(layer, module)]`` for each targeted module."""

    id: AdapterId
    path: Path
    max_rank: int
    deltas: dict[tuple[int, str], ModuleDelta]

    @property
    def name(self) -> str:
        return self.id.name

    def modules(self) -> set[str]:
        return {m for _, m in self.deltas}


def module_path(layer: int, module: str) -> str:
    """The module's name in the Hugging Face model, e.g. ``model.layers.3.self_attn.q_proj``."""
    return f"model.layers.{layer}.{_PARENT.get(module, 'mlp')}.{module}"


def check_name(name: str) -> None:
    """An adapter name is what clients put in ``model``: 1-128 printable characters, no spaces."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} must be 1-128 printable characters without spaces")


def load_adapter(name: str, path: str | Path, config: ModelConfig, *, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT folder ``path`` for the base model ``config``; raises ``AdapterError``."""
    check_name(name)
    folder = Path(path)
    raw = _read_config(folder)
    targets = _targets(raw, config)
    tensors = _read_tensors(folder / WEIGHTS_FILE)
    rank, alpha = _positive(raw, "r"), _number(raw, "lora_alpha", default=8)
    rank_pattern = _mapping(raw, "rank_pattern")
    alpha_pattern = _mapping(raw, "alpha_pattern")
    rslora = raw.get("use_rslora") is True
    deltas: dict[tuple[int, str], ModuleDelta] = {}
    for layer, module in targets:
        key = module_path(layer, module)
        r = int(_pattern_value(rank_pattern, key, rank))
        a_alpha = float(_pattern_value(alpha_pattern, key, alpha))
        if r > max_rank:
            raise AdapterError(
                f"{folder / CONFIG_FILE}: r (rank_pattern) of {key} is {r}, above the engine's "
                f"max_lora_rank {max_rank}; raise --max-lora-rank"
            )
        a, b = (_tensor(tensors, f"{_PEFT_PREFIX}{key}.lora_{x}.weight", folder) for x in ("A", "B"))
        out_features, in_features = _shape(config, module)
        for t, want, what in ((a, (r, in_features), "A"), (b, (out_features, r), "B")):
            if tuple(t.shape) != want:
                raise AdapterError(
                    f"{folder / WEIGHTS_FILE}: {key}.lora_{what} has shape {tuple(t.shape)}, but the base "
                    f"model and r={r} need {want}: the adapter was made for another model or rank"
                )
        scaling = a_alpha / math.sqrt(r) if rslora else a_alpha / r
        deltas[(layer, module)] = ModuleDelta(r, scaling, a, b)
    if extra := sorted(tensors):
        raise AdapterError(
            f"{folder / WEIGHTS_FILE}: tensors {extra[:3]} belong to no served target "
            f"(target_modules covers {sorted({m for _, m in targets})})"
        )
    if not deltas:
        raise AdapterError(f"{folder / CONFIG_FILE}: target_modules selects no module of the base model")
    adapter_id = AdapterId(name, _digest(deltas))
    return LoRAAdapter(adapter_id, folder, max(d.rank for d in deltas.values()), deltas)


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing: not a PEFT adapter folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {raw.get('peft_type')!r} is not served (LORA only)")
    for field, value in raw.items():
        if field in _REFUSED:
            served = value in _REFUSED[field]
        elif field == "init_lora_weights":
            served = any(value is v or (isinstance(v, str) and value == v) for v in _INIT_SERVED)
        else:  # a key unknown here is served only as the absence of what it would switch on
            served = field in _SERVED or field in _INERT or value in (None, False, [], {}, "")
        if not served:
            raise AdapterError(f"{file}: {field}={value!r} is not served (pdkv serves plain LoRA)")
    return raw


def _targets(raw: dict[str, Any], config: ModelConfig) -> list[tuple[int, str]]:
    """(layer, module) pairs the config targets, by PEFT's matching rules; refuses targets not served."""
    spec = raw.get("target_modules")
    if spec is None:
        raise AdapterError(f"{CONFIG_FILE}: target_modules is missing")
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    if layers is not None and not all(isinstance(i, int) for i in layers):
        raise AdapterError(f"{CONFIG_FILE}: layers_to_transform must be an integer or a list of integers")
    exclude = raw.get("exclude_modules")
    out = []
    for layer in range(config.num_layers):
        if layers is not None and layer not in layers:
            continue
        for module in MODULES:
            key = module_path(layer, module)
            if _matches(spec, key, all_linear=True) and not (exclude and _matches(exclude, key)):
                out.append((layer, module))
    names = [spec] if isinstance(spec, str) else list(spec)
    for other in ("lm_head", "embed_tokens", "model.embed_tokens", "model.norm"):
        if other in names or (isinstance(spec, str) and spec != "all-linear" and re.fullmatch(spec, other)):
            raise AdapterError(
                f"{CONFIG_FILE}: target_modules includes {other!r}, which is not served "
                f"(LoRA on {', '.join(MODULES)} only)"
            )
    return out


def _matches(spec: str | list[str], key: str, *, all_linear: bool = False) -> bool:
    if isinstance(spec, str):
        return (all_linear and spec == "all-linear") or re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith(f".{t}") for t in spec)


def _pattern_value(pattern: dict[str, Any], key: str, default: float) -> float:
    """PEFT's rule for rank_pattern / alpha_pattern: the value of the first key that matches the module's
    name, else ``default``."""
    return next((v for k, v in pattern.items() if re.match(rf"(.*\.)?({k})$", key)), default)


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        bins = sorted(p.name for p in file.parent.glob("adapter_model*.bin"))
        why = f" ({bins[0]} is a pickle: save with safe_serialization)" if bins else ""
        raise AdapterError(f"{file} is missing{why}")
    try:
        return dict(load_file(str(file)))
    except (SafetensorError, OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"{file}: cannot be read ({exc}); is it truncated?") from exc


def _tensor(tensors: dict[str, torch.Tensor], key: str, folder: Path) -> torch.Tensor:
    t = tensors.pop(key, None)
    if t is None:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: {key} is missing (target_modules names its module)")
    if not t.is_floating_point():
        raise AdapterError(f"{folder / WEIGHTS_FILE}: {key} has dtype {t.dtype}, not a float type")
    if not bool(t.isfinite().all()):  # it would turn every output of its module into NaN or inf
        raise AdapterError(f"{folder / WEIGHTS_FILE}: {key} has values that are not finite (inf or NaN)")
    return t


def _shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of the base model's ``module``."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }[module]


def _positive(raw: dict[str, Any], field: str) -> int:
    value = raw.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{CONFIG_FILE}: {field} must be a positive integer, got {value!r}")
    return value


def _number(raw: dict[str, Any], field: str, *, default: float) -> float:
    value = raw.get(field, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise AdapterError(f"{CONFIG_FILE}: {field} must be a number, got {value!r}")
    return float(value)


def _mapping(raw: dict[str, Any], field: str) -> dict[str, Any]:
    value = raw.get(field) or {}
    if not isinstance(value, dict) or not all(isinstance(v, int | float) for v in value.values()):
        raise AdapterError(f"{CONFIG_FILE}: {field} must map module patterns to numbers")
    return value


def _digest(deltas: dict[tuple[int, str], ModuleDelta]) -> bytes:
    """SHA-256 over each module (sorted): its name, rank, scaling and A, B as dtype, shape and bytes."""
    h = hashlib.sha256(b"pdkv-lora/v1")
    for (layer, module), d in sorted(deltas.items()):
        h.update(f"\x00{module_path(layer, module)}\x00{d.rank}\x00{d.scaling!r}".encode())
        for t in (d.a, d.b):
            t = t.contiguous()
            h.update(f"\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.digest()
