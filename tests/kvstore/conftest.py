"""Fixtures for the KV store tests (helpers live in ``kvtest``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvtest import BLOCK, Blocks, RedisProcess, StoreServerProcess, chain, free_port


@pytest.fixture
def make_blocks() -> Callable[..., Blocks]:
    def make(n: int, salt: int = 0, hash_size: int = 32) -> Blocks:
        generator = torch.Generator().manual_seed(1000 + salt)
        data = torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=generator)
        return Blocks(chain(n, salt, hash_size), data, torch.zeros_like(data))

    return make


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess(free_port())
    server.start()
    try:
        yield server
    finally:
        if server._proc is not None:
            server.resume()
        server.stop()


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[Callable[..., StoreServerProcess]]:
    started: list[StoreServerProcess] = []

    def start(
        spec: str = "cpu:1MiB", bind: str | None = None, extra: tuple[str, ...] = ()
    ) -> StoreServerProcess:
        server = StoreServerProcess(spec, bind or f"tcp://127.0.0.1:{free_port()}", extra)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()
