"""The disk tier's file I/O: whole-buffer vectored reads and writes, a block file's header check, and
the quiet forms of unlink and listdir the tier's bookkeeping wants (``kvstore/tiers/disk.py`` is the tier)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from kvstore.results import MissReason
from wire.codec import HEADER_SIZE, parse_header

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def check_file(path: str, namespace: bytes, block_hash: bytes) -> tuple[int, int] | None:
    """(mtime, size) of a block file whose header names this block and whose size matches; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    header = parse_header(raw)
    if isinstance(header, MissReason) or header.namespace != namespace or header.block_hash != block_hash:
        return None
    if st.st_size != HEADER_SIZE + header.payload_len:
        return None
    return st.st_mtime_ns, st.st_size


def preadv_all(fd: int, buffers: list[Any]) -> int:
    """Fill ``buffers`` from offset 0 until they are full or the file ends; returns bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def writev_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
