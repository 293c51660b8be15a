"""The ``offload`` connector passes the conformance kit on each tier of the store, every hook given.

One redis-server (a real process on a free port) serves the whole module; every test gets its own
namespace of keys through its own ``tmp_path`` (the cpu tier's name, a disk folder, a Redis key prefix,
a store server of its own over a disk tier in that folder), so tests never see each other's blocks.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.registry import KVConnectorConfig
from connectors.testing import conformance_suite
from kvstore.server import StoreServer
from kvstore.store import TieredStore
from tests.connectors.test_conformance_builtins import unreachable
from tests.kvstore.kvtest import RedisProcess, free_port

SERVERS: dict[str, str] = {}
STORE_SERVERS: dict[Path, tuple[StoreServer, threading.Event, threading.Thread]] = {}


@pytest.fixture(scope="module", autouse=True)
def servers() -> Iterator[None]:
    redis = RedisProcess(free_port())
    redis.start()
    SERVERS.update(redis=f"127.0.0.1:{redis.port}")
    try:
        yield
    finally:
        for server, stop, thread in STORE_SERVERS.values():
            stop.set()
            thread.join()
            server.close()
            server.store.close()
        STORE_SERVERS.clear()
        redis.stop()


def store_server(shared: Path) -> str:
    """The endpoint of a store server of this test's own (in this process), over a disk tier in
    ``shared / "srv"``, so that ``corrupt`` can damage what it holds."""
    if shared not in STORE_SERVERS:
        store = TieredStore.from_config(f"disk:{shared / 'srv'}:64MiB")
        server = StoreServer(store, f"tcp://127.0.0.1:{free_port()}")
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        STORE_SERVERS[shared] = (server, stop, thread)
    return STORE_SERVERS[shared][0].endpoint


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


def corrupt_disk_tier(shared: Path, folder: str = "kv") -> None:
    """Flip one payload byte of every block file of the disk tier (its checksum no longer matches)."""
    files = sorted(p for p in (shared / folder).rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files, f"nothing was saved under {shared / folder}"
    for path in files:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))


def corrupt_cpu_tier(shared: Path) -> None:
    """Flip one payload byte of every block the test's named cpu tier holds, after its checksum was taken
    (a tier with ``verify=true`` then reports the block damaged)."""
    from connectors.offload import _SharedStores

    damaged = 0
    for (spec, _, _), store in list(_SharedStores._stores.items()):
        if f"name=cpu{tag(shared)}" not in spec:
            continue
        for tier in store.store.tiers:
            if tier.kind != "cpu":
                continue
            with tier._lock:  # type: ignore[attr-defined]
                for entry in tier._index.values():  # type: ignore[attr-defined]
                    tier._seal(entry)  # type: ignore[attr-defined]  # the checksum of the intact block
                    entry.slot.view[entry.nbytes - 3] ^= 0x40
                    damaged += 1
    assert damaged, "nothing was saved in the cpu tier"


def nowhere() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def cpu_spec(shared: Path, size: str = "64MiB") -> str:
    # verify=true: the kit damages blocks in memory (corrupt_cpu_tier); a tier that trusts its memory
    # would hand them out.
    return f"cpu:{size}?name=cpu{tag(shared)}&verify=true"


TestOffloadCpu = conformance_suite(
    lambda shared: offload(cpu_spec(shared)),
    corrupt=corrupt_cpu_tier,
    unreachable_factory=lambda shared: offload(cpu_spec(shared)),
    nothing_to_reach=True,  # in-process memory
)

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
    lambda shared: offload(f"remote:{store_server(shared)}?timeout_ms=500"),
    corrupt=lambda shared: corrupt_disk_tier(shared, "srv"),
    unreachable_factory=lambda shared: offload(f"remote:tcp://{nowhere()}?timeout_ms=300"),
)


def corrupt_both_tiers(shared: Path) -> None:
    corrupt_cpu_tier(shared)
    corrupt_disk_tier(shared)


TestOffloadCpuOverDisk = conformance_suite(
    lambda shared: offload(f"{cpu_spec(shared, '8MiB')},disk:{shared / 'kv'}:64MiB"),
    corrupt=corrupt_both_tiers,
    unreachable_factory=lambda shared: offload(
        f"{cpu_spec(shared, '8MiB')},disk:{unreachable(shared)}:64MiB"
    ),
    nothing_to_reach=True,  # the cpu tier above the dead disk is in-process memory, reachable by design
)
