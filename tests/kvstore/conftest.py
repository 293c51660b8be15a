"""Fixtures for the KV store tests (helpers live in ``kvtest``; server fixtures in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvtest import BLOCK, Blocks, chain


@pytest.fixture
def make_blocks() -> Callable[..., Blocks]:
    def make(n: int, salt: int = 0, hash_size: int = 32) -> Blocks:
        generator = torch.Generator().manual_seed(1000 + salt)
        data = torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=generator)
        return Blocks(chain(n, salt, hash_size), data, torch.zeros_like(data))

    return make
