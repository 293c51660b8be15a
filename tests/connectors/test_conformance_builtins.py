"""Our built-in connectors pass the conformance kit (``connectors.testing``), run the way a plugin author
runs it: one ``conformance_suite(...)`` line per connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from connectors.registry import KVConnectorConfig
from connectors.testing import conformance_suite


def shared_dir(path: Path) -> dict[str, Any]:
    return {"name": "shared-dir", "options": {"path": str(path)}}


def unreachable(shared: Path, name: str = "kv") -> Path:
    """A path that can never be a directory: its parent is a regular file."""
    blocker = shared / "not-a-directory"
    blocker.touch()
    return blocker / name


def evict_block_file(shared: Path, block_hash: bytes) -> None:
    """Remove the one block ``block_hash`` from every shared-dir under ``shared``."""
    files = list(shared.rglob(f"{block_hash.hex()}.kv"))
    assert files, f"block {block_hash.hex()[:16]} was never saved under {shared}"
    for path in files:
        path.unlink()


def corrupt_block_files(shared: Path) -> None:
    """Flip one payload byte of every block file under ``shared`` (the checksum no longer matches)."""
    files = sorted(shared.rglob("*.kv"))
    assert files, f"nothing was saved under {shared}"
    for path in files:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))


def multi(*children: dict[str, Any]) -> KVConnectorConfig:
    return KVConnectorConfig("multi", {"connectors": list(children)})


TestNull = conformance_suite(
    lambda shared: KVConnectorConfig("null"),
    provides_hits=False,
    unreachable_factory=lambda shared: KVConnectorConfig("null"),  # no backend: nothing to reach
)

TestSharedDir = conformance_suite(
    lambda shared: KVConnectorConfig("shared-dir", {"path": str(shared / "kv")}),
    corrupt=corrupt_block_files,
    evict=evict_block_file,
    unreachable_factory=lambda shared: KVConnectorConfig("shared-dir", {"path": str(unreachable(shared))}),
)

TestMultiSharedDirAndNull = conformance_suite(
    lambda shared: multi(shared_dir(shared / "kv"), {"name": "null"}),
    corrupt=corrupt_block_files,
    evict=evict_block_file,
    unreachable_factory=lambda shared: multi(shared_dir(unreachable(shared)), {"name": "null"}),
)

TestMultiTwoSharedDirs = conformance_suite(
    lambda shared: multi(shared_dir(shared / "a"), shared_dir(shared / "b")),
    corrupt=corrupt_block_files,
    evict=evict_block_file,
    unreachable_factory=lambda shared: multi(
        shared_dir(unreachable(shared, "a")), shared_dir(unreachable(shared, "b"))
    ),
)
