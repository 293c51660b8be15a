"""The store as one engine sees it (``KVStore``): block hashes of one namespace, buffers of one layout,
over a ``TieredStore`` (``kvstore.store``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.buffers import host_views
from kvstore.config import StoreConfig
from kvstore.deadline import Deadline
from kvstore.lane import Lane
from kvstore.results import GetResult, PutResult, Unit
from kvstore.store import StoreStats, TieredStore
from wire.codec import BlockCodec, check_block_hash, store_namespace
from wire.keys import KeyRun
from wire.layout import BlockLayout


class KVStore:
    """The store as one engine sees it: block hashes of one namespace, buffers of one layout.

    ``hashes`` is always the request's chain of block hashes from block 0 (``Request.block_hashes``) and
    ``start`` the index of the first block the call is about; ``buffers`` / ``payloads`` hold one engine
    block each (flat byte views or contiguous host tensors of ``layout.payload_nbytes`` bytes) for blocks
    ``start, start + 1, ...``.  No method raises for a backend failure; each returns by its deadline.
    """

    def __init__(self, store: TieredStore, *, namespace_id: str | bytes, layout: BlockLayout) -> None:
        self.store = store
        self.layout = layout
        self.namespace = store_namespace(namespace_id, layout)
        self.codec = BlockCodec(self.namespace, layout)
        self._lookup_lane = Lane("kvstore-async-lookup")

    @classmethod
    def open(
        cls,
        config: StoreConfig | str,
        *,
        namespace_id: str | bytes,
        layout: BlockLayout,
        clock: Callable[[], float] | None = None,
    ) -> KVStore:
        """Build the tiers ``config`` names (a ``--kv-store`` string, ``@file.toml`` or a ``StoreConfig``)."""
        return cls(TieredStore.from_config(config, clock=clock), namespace_id=namespace_id, layout=layout)

    def _run(self, hashes: Sequence[bytes], start: int, count: int | None = None) -> KeyRun:
        stop = len(hashes) if count is None else start + count
        run = KeyRun.of_chain(self.namespace, hashes, start, stop)
        if {len(h) for h in run.hashes} - {16, 32}:
            for h in run.hashes:
                check_block_hash(h)
        return run

    def contains_prefix(
        self, hashes: Sequence[bytes], start: int = 0, *, timeout_s: float | None = None
    ) -> int:
        """How many blocks from ``start`` on are stored, contiguously (side-effect free)."""
        run = self._run(hashes, start)
        return self.store.contains_prefix(run, _deadline(timeout_s, self.store.policy.lookup_timeout_s))

    def lookup_async(
        self, hashes: Sequence[bytes], start: int = 0, *, timeout_s: float | None = None
    ) -> Future[int]:
        """``contains_prefix`` off the caller's thread (the scheduler polls ``done()`` each step)."""
        hashes = list(hashes)
        return self._lookup_lane.submit(lambda: self.contains_prefix(hashes, start, timeout_s=timeout_s))

    def get_into(
        self,
        hashes: Sequence[bytes],
        buffers: Sequence[Any],
        start: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> GetResult:
        """Fill ``buffers`` with blocks ``start, start + 1, ...``; ``loaded`` says how many leading ones."""
        views = host_views(buffers, writable=True, nbytes=self.layout.payload_nbytes)
        run = self._run(hashes, start, len(views))
        return self.store.get_into(
            run, views, self.layout, _deadline(timeout_s, self.store.policy.get_timeout_s)
        )

    def put(
        self,
        hashes: Sequence[bytes],
        payloads: Sequence[Any],
        start: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Store blocks ``start, start + 1, ...``.  Payloads are read during the call only."""
        views = host_views(payloads, writable=False, nbytes=self.layout.payload_nbytes)
        run = self._run(hashes, start, len(views))
        units = [Unit(view, sealer=self.codec.sealer(h)) for view, h in zip(views, run.hashes, strict=True)]
        return self.store.put(run, units, _deadline(timeout_s, self.store.policy.put_timeout_s))

    def delete(self, hashes: Sequence[bytes], start: int = 0, *, timeout_s: float | None = None) -> int:
        run = self._run(hashes, start)
        return self.store.delete(run, _deadline(timeout_s, self.store.policy.put_timeout_s))

    def stats(self) -> StoreStats:
        return self.store.stats()

    def drain(self, timeout_s: float = 10.0) -> bool:
        return self.store.drain(timeout_s)

    def close(self) -> None:
        self._lookup_lane.close()
        self.store.close()


def _deadline(timeout_s: float | None, default_s: float) -> Deadline:
    return Deadline.after(default_s if timeout_s is None else timeout_s)
