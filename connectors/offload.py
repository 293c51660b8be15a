"""``offload``: the engine's KV blocks in the tiered store (CPU, disk, Redis, a store server).

Options::

    {"kv_store": "cpu:4GiB,disk:/var/cache/pdkv:64GiB",   # kvstore's --kv-store string (required)
     "lookup_timeout_s": 0.2,   # an unanswered lookup counts as zero hits after this long
     "load_timeout_s": 5.0,     # a load that does not finish in time: its missing blocks are load errors
     "save_timeout_s": 5.0}     # a save that does not finish in time is dropped (and counted)

How the halves split the work:

- scheduler half: ``get_num_new_matched_tokens`` asks the store, from ``request.block_hashes`` alone,
  how many blocks past the local hit it holds.  The lookup runs off the step loop (``lookup_async``):
  until the answer is in the call returns ``None`` ("ask next step"); past ``lookup_timeout_s`` it is
  zero hits.  After allocation it remembers which blocks to load; each step it lists in the metadata the
  loads and the blocks that became full (to save).
- worker half: loads in ``start_load_kv``, before any layer reads the cache (blocks are stored whole,
  all layers together, so one read per block; the store's read path writes straight into the block).
  A block the store cannot return (evicted since the lookup, corrupt, another layout, a tier timing out)
  is a load error: the engine recomputes from it.  Saves run on a background thread after the forward
  (``wait_for_save`` only queues them), so they never stall the step.  A preempted request's saves finish
  in ``handle_preemptions``, before the forward may overwrite its blocks; a finished request with saves in
  flight is held until they are done (``finished_sending``), and a hold the engine stops (abort, deadline)
  drops the queued saves and waits for the running one before reporting it.  A cache on a GPU moves
  through pinned host staging on a CUDA stream of its own, ordered with the forward by events
  (``connectors/staging.py``): loads land before the forward reads them, saves copy out before any later
  forward can overwrite the blocks.

Every engine of a process -- and both halves of each -- uses one store instance per configuration
(``_SharedStores``): the store is the shared backend, as a store server would be; the halves still talk
only through metadata and the worker's report.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from engine.connector.base import (
    ConnectorContext,
    ConnectorStats,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from engine.connector.params import KVTransferParams
from engine.hashing import BlockHash
from engine.metrics import SPECS
from engine.request import Request, RequestId
from telemetry.metrics import Histogram

if TYPE_CHECKING:
    import torch

    from connectors.staging import BlockStager, StagedBlocks
    from engine.scheduler.output import SchedulerOutput
    from kvstore.engine_view import KVStore

logger = logging.getLogger(__name__)


# Saves of a GPU cache waiting for the store, each holding a pinned host copy of its blocks.
MAX_STAGED_SAVES = 64


@dataclass(frozen=True)
class OffloadOptions:
    kv_store: str = ""
    lookup_timeout_s: float = 0.2
    load_timeout_s: float = 5.0
    save_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.kv_store, str) or not self.kv_store:
            raise ValueError(
                "connector 'offload': option 'kv_store' must be a --kv-store string, e.g. 'cpu:1GiB'"
            )
        for name in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"connector 'offload': option {name!r} must be a positive number, got {value!r}"
                )


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Blocks ``[start, start + len(block_ids))`` of one request: engine block ids and their chain."""

    request_id: RequestId
    block_ids: list[int]
    hashes: list[BlockHash]  # the request's chain from block 0 up to start + len(block_ids)
    start: int


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


class _SharedStores:
    """One open ``KVStore`` per (config, namespace, layout) per process, open until the process exits.

    The store is a process-wide resource, like a connection pool: every engine (and both halves of each)
    in the process attaches to the same one, so a ``cpu`` tier filled by one engine serves the next one
    even after the first has shut down.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _stores: ClassVar[dict[tuple[str, str, Any], KVStore]] = {}

    @classmethod
    def acquire(cls, spec: str, namespace_id: str, layout: Any) -> KVStore:
        from kvstore.engine_view import KVStore

        key = (spec, namespace_id, layout)
        with cls._lock:
            store = cls._stores.get(key)
            if store is None:
                store = KVStore.open(spec, namespace_id=namespace_id, layout=layout)
                if not cls._stores:
                    atexit.register(cls.close_all)
                cls._stores[key] = store
            return store

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            stores, cls._stores = list(cls._stores.values()), {}
        for store in stores:
            store.close()


@dataclass
class _Lookup:
    start: int
    limit: int
    future: Future[int]
    deadline: float
    answer: int | None = None


class OffloadConnector(KVConnectorBase):
    name = "offload"
    Options = OffloadOptions

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        from wire.layout import BlockLayout

        self.layout = BlockLayout.from_spec(context.spec)
        self.store = _SharedStores.acquire(self.options.kv_store, context.namespace.namespace_id, self.layout)
        self.block_size = context.block_size
        # scheduler half
        self._lookups: dict[RequestId, _Lookup] = {}
        self._requests: dict[RequestId, Request] = {}
        self._saved_upto: dict[RequestId, int] = {}
        self._had_saves: set[RequestId] = set()
        self._pending_loads: list[BlockRun] = []
        self._block_tables: dict[RequestId, list[int]] = {}  # as of the last step, to map load errors
        self.num_lookup_timeouts = 0
        # worker half
        self._kv: torch.Tensor | None = None
        self._stager: BlockStager | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._saves_in_flight: dict[RequestId, list[Future[Any]]] = {}
        self._awaiting_release: set[RequestId] = set()
        self._load_errors: set[int] = set()
        self._failed_loads: set[RequestId] = set()
        self._load_seconds = Histogram(SPECS["kv_load_seconds"])  # one observation per load run
        self.stats_counters = {
            "blocks_loaded": 0,
            "blocks_load_failed": 0,
            "blocks_saved": 0,
            "saves_failed": 0,
            "saves_skipped": 0,
        }

    # ---------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # never the last token
        if start >= limit:
            return 0, False
        rid = request.request_id
        lookup = self._lookups.get(rid)
        if lookup is None or (lookup.start, lookup.limit) != (start, limit):
            # Asking again for the same range reuses the answer: repeated calls are idempotent.
            future = self.store.lookup_async(
                request.block_hashes[:limit], start, timeout_s=self.options.lookup_timeout_s
            )
            lookup = _Lookup(start, limit, future, time.monotonic() + self.options.lookup_timeout_s)
            self._lookups[rid] = lookup
        if lookup.answer is None:
            if lookup.future.done():
                try:
                    lookup.answer = max(0, min(int(lookup.future.result()), limit - start))
                except Exception:  # the store reports failures as misses; anything else is a miss too
                    logger.exception("offload: lookup failed")
                    lookup.answer = 0
            elif time.monotonic() >= lookup.deadline:
                self.num_lookup_timeouts += 1
                lookup.answer = 0
            else:
                return None, False
        return lookup.answer * bs, False

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        bs = self.block_size
        first = request.num_computed_tokens // bs
        n = num_external_tokens // bs
        if n:
            self._pending_loads.append(
                BlockRun(
                    rid, list(block_ids[first : first + n]), list(request.block_hashes[: first + n]), first
                )
            )
        self._lookups.pop(rid, None)
        self._requests[rid] = request
        self._block_tables[rid] = list(block_ids)
        # Never saved from here: blocks that were local hits or that this connector loads (they are in
        # the store), and blocks another connector loaded for the request (under multi, where this one
        # is told 0): if that load failed, the step computed over them, and such KV is never stored.
        loaded_elsewhere_end = (request.num_local_cached_tokens + request.num_external_computed_tokens) // bs
        self._saved_upto[rid] = max(first + n, loaded_elsewhere_end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OffloadMetadata(loads=self._pending_loads)
        self._pending_loads = []
        bs = self.block_size
        for sr in scheduler_output.scheduled:
            request = self._requests.get(sr.request_id)
            if request is None:
                continue
            self._block_tables[sr.request_id] = sr.block_ids
            full = min((sr.start_position + sr.num_tokens) // bs, len(request.block_hashes))
            start = self._saved_upto.get(sr.request_id, 0)
            if full > start:
                meta.saves.append(
                    BlockRun(
                        sr.request_id,
                        list(sr.block_ids[start:full]),
                        list(request.block_hashes[:full]),
                        start,
                    )
                )
                self._saved_upto[sr.request_id] = full
                self._had_saves.add(sr.request_id)
        for rid in scheduler_output.preempted_request_ids:
            self._saved_upto.pop(rid, None)  # it comes back through update_state_after_alloc
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if output.invalid_block_ids:
            # The engine cuts those requests back to their first bad block and recomputes; the worker
            # dropped this step's saves of theirs, so save again from the first bad block.
            for rid, table in self._block_tables.items():
                bad = next((i for i, b in enumerate(table) if b in output.invalid_block_ids), None)
                if bad is not None and rid in self._saved_upto:
                    self._saved_upto[rid] = min(self._saved_upto[rid], bad)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._block_tables.pop(rid, None)
        self._lookups.pop(rid, None)
        self._requests.pop(rid, None)
        self._saved_upto.pop(rid, None)
        had_saves = rid in self._had_saves
        self._had_saves.discard(rid)
        # Saves run in the background: its blocks are held until the worker says they are written.
        return had_saves, None

    # ---------------------------------------------------------------- worker half

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        from connectors.staging import BlockStager, needs_staging

        self._kv = kv_cache
        # A GPU cache: the store moves host bytes, so blocks go through pinned staging (staging.py).
        self._stager = BlockStager.for_cache(kv_cache) if needs_staging(kv_cache) else None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-save")

    def _blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        assert self._kv is not None, "register_kv_caches was not called"
        return [self._kv[b] for b in block_ids]  # each a contiguous [L, 2, bs, H, D] view, no copy

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMetadata)
        # Preempted: this step's forward may overwrite the blocks.  Stopped: the engine wants them back
        # (get_finished then reports the request, its saves being over).
        for rid in [*metadata.preempted_request_ids, *metadata.stop_request_ids]:
            self._wait_saves(rid)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMetadata)
        self._failed_loads = set()
        for run in metadata.loads:
            started = time.monotonic()
            staged = self._stager.empty(len(run.block_ids)) if self._stager is not None else None
            result = self.store.get_into(
                run.hashes,
                staged.views() if staged is not None else self._blocks(run.block_ids),
                run.start,
                timeout_s=self.options.load_timeout_s,
            )
            if staged is not None and self._stager is not None:
                # The loaded blocks land before the forward reads them (the compute stream waits).
                self._stager.to_device(staged, run.block_ids, result.loaded)
            self._load_seconds.observe(time.monotonic() - started)
            self.stats_counters["blocks_loaded"] += result.loaded
            failed = run.block_ids[result.loaded :]
            if failed:
                reason = result.reason.value if result.reason is not None else "unknown"
                logger.warning(
                    "offload: %d of %d blocks of %s not loaded (%s); recomputing them",
                    len(failed),
                    len(run.block_ids),
                    run.request_id,
                    reason,
                )
                self.stats_counters["blocks_load_failed"] += len(failed)
                self._load_errors.update(failed)
                self._failed_loads.add(run.request_id)

    def wait_for_save(self) -> None:
        meta = self.step_metadata  # what start_load_kv got this step
        if not isinstance(meta, OffloadMetadata) or not meta.saves:
            return
        assert self._saver is not None
        for run in meta.saves:
            if run.request_id in self._failed_loads:
                continue  # computed over blocks that did not load: wrong KV, never stored
            # A GPU cache: copied out now, after this forward wrote them and before any later one can
            # overwrite them; the saver thread waits for the copy and reads the host copy.  Host copies
            # cost pinned memory: past MAX_STAGED_SAVES waiting saves, a save is skipped (best effort).
            staged = None
            if self._stager is not None:
                if self._saves_pending() >= MAX_STAGED_SAVES:
                    self.stats_counters["saves_skipped"] += len(run.block_ids)
                    continue
                staged = self._stager.to_host(run.block_ids)
            future = self._saver.submit(self._save, run, staged)
            self._saves_in_flight.setdefault(run.request_id, []).append(future)

    def _saves_pending(self) -> int:
        return sum(not f.done() for futures in self._saves_in_flight.values() for f in futures)

    def _save(self, run: BlockRun, staged: StagedBlocks | None = None) -> None:
        try:
            payloads = staged.ready().views() if staged is not None else self._blocks(run.block_ids)
            result = self.store.put(run.hashes, payloads, run.start, timeout_s=self.options.save_timeout_s)
        except Exception:  # the store reports backend failures; anything else must not vanish silently
            logger.exception("offload: saving %d blocks of %s failed", len(run.block_ids), run.request_id)
            self.stats_counters["saves_failed"] += len(run.block_ids)
            return
        self.stats_counters["blocks_saved"] += result.stored
        if result.stored < len(run.block_ids):
            self.stats_counters["saves_failed"] += len(run.block_ids) - result.stored

    def _wait_saves(self, rid: RequestId) -> None:
        """When this returns, no save of ``rid`` reads its blocks any more."""
        futures = self._saves_in_flight.pop(rid, [])
        running = [f for f in futures if not f.cancel()]  # queued saves are dropped, not waited for
        if running:
            # One saver thread: at most one runs, bounded by its own store deadline.
            _, late = wait_futures(running, timeout=self.options.save_timeout_s + 5.0)
            if late:
                logger.error("offload: a save of %s outlived its deadline; its blocks may be reused", rid)

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        self._awaiting_release |= finished_req_ids
        done: set[RequestId] = set()
        for rid in list(self._awaiting_release):
            futures = self._saves_in_flight.get(rid, [])
            if all(f.done() for f in futures):
                self._saves_in_flight.pop(rid, None)
                self._awaiting_release.discard(rid)
                done.add(rid)
        return done, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- both

    def get_stats(self) -> ConnectorStats:
        loads = self._load_seconds.snapshot()
        return ConnectorStats(
            self.stats(), histograms={"kv_load_seconds.offload": loads} if loads.count else {}
        )

    def stats(self) -> dict[str, float]:
        """Flat counters for the node's metrics (summed over both halves there, so the store's own
        per-tier counters come from the worker half only): ``offload_*`` and ``store_<tier>_<counter>``."""
        out: dict[str, float] = {"offload_lookup_timeouts": float(self.num_lookup_timeouts)}
        if self.role is not KVConnectorRole.WORKER:
            return out
        out.update({f"offload_{k}": float(v) for k, v in self.stats_counters.items()})
        store = self.store.stats()
        out["store_write_jobs_dropped"] = float(store.write_jobs_dropped)
        for tier in store.tiers:
            for group in (
                tier.counters,
                {f"miss_{k}": v for k, v in tier.misses.items()},
                {f"put_failure_{k}": v for k, v in tier.put_failures.items()},
            ):
                for key, value in group.items():
                    out[f"store_{tier.name}_{key}"] = float(value)
        return out

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
            self._saver = None
        # The store stays open for the other engines of this process (see _SharedStores).
