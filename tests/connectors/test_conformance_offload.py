"""The ``offload`` connector passes the conformance kit on each tier of the store.

One redis-server and one store server (real processes on free ports) serve the whole module; every
test gets its own namespace of keys through its own ``tmp_path`` (the cpu tier's name, a disk folder, a
Redis key prefix), so tests never see each other's blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.registry import KVConnectorConfig
from connectors.testing import conformance_suite
from tests.connectors.test_conformance_builtins import unreachable
from tests.kvstore.kvtest import RedisProcess, StoreServerProcess, free_port

SERVERS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def servers() -> Iterator[None]:
    redis = RedisProcess(free_port())
    redis.start()
    store = StoreServerProcess("cpu:256MiB", f"tcp://127.0.0.1:{free_port()}", ())
    store.start()
    SERVERS.update(redis=f"127.0.0.1:{redis.port}", remote=store.endpoint)
    try:
        yield
    finally:
        store.kill()
        redis.stop()


def tag(shared: Path) -> str:
    return hashlib.sha256(str(shared).encode()).hexdigest()[:12]


def offload(spec: str) -> KVConnectorConfig:
    return KVConnectorConfig("offload", {"kv_store": spec, "lookup_timeout_s": 1.0, "load_timeout_s": 2.0})


def redis_spec(shared: Path, address: str | None = None) -> str:
    return f"redis://{address or SERVERS['redis']}/0?prefix=t{tag(shared)}&timeout_ms=300"


def corrupt_redis_values(shared: Path) -> None:
    import redis

    host, port = SERVERS["redis"].split(":")
    client = redis.Redis(host=host, port=int(port))
    keys = list(client.scan_iter(match=f"t{tag(shared)}*".encode(), count=1000))
    assert keys, "nothing was saved in Redis"
    for key in keys:
        value = bytearray(client.get(key) or b"")
        value[-3] ^= 0x40
        client.set(key, bytes(value))


def corrupt_disk_tier(shared: Path) -> None:
    """Flip one payload byte of every block file of the disk tier (its checksum no longer matches)."""
    files = sorted(p for p in (shared / "kv").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files, f"nothing was saved under {shared / 'kv'}"
    for path in files:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))


def nowhere() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


TestOffloadCpu = conformance_suite(lambda shared: offload(f"cpu:64MiB?name=cpu{tag(shared)}"))

TestOffloadDisk = conformance_suite(
    lambda shared: offload(f"disk:{shared / 'kv'}:64MiB"),
    corrupt=corrupt_disk_tier,
    unreachable_factory=lambda shared: offload(f"disk:{unreachable(shared)}:64MiB"),
)

TestOffloadRedis = conformance_suite(
    lambda shared: offload(redis_spec(shared)),
    corrupt=corrupt_redis_values,
    unreachable_factory=lambda shared: offload(redis_spec(shared, nowhere())),
)

TestOffloadRemote = conformance_suite(
    lambda shared: offload(f"remote:{SERVERS['remote']}?timeout_ms=500"),
    unreachable_factory=lambda shared: offload(f"remote:tcp://{nowhere()}?timeout_ms=300"),
)

TestOffloadCpuOverDisk = conformance_suite(
    # No corrupt hook: the cpu tier in front keeps intact copies of what the disk tier holds.
    lambda shared: offload(f"cpu:8MiB?name=cpu{tag(shared)},disk:{shared / 'kv'}:64MiB"),
)
