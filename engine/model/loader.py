"""Load a Llama-family model from a local Hugging Face folder or GGUF file.  Nothing is ever downloaded.

``inspect_model(path)`` dispatches: a file is read as GGUF (``engine/model/gguf.py``), a folder as a
Hugging Face checkpoint.  Both answer the same questions (config, fingerprint, weights, chat template).

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
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.config import ModelConfig
from engine.model.fingerprint import model_fingerprint
from engine.model.gguf import GGUFError, GGUFModel, inspect_gguf

if TYPE_CHECKING:
    import torch

    from engine.model.llama import LlamaForCausalLM
    from engine.native import QuantKernel

INDEX_FILE = "model.safetensors.index.json"
# "onednn" keeps bfloat16 linears on oneDNN's packed matmuls (engine/model/packed.py) where the native
# bfloat16 kernel (engine/csrc/bf16_linear.c) would run them.
BF16_LINEARS_ENV = "PDKV_BF16_LINEARS"
# make-model and the tests' random checkpoints carry this key in config.json (see is_random).
RANDOM_MODEL_KEY = "pdkv_random_model"


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

    @property
    def is_random(self) -> bool:
        """A random-weight test model (``pdkv make-model``, the tests' checkpoints) says so in its config."""
        return RANDOM_MODEL_KEY in self.raw_config

    @property
    def chat_template(self) -> str | None:
        """``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (None: no template)."""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = self.path / "tokenizer_config.json"
        if not cfg.is_file():
            return None
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{cfg}: cannot be read as JSON ({exc})") from exc
        template = raw.get("chat_template") if isinstance(raw, dict) else None
        if isinstance(template, list):  # the older list-of-named-templates form: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.weight_files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in list(f.keys()):
                    yield name, f.get_tensor(name)


ModelSource = ModelFolder | GGUFModel


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    fingerprint: str
    path: Path
    dtype: torch.dtype
    device: torch.device
    quantized: bool = False  # some matrices run packed (engine/model/quantized.py)
    bf16_tiles: bool = False  # bfloat16 linears in AMX tiles (engine/csrc/bf16_amx.h): other bits
    # bfloat16 linears in torch's matmuls (oneDNN on the CPU, packed or not; PDKV_BF16_LINEARS=onednn, or no
    # native kernel): sums that follow the CPU's instruction set, so other bits than bf16_linear.c's
    torch_linears: bool = False


def inspect_model(path: str | Path) -> ModelSource:
    """A GGUF file or a Hugging Face folder, checked without reading weights."""
    p = Path(path).expanduser()
    if p.is_file() or (not p.exists() and p.suffix.lower() == ".gguf"):
        return inspect_gguf(p)
    if p.exists() and not p.is_dir():  # a FIFO, a socket, a device: neither a file nor a folder
        raise ValueError(f"model {str(p)!r} is neither a GGUF file nor a model folder (a special file)")
    return inspect_model_folder(p)


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
    files = _weight_files(folder)
    _check_weight_files(files)
    return ModelFolder(folder, raw, config, files)


FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})  # safetensors' names of the dtypes a folder's weights take


def _check_weight_files(files: Iterable[Path]) -> None:
    """Each file's header parses, covers the file, and stores float tensors only: a damaged file, or a
    quantized checkpoint's (FP8, GPTQ/AWQ int packs, bitsandbytes bytes), is an error naming it before any
    weight is read (safetensors reads the header alone here; "np" imports no torch, for the router).  A
    ``quantization_config`` over float tensors (a merged 16-bit export) is served: the tensors decide."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="np") as f:
                names = list(f.keys())
                dtypes = {name: f.get_slice(name).get_dtype() for name in names}
        except Exception as exc:  # safetensors' SafetensorError (damaged, cut short), OSError
            raise ValueError(f"weight file {file}: cannot be read as safetensors ({exc})") from None
        for name, dtype in dtypes.items():
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"weight file {file}: tensor {name} is stored as {dtype}; weights of a model folder are "
                    "float32, float16 or bfloat16 (quantized checkpoints: give a GGUF file)"
                )


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
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if files:
        return tuple(files)
    if any(folder.glob("*.bin")):
        raise FileNotFoundError(
            f"model folder {str(folder)!r} has only PyTorch .bin weights; pdkv reads *.safetensors "
            "(convert with transformers' save_pretrained(safe_serialization=True))"
        )
    raise FileNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")


def load_model(
    path: str | Path | ModelSource,
    *,
    dtype: torch.dtype,
    device: torch.device,
    kernel: QuantKernel | None = None,
    quantized: bool = False,
) -> LoadedModel:
    """Build the model for ``path`` on ``device`` in ``dtype`` and fill every parameter from its files.

    ``kernel``: the native linears (engine/native.py; None: torch's and oneDNN's).  With ``quantized`` a
    GGUF file's matrices of the kernels' types (engine/model/quant_blocks.py's KERNEL_TYPES) stay packed
    (engine/model/quantized.py); the other bfloat16 linears are packed for the native bfloat16 kernel where
    the build has it, else for oneDNN.  A weight with an inf or NaN -- a corrupt block -- is refused by
    name, packed or not."""
    import torch

    from engine.model.gguf import RawBlocks
    from engine.model.llama import LlamaForCausalLM
    from engine.model.packed import can_pack, pack_linears
    from engine.model.quant_blocks import KERNEL_TYPES, CorruptBlocks
    from engine.model.quantized import gather_packed, native_bf16_linears, quantize_model

    source = path if isinstance(path, ModelFolder | GGUFModel) else inspect_model(path)
    model = LlamaForCausalLM(source.config, dtype=dtype, device=device)
    expected = model.expected_weight_names()
    raw: dict[str, RawBlocks] = {}
    if quantized:
        assert kernel is not None and isinstance(source, GGUFModel)
        stream: Iterator[tuple[str, Any]] = source.weights_or_blocks(dtype, frozenset(KERNEL_TYPES))
    else:
        stream = source.weights(dtype)

    what = (
        f"GGUF file {str(source.path)!r}"
        if isinstance(source, GGUFModel)
        else f"model folder {str(source.path)!r}"
    )
    refusal = GGUFError if isinstance(source, GGUFModel) else ValueError

    def finite(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return finite_weights(pairs, what, refusal)

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            if isinstance(tensor, RawBlocks):
                raw[name] = tensor
            else:
                yield name, tensor

    try:
        loaded, unknown = model.load_weights(finite(dense()))
        if raw:
            assert kernel is not None
            try:
                consumed, rest = quantize_model(model, raw, kernel, dtype)
            except CorruptBlocks as exc:
                raise GGUFError(f"{what}: weight {exc}: corrupt") from exc
            more, unknown_more = model.load_weights(finite(rest))
            loaded |= consumed | more
            unknown |= unknown_more
    except ValueError as exc:  # a shape the config does not imply (llama.py): name the file it is in
        if str(exc).startswith(what):
            raise
        raise refusal(f"{what}: {exc}") from exc
    missing = expected - loaded
    if missing:
        raise ValueError(f"{what} is missing weights: {_few(missing)}")
    # Rotary caches and the like are not weights; anything else unknown means another architecture.
    unknown = {n for n in unknown if not n.endswith("rotary_emb.inv_freq")}
    if unknown:
        raise ValueError(f"{what} has weights a {source.config.architecture} does not use: {_few(unknown)}")
    model.eval()
    native_bf16 = (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and kernel is not None
        and kernel.bf16
        and os.environ.get(BF16_LINEARS_ENV) != "onednn"
    )
    if native_bf16:
        assert kernel is not None
        native_bf16_linears(model, kernel)  # bf16_linear.c: batch-invariant, 3x oneDNN at batch 1
    elif can_pack(dtype, device):
        pack_linears(model)  # bfloat16 on the CPU: oneDNN's blocked weights, reordered once (packed.py)
    if kernel is not None:
        gather_packed(model)  # one region, huge pages where the host gives them (4-9% off a decode step)
    return LoadedModel(
        model,
        source.config,
        source.fingerprint,
        source.path,
        dtype,
        device,
        quantized=bool(raw),
        bf16_tiles=native_bf16 and kernel is not None and kernel.amx,
        torch_linears=dtype == torch.bfloat16 and not native_bf16,
    )


def finite_weights(
    pairs: Iterable[tuple[str, torch.Tensor]], what: str, refusal: type[ValueError] = ValueError
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs``, refusing a weight with an inf or NaN (a corrupt block or file) by name: every load and
    every conversion reads its weights through this."""
    import torch

    for name, tensor in pairs:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise refusal(f"{what}: weight {name} has values that are not finite (inf or NaN): corrupt")
        yield name, tensor


def _few(names: set[str], limit: int = 5) -> str:
    ordered = sorted(names)
    more = f" (and {len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more
