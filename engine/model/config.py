"""What pdkv needs to know about a decoder, parsed once from a Hugging Face ``config.json``.

Hugging Face configs come in two dialects: transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at
the top level, transformers 5.x nests both in ``rope_parameters``.  Both parse to the same ``RopeConfig``.
Anything pdkv cannot run faithfully (another architecture, another activation, a RoPE variant we do not
implement) is refused here with an error that names the field, never approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# architectures[0] -> model_type family.  All three share one implementation (engine/model/llama.py).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """``config.json`` describes a model pdkv cannot run; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.  ``kind``: default, linear (positions / factor) or llama3."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {self.kind!r} is not supported; pdkv implements {', '.join(ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ModelConfigError(f"rope_theta must be positive, got {self.theta!r}")
        if self.factor <= 0:
            raise ModelConfigError(f"rope factor must be positive, got {self.factor!r}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got {self.high_freq_factor!r} <= "
                f"{self.low_freq_factor!r}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape.  ``sliding_windows`` has one entry per layer (None = full)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise ModelConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )
        for w in self.sliding_windows:
            if w is not None and w <= 0:
                raise ModelConfigError(f"sliding_window must be a positive integer, got {w!r}")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict.  ``source`` names the file in error messages."""
        try:
            return _parse(raw)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None


def _parse(raw: Mapping[str, Any]) -> ModelConfig:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError("field 'architectures' is missing; expected e.g. [\"LlamaForCausalLM\"]")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architectures[0] {arch!r} is not supported; pdkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act {act!r} is not supported; the Llama family uses 'silu'")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ModelConfigError("pretraining_tp other than 1 is not supported")

    hidden = _require_int(raw, "hidden_size")
    heads = _require_int(raw, "num_attention_heads")
    layers = _require_int(raw, "num_hidden_layers")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or (hidden // heads if heads else 0)
    family = SUPPORTED_ARCHITECTURES[arch]
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=_require_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require_int(raw, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_require_int(raw, "max_position_embeddings"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama's attention_bias adds them to o_proj too.
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_windows=_parse_sliding_windows(raw, family, layers),
        bos_token_id=_optional_int(raw.get("bos_token_id"), "bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id"), "eos_token_id"),
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _require_int(raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    if value is None:
        raise ModelConfigError(f"field {name!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"field {name!r} must be an integer, got {value!r}")
    return value


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(f"field {name!r} must be a non-negative integer, got {value!r}")
    return value


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    """``eos_token_id`` may be one id or a list of them (Llama 3)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        checked = _optional_int(v, name)
        assert checked is not None
        out.append(checked)
    return tuple(out)


def _parse_rope(raw: Mapping[str, Any]) -> RopeConfig:
    # transformers 5: rope_parameters holds theta too; transformers 4: rope_theta + rope_scaling.
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(params, Mapping):
        raise ModelConfigError(f"rope_parameters must be an object, got {params!r}")
    if "full_attention" in params:  # per-layer-type rope parameters; the Llama family uses one kind
        params = params["full_attention"]
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(_rope_field(params, "factor")))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(_rope_field(params, "factor")),
            low_freq_factor=float(_rope_field(params, "low_freq_factor")),
            high_freq_factor=float(_rope_field(params, "high_freq_factor")),
            original_max_position_embeddings=int(_rope_field(params, "original_max_position_embeddings")),
        )
    raise ModelConfigError(f"rope_type {kind!r} is not supported; pdkv implements {', '.join(ROPE_TYPES)}")


def _rope_field(params: Mapping[str, Any], name: str) -> Any:
    if name not in params:
        raise ModelConfigError(f"rope scaling field {name!r} is missing")
    return params[name]


def _parse_sliding_windows(raw: Mapping[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    """One window per layer, following each family's rule for when the window applies."""
    window = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers:
            raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if family == "qwen2":
        first = int(raw.get("max_window_layers", layers))
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers
