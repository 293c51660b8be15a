"""The router's tokenizer: the nodes' model's (folder or GGUF), loaded without the weights (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from engine.model.loader import inspect_model
from engine.structured import GrammarCompiler
from engine.tokenizer import Tokenizer


def model_path(model: str | None) -> Path:
    """``model``, or the embedded default model's file (fetched on first use, as the nodes do)."""
    if model is not None:
        return Path(model).expanduser()
    from engine.model.embedded import ensure_default_model

    return ensure_default_model()


@dataclass(frozen=True)
class RouterModel:
    """What the router knows of the nodes' model: its tokenizer (with the chat template) and shape."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The model's one grammar compiler (engine/structured.py): admission's constraint checks and the
        answers' token bytes share its vocabulary table (~0.3 s to build) and its cache."""
        return GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)


def load_model(path: Path, name: str | None = None, max_model_len: int | None = None) -> RouterModel:
    """The model at ``path`` without its weights; ``name`` is what clients call it (default: the file's
    stem or the folder's name; the embedded model is SmolLM2-135M-Instruct); ``max_model_len``: the
    nodes' context when they were given one shorter than the model's (the engine refuses a longer one)."""
    from engine.model.embedded import model_name

    source = inspect_model(path)
    c = source.config
    context = c.max_position_embeddings
    if max_model_len is not None:
        if max_model_len > context:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {context}"
            )
        context = max_model_len
    return RouterModel(
        name or model_name(path), Tokenizer.for_model(source), c.vocab_size, context, c.eos_token_ids
    )
