"""Fixtures shared by every test folder: real servers on free ports, started and stopped per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kvstore.kvtest import RedisProcess, StoreServerProcess, free_port


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
