"""KV cache events: what a prefix-aware router consumes to know which node holds which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached.  ``token_ids`` covers exactly those blocks, in order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = "local"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted (their hashes are no longer findable here)."""

    block_hashes: list[BlockHash]
    medium: str = "local"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    medium: str = field(default="local")


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
