"""The conformance kit against ``example-memory``: one line (plus an optional hook that damages data)."""

from pathlib import Path

from pdkv_example_connector import get_store

from connectors.registry import KVConnectorConfig
from connectors.testing import conformance_suite


def damage(shared: Path) -> None:
    """Flip one byte of every block in the store the factory below names."""
    blocks = get_store(str(shared)).blocks
    for key, block in blocks.items():
        blocks[key] = block._replace(payload=bytes([block.payload[0] ^ 1]) + block.payload[1:])


def evict(shared: Path, block_hash: bytes) -> None:
    """Remove the one block ``block_hash`` from the store the factory below names."""
    blocks = get_store(str(shared)).blocks
    for key in [k for k in blocks if k.endswith(block_hash)]:
        del blocks[key]


TestExampleMemory = conformance_suite(
    lambda shared: KVConnectorConfig("example-memory", {"store": str(shared)}), corrupt=damage, evict=evict
)
