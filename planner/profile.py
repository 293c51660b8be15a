"""A node's measured costs (``pdkv profile`` writes them; the simulator and ``pdkv plan`` read them).

The file is JSON:

    {"version": 1, "machine": {...}, "model": {...},
     "engine": {"block_size", "max_num_batched_tokens", "max_num_seqs", "num_blocks", "kv_bytes_per_token"},
     "step": {"decode_base_s", "prefill_base_s", "prefill_token_s", "prefill_attention_s",
              "decode_row_s", "decode_context_s", "samples", "error_p50", "error_p90"},
     "loads": {"cpu": {"base_s", "token_s", "samples", "spread"}, "disk": {...}},
     "p2p": {"base_s", "byte_s", "samples", "spread"},
     "repeat": {"runs", "step_spread"}}

One engine step of a node costs (``StepCost.seconds``)

    (prefill_base_s if the step computes a prompt chunk, else decode_base_s)
      + sum over prompt chunks of  n x prefill_token_s + n x (context + (n + 1) / 2) x prefill_attention_s
      + decode rows x decode_row_s + their contexts summed x decode_context_s

(a chunk of ``n`` tokens after ``context`` cached ones attends to about n x (context + n/2) positions),
fitted by least squares to every step the profiler timed; a store load of ``t`` tokens from a tier adds
``base_s + t x token_s`` to its step, and a p2p pull of ``b`` bytes takes ``base_s + b x byte_s``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that is not what the format says; the text names the file and the field."""


@dataclass(frozen=True)
class StepCost:
    decode_base_s: float
    prefill_base_s: float
    prefill_token_s: float
    prefill_attention_s: float
    decode_row_s: float
    decode_context_s: float
    samples: int = 0
    error_p50: float = 0.0  # |fitted - measured| / measured over the samples
    error_p90: float = 0.0

    def seconds(self, chunks: list[tuple[int, int]], decode_rows: int, decode_context: int) -> float:
        """One step: prompt ``chunks`` as (tokens, context before them), and ``decode_rows`` rows of one
        token whose contexts sum to ``decode_context``."""
        t = self.prefill_base_s if chunks else self.decode_base_s
        for n, ctx in chunks:
            t += n * self.prefill_token_s + n * (ctx + (n + 1) / 2) * self.prefill_attention_s
        return t + decode_rows * self.decode_row_s + decode_context * self.decode_context_s

    def decode_seconds(self, rows: int, context: int) -> float:
        return self.decode_base_s + rows * self.decode_row_s + context * self.decode_context_s

    def prefill_seconds(self, new: int, cached: int = 0) -> float:
        """One prompt of ``new`` tokens after ``cached`` ones, alone, in steps of the node's budget."""
        return self.seconds([(new, cached)], 0, 0)


@dataclass(frozen=True)
class LinearCost:
    """``base_s + amount x per`` (tokens for loads, bytes for p2p), with the samples' spread."""

    base_s: float
    per: float
    samples: int = 0
    spread: float = 0.0  # the largest relative deviation of a sample from the fit

    def seconds(self, amount: float) -> float:
        return self.base_s + amount * self.per if amount > 0 else 0.0


@dataclass(frozen=True)
class EngineShape:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int
    kv_bytes_per_token: int
    max_model_len: int


@dataclass(frozen=True)
class Profile:
    machine: dict[str, Any]
    model: dict[str, Any]
    engine: EngineShape
    step: StepCost
    loads: dict[str, LinearCost]  # by tier kind: "cpu", "disk", ...
    p2p: LinearCost
    repeat: dict[str, Any] = field(default_factory=dict)

    def load_seconds(self, tier: str, tokens: int) -> float:
        cost = self.loads.get(tier)
        if cost is None:
            have = ", ".join(sorted(self.loads)) or "none"
            raise ProfileError(f"the profile has no load cost for tier {tier!r} (it has {have})")
        return cost.seconds(tokens)

    def transfer_seconds(self, tokens: int) -> float:
        return self.p2p.seconds(tokens * self.engine.kv_bytes_per_token)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "machine": self.machine,
            "model": self.model,
            "engine": asdict(self.engine),
            "step": asdict(self.step),
            "loads": {k: _linear_json(v, "token_s") for k, v in self.loads.items()},
            "p2p": _linear_json(self.p2p, "byte_s"),
            "repeat": self.repeat,
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: a profile is a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"{where}: field 'version' is {data.get('version')!r}; "
                f"this pdkv reads version {PROFILE_VERSION}"
            )
        for key in ("machine", "model", "engine", "step", "loads", "p2p"):
            if not isinstance(data.get(key), dict):
                raise ProfileError(f"{where}: field {key!r} is missing or not an object")
        loads = {tier: _linear(v, f"loads.{tier}", "token_s", where) for tier, v in data["loads"].items()}
        return cls(
            machine=data["machine"],
            model=data["model"],
            engine=_numbers(EngineShape, data["engine"], "engine", where, integer=True),
            step=_numbers(StepCost, data["step"], "step", where),
            loads=loads,
            p2p=_linear(data["p2p"], "p2p", "byte_s", where),
            repeat=data["repeat"] if isinstance(data.get("repeat"), dict) else {},
        )


def _linear_json(cost: LinearCost, per_name: str) -> dict[str, Any]:
    return {"base_s": cost.base_s, per_name: cost.per, "samples": cost.samples, "spread": cost.spread}


def _linear(value: Any, name: str, per_name: str, where: str) -> LinearCost:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: field {name!r} is not an object")
    renamed = {("per" if k == per_name else k): v for k, v in value.items()}
    return _numbers(LinearCost, renamed, name, where, rename={"per": per_name})


def _numbers(
    cls: Any,
    value: Mapping[str, Any],
    name: str,
    where: str,
    *,
    integer: bool = False,
    rename: Mapping[str, str] | None = None,
) -> Any:
    """``cls`` from the object ``value``: every field present, a finite number >= 0 (integers >= 1
    where ``integer``); an error names the field."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        shown = f"{name}.{(rename or {}).get(f.name, f.name)}"
        if f.name not in value:
            if f.default is not MISSING:
                continue
            raise ProfileError(f"{where}: field {shown!r} is missing")
        v = value[f.name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ProfileError(f"{where}: field {shown!r} must be a finite number >= 0, got {v!r}")
        if integer:
            if int(v) != v or v < 1:
                raise ProfileError(f"{where}: field {shown!r} must be a whole number >= 1, got {v!r}")
            v = int(v)
        out[f.name] = v
    return cls(**out)
