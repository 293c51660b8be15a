"""The router's tokenizer: the nodes' model folder's, loaded without the model (no torch import)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.model.config import ModelConfig
from engine.tokenizer import Tokenizer


def model_folder(model: str | None) -> Path:
    """``model``, or the embedded default model's folder (written on first use, as the nodes do)."""
    if model is not None:
        return Path(model).expanduser()
    from engine.model.make_model import ensure_default_model  # imports torch: only for the default

    return ensure_default_model()


def load_tokenizer(folder: Path) -> tuple[Tokenizer, int]:
    """The tokenizer of ``folder`` and the model's vocabulary size (token ids are checked against it)."""
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read the model config ({exc})") from exc
    config = ModelConfig.from_hf(raw, source=str(config_path))
    tokenizer = Tokenizer.from_folder(
        folder,
        vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
    )
    return tokenizer, config.vocab_size
