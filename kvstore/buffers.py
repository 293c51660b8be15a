"""Caller buffers: normalising them to byte views, copying into them, and fencing late writers.

The engine hands the store its blocks as writable memoryviews or contiguous host tensors (any dtype; the
store sees their bytes).  ``host_view`` turns either into a flat ``memoryview`` of format ``"B"`` without
copying.

``BufferFence`` guards the buffers of one ``get_into`` call against a tier call that outlives its deadline:
a tier writes block ``i`` only inside ``with fence.writing(i) as dst`` (or a few blocks in a row between
``hold_all()`` and ``let_go()``); once the caller gives up it calls ``fence.close()``, which waits for the
write in progress (at most that group of blocks) to finish and makes every later write raise
``Abandoned``, so no byte lands in an engine block after the store has reported it as a miss.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def host_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf`` (a buffer-protocol object or a contiguous CPU tensor), without a copy."""
    torch = sys.modules.get("torch")  # a tensor can only come from a process that imported torch
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(
                f"kvstore buffers must be host memory, got a tensor on {buf.device}; stage device blocks "
                "through pinned host buffers"
            )
        if not buf.is_contiguous():
            raise TypeError("kvstore buffers must be contiguous tensors")
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise TypeError("kvstore buffers must be C-contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    if writable and view.readonly:
        raise TypeError("kvstore get buffers must be writable")
    return view


def host_views(bufs: Sequence[Any], *, writable: bool, nbytes: int) -> list[memoryview]:
    """``host_view`` of each buffer, checking each is exactly ``nbytes`` long."""
    views = [host_view(b, writable=writable) for b in bufs]
    for i, v in enumerate(views):
        if v.nbytes != nbytes:
            raise ValueError(f"buffer {i} is {v.nbytes} bytes; one block of this layout is {nbytes} bytes")
    return views


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for equal-length byte views: one single-threaded memcpy.

    Deliberately not torch's parallel copy: it is faster on an idle host, but from a store thread it
    competes with the engine's compute for the intra-op thread pool, and on a busy host its barrier can
    stall for milliseconds (``docs/kvstore.md``, performance notes).
    """
    dst[:] = src


class Abandoned(Exception):
    """The caller gave up on this call; its buffers must not be touched any more."""


class BufferFence:
    """The caller's buffers of one ``get_into`` call, writable only until the caller gives up."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self._buffers = buffers
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._buffers)

    def nbytes(self, i: int) -> int:
        return self._buffers[i].nbytes

    @contextmanager
    def writing(self, i: int) -> Iterator[memoryview]:
        with self._lock:
            if self._closed:
                raise Abandoned
            yield self._buffers[i]

    def hold(self, i: int) -> memoryview:
        """Block ``i`` for writing; the caller must ``let_go()`` (the ``writing`` context, unrolled for a
        hot loop)."""
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            raise Abandoned
        return self._buffers[i]

    def hold_all(self) -> Sequence[memoryview]:
        """Every block for writing, until ``let_go()``: for a loop that writes several blocks in a row
        (hold the fence for a few blocks at a time, so that ``close`` never waits long)."""
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            raise Abandoned
        return self._buffers

    def let_go(self) -> None:
        self._lock.release()

    def copy_into(self, i: int, src: memoryview) -> None:
        """``buffers[i][:] = src`` unless the caller gave up (then ``Abandoned``)."""
        with self._lock:
            if self._closed:
                raise Abandoned
            self._buffers[i][:] = src

    def peek(self, i: int) -> memoryview:
        """Block ``i`` for reading back what this call wrote (checksums); not for writing."""
        return self._buffers[i]

    def close(self) -> None:
        """Give up: wait for a write in progress, then refuse every later one."""
        with self._lock:
            self._closed = True
