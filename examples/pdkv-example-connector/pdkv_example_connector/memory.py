"""``example-memory``: KV blocks in an in-process store -- a complete pdkv KV connector plugin.

    from connectors.registry import KVConnectorConfig
    config = KVConnectorConfig("example-memory", {"store": "team-a"})

Engines in one process whose configs name the same ``store`` share its blocks: what one computed, the
next loads instead of computing.  (A real plugin puts the store somewhere other processes reach: a
directory, a server.  Only ``MemoryStore`` would change.)

How the two halves split the work (the contract is the docstring of ``engine/connector/base.py``; plugins
import its names from ``connectors.base``):

- scheduler half: answers lookups from ``request.block_hashes`` (whole blocks, never the last token);
  after allocation, remembers which blocks to load; each step, puts in the metadata the blocks to load
  and the newly completed blocks to save.
- worker half: copies stored bytes into the paged cache in ``start_load_kv`` (before any layer reads
  them) and the step's completed blocks out in ``wait_for_save`` (after the forward pass).  Both are
  synchronous, so it never delays a free.  A stored block whose checksum no longer matches is a load
  error, reported, never raised: the engine recomputes from it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from connectors.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferParams,
)
from engine.request import Request, RequestId

if TYPE_CHECKING:
    import torch

    from engine.scheduler.output import SchedulerOutput


# -- the backend -------------------------------------------------------------------------------------------


class StoredBlock(NamedTuple):
    checksum: bytes  # of the payload when it was stored: a changed byte is caught at load
    payload: bytes  # the block's raw KV bytes: kv_cache[block_id], all layers' K and V


class MemoryStore:
    """Blocks by key.  Both halves of every engine naming this store read and write it, hence the lock."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, StoredBlock] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def put(self, key: bytes, payload: bytes) -> None:
        with self._lock:
            self.blocks[key] = StoredBlock(_checksum(payload), payload)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self.blocks.pop(key, None)

    def get(self, key: bytes) -> bytes | None:
        """The payload, or None if the key is unknown or the bytes changed since they were stored."""
        with self._lock:
            block = self.blocks.get(key)
        if block is None or _checksum(block.payload) != block.checksum:
            return None
        return block.payload


_STORES: dict[str, MemoryStore] = {}
_STORES_LOCK = threading.Lock()


def get_store(name: str) -> MemoryStore:
    """The process-wide store called ``name`` (created on first use)."""
    with _STORES_LOCK:
        return _STORES.setdefault(name, MemoryStore())


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


# -- the connector -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryOptions:
    """The connector's options, validated by ``parse_options``: an unknown key is an error naming it."""

    store: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError("connector 'example-memory': option 'store' must be a non-empty string")


@dataclass
class MemoryMetadata(KVConnectorMetadata):
    """What the worker half does this step (the only thing the scheduler half tells it)."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, block hash): read in
    saves: list[tuple[str, int, bytes]] = field(default_factory=list)  # (request, block id, hash): write out
    tables: dict[str, list[int]] = field(default_factory=dict)  # the block table of each request saving


class MemoryConnector(KVConnectorBase):
    name = "example-memory"
    Options = MemoryOptions

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)  # validates options into self.options
        self.store = get_store(self.options.store)
        self.block_size = context.block_size
        # A block hash already names the model, the block size and what makes KV bits differ (the dtype
        # among them: docs/hashing.md); the key adds the cache's layout anyway (rule 7), so a store read by
        # engines of another geometry never hands them bytes of the wrong shape, whatever the hash says.
        spec = context.spec
        geometry = f"{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
        self._key_prefix = f"{context.namespace.namespace_id}/{spec.dtype}/{geometry}/".encode()
        # scheduler half
        self._saved_upto: dict[RequestId, int] = {}  # blocks [0, n) of the request are in the store
        self._pending_loads: list[tuple[int, bytes]] = []
        # worker half
        self._kv: torch.Tensor | None = None
        self._load_errors: set[int] = set()

    def _key(self, block_hash: bytes) -> bytes:
        return self._key_prefix + block_hash

    # ---------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # never the last token
        n = 0
        for block_hash in request.block_hashes[first:last]:  # contiguous: the first miss ends the hit
            if self._key(block_hash) not in self.store:
                break
            n += 1
        return n * bs, False  # False: loaded inside the next forward pass, no waiting across steps

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        first = request.num_computed_tokens // self.block_size  # the local hit ends here
        n = num_external_tokens // self.block_size
        for i in range(first, first + n):
            self._pending_loads.append((block_ids[i], request.block_hashes[i]))
        self._saved_upto[request.request_id] = first + n  # what it hit locally or loads is stored already

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MemoryMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for sr in scheduler_output.scheduled:
            if sr.request_id not in self._saved_upto:
                continue
            # Blocks whose every token has KV once this step's forward pass is done (sr.block_hashes is
            # the request's list of block hashes: block i of sr.block_ids is stored under hash i).
            full = min((sr.start_position + sr.num_tokens) // self.block_size, len(sr.block_hashes))
            # From where the last save stopped, or from where this step starts if that is earlier: after a
            # failed load the engine recomputes from the bad block, and those blocks are saved again.
            saved = self._saved_upto[sr.request_id]
            start = min(saved, sr.start_position // self.block_size)
            meta.saves.extend(
                (sr.request_id, sr.block_ids[i], sr.block_hashes[i]) for i in range(start, full)
            )
            if start < full:
                meta.tables[sr.request_id] = list(sr.block_ids)
            self._saved_upto[sr.request_id] = max(saved, full)
        return meta

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._saved_upto.pop(request.request_id, None)
        return False, None  # saves are synchronous: nothing reads the blocks after this step

    # ---------------------------------------------------------------- worker half

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self._kv = kv_cache  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        import torch

        assert isinstance(metadata, MemoryMetadata) and self._kv is not None
        block_shape = self._kv.shape[1:]
        nbytes = self._kv[0].numel() * self._kv.element_size()
        for block_id, block_hash in metadata.loads:
            payload = self.store.get(self._key(block_hash))
            if payload is None or len(payload) != nbytes:
                self._load_errors.add(block_id)  # reported, never raised: the engine recomputes it
                self.store.discard(self._key(block_hash))  # so the recomputed block is stored again
                continue
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self._kv[block_id].copy_(raw.view(self._kv.dtype).view(block_shape))

    def wait_for_save(self) -> None:
        import torch

        meta = self.step_metadata  # this step's metadata, as start_load_kv got it
        if not isinstance(meta, MemoryMetadata) or self._kv is None:
            return
        # A request holding a block whose load failed this step computed its new blocks over bad KV: saving
        # them would hand every later reader wrong KV.  They are saved after the engine recomputes them.
        tainted = {rid for rid, ids in meta.tables.items() if not self._load_errors.isdisjoint(ids)}
        for rid, block_id, block_hash in meta.saves:
            if rid in tainted:
                continue
            key = self._key(block_hash)
            if key in self.store:
                continue  # content-addressed: the same hash is the same KV
            block = self._kv[block_id].cpu().contiguous()
            self.store.put(key, block.view(torch.uint8).numpy().tobytes())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
