"""The disk tier's file I/O: whole-buffer vectored reads and writes, a block file's header check, the scan
of a folder at start, and the quiet forms of unlink and listdir the tier's bookkeeping wants
(``kvstore/tiers/disk.py`` is the tier)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from kvstore.results import MissReason
from wire.codec import HEADER_SIZE, parse_header

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_HEX = frozenset("0123456789abcdef")


def scan_blocks(root: str) -> tuple[list[tuple[int, bytes, int]], list[str], int]:
    """The block files under ``root`` as (mtime, key, size), oldest first; the shard folders found; and how
    many files were deleted -- temp files of writes that never completed, and files failing their checks."""
    found: list[tuple[int, bytes, int]] = []
    folders: list[str] = []
    discarded = 0
    for ns_name in listdir(root):
        if len(ns_name) != 32 or not set(ns_name) <= _HEX:
            continue  # not ours
        namespace = bytes.fromhex(ns_name)
        for shard in listdir(f"{root}/{ns_name}"):
            folder = f"{root}/{ns_name}/{shard}"
            if len(shard) != 2 or not set(shard) <= _HEX or not os.path.isdir(folder):
                continue
            folders.append(folder)
            for name in listdir(folder):
                path = f"{folder}/{name}"
                if name.startswith(".") and name.endswith(".tmp"):
                    unlink_quietly(path)  # a write that never completed
                    discarded += 1
                    continue
                if len(name) not in (32, 64) or not set(name) <= _HEX or not name.startswith(shard):
                    continue
                entry = check_file(path, namespace, bytes.fromhex(name))
                if entry is None:
                    unlink_quietly(path)
                    discarded += 1
                else:
                    found.append((entry[0], namespace + bytes.fromhex(name), entry[1]))
    found.sort()
    return found, folders, discarded


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
