"""Helpers for the KV store tests: a tiny layout, block factories, and real servers on free ports.

Every server a test needs (redis-server, a Redis Cluster, the store server) is started on a free port and
waited for with a deadline; the machine's own Redis on 6379 is never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstore.results import Unit
from wire.codec import BlockCodec
from wire.keys import KeyRun
from wire.layout import BlockLayout

# 2 layers x 2 (K, V) x 4 tokens x 2 heads x 8 dims x 2 bytes = 512 bytes per block: big enough to be a
# real payload, small enough that capacities in tests are counted in blocks.
LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
BLOCK = LAYOUT.payload_nbytes
NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(1, 17))


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chain(n: int, salt: int = 0, size: int = 32) -> list[bytes]:
    """``n`` distinct, random-looking block hashes (stand-ins for ``Request.block_hashes``)."""
    return [hashlib.sha256(b"%d:%d" % (salt, i)).digest()[:size] for i in range(n)]


@dataclass
class Blocks:
    """``n`` engine blocks with deterministic contents, their hashes, and a zeroed destination."""

    hashes: list[bytes]
    data: torch.Tensor  # [n, BLOCK] uint8
    out: torch.Tensor  # [n, BLOCK] uint8, zeroed

    @property
    def views(self) -> list[memoryview]:
        return [memoryview(self.data[i].numpy()) for i in range(len(self.hashes))]  # type: ignore[arg-type]

    @property
    def out_views(self) -> list[memoryview]:
        return [memoryview(self.out[i].numpy()) for i in range(len(self.hashes))]  # type: ignore[arg-type]

    def run(self, start: int = 0, stop: int | None = None, namespace: bytes = NAMESPACE) -> KeyRun:
        return KeyRun.of_chain(namespace, self.hashes, start, stop)

    def units(self, start: int = 0, stop: int | None = None, namespace: bytes = NAMESPACE) -> list[Unit]:
        codec = BlockCodec(namespace, LAYOUT)
        stop = len(self.hashes) if stop is None else stop
        return [
            Unit(self.views[i].toreadonly(), sealer=codec.sealer(self.hashes[i])) for i in range(start, stop)
        ]

    def loaded(self, count: int, start: int = 0) -> bool:
        """The first ``count`` output blocks equal blocks ``start..`` of the data."""
        return torch.equal(self.out[:count], self.data[start : start + count])


# ---- redis -------------------------------------------------------------------------------------------------

REDIS_SERVER = shutil.which("redis-server")
requires_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="needs a redis-server binary")


class RedisProcess:
    """A redis-server of our own on a free port, which a test may stop and start again."""

    def __init__(self, port: int, extra: tuple[str, ...] = ()) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._extra = extra
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self._proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self._extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self.ping, 10.0, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    def pause(self) -> None:
        """Freeze the server (it keeps its socket: clients hang rather than being refused)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(port=self.port)


# ---- the store server ------------------------------------------------------------------------------------


class StoreServerProcess:
    """``python -m kvstore.server`` as a child process; ``endpoint`` is where it serves."""

    def __init__(self, spec: str, bind: str, extra: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.bind = bind
        self.extra = extra
        self.endpoint = ""
        self.metrics = ""
        self.kv_events = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore.server",
                "--kv-store",
                self.spec,
                "--bind",
                self.bind,
                *self.extra,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # the readiness line, or "" if it died
        assert line.startswith("pdkv kvstore: serving on "), f"store server did not start: {line!r}"
        self.endpoint, *rest = line.removeprefix("pdkv kvstore: serving on ").split()
        # "metrics=HOST:PORT" when started with --metrics-address
        self.metrics = next((w.removeprefix("metrics=") for w in rest if w.startswith("metrics=")), "")
        # "kv_events=PUB,REPLAY" when started with --kv-events
        self.kv_events = next((w.removeprefix("kv_events=") for w in rest if w.startswith("kv_events=")), "")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(10)
        self.proc = None
        return code
