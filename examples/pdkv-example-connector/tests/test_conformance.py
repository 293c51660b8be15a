"""The conformance kit against ``example-memory``: one line, plus the two hooks the kit requires (a way to
damage stored blocks, and a backend that cannot be reached -- for an in-process store, its own factory)."""

from pathlib import Path

from pdkv_example_connector import get_store

from connectors.registry import KVConnectorConfig
from connectors.testing import conformance_suite


def factory(shared: Path) -> KVConnectorConfig:
    return KVConnectorConfig("example-memory", {"store": str(shared)})


def damage(shared: Path) -> None:
    """Flip one byte of every block in the store the factory names."""
    blocks = get_store(str(shared)).blocks
    for key, block in blocks.items():
        blocks[key] = block._replace(payload=bytes([block.payload[0] ^ 1]) + block.payload[1:])


# In-process memory has nothing to reach: its own factory is the "unreachable" backend.
TestExampleMemory = conformance_suite(
    factory, corrupt=damage, unreachable_factory=factory, nothing_to_reach=True
)
