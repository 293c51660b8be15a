"""The block codec: the one definition of a stored block's bytes, shared by every tier and the wire.

A stored block is a 96-byte header followed by the payload (one engine block, see ``wire.layout``):

    offset size  field                                         (all little-endian)
      0     4    magic b"PDKV"
      4     2    format version (u16) = 1
      6     2    header size (u16) = 96
      8    16    namespace id (raw bytes; ``HashNamespace.namespace_id`` is their hex)
     24    32    block hash, zero-padded to 32 bytes
     56     1    block hash length (16 for xxh3_128, 32 for sha256)
     57     1    dtype code (``wire.layout.DTYPES``)
     58     2    flags (u16) = 0
     60    16    num_layers, num_kv_heads, head_dim, block_size (u32 each)
     76     8    payload length (u64)
     84     8    payload checksum: xxh3_64 of the payload (u64)
     92     4    header checksum: xxh32 of bytes 0..91 (u32)

Decoding checks everything, and every failure is a ``MissReason``, never data: a damaged header or payload
is ``CORRUPT``, missing bytes ``TRUNCATED``, a header for another model ``WRONG_NAMESPACE``, for another
layout ``WRONG_LAYOUT``, for another block ``WRONG_HASH``.  Nothing here copies a payload: callers read
and write through memoryviews over the engine's buffers, and the header travels separately (a second
frame, an ``iovec``, a separate Redis argument chunk), so the payload is never concatenated.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import xxhash

from wire.layout import BlockLayout
from wire.reasons import MissReason

MAGIC = b"PDKV"
FORMAT_VERSION = 1
HEADER_SIZE = 96
NAMESPACE_SIZE = 16
MAX_HASH_SIZE = 32
HASH_SIZES = (16, 32)

_BODY = struct.Struct("<4sHH16s32sBBHIIIIQQ")  # bytes 0..91: everything but the header checksum
_CRC = struct.Struct("<I")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_OFFSET = 84
assert _BODY.size + _CRC.size == HEADER_SIZE

payload_checksum: Callable[[Any], int] = xxhash.xxh3_64_intdigest
_header_checksum: Callable[[Any], int] = xxhash.xxh32_intdigest


def namespace_bytes(namespace_id: str | bytes) -> bytes:
    """The 16 raw bytes of a namespace id, given as ``HashNamespace.namespace_id`` (32 hex chars) or raw."""
    if isinstance(namespace_id, str):
        try:
            raw = bytes.fromhex(namespace_id)
        except ValueError:
            raw = b""
        if len(raw) != NAMESPACE_SIZE:
            raise ValueError(
                f"namespace id {namespace_id!r} must be 32 hex characters (HashNamespace.namespace_id)"
            )
        return raw
    if len(namespace_id) != NAMESPACE_SIZE:
        raise ValueError(f"a raw namespace id is {NAMESPACE_SIZE} bytes, got {len(namespace_id)}")
    return bytes(namespace_id)


def store_namespace(namespace_id: str | bytes, layout: BlockLayout) -> bytes:
    """The 16-byte namespace of stored blocks: the engine's hash namespace *and* the block layout.

    Two engines running one model with different KV dtypes compute the same block hashes; folding the
    layout into the namespace gives them separate keys instead of a fight over one key that one of them
    can never read.
    """
    raw = namespace_bytes(namespace_id)
    descriptor = struct.pack(
        "<BIIII",
        layout.dtype_code,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
    )
    return xxhash.xxh3_128_digest(b"pdkv-kvstore/v1\x00" + raw + descriptor)


def check_block_hash(block_hash: bytes) -> None:
    if len(block_hash) not in HASH_SIZES:
        raise ValueError(f"a block hash is 16 or 32 bytes (xxh3_128 or sha256), got {len(block_hash)}")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed, structurally valid header."""

    namespace: bytes
    block_hash: bytes
    layout: BlockLayout
    payload_len: int
    checksum: int


def header_checksum(header: bytes) -> int:
    """The payload checksum recorded in a header this process packed (no other check)."""
    return int(_CHECKSUM.unpack_from(header, _CHECKSUM_OFFSET)[0])


def pack_header(namespace: bytes, block_hash: bytes, layout: BlockLayout, checksum: int) -> bytes:
    """The 96 header bytes of a block whose payload has checksum ``checksum``."""
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        namespace,
        block_hash,  # struct pads a 16-byte hash with zeros
        len(block_hash),
        layout.dtype_code,
        0,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.payload_nbytes,
        checksum,
    )
    return body + _CRC.pack(_header_checksum(body))


def parse_header(buf: Any) -> BlockHeader | MissReason:
    """Parse and self-check a header (magic, version, size, checksum, layout); no expectation applied."""
    view = memoryview(buf)
    if view.nbytes < HEADER_SIZE:
        return MissReason.TRUNCATED
    view = view[:HEADER_SIZE]
    (crc,) = _CRC.unpack_from(view, _BODY.size)
    if _header_checksum(view[: _BODY.size]) != crc:
        return MissReason.CORRUPT
    fields = _BODY.unpack_from(view)
    magic, version, size, namespace, hash_field, hash_len, dtype_code = fields[:7]
    layers, heads, head_dim, block_size, payload_len, checksum = fields[8:]
    if magic != MAGIC or version != FORMAT_VERSION or size != HEADER_SIZE or hash_len not in HASH_SIZES:
        return MissReason.CORRUPT
    try:
        layout = BlockLayout.from_code(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype_code=dtype_code,
        )
    except ValueError:
        return MissReason.WRONG_LAYOUT  # a dtype this build does not know: not ours to read
    if payload_len != layout.payload_nbytes:
        return MissReason.CORRUPT
    return BlockHeader(namespace, hash_field[:hash_len], layout, payload_len, checksum)


def check_header(
    buf: Any, namespace: bytes, block_hash: bytes, layout: BlockLayout | None
) -> BlockHeader | MissReason:
    """Parse a header and check it names this namespace, this block and (when given) this layout."""
    header = parse_header(buf)
    if isinstance(header, MissReason):
        return header
    if header.namespace != namespace:
        return MissReason.WRONG_NAMESPACE
    if header.block_hash != block_hash:
        return MissReason.WRONG_HASH
    if layout is not None and header.layout != layout:
        return MissReason.WRONG_LAYOUT
    return header


def verify_payload(header: BlockHeader, payload: Any, received: int | None = None) -> MissReason | None:
    """``None`` when ``payload`` (``received`` bytes of it, default all) is the one ``header`` describes."""
    n = memoryview(payload).nbytes if received is None else received
    if n < header.payload_len:
        return MissReason.TRUNCATED
    if n > header.payload_len:
        return MissReason.CORRUPT
    if payload_checksum(payload) != header.checksum:
        return MissReason.CORRUPT
    return None


class HeaderMatcher:
    """Checks headers against one namespace and layout by comparing bytes with a template (no parsing).

    ``match`` answers the payload checksum a valid header records, or the ``MissReason`` the full check
    (``check_header``) finds for an invalid one.  The fast path is one 84-byte comparison: every field but
    the payload checksum and the header checksum must equal the template's, and a damaged payload checksum
    field shows up as a payload mismatch anyway.
    """

    def __init__(self, namespace: bytes, layout: BlockLayout) -> None:
        self.namespace = namespace
        self.layout = layout
        templates = {n: pack_header(namespace, bytes(n), layout, 0) for n in HASH_SIZES}
        # (bytes 0..23: magic .. namespace, bytes 56..83: hash length .. payload length) per hash length
        self._parts = {n: (t[:24], bytes(MAX_HASH_SIZE - n) + t[56:84]) for n, t in templates.items()}

    def match(self, header: Any, block_hash: bytes) -> int | MissReason:
        parts = self._parts.get(len(block_hash))
        if parts is not None and header[:84] == parts[0] + block_hash + parts[1]:
            return int(_CHECKSUM.unpack_from(header, _CHECKSUM_OFFSET)[0])
        checked = check_header(header, self.namespace, block_hash, self.layout)
        return checked if isinstance(checked, MissReason) else checked.checksum

    def match_run(
        self, headers: Any, hashes: Sequence[bytes]
    ) -> tuple[list[int], tuple[int, MissReason] | None]:
        """``match`` for ``len(hashes)`` headers laid end to end in ``headers``, in one vectorised comparison.

        Answers the payload checksums of the leading headers that match, and the index and reason of the
        first one that does not (``None`` when all match).
        """
        n = len(hashes)
        if n == 0:
            return [], None
        size = len(hashes[0])
        parts = self._parts.get(size)
        if parts is None or any(len(h) != size for h in hashes):
            return self._match_each(headers, hashes, 0, [])
        got = np.frombuffer(headers, dtype=np.uint8, count=n * HEADER_SIZE).reshape(n, HEADER_SIZE)
        want = np.empty((n, _CHECKSUM_OFFSET), dtype=np.uint8)
        want[:, :24] = np.frombuffer(parts[0], dtype=np.uint8)
        want[:, 24 : 24 + size] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, size)
        want[:, 24 + size :] = np.frombuffer(parts[1], dtype=np.uint8)
        same = (got[:, :_CHECKSUM_OFFSET] == want).all(axis=1)
        first = n if bool(same.all()) else int(np.argmin(same))
        sums = got[:first, _CHECKSUM_OFFSET : _CHECKSUM_OFFSET + 8].copy().view("<u8").ravel().tolist()
        if first == n:
            return sums, None
        return self._match_each(headers, hashes, first, sums)  # the full check says why (or that it is fine)

    def _match_each(
        self, headers: Any, hashes: Sequence[bytes], start: int, sums: list[int]
    ) -> tuple[list[int], tuple[int, MissReason] | None]:
        view = memoryview(headers).cast("B")
        for i in range(start, len(hashes)):
            checksum = self.match(view[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], hashes[i])
            if isinstance(checksum, MissReason):
                return sums, (i, checksum)
            sums.append(checksum)
        return sums, None

    def parse(self, header: Any, block_hash: bytes) -> BlockHeader | MissReason:
        """``match`` as a parsed header (what ``check_header`` answers for a valid one)."""
        checksum = self.match(header, block_hash)
        if isinstance(checksum, MissReason):
            return checksum
        return BlockHeader(self.namespace, block_hash, self.layout, self.layout.payload_nbytes, checksum)


class BlockCodec:
    """Encodes and decodes the blocks of one namespace and one layout (what one engine stores)."""

    def __init__(self, namespace_id: str | bytes, layout: BlockLayout) -> None:
        self.namespace = namespace_bytes(namespace_id)
        self.layout = layout

    @property
    def payload_nbytes(self) -> int:
        return self.layout.payload_nbytes

    def header(self, block_hash: bytes, checksum: int) -> bytes:
        return pack_header(self.namespace, block_hash, self.layout, checksum)

    def header_of(self, block_hash: bytes, payload: Any) -> bytes:
        """The header of ``payload``, computing its checksum."""
        return pack_header(self.namespace, block_hash, self.layout, payload_checksum(payload))

    def sealer(self, block_hash: bytes) -> Callable[[memoryview], bytes]:
        """A ``Unit.sealer``: computes the header over whichever stable copy the first tier holds."""
        return partial(self.header_of, block_hash)

    def check_header(self, buf: Any, block_hash: bytes) -> BlockHeader | MissReason:
        return check_header(buf, self.namespace, block_hash, self.layout)

    def encode(self, block_hash: bytes, payload: Any) -> bytes:
        """Header and payload as one ``bytes`` (a copy: for tests and tools, not for the data path)."""
        check_block_hash(block_hash)
        view = memoryview(payload).cast("B")
        if view.nbytes != self.payload_nbytes:
            raise ValueError(
                f"payload is {view.nbytes} bytes; layout {self.layout.describe()} needs {self.payload_nbytes}"
            )
        return self.header_of(block_hash, view) + view.tobytes()

    def decode_into(self, block_hash: bytes, data: Any, dst: Any) -> MissReason | None:
        """Check a contiguous encoded block and copy its payload into ``dst``; ``None`` on success."""
        view = memoryview(data).cast("B")
        header = self.check_header(view, block_hash)
        if isinstance(header, MissReason):
            return header
        payload = view[HEADER_SIZE:]
        reason = verify_payload(header, payload)
        if reason is not None:
            return reason
        out = memoryview(dst).cast("B")
        if out.nbytes != header.payload_len:
            return MissReason.WRONG_LAYOUT
        out[:] = payload
        return None
