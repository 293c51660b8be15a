"""Moving whole blocks of a CUDA paged cache through pinned host memory, on a stream of their own.

The byte movers (``offload``'s store reads and writes, ``p2p``'s sockets) work on host bytes.  With the
cache on the CPU they read and write the cache itself, and nothing here is used.  With the cache on a GPU
(``kv_cache.device.type == "cuda"``) every move goes through a ``StagedBlocks``: a pinned host buffer of
the blocks, filled or drained by ``BlockStager`` on its own CUDA stream, ordered against the forward pass
with events both ways:

- **to host** (a save, a lease): the copy waits for an event recorded on the compute stream, so it reads
  what the forward wrote; the compute stream then waits for the copy's event, so no later kernel (a
  forward reusing the blocks after they are released) overwrites a block before the copy read it.  Host
  readers call ``ready()`` (it waits for the copy) before touching the bytes.
- **to device** (a load, a pull): the host bytes are complete first; the copy runs on the side stream
  and the compute stream waits for its event, so the forward never reads a block before its copy landed.

Pinned buffers are safe to drop while a copy is in flight (PyTorch's pinned allocator records an event
for every non-blocking copy and reuses a buffer only after it), and a copy allocates no device memory.
All connectors of one engine share the cache's one stager (``BlockStager.for_cache``), so their copies
are ordered with each other too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch


def needs_staging(kv_cache: torch.Tensor) -> bool:
    """True when the cache is not in host memory: byte movers must stage its blocks."""
    return kv_cache.device.type != "cpu"


class StagedBlocks:
    """Pinned host copies of some blocks (``[n, *block_shape]`` of the cache's dtype), with the event of
    the copy that fills them (to host) or drains them (to device)."""

    def __init__(self, host: torch.Tensor, event: Any = None) -> None:
        self.host = host
        self.event = event
        n = int(host.shape[0])
        self._bytes = host.view(torch.uint8).reshape(n, -1) if n else None

    def __len__(self) -> int:
        return int(self.host.shape[0])

    def ready(self) -> StagedBlocks:
        """Wait until the copy into host memory is done (no-op when there is none).  Call it outside any
        lock: it waits for the GPU."""
        if self.event is not None:
            self.event.synchronize()
        return self

    def view(self, i: int) -> memoryview:
        """Block ``i``'s bytes (writable: a receiver may fill it)."""
        assert self._bytes is not None, "no blocks staged"
        return memoryview(self._bytes[i].numpy())  # type: ignore[arg-type]

    def views(self) -> list[memoryview]:
        return [self.view(i) for i in range(len(self))]


class BlockStager:
    """Copies blocks between a CUDA cache ``[num_blocks, L, 2, bs, H, D]`` and pinned host memory.

    One per cache (``for_cache``): every connector of an engine (``multi``'s children too) copies on the
    same stream, so their copies are ordered with each other as well as with the forward pass.  Blocks
    are copied one by one (each is contiguous), so no device memory is allocated for a copy.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _by_cache: ClassVar[dict[tuple[int, int], BlockStager]] = {}

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"BlockStager moves blocks of a CUDA cache, not of one on {kv_cache.device}")
        self.kv = kv_cache
        self.device = kv_cache.device
        self.block_shape = tuple(kv_cache.shape[1:])
        self.stream = torch.cuda.Stream(device=self.device)

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor) -> BlockStager:
        """The stager of this cache tensor (made on first use)."""
        key = (kv_cache.data_ptr(), kv_cache.device.index or 0)
        with cls._lock:
            stager = cls._by_cache.get(key)
            if stager is None or stager.kv is not kv_cache:
                stager = cls._by_cache[key] = cls(kv_cache)
            return stager

    def empty(self, n: int) -> StagedBlocks:
        """Pinned room for ``n`` blocks (a receiver fills it, then ``to_device``)."""
        return StagedBlocks(torch.empty((n, *self.block_shape), dtype=self.kv.dtype, pin_memory=True))

    def _after_compute(self) -> Any:
        """An event on the compute stream now: what the forward passes so far wrote or read."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, block_ids: Sequence[int]) -> StagedBlocks:
        """Start copying ``block_ids`` into pinned memory; ``ready()`` on the result waits for it."""
        staged = self.empty(len(block_ids))
        if not block_ids:
            return staged
        written = self._after_compute()
        done = torch.cuda.Event(blocking=True)  # host threads wait on it without spinning
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            for j, b in enumerate(block_ids):
                staged.host[j].copy_(self.kv[b], non_blocking=True)
            done.record(self.stream)
        # Nothing later on the compute stream (a forward reusing the blocks) overwrites one before it is read.
        torch.cuda.current_stream(self.device).wait_event(done)
        staged.event = done
        return staged

    def to_device(self, staged: StagedBlocks, block_ids: Sequence[int], count: int | None = None) -> None:
        """Copy the first ``count`` (default all) staged blocks into ``block_ids`` of the cache, after what
        the compute stream did so far; the compute stream then waits for the copy, so the next forward
        reads the landed blocks.  The host bytes must be complete."""
        n = len(block_ids) if count is None else count
        if n == 0:
            return
        before = (
            self._after_compute()
        )  # a forward still writing these (newly allocated) blocks finishes first
        done = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(before)
            for j in range(n):
                self.kv[block_ids[j]].copy_(staged.host[j], non_blocking=True)
            done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        staged.event = done
