"""``pdkv convert-gguf FILE OUT_DIR``: a GGUF model as a Hugging Face folder transformers (and pdkv) load.

Writes, into a temporary sibling renamed into place at the end (a reader never sees half a folder):

    config.json              the ``llama.*`` metadata as a Hugging Face config
    model.safetensors        every tensor dequantized to ``dtype`` (float32 keeps Q4/Q8 values exactly)
    tokenizer.json           the tokenizer built from ``tokenizer.ggml.*``
    tokenizer_config.json    special tokens and ``chat_template``
    generation_config.json   bos / eos ids
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def convert_gguf(path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    import torch
    from safetensors.torch import save_file

    from engine.model.gguf import inspect_gguf
    from engine.model.gguf_tokenizer import build_gguf_tokenizer
    from engine.model.loader import finite_weights

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {str(out)!r} is a file, not a folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT_DIR {str(out)!r} already exists and is not empty")
    model = inspect_gguf(path)  # every check before any weight is read
    tokenizer = build_gguf_tokenizer(model.tokenizer, source=str(model.path))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:  # a file in the way, no permission, a read-only place
        raise ValueError(f"OUT_DIR {str(out)!r} cannot be made there: {exc.strerror or exc}") from None
    try:
        weights = finite_weights(model.weights(getattr(torch, dtype)), f"GGUF file {str(model.path)!r}")
        tensors = {name: t.contiguous() for name, t in weights}  # a corrupt block: refused, as at load
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {**model.hf_config, "torch_dtype": dtype}
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(model, config))
        gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        _write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tokenizer_config(model: Any, config: dict[str, Any]) -> dict[str, Any]:
    spec = model.tokenizer

    def token(i: int | None) -> str | None:
        return None if i is None else spec.tokens[i]

    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(spec.bos_token_id),
        "eos_token": token(spec.eos_token_id),
        "unk_token": token(spec.unk_token_id),
        "pad_token": token(spec.pad_token_id),
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": spec.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if model.chat_template is not None:
        out["chat_template"] = model.chat_template
    return {k: v for k, v in out.items() if v is not None}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
