"""The ``disk`` tier: one file per block under one directory, bounded by bytes, LRU, survives restarts.

    ROOT/<namespace hex>/<first byte of hash, 2 hex>/<hash hex>            a block: header + payload
    ROOT/<namespace hex>/<first byte of hash, 2 hex>/.<hash hex>.<pid>.<n>.tmp   a write in progress

Writes are atomic: the block goes to a temp file in its shard folder (one ``writev`` of header and
payload), optionally ``fsync``-ed, then ``rename``-d into place; a lookup sees the block only after the
rename, and a crash leaves at most a temp file, which the next start deletes.  ``fsync``: ``never`` (a
crash may lose recent blocks; checksums catch any torn file), ``file`` (before the rename) or ``always``
(also the folder after it).

Reads use one ``preadv`` into a header buffer and the caller's block, then verify the header (namespace,
hash, layout) and the payload checksum; a file that fails is deleted and reported by reason.  On start the
index is rebuilt from the files (header and size checked, oldest modification first in LRU order); files
that do not check out are deleted.  Payload checksums are verified when a block is read, not at start.

Write failures (a full or read-only disk) are counted and leave no file behind; they never raise.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.buffers import BufferFence
from kvstore.config import DiskTierConfig
from kvstore.deadline import Deadline
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit
from kvstore.tiers.base import Ghosts, Tier, TierError, TierPolicy
from kvstore.tiers.diskio import O_CLOEXEC, preadv_all, scan_blocks, unlink_quietly, writev_all
from wire.codec import (
    HEADER_SIZE,
    HeaderMatcher,
    check_header,
    payload_checksum,
    verify_payload,
)
from wire.keys import KeyRun
from wire.layout import BlockLayout

logger = logging.getLogger(__name__)

# Reads leave the access time alone: a cache has no use for it, and on a relatime mount the first read of
# each new file would otherwise dirty its inode.  Only a file's owner may ask (EPERM otherwise).
_O_NOATIME = getattr(os, "O_NOATIME", 0)
_FENCE_GROUP = 16  # blocks read per hold of the caller's fence


class DiskTier(Tier):
    kind = "disk"
    inline_ops = frozenset({"lookup"})  # answered from the in-memory index: no I/O to wait for

    def __init__(
        self,
        config: DiskTierConfig,
        *,
        policy: TierPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config.name, policy=policy, clock=clock)
        self.config = config
        self.root = os.path.abspath(config.path)
        self.capacity_bytes = config.capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._reserved = 0  # bytes of writes in progress
        # Bytes the file system held for the tier when it filled up (ENOSPC) under its capacity: the tier
        # keeps to that (evicting LRU blocks) until a health probe finds room again.  None: not full.
        self._room: int | None = None
        self._largest = 0  # the largest block file stored: what "room for a block" means
        self._ghosts = Ghosts()
        self._dirs: set[str] = set()
        self._tmp_ids = itertools.count()
        self._read_flags = os.O_RDONLY | O_CLOEXEC | _O_NOATIME
        if os.path.exists(self.root) and not os.path.isdir(self.root):  # a mistake, not a passing fault
            raise ValueError(f"disk tier {self.name}: {self.root} is not a folder (a file is in the way)")
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            self.discarded_on_start = self._rebuild_index()
        except OSError as exc:
            # An unusable folder (missing mount, a file in the way, no permission) makes an empty tier
            # whose writes fail and are counted: the engine serves on, recomputing what it cannot load.
            logger.error(
                "disk tier %s: cannot use %s (%s); it holds nothing until writes succeed",
                self.name,
                self.root,
                exc,
            )
            self.discarded_on_start = 0

    def _probe(self, deadline: Deadline) -> None:
        """The folder is there, writable, and its file system has room for a block."""
        if not os.path.isdir(self.root) or not os.access(self.root, os.W_OK | os.X_OK):
            raise TierError(f"{self.root} is not a writable folder")
        free = self._room_again()
        room = self._room
        if room is not None and room >= self._largest:
            return  # full, and storing within what it holds (evicting): it serves
        if free < max(self._largest, 1):
            raise TierError(f"the file system of {self.root} is full ({free} bytes free, under one block)")

    def _room_again(self) -> int:
        """The file system's free bytes; with room for two blocks again (files deleted, the volume grown),
        the tier stops keeping to what it held when it filled."""
        fs = os.statvfs(self.root)
        free = fs.f_bavail * fs.f_frsize
        if self._room is not None and free >= 2 * max(self._largest, 1):
            with self._lock:
                self._room = None  # up to the capacity again
        return free

    # ---- paths ---------------------------------------------------------------------------------------

    def _path(self, key: bytes) -> tuple[str, str]:
        """(shard folder, file path) of a key (namespace + hash)."""
        ns_hex, hash_hex = key[:16].hex(), key[16:].hex()
        folder = f"{self.root}/{ns_hex}/{hash_hex[:2]}"
        return folder, f"{folder}/{hash_hex}"

    # ---- lookups and reads -----------------------------------------------------------------------------

    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int:
        # A hit becomes most recently used: blocks a scheduler is about to load are the last this tier
        # evicts, so a lookup's answer holds until the load (recency only; no entry is added or removed).
        return self._touch_run(run)[0]

    def _touch(self, key: bytes) -> int | None:
        with self._lock:
            size = self._index.get(key)
            if size is not None:
                self._index.move_to_end(key)
            return size

    def _miss(self, key: bytes) -> MissReason:
        with self._lock:
            return self._ghosts.reason(key)

    def _touch_run(self, run: KeyRun) -> tuple[int, MissReason | None]:
        """Touch the leading indexed blocks of ``run``: (how many, why the next one is missing)."""
        index = self._index
        ns = run.namespace
        with self._lock:
            for i, block_hash in enumerate(run.hashes):
                key = ns + block_hash
                if key not in index:
                    return i, self._ghosts.reason(key)
                index.move_to_end(key)
        return len(run), None

    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult:
        # The hot loop of a disk hit, per block: one open, one preadv (header into a row of one headers
        # buffer, payload straight into the caller's block), one close, the payload checksum while it is
        # hot.  The headers are checked afterwards, all in one comparison (HeaderMatcher.match_run).
        present, missing = self._touch_run(run)
        hashes = run.hashes
        folder = f"{self.root}/{run.namespace.hex()}/"
        expected = HEADER_SIZE + layout.payload_nbytes
        headers = memoryview(bytearray(HEADER_SIZE * present))
        spare = bytearray(1)  # a byte past the block: a file longer than one is damaged (as the scan says)
        actual: list[int] = []  # payload checksums of the blocks read whole
        short: tuple[int, str, int] | None = None  # a block that was not: (index, path, bytes read)
        for lo in range(0, present, _FENCE_GROUP):
            dsts = fence.hold_all()
            try:
                for i in range(lo, min(present, lo + _FENCE_GROUP)):
                    name = hashes[i].hex()
                    path = f"{folder}{name[:2]}/{name}"
                    try:
                        fd = self._open_for_read(path)
                    except FileNotFoundError:
                        short = (i, path, -1)
                        break
                    try:
                        dst = dsts[i]
                        header = headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
                        got = os.preadv(fd, [header, dst, spare], 0)
                        if 0 < got < expected:
                            got = preadv_all(fd, [header, dst, spare])  # a short read: finish it
                    finally:
                        os.close(fd)
                    if got != expected:
                        short = (i, path, got)
                        break
                    actual.append(payload_checksum(dst))
            finally:
                fence.let_go()
            if short is not None:
                break
        matcher = HeaderMatcher(run.namespace, layout)
        recorded, bad = matcher.match_run(headers, hashes[: len(actual)])
        for i, (want, have) in enumerate(zip(recorded, actual, strict=False)):
            if want != have:
                bad = (i, MissReason.CORRUPT)
                break
        if bad is None and short is not None:
            i, path, got = short
            if got < 0:
                self._remove([run.key(i)])  # gone from under the index
                bad = (i, MissReason.ABSENT)
            elif got > expected:  # more than one block's bytes: not what this tier wrote
                bad = (i, MissReason.CORRUPT)
            else:
                head = headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
                reason = matcher.match(head, hashes[i]) if got >= HEADER_SIZE else None
                bad = (i, reason if isinstance(reason, MissReason) else MissReason.TRUNCATED)
        if bad is None:
            return GetResult(present, missing if present < len(run) else None, tuple(recorded))
        i, reason = bad
        if reason is not MissReason.ABSENT:
            self._discard(run.key(i), self._path(run.key(i))[1], reason)
        self._drop_unreachable(run, i + 1)
        return GetResult(i, reason, tuple(recorded[:i]))

    def _read(self, run: KeyRun, deadline: Deadline, layout: BlockLayout | None) -> ReadResult:
        units: list[Unit] = []
        for i, block_hash in enumerate(run.hashes):
            key = run.key(i)
            size = self._touch(key)
            if size is None:
                return ReadResult(units, self._miss(key))
            _, path = self._path(key)
            buf = bytearray(size)
            try:
                fd = self._open_for_read(path)
            except FileNotFoundError:
                self._remove([key])  # gone from under the index
                self._drop_unreachable(run, i + 1)
                return ReadResult(units, MissReason.ABSENT)
            try:
                got = preadv_all(fd, [buf, bytearray(1)])  # a byte past it: longer is damaged
            finally:
                os.close(fd)
            view = memoryview(buf)
            header = check_header(view, run.namespace, block_hash, None)
            if isinstance(header, MissReason):
                reason: MissReason | None = header
            elif got > size:  # longer than the block it was indexed as: not what this tier wrote
                reason = MissReason.CORRUPT
            else:
                reason = verify_payload(header, view[HEADER_SIZE:got], got - HEADER_SIZE)
            if reason is not None:
                self._discard(key, path, reason)
                self._drop_unreachable(run, i + 1)
                return ReadResult(units, reason)
            units.append(Unit(view[HEADER_SIZE:], bytes(view[:HEADER_SIZE])))
        return ReadResult(units)

    # ---- writes ----------------------------------------------------------------------------------------

    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult:
        if self._room is not None:  # full when it last wrote: room again? (once a put, not per block)
            self._room_again()
        for i, unit in enumerate(units):
            key = run.key(i)
            size = HEADER_SIZE + unit.payload.nbytes
            # A file deleted behind the tier's back is written again (the stat outside the lock).
            present = key in self._index and os.path.exists(self._path(key)[1])
            with self._lock:
                if key in self._index:
                    if present:
                        self._index.move_to_end(key)
                        continue  # stored already
                    self._used -= self._index.pop(key)  # its file has gone: not counted while rewritten
                if not self._make_room(size):
                    self.metrics.error(f"put: a {size}-byte block does not fit in {self._limit()} bytes")
                    return PutResult(i, MissReason.ERROR)
                self._reserved += size
            try:
                self._write_fitting(key, unit, size)
            except OSError as exc:
                with self._lock:
                    self._reserved -= size
                self.metrics.error(
                    f"put: {errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc}"
                )
                logger.warning("kvstore disk tier %s: write failed: %s", self.name, exc)
                return PutResult(i, MissReason.ERROR)
            with self._lock:
                self._reserved -= size
                previous = self._index.pop(key, None)
                self._used += size - (previous or 0)
                self._index[key] = size
                self._ghosts.discard(key)
                self._largest = max(self._largest, size)
        return PutResult(len(run))

    def _write_fitting(self, key: bytes, unit: Unit, size: int) -> None:
        """Write a block file; when the file system is full below the tier's capacity (ENOSPC), keep to
        what it holds -- evict LRU blocks for this one -- and try once more: a full disk must not freeze
        the tier with whatever it held when it filled."""
        try:
            self._write_file(key, unit.seal(), unit.payload)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # the volume, or the user's quota, is full
                raise
            with self._lock:
                first = self._room is None
                self._room = self._used + self._reserved - size  # what it held, this block not counted
                if not self._make_room(0):
                    raise
            if first:
                why = f"{self.root} filled up at {self._room} bytes of blocks: keeping to that (evicting)"
                logger.warning("kvstore disk tier %s: %s until there is room again", self.name, why)
            self._write_file(key, unit.seal(), unit.payload)

    def _make_folders(self, folder: str) -> None:
        # KV is the users' data: owner only (makedirs' mode covers the last level only, so each one)
        for level in (self.root, os.path.dirname(folder), folder):
            os.makedirs(level, mode=0o700, exist_ok=True)
        self._dirs.add(folder)

    def _write_file(self, key: bytes, header: bytes, payload: memoryview) -> None:
        folder, path = self._path(key)
        if folder not in self._dirs:
            self._make_folders(folder)
        tmp = f"{folder}/.{key[16:].hex()}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # the folders went away under the tier (deleted by hand, a cleaner): again
            self._dirs.clear()
            self._make_folders(folder)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                writev_all(fd, [header, payload])
                if self.config.fsync != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        if self.config.fsync == "always":
            dir_fd = os.open(folder, os.O_RDONLY | O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _limit(self) -> int:
        """The bytes the tier may hold: its capacity, or less while its file system is full."""
        return self.capacity_bytes if self._room is None else min(self.capacity_bytes, self._room)

    def _make_room(self, size: int) -> bool:
        """Evict LRU files until ``size`` more bytes fit (caller holds the lock)."""
        limit = self._limit()
        if size > limit:
            return False
        while self._used + self._reserved + size > limit and self._index:
            key, victim_size = self._index.popitem(last=False)
            self._used -= victim_size
            self._ghosts.add(key)
            self.metrics.count(evictions=1)
            self._changed("removed", [key])
            unlink_quietly(self._path(key)[1])
        return self._used + self._reserved + size <= limit

    def _delete(self, run: KeyRun, deadline: Deadline) -> int:
        return len(self._remove([run.key(i) for i in range(len(run))]))

    def _open_for_read(self, path: str) -> int:
        """A block file opened for reading (``FileNotFoundError`` when it is gone), with ``O_NOATIME``
        until a file another user owns refuses it: then without it, from now on."""
        try:
            return os.open(path, self._read_flags)
        except PermissionError:
            if not self._read_flags & _O_NOATIME:
                raise
            self._read_flags &= ~_O_NOATIME
            return os.open(path, self._read_flags)

    def _drop_unreachable(self, run: KeyRun, start: int) -> None:
        """Forget (and delete) the indexed blocks of ``run`` from ``start`` on, after block ``start - 1``
        was found missing or damaged: a chained hash is reached only through its parent, so until that
        block is stored again they answer no lookup -- and if the fault took them too (a folder deleted,
        a disk damaged), the tier would go on counting them and skip them at the next put, which is what
        stores the recomputed run again; this way that put writes them all."""
        self._changed("removed", self._remove([run.key(i) for i in range(start, len(run))]))

    def _remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop ``keys`` from the index and their files from the folder: those that were indexed."""
        removed = []
        with self._lock:
            for key in keys:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
                    unlink_quietly(self._path(key)[1])
                    removed.append(key)
        return removed

    def _discard(self, key: bytes, path: str, reason: MissReason) -> None:
        """A file that failed its checks is garbage: drop it so the block can be stored again."""
        logger.warning("kvstore disk tier %s: discarding %s (%s)", self.name, path, reason.value)
        self.metrics.count(discarded_files=1)
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            unlink_quietly(path)
        self._changed("removed", [key])

    # ---- restart -------------------------------------------------------------------------------------

    def _rebuild_index(self) -> int:
        """Index every block file under the root; delete temp files and files that fail their checks."""
        found, folders, discarded = scan_blocks(self.root)
        self._dirs.update(folders)
        for _, key, size in found:
            self._index[key] = size
            self._used += size
            self._largest = max(self._largest, size)
        with self._lock:
            self._make_room(0)
        if discarded:
            logger.warning(
                "kvstore disk tier %s: discarded %d incomplete or damaged files", self.name, discarded
            )
        return discarded

    def _backend_stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "path": self.root,
                "capacity_bytes": self.capacity_bytes,
                "full_at_bytes": self._room,  # None; or what the file system held when it filled
                "used_bytes": self._used,
                "blocks": len(self._index),
                "discarded_on_start": self.discarded_on_start,
            }

    def keys_lru(self) -> list[bytes]:
        """Index keys, least recently used first (for tests and tools)."""
        with self._lock:
            return list(self._index)
