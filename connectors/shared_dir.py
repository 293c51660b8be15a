"""``shared-dir``: KV blocks as files in a plain directory.  The connector to copy when writing your own.

Options: ``{"path": "/some/dir"}`` (created if missing; if it cannot be, lookups miss and saves are
skipped with a warning: an engine still serves while the share is down).  Any number of engines, in any
number of processes, may share the directory: a block another engine saved is a hit here.

Layout on disk (one file per block, written atomically: temp file + rename, so a reader never sees a
half-written block)::

    <path>/<namespace id>/<dtype>-<layers>x<kv heads>x<head dim>/<hash hex[:2]>/<block hash hex>.kv
        = kvstore block codec: a 96-byte header (magic, namespace, block hash, layout, checksums)
          followed by the block's payload: kv_cache[block_id], all layers' K and V

The namespace id names the model and the block size; the folder below it, the cache's dtype and geometry,
so engines running one model in two dtypes share a directory without reading (or replacing) each other's
blocks.

How the halves split the work:

- scheduler half: looks up ``request.block_hashes`` as file names (whole blocks, contiguous, never the
  last token); remembers which blocks to load after allocation; each step, lists in the metadata the
  newly completed full blocks to save and the blocks to load.
- worker half: loads synchronously in ``start_load_kv`` (before any layer reads) and saves
  synchronously in ``wait_for_save`` (after the forward), so it never holds blocks.
  A file that is missing, truncated, corrupt or for another model/layout is a load error, reported
  through ``get_block_ids_with_load_errors`` -- the engine recomputes from there -- and a damaged file
  is removed, so the block is saved again, good, after it is recomputed.  Blocks computed in a step whose
  load failed under them are not saved (their KV attended to the bad block).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.connector.base import ConnectorContext, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.connector.params import KVTransferParams
from engine.hashing import BlockHash
from engine.request import Request, RequestId

if TYPE_CHECKING:
    import torch

    from engine.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedDirOptions:
    path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("connector 'shared-dir': option 'path' must name a directory")


@dataclass
class SharedDirMetadata(KVConnectorMetadata):
    loads: list[tuple[int, BlockHash]] = field(default_factory=list)  # (block id, hash) to read now
    # (request, block id, hash) to write after the forward, and the block table of each such request
    saves: list[tuple[RequestId, int, BlockHash]] = field(default_factory=list)
    tables: dict[RequestId, list[int]] = field(default_factory=dict)


class SharedDirConnector(KVConnectorBase):
    name = "shared-dir"
    Options = SharedDirOptions

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        spec = context.spec
        layout = (
            f"{str(spec.dtype).removeprefix('torch.')}-{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
        )
        self.dir = Path(self.options.path) / context.namespace.namespace_id / layout
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a share that is down costs hits, never the engine (contract rule 3)
            logger.warning(
                "shared-dir: cannot create %s (%s): every lookup misses until it can", self.dir, exc
            )
        self.block_size = context.block_size
        # scheduler half
        self._requests: dict[RequestId, Request] = {}
        self._saved_upto: dict[RequestId, int] = {}  # blocks [0, n) of the request are in the directory
        self._pending_loads: list[tuple[int, BlockHash]] = []
        # worker half
        self._kv: torch.Tensor | None = None
        self._codec: Any = None
        self._load_errors: set[int] = set()

    def _file(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}.kv"

    # ---------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # never the last token
        n = 0
        for h in request.block_hashes[first:last]:
            if not self._file(h).is_file():
                break
            n += 1
        return n * bs, False

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        bs = self.block_size
        first = request.num_computed_tokens // bs
        n = num_external_tokens // bs
        for i in range(first, first + n):
            self._pending_loads.append((block_ids[i], request.block_hashes[i]))
        self._requests[request.request_id] = request
        self._saved_upto[request.request_id] = first + n

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SharedDirMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for sr in scheduler_output.scheduled:
            request = self._requests.get(sr.request_id)
            if request is None:
                continue
            # Blocks whose every token has KV once this step's forward is done.
            full = min((sr.start_position + sr.num_tokens) // self.block_size, len(request.block_hashes))
            # Normally from where the last save stopped; from where this step starts when that is earlier:
            # blocks whose load failed are recomputed now, and their bad files were removed.
            saved = self._saved_upto.get(sr.request_id, 0)
            start = min(saved, sr.start_position // self.block_size)
            for i in range(start, full):
                meta.saves.append((sr.request_id, sr.block_ids[i], request.block_hashes[i]))
            if start < full:
                meta.tables[sr.request_id] = list(sr.block_ids)
            self._saved_upto[sr.request_id] = max(saved, full)
        return meta

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._requests.pop(request.request_id, None)
        self._saved_upto.pop(request.request_id, None)
        return False, None  # saves are synchronous: nothing reads the blocks after the step

    # ---------------------------------------------------------------- worker half

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        from wire.codec import BlockCodec
        from wire.layout import BlockLayout

        self._kv = kv_cache
        self._codec = BlockCodec(self.context.namespace.namespace_id, BlockLayout.from_kv_cache(kv_cache))

    def _block_bytes(self, block_id: int) -> memoryview:
        """The engine's block ``block_id`` as a writable byte view (no copy): ``[L, 2, bs, H, D]`` raw."""
        assert self._kv is not None, "register_kv_caches was not called"
        import torch

        return memoryview(self._kv[block_id].view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, SharedDirMetadata)
        for block_id, block_hash in metadata.loads:
            try:
                data = self._file(block_hash).read_bytes()
            except OSError as exc:
                logger.warning("shared-dir: cannot read block %s: %s", block_hash.hex()[:16], exc)
                self._load_errors.add(block_id)
                continue
            reason = self._codec.decode_into(block_hash, data, self._block_bytes(block_id))
            if reason is not None:
                logger.warning("shared-dir: block %s is a miss: %s", block_hash.hex()[:16], reason.value)
                self._load_errors.add(block_id)
                self._remove_bad_file(block_hash)

    def _remove_bad_file(self, block_hash: bytes) -> None:
        """A file that failed its checks helps nobody: remove it, so the next save of the block (this
        engine's, after it recomputes it, or another's) writes a good one instead of keeping the bad one."""
        try:
            self._file(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("shared-dir: cannot remove bad block file %s: %s", block_hash.hex()[:16], exc)

    def wait_for_save(self) -> None:
        meta = self.step_metadata  # what start_load_kv got this step (None outside a step)
        if isinstance(meta, SharedDirMetadata):
            self._save_blocks(meta)

    def _save_blocks(self, meta: SharedDirMetadata) -> None:
        # A request whose blocks include one that failed to load this step computed its new blocks over
        # bad KV: they are not saved (the engine recomputes from the bad block, and they are saved then).
        tainted = {rid for rid, ids in meta.tables.items() if not self._load_errors.isdisjoint(ids)}
        for rid, block_id, block_hash in meta.saves:
            if rid in tainted:
                continue
            path = self._file(block_hash)
            if path.exists():
                continue  # content-addressed: the same hash is the same KV
            try:
                self._write_atomically(path, block_hash, self._block_bytes(block_id))
            except OSError as exc:  # a full or read-only disk costs us the save, never the request
                logger.warning("shared-dir: cannot save block %s: %s", block_hash.hex()[:16], exc)

    def _write_atomically(self, path: Path, block_hash: bytes, payload: memoryview) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._codec.header_of(block_hash, payload))
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
