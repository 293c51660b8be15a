"""Fixtures the GGUF tests share (test_gguf.py, test_quantized.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_models import WRITTEN_TYPES, write_gguf
from tests.tiny_models import pdkv_tiny_model_dir


@pytest.fixture(scope="module")
def folder() -> Path:
    """A make-model folder with a real tokenizer, the source of the GGUF files below."""
    return pdkv_tiny_model_dir(init_std=0.2)  # spread-out logits: no near-ties in greedy picks


@pytest.fixture(scope="module")
def files(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``folder`` as a GGUF file per tensor type the ``gguf`` package writes, by type name."""
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(folder, root / f"tiny-{q}.gguf", qtype=q) for q in WRITTEN_TYPES}
