"""The router's tokenizer: the nodes' model's (folder or GGUF), loaded without the weights (no torch)."""

from __future__ import annotations

from pathlib import Path

from engine.model.loader import inspect_model
from engine.tokenizer import Tokenizer


def model_path(model: str | None) -> Path:
    """``model``, or the embedded default model's file (fetched on first use, as the nodes do)."""
    if model is not None:
        return Path(model).expanduser()
    from engine.model.embedded import ensure_default_model

    return ensure_default_model()


def load_tokenizer(path: Path) -> tuple[Tokenizer, int]:
    """The tokenizer of the model at ``path`` and its vocabulary size (token ids are checked against it)."""
    source = inspect_model(path)
    return Tokenizer.for_model(source), source.config.vocab_size
