"""Read a Llama-family model from one GGUF file (llama.cpp's format) with the ``gguf`` package.

``inspect_gguf(path)`` checks everything it can before any weight is read and says what is wrong in one
error: not a GGUF file (magic), a file cut short (a tensor's bytes end past the end of the file), an
architecture pdkv does not run, a tensor type it does not dequantize, missing ``llama.*`` or tokenizer
metadata.  ``GGUFModel.weights(dtype)`` then yields Hugging Face-named tensors, dequantized to ``dtype``:

    GGUF name                     Hugging Face name                              note
    token_embd.weight             model.embed_tokens.weight
    blk.N.attn_norm.weight        model.layers.N.input_layernorm.weight
    blk.N.attn_{q,k,v}.weight     model.layers.N.self_attn.{q,k,v}_proj.weight   q, k: row permutation undone
    blk.N.attn_output.weight      model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight         model.layers.N.post_attention_layernorm.weight
    blk.N.ffn_{gate,up,down}      model.layers.N.mlp.{gate,up,down}_proj.weight
    output_norm.weight            model.norm.weight
    output.weight                 lm_head.weight                                 absent: tied embeddings

llama.cpp's converter permutes the rows of q and k for the ``llama`` architecture so its RoPE can rotate
adjacent pairs; per head the rows go from [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...].
``_unpermute`` restores the Hugging Face (rotate-half) order.  ``qwen2`` files are not permuted.

Tensor types dequantized (by the ``gguf`` package, llama.cpp's own reference code): see
``SUPPORTED_TENSOR_TYPES`` -- among them the K-quants of the common ``Q4_K_M`` / ``Q5_K_M`` / ``Q6_K``
files (Q4_K, Q5_K, Q6_K: checked against a dequantizer written from ggml's C, tests/kquants.py).  Under
``--weights quantized`` all three come as raw blocks, packed for the native kernels with Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 (engine/model/quantized.py); the float types are dequantized beside them.  Every
other type (Q2_K, Q3_K, the IQ types, ternary and FP4 formats) is refused with the list of what is
supported.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.config import ModelConfig, ModelConfigError
from engine.model.fingerprint import model_fingerprint

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
# GGUF architecture -> the Hugging Face architecture it corresponds to.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256 weights (the docstring: which run packed)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QUANTS)
# The tokenizer models pdkv builds (llama.cpp's "gpt2" is byte-level BPE) and their pre-tokenizers.
TOKENIZER_MODELS = ("gpt2",)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """A GGUF file pdkv cannot run; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The ``tokenizer.ggml.*`` metadata a tokenizer is built from (see ``engine/model/gguf_tokenizer``)."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool


@dataclass(frozen=True)
class GGUFModel:
    """A checked GGUF file: its config, tokenizer metadata and chat template; weights not yet read."""

    path: Path
    architecture: str  # GGUF's name: llama, qwen2
    config: ModelConfig
    hf_config: dict[str, Any]  # the config.json this file corresponds to (convert-gguf writes it)
    tokenizer: GGUFTokenizerSpec
    chat_template: str | None
    tensor_types: Mapping[str, int]  # type name -> how many tensors have it
    # The reader's tensors (names, types, shapes, views of the memory map), not the reader: its metadata
    # fields hold a memmap per part (SmolLM2's vocabulary and merges: ~250,000 of them), which the cache
    # of inspected files would keep alive in every process -- objects each full collection of Python's
    # garbage collector walks (215-221 ms with them, 176-181 without: docs/BENCHMARKS.md), a pause of
    # the engine's step.
    _tensors: tuple[Any, ...] = field(repr=False, compare=False)

    @property
    def fingerprint(self) -> str:
        """Same file, same fingerprint on every node; another quantization is another file's bytes."""
        return model_fingerprint(self.config.architecture, self.hf_config, (self.path,), by_name=False)

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor in ``dtype``) for every tensor of the file, dequantized on the fly."""
        import torch

        for name, tensor in self.weights_or_blocks(dtype, frozenset()):
            assert isinstance(tensor, torch.Tensor)
            yield name, tensor

    def weights_or_blocks(
        self, dtype: torch.dtype, raw_types: frozenset[str]
    ) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
        """(Hugging Face name, tensor in ``dtype``) for every tensor of the file, dequantized on the fly --
        except the matrices of ``raw_types`` (GGUF type names), which come as the file stores them
        (``RawBlocks``, for engine/model/quantized.py to pack)."""
        import numpy as np
        import torch
        from gguf import quants

        c = self.config
        for t in self._tensors:
            name = _hf_name(t.name)
            assert name is not None  # inspect_gguf refused unknown tensors
            if t.tensor_type.name in raw_types and len(t.shape) == 2:
                data = t.data  # [rows, bytes per row], a view of the memory map
                if self.architecture == "llama" and name.endswith("q_proj.weight"):
                    data = _unpermute(data, c.num_heads)  # whole rows move: blocks stay intact
                elif self.architecture == "llama" and name.endswith("k_proj.weight"):
                    data = _unpermute(data, c.num_kv_heads)
                rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
                yield name, RawBlocks(name, t.tensor_type.name, rows, cols, np.ascontiguousarray(data))
                continue
            # a corrupt block's inf or NaN (no warning here: the loader refuses the file, naming the weight)
            with np.errstate(over="ignore", invalid="ignore"):
                array = quants.dequantize(t.data, t.tensor_type)  # float32, numpy order [out, in]
            array = np.ascontiguousarray(array, dtype=np.float32)
            if not array.flags.writeable:  # an F32 tensor is a view of the read-only memory map
                array = array.copy()
            if self.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = _unpermute(array, c.num_heads)
            elif self.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = _unpermute(array, c.num_kv_heads)
            yield name, torch.from_numpy(array).to(dtype)


@dataclass(frozen=True)
class RawBlocks:
    """One GGUF matrix as the file stores it: ``data`` [rows, bytes per row] of ``qtype`` blocks."""

    name: str  # the Hugging Face name
    qtype: str
    rows: int
    cols: int
    data: Any  # numpy uint8, rows already in Hugging Face order (q/k unpermuted)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, quants

        array = quants.dequantize(self.data, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype)


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its magic, or by its suffix when it does not exist)."""
    p = Path(path).expanduser()
    if p.is_file():
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    return p.suffix.lower() == ".gguf"


def inspect_gguf(path: str | Path) -> GGUFModel:
    """Validate ``path`` as a GGUF model pdkv can run, without dequantizing any weight.

    Parsing a file's metadata takes seconds (the reader builds an array per vocabulary entry), so the
    result is kept per (path, size, mtime): a second engine on the same file in one process skips it."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist or is not a file")
    st = p.stat()
    return _inspect(p.resolve(), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _inspect(p: Path, size: int, mtime_ns: int) -> GGUFModel:
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    reader = _open_reader(p)
    meta = _Metadata(reader, p)
    _check_tensors(reader, p)
    arch = meta.string("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{p}: general.architecture {arch!r} is not supported; pdkv runs {', '.join(ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    hf = _hf_config(meta, arch, tensor_names)
    matrix_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    stored = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    if len(matrix_types) == 1 and next(iter(matrix_types)) in stored:
        hf["torch_dtype"] = stored[next(iter(matrix_types))]  # else quantized: no natural dtype
    try:
        config = ModelConfig.from_hf(hf, source=str(p))
    except ModelConfigError as exc:
        raise GGUFError(str(exc)) from None
    tokenizer = _tokenizer_spec(meta)
    config = dataclasses.replace(
        config,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,),
    )
    if len(tokenizer.tokens) != config.vocab_size:
        raise GGUFError(
            f"{p}: tokenizer.ggml.tokens has {len(tokenizer.tokens)} tokens for a vocabulary of "
            f"{config.vocab_size}"
        )
    template = meta.optional("tokenizer.chat_template")
    return GGUFModel(
        path=p,
        architecture=arch,
        config=config,
        hf_config=hf,
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        _tensors=tuple(reader.tensors),
    )


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as exc:
        # The reader memory-maps the file and parses it eagerly; a cut-off file fails here.
        size = path.stat().st_size
        raise GGUFError(
            f"{path}: cannot be parsed as GGUF ({size} bytes: truncated or damaged?): {exc}"
        ) from exc


def _check_tensors(reader: Any, path: Path) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"{path}: truncated: tensor {t.name!r} ends at byte {end} but the file has {size} bytes"
            )
        if _hf_name(t.name) is None:
            raise GGUFError(
                f"{path}: tensor {t.name!r} is not part of a Llama-family model pdkv runs "
                "(rope_freqs: Llama 3.1 rope scaling; others: another architecture)"
            )
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which pdkv does not dequantize; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )


class _Metadata:
    """Typed access to a reader's key/value fields, with errors that name the key and the file."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def optional(self, key: str) -> Any:
        f = self._fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self._path}: metadata {key!r} cannot be read ({exc})") from exc

    def array_length(self, key: str) -> int:
        """How many elements the array ``key`` holds (0 if absent), without decoding them."""
        f = self._fields.get(key)
        return len(f.data) if f is not None and len(f.types) > 1 else 0

    def required(self, key: str) -> Any:
        value = self.optional(key)
        if value is None:
            raise GGUFError(f"{self._path}: metadata {key!r} is missing")
        return value

    def string(self, key: str) -> str:
        value = self.required(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self._path}: metadata {key!r} must be a string, got {value!r}")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.optional(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise GGUFError(f"{self._path}: metadata {key!r} is missing")
        if not isinstance(value, int) or isinstance(value, bool):
            raise GGUFError(f"{self._path}: metadata {key!r} must be an integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.optional(key)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise GGUFError(f"{self._path}: metadata {key!r} must be a number, got {value!r}")
        return float(value)

    def list_of(self, key: str, kind: type) -> list[Any]:
        value = self.required(key)
        if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
            raise GGUFError(f"{self._path}: metadata {key!r} must be an array of {kind.__name__}")
        return value


def _hf_config(meta: _Metadata, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` equivalent of the ``{arch}.*`` metadata."""
    heads = meta.integer(f"{arch}.attention.head_count")
    hidden = meta.integer(f"{arch}.embedding_length")
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads if heads else 0)
    rope_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(
            f"{meta._path}: {arch}.rope.dimension_count {rope_dim} differs from the head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    vocab = meta.integer(f"{arch}.vocab_size", meta.array_length("tokenizer.ggml.tokens"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.number(f"{arch}.rope.freq_base", 1e4)}
    scaling = meta.optional(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{meta._path}: {arch}.rope.scaling.type {scaling!r} is not supported")
        rope = {**rope, "rope_type": "linear", "factor": meta.number(f"{arch}.rope.scaling.factor", 1.0)}
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.integer(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.integer(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.integer(f"{arch}.context_length"),
        "rms_norm_eps": meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.optional("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.optional("tokenizer.ggml.eos_token_id"),
    }


def _tokenizer_spec(meta: _Metadata) -> GGUFTokenizerSpec:
    model = meta.optional("tokenizer.ggml.model")
    if model is None:
        raise GGUFError(f"{meta._path}: no tokenizer metadata (tokenizer.ggml.model is missing)")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(
            f"{meta._path}: tokenizer.ggml.model {model!r} is not supported; pdkv builds "
            f"{', '.join(TOKENIZER_MODELS)} (byte-level BPE)"
        )
    tokens = meta.list_of("tokenizer.ggml.tokens", str)
    types = meta.optional("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != len(tokens)):
        raise GGUFError(f"{meta._path}: tokenizer.ggml.token_type must have one entry per token")

    def special(key: str) -> int | None:
        value = meta.optional(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise GGUFError(f"{meta._path}: tokenizer.ggml.{key} {value!r} is not a token id")
        return value

    return GGUFTokenizerSpec(
        model=model,
        pre=str(meta.optional("tokenizer.ggml.pre") or "default"),
        tokens=tuple(tokens),
        token_types=tuple(types or ()),
        merges=tuple(meta.list_of("tokenizer.ggml.merges", str)),
        bos_token_id=special("bos_token_id"),
        eos_token_id=special("eos_token_id"),
        unk_token_id=special("unknown_token_id"),
        pad_token_id=special("padding_token_id"),
        add_bos_token=bool(meta.optional("tokenizer.ggml.add_bos_token") or False),
        add_eos_token=bool(meta.optional("tokenizer.ggml.add_eos_token") or False),
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(array: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation: per head, rows [x0, y0, x1, y1, ...] -> [x0, x1, ..., y0, ...].

    rows [heads * d] = [heads, d/2, 2] (llama.cpp's order) -> swap the last two -> [heads, 2, d/2].
    """
    rows = array.shape[0]
    rest = array.shape[1:]
    return array.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
