"""The disk tier: prefix lookups, exact reads, LRU by bytes, atomic writes, restarts, damaged files, a
disk that refuses writes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from kvtest import BLOCK, LAYOUT, NAMESPACE, OTHER_NAMESPACE, Blocks

from kvstore.config import DiskTierConfig
from kvstore.results import MissReason
from kvstore.tiers.disk import DiskTier
from wire.codec import HEADER_SIZE, BlockCodec

FILE = HEADER_SIZE + BLOCK


def disk(path: Path, blocks: int = 64, fsync: str = "never") -> DiskTier:
    return DiskTier(DiskTierConfig(str(path), blocks * FILE, fsync=fsync))


def block_file(tier: DiskTier, b: Blocks, i: int) -> Path:
    return Path(tier._path(NAMESPACE + b.hashes[i])[1])


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_prefix_lookup_and_exact_get(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(6)
    tier = disk(tmp_path)
    assert tier.put(b.run(0, 4), b.units(0, 4)).stored == 4
    assert tier.contains_prefix(b.run()) == 4
    assert tier.contains_prefix(b.run(1)) == 3
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (4, MissReason.ABSENT)
    assert b.loaded(4)
    # one file per block, in a shard folder under the namespace
    assert block_file(tier, b, 0).parent.parent.name == NAMESPACE.hex()
    assert len(files(tmp_path)) == 4


def test_lru_eviction_by_bytes(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(5)
    tier = disk(tmp_path, blocks=3)
    tier.put(b.run(0, 3), b.units(0, 3))
    tier.get_into(b.run(0, 1), b.out_views[:1], LAYOUT)  # touch block 0
    tier.put(b.run(3, 5), b.units(3, 5))  # evicts 1, then 2
    assert tier.keys_lru() == [NAMESPACE + b.hashes[i] for i in (0, 3, 4)]
    assert not block_file(tier, b, 1).exists() and not block_file(tier, b, 2).exists()
    assert tier.get_into(b.run(1, 2), b.out_views[:1], LAYOUT).reason is MissReason.EVICTED
    stats = tier.stats()
    assert stats.counter("evictions") == 2 and stats.backend["used_bytes"] == 3 * FILE


def test_a_failed_rename_leaves_nothing_visible(
    tmp_path: Path, make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_blocks(2)
    tier = disk(tmp_path)

    def no_rename(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "simulated failure between write and rename")

    monkeypatch.setattr(os, "rename", no_rename)
    result = tier.put(b.run(), b.units())
    assert (result.stored, result.reason) == (0, MissReason.ERROR)
    assert tier.contains_prefix(b.run()) == 0
    assert files(tmp_path) == []  # the temp file is gone too
    assert "EIO" in tier.stats().last_error


def test_a_crash_between_write_and_rename(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    # A child process writes a block and dies (os._exit) in place of the rename: a real crash.
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from kvtest import NAMESPACE, chain, LAYOUT
        from wire.codec import BlockCodec
        from kvstore.config import DiskTierConfig
        from wire.keys import KeyRun
        from kvstore.results import Unit
        from kvstore.tiers.disk import DiskTier
        tier = DiskTier(DiskTierConfig({str(tmp_path)!r}, 1 << 20))
        hashes = chain(1)
        codec = BlockCodec(NAMESPACE, LAYOUT)
        payload = memoryview(bytes(LAYOUT.payload_nbytes))
        os.rename = lambda src, dst: os._exit(17)
        tier.put(KeyRun.of_chain(NAMESPACE, hashes), [Unit(payload, codec.header_of(hashes[0], payload))])
        """
    )
    code = subprocess.run([sys.executable, "-c", child], timeout=60).returncode
    assert code == 17
    leftovers = files(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp")  # the crash left a partial write
    tier = disk(tmp_path)  # the restart
    assert tier.contains_prefix(make_blocks(1).run()) == 0
    assert tier.discarded_on_start == 1 and files(tmp_path) == []


def test_restart_rebuilds_the_index(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(4)
    first = disk(tmp_path)
    first.put(b.run(), b.units())
    for i in range(4):  # distinct modification times, oldest first
        os.utime(block_file(first, b, i), (1_700_000_000 + i, 1_700_000_000 + i))
    first.close()
    second = disk(tmp_path)
    assert second.contains_prefix(b.run()) == 4
    assert second.keys_lru() == [NAMESPACE + h for h in b.hashes]
    assert second.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)
    assert second.stats().backend["used_bytes"] == 4 * FILE


def test_restart_discards_damaged_files_and_enforces_capacity(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(5)
    first = disk(tmp_path)
    first.put(b.run(), b.units())
    truncated, bad_header, misnamed = (block_file(first, b, i) for i in (1, 2, 3))
    truncated.write_bytes(truncated.read_bytes()[: FILE // 2])
    raw = bytearray(bad_header.read_bytes())
    raw[0] ^= 0xFF
    bad_header.write_bytes(bytes(raw))
    misnamed.write_bytes(block_file(first, b, 4).read_bytes())  # block 4's bytes under block 3's name
    (tmp_path / "not-ours.txt").write_text("left alone")
    first.close()
    second = disk(tmp_path, blocks=1)
    assert second.discarded_on_start == 3
    assert not truncated.exists() and not bad_header.exists() and not misnamed.exists()
    assert second.stats().backend["blocks"] == 1  # of blocks 0 and 4, capacity keeps one
    assert (tmp_path / "not-ours.txt").exists()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", MissReason.TRUNCATED),
        ("flip", MissReason.CORRUPT),
        ("other_model", MissReason.WRONG_NAMESPACE),
        # An outside probe's find: bytes appended to a block were served (the scan at restart deleted
        # the same files as damaged); a file longer than a block is not what the tier wrote.
        ("append", MissReason.CORRUPT),
    ],
)
def test_a_damaged_file_is_a_miss_and_is_removed(
    tmp_path: Path, make_blocks: Callable[..., Blocks], damage: str, reason: MissReason
) -> None:
    b = make_blocks(3)
    tier = disk(tmp_path)
    tier.put(b.run(), b.units())
    path = block_file(tier, b, 1)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 100] ^= 0x04
        path.write_bytes(bytes(raw))
    elif damage == "append":
        path.write_bytes(path.read_bytes() + b"\x00" * 70)
    else:
        path.write_bytes(BlockCodec(OTHER_NAMESPACE, LAYOUT).encode(b.hashes[1], b.views[1]))
    damaged = path.read_bytes()
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (1, reason)
    assert not path.exists() and tier.contains_prefix(b.run()) == 1
    assert tier.stats().missed(reason) == 1
    # The store server's whole-block read says the same of the same file.
    tier.put(b.run(), b.units())
    path.write_bytes(damaged)
    read = tier.read(b.run())
    assert (len(read.units), read.reason) == (1, reason) and not path.exists()


@pytest.mark.parametrize(
    ("damages", "first", "reason"),
    [
        ({19: "flip", 23: "other_model"}, 19, MissReason.CORRUPT),  # a payload before a bad header
        ({19: "other_model", 23: "flip"}, 19, MissReason.WRONG_NAMESPACE),
        ({21: "flip", 20: "truncate"}, 20, MissReason.TRUNCATED),  # the short file stops the read
        ({22: "flip", 17: "delete"}, 17, MissReason.ABSENT),
        ({3: "truncate"}, 3, MissReason.TRUNCATED),
    ],
)
def test_the_first_damaged_file_of_a_long_run_ends_the_get(
    tmp_path: Path,
    make_blocks: Callable[..., Blocks],
    damages: dict[int, str],
    first: int,
    reason: MissReason,
) -> None:
    b = make_blocks(40)
    tier = disk(tmp_path)
    tier.put(b.run(), b.units())
    for i, damage in damages.items():
        path = block_file(tier, b, i)
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[: HEADER_SIZE + 7])
        elif damage == "flip":
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0x80
            path.write_bytes(bytes(raw))
        elif damage == "delete":
            path.unlink()
        else:
            path.write_bytes(BlockCodec(OTHER_NAMESPACE, LAYOUT).encode(b.hashes[i], b.views[i]))
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (first, reason)
    assert b.loaded(first)
    assert len(result.checksums) == first
    assert not block_file(tier, b, first).exists()  # the damaged file is gone
    assert tier.contains_prefix(b.run()) == first
    assert tier.stats().missed(reason) == 1
    # What follows it is reached only through it: forgotten too (damaged or not), so the put that stores
    # the recomputed run writes every block again -- it had skipped the later damaged ones as stored,
    # and a damaged disk healed one block per request.
    assert len(files(tmp_path)) == first
    assert tier.stats().to_dict()["backend"]["blocks"] == first
    assert tier.put(b.run(), b.units()).stored == 40
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 40 and b.loaded(40)


@pytest.mark.skipif(not getattr(os, "O_NOATIME", 0), reason="no O_NOATIME here")
def test_files_another_user_owns_are_read_without_noatime(
    tmp_path: Path, make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_blocks(3)
    tier = disk(tmp_path)
    tier.put(b.run(), b.units())
    real_open = os.open
    refused: list[str] = []

    def open_as_non_owner(path: str, flags: int, *args: int, **kw: int) -> int:
        if flags & os.O_NOATIME:  # what the kernel answers a reader that does not own the file
            refused.append(path)
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr("kvstore.tiers.disk.os.open", open_as_non_owner)
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (3, None) and b.loaded(3)
    assert len(refused) == 1  # asked once, then never again
    assert [u.payload.tobytes() for u in tier.read(b.run()).units] == [bytes(v) for v in b.views]
    # A file gone between the refusal and the second open is a miss like any missing file.
    fresh = disk(tmp_path / "other")
    fresh.put(b.run(), b.units())
    block_file(fresh, b, 0).unlink()  # refused with O_NOATIME first, then not found without it
    result = fresh.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (0, MissReason.ABSENT)


def test_a_file_deleted_behind_its_back_is_absent(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    tier = disk(tmp_path)
    tier.put(b.run(), b.units())
    block_file(tier, b, 0).unlink()
    assert tier.get_into(b.run(), b.out_views, LAYOUT).reason is MissReason.ABSENT
    assert tier.contains_prefix(b.run()) == 0


def test_a_tier_whose_folder_is_deleted_writes_again(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    """An outside fault drill deleted the tier's folder while it ran: every later write failed (ENOENT: the
    shard folders it had made were remembered, not made again) while its health said it served.  Now the
    next write makes the folders again, owner-only, and stores."""
    root = tmp_path / "kv"
    tier = disk(root, 16)
    b = make_blocks(6)
    assert tier.put(b.run(0, 3), b.units(0, 3)).stored == 3
    shutil.rmtree(root)
    assert tier.put(b.run(3, 6), b.units(3, 6)).stored == 3
    assert block_file(tier, b, 3).is_file() and root.stat().st_mode & 0o777 == 0o700
    assert tier.get_into(b.run(3), b.out_views[3:], LAYOUT).loaded == 3
    tier.close()


@pytest.mark.parametrize("read", ["get_into", "read"])
def test_a_folder_deleted_behind_the_tier_s_back_is_stored_again_by_the_next_put(
    tmp_path: Path, make_blocks: Callable[..., Blocks], read: str
) -> None:
    """An outside fault drill deleted the folder: the get missed at the first block, the put of the
    recomputed run said 8 stored and wrote one file (the index still named the other 7), and every
    later lookup promised blocks that were not there."""
    root = tmp_path / "kv"
    tier = disk(root, 16)
    b = make_blocks(8)
    assert tier.put(b.run(), b.units()).stored == 8
    shutil.rmtree(root)
    if read == "get_into":
        assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 0
    else:
        assert tier.read(b.run()).units == []
    assert tier.contains_prefix(b.run()) == 0 and tier.stats().to_dict()["backend"]["used_bytes"] == 0
    assert tier.put(b.run(), b.units()).stored == 8
    assert len(files(root)) == 8
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 8 and b.loaded(8)
    # And a put before any read: the files it lists but lacks are written, not skipped.
    shutil.rmtree(root)
    assert tier.put(b.run(), b.units()).stored == 8 and len(files(root)) == 8
    tier.close()


def test_a_path_that_is_a_file_is_refused_when_the_tier_opens(tmp_path: Path) -> None:
    """``disk:/etc/passwd:1MiB`` started a store whose disk tier held nothing, with a warning: a file in
    the way is a mistake in the configuration, refused naming the tier and the path."""
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"disk tier disk: .*/file is not a folder"):
        disk(tmp_path / "file")


def test_a_full_disk_is_counted_and_never_raises(
    tmp_path: Path, make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that takes no write at all, its blocks' room evicted or not (something else filled it)."""
    b = make_blocks(4)
    tier = disk(tmp_path)
    tier.put(b.run(0, 2), b.units(0, 2))

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    result = tier.put(b.run(2, 4), b.units(2, 4))
    assert (result.stored, result.reason) == (0, MissReason.ERROR)
    stats = tier.stats()
    assert stats.put_failures == {"error": 2} and "ENOSPC" in stats.last_error
    assert stats.breakers == {"read": "closed", "write": "open"}  # reads go on
    # The oldest block made room for a second try (below), which failed too; no partial file is left.
    assert [p.name for p in files(tmp_path)] == [block_file(tier, b, 1).name]
    assert tier.get_into(b.run(1, 2), b.out_views[1:2], LAYOUT).loaded == 1
    assert tier.put(b.run(2, 4), b.units(2, 4)).reason is MissReason.UNAVAILABLE  # skipped while open


def test_a_file_system_that_fills_below_the_capacity_keeps_the_tier_storing(
    tmp_path: Path, make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside drill put a 64 MiB tier on a 1.2 MB tmpfs: the three blocks written before ENOSPC
    stayed for good, nothing new was stored (the tier thought it had room, so it never evicted), and the
    health probe said healthy with less than a block free (it counted only a 100 % full disk).  Now
    ENOSPC makes the tier keep to what the file system held, evicting LRU blocks for new ones, until the
    file system has room again; the probe calls a disk with less than a block free full unless the tier
    is storing within what it holds."""
    root = tmp_path / "kv"
    tier = disk(root, 64)
    holds = 3  # what the "file system" takes
    real_writev, real = os.writev, os.statvfs(tmp_path)

    def small_disk(fd: int, buffers: list[bytes]) -> int:
        if len(files(root)) > holds:  # the temp file counts: a fourth block does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers)

    def free_bytes(n: int) -> Callable[[object], os.statvfs_result]:
        fields = (real.f_bsize, 1, real.f_blocks, n, n, *real[5:])  # f_frsize 1: f_bavail is bytes
        return lambda _path: os.statvfs_result(fields)

    b = make_blocks(6)
    monkeypatch.setattr(os, "statvfs", free_bytes(0))
    assert "is full" in (tier.health() or "")  # before it has met ENOSPC: a full disk takes nothing
    monkeypatch.setattr(os, "writev", small_disk)
    assert tier.put(b.run(0, 3), b.units(0, 3)).stored == 3
    for i in range(3, 6):  # each new block evicts the oldest one
        assert tier.put(b.run(i, i + 1), b.units(i, i + 1)).stored == 1
    assert sorted(files(root)) == sorted(block_file(tier, b, i) for i in range(3, 6))
    backend = tier.stats().to_dict()["backend"]
    assert backend["full_at_bytes"] == 3 * FILE and backend["used_bytes"] == 3 * FILE
    assert tier.stats().put_failures == {} and tier.write_breaker.state.value == "closed"
    assert tier.get_into(b.run(3), b.out_views[3:], LAYOUT).loaded == 3
    assert tier.health() is None  # full, but storing within what it holds: it serves
    monkeypatch.setattr(os, "statvfs", free_bytes(FILE + 1))  # a block's room, not yet two: still keeps to 3
    assert tier.health() is None and tier.stats().to_dict()["backend"]["full_at_bytes"] == 3 * FILE
    # Room again (files deleted, the volume grown): the next put sees it, health probe or not.
    monkeypatch.setattr(os, "statvfs", free_bytes(10 * FILE))
    holds = 10
    assert tier.put(b.run(0, 3), b.units(0, 3)).stored == 3 and len(files(root)) == 6
    assert tier.stats().to_dict()["backend"]["full_at_bytes"] is None
    tier.close()


def test_a_tier_that_filled_up_holding_nothing_stores_again_when_room_comes_back(
    tmp_path: Path, make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review's find: ENOSPC with nothing held made the tier's limit 0, every later put failed before
    trying, and only a health probe (which the store embedded in a node never runs) could lift it."""
    root = tmp_path / "kv"
    tier = disk(root, 64)
    real_writev, real = os.writev, os.statvfs(tmp_path)
    full = True

    def writev(fd: int, buffers: list[bytes]) -> int:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "statvfs", lambda _p: os.statvfs_result((4096, 1, 1, 0, 0, *real[5:])))
    b = make_blocks(2)
    assert tier.put(b.run(0, 1), b.units(0, 1)).reason is MissReason.ERROR
    assert tier.stats().to_dict()["backend"]["full_at_bytes"] == 0
    full = False
    monkeypatch.setattr(os, "statvfs", lambda _p: real)
    tier.write_breaker.record_success()  # the breaker's cooldown is its own business
    assert tier.put(b.run(), b.units()).stored == 2
    assert tier.stats().to_dict()["backend"]["full_at_bytes"] is None
    tier.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_counted(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(1)
    tier = disk(tmp_path)
    tmp_path.chmod(0o555)
    try:
        assert tier.put(b.run(), b.units()).reason is MissReason.ERROR
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize(("policy", "expected"), [("never", 0), ("file", 2), ("always", 4)])
def test_fsync_policy(
    tmp_path: Path,
    make_blocks: Callable[..., Blocks],
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    expected: int,
) -> None:
    b = make_blocks(2)
    tier = disk(tmp_path, fsync=policy)
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    tier.put(b.run(), b.units())
    assert len(calls) == expected  # per block: the file, then (always) its folder


def test_read_returns_verified_units(tmp_path: Path, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(3)
    tier = disk(tmp_path)
    tier.put(b.run(0, 2), b.units(0, 2))
    read = tier.read(b.run())
    assert [bytes(u.payload) for u in read.units] == [bytes(v) for v in b.views[:2]]
    assert read.reason is MissReason.ABSENT


def test_block_files_and_folders_are_the_owner_s_only(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    """Another user on the host must not read the KV (prompts can be recovered from it): 0600 / 0700."""
    root = tmp_path / "kv"
    tier = disk(root, 8)
    b = make_blocks(3)
    assert tier.put(b.run(), b.units()).stored == 3
    files = [p for p in root.rglob("*") if p.is_file()]
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in folders)
    tier.close()
