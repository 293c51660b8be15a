"""KV cache events: what a prefix-aware router consumes to know which node holds which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from wire.framing import unpack_bounded
from wire.keys import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached.  ``token_ids`` covers exactly those blocks, in order (empty, with
    ``block_size`` 0, from a store, which keeps bytes, not tokens)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    adapter: str | None = None  # the adapter (name@digest) the blocks were computed under
    medium: str = "local"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted (their hashes are no longer findable here)."""

    block_hashes: list[BlockHash]
    medium: str = "local"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    medium: str = field(default="local")


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


# ---- on the wire ----------------------------------------------------------------------------------------
#
# A publisher (a node's engine, the store server) sends *batches*, one msgpack frame each:
#
#     {"v": 1, "pub": str, "epoch": str, "seq": u64, "ts": float, "dropped": u64,
#      "events": [["stored", [hash, ...], parent | nil, [token, ...], block_size, medium],
#                 ["removed", [hash, ...], medium],
#                 ["cleared", medium], ...]}
#
# ``epoch`` is a fresh random id each time the publisher starts: a subscriber that sees a new epoch
# forgets everything the old one told it.  ``seq`` counts batches from 1 within an epoch: a subscriber
# that sees a jump asks the publisher's replay socket for the missing batches (or, when they are gone,
# forgets the publisher's blocks and starts over).  ``dropped`` counts batches the publisher could not
# queue since the last one it sent: their sequence numbers were skipped, so the gap is visible too.

EVENTS_VERSION = 1
MAX_EVENT_FRAME_BYTES = 16 << 20
MAX_EVENTS_PER_BATCH = 65536


class EventDecodeError(ValueError):
    """A frame that is not an event batch; the text says what is wrong."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    publisher: str
    epoch: str
    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]
    dropped: int = 0

    def encode(self) -> bytes:
        body = {
            "v": EVENTS_VERSION,
            "pub": self.publisher,
            "epoch": self.epoch,
            "seq": self.seq,
            "ts": self.ts,
            "dropped": self.dropped,
            "events": [_encode_event(e) for e in self.events],
        }
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, frame: bytes | memoryview) -> EventBatch:
        """Parse one batch frame; ``EventDecodeError`` for anything that is not one (bounded: a hostile or
        garbled frame costs at most its size)."""
        body = unpack_bounded(
            frame,
            max_bytes=MAX_EVENT_FRAME_BYTES,
            max_str_len=256,
            max_array_len=MAX_EVENTS_PER_BATCH,
            error=EventDecodeError,
        )
        if not isinstance(body, dict) or body.get("v") != EVENTS_VERSION:
            raise EventDecodeError(f"not an event batch of version {EVENTS_VERSION}")
        publisher, epoch, seq, ts, dropped = (body.get(k) for k in ("pub", "epoch", "seq", "ts", "dropped"))
        if not isinstance(publisher, str) or not publisher or not isinstance(epoch, str) or not epoch:
            raise EventDecodeError("a batch names its publisher and epoch")
        if not isinstance(seq, int) or seq < 1 or not isinstance(dropped, int) or dropped < 0:
            raise EventDecodeError("seq must be a positive int and dropped a non-negative int")
        if not isinstance(ts, (int, float)):
            raise EventDecodeError("ts must be a number")
        events = body.get("events")
        if not isinstance(events, list):
            raise EventDecodeError("events must be a list")
        return cls(publisher, epoch, seq, float(ts), tuple(_decode_event(e) for e in events), dropped)


def _encode_event(event: KVCacheEvent) -> list[object]:
    if isinstance(event, BlockStored):
        return [
            "stored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["removed", list(event.block_hashes), event.medium]
    return ["cleared", event.medium]


def _hashes(value: object, what: str) -> list[BlockHash]:
    if not isinstance(value, list) or not all(isinstance(h, bytes) and len(h) in (16, 32) for h in value):
        raise EventDecodeError(f"{what}: block hashes must be a list of 16- or 32-byte binaries")
    return [BlockHash(h) for h in value]


def _medium(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 64:
        raise EventDecodeError(f"medium must be a short string, got {value!r}")
    return value


def _decode_event(raw: object) -> KVCacheEvent:
    if not isinstance(raw, list) or not raw:
        raise EventDecodeError("an event must be a non-empty list")
    kind = raw[0]
    if kind == "stored" and len(raw) == 6:
        _, hashes, parent, tokens, block_size, medium = raw
        if parent is not None and not (isinstance(parent, bytes) and len(parent) in (16, 32)):
            raise EventDecodeError("stored: the parent hash must be a 16- or 32-byte binary or nil")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EventDecodeError("stored: token ids must be a list of ints")
        if not isinstance(block_size, int) or block_size < 0:
            raise EventDecodeError("stored: block_size must be a non-negative int (0: not known)")
        return BlockStored(
            _hashes(hashes, "stored"),
            BlockHash(parent) if parent is not None else None,
            tokens,
            block_size,
            medium=_medium(medium),
        )
    if kind == "removed" and len(raw) == 3:
        return BlockRemoved(_hashes(raw[1], "removed"), medium=_medium(raw[2]))
    if kind == "cleared" and len(raw) == 2:
        return AllBlocksCleared(medium=_medium(raw[1]))
    raise EventDecodeError(f"unknown event {str(kind)[:32]!r} of {len(raw)} fields")


# ---- replay ---------------------------------------------------------------------------------------------
#
# A subscriber that missed batches asks the publisher's replay socket (a ROUTER; the subscriber connects a
# DEALER) for every batch from a sequence number on:
#
#     request  {"v": 1, "id": u64, "from": seq}
#     reply    [{"v": 1, "id": u64, "epoch": str, "oldest": seq, "last": seq, "gone": bool}, batch, ...]
#
# ``gone``: the batches asked for are older than the publisher keeps (the subscriber starts over).

MAX_REPLAY_REQUEST_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    id: int
    start: int

    def encode(self) -> bytes:
        return msgpack.packb({"v": EVENTS_VERSION, "id": self.id, "from": self.start})  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, frame: bytes | memoryview) -> ReplayRequest:
        body = unpack_bounded(
            frame, max_bytes=MAX_REPLAY_REQUEST_BYTES, max_array_len=0, max_map_len=8, error=EventDecodeError
        )
        if not isinstance(body, dict) or body.get("v") != EVENTS_VERSION:
            raise EventDecodeError(f"not a replay request of version {EVENTS_VERSION}")
        request_id, start = body.get("id", 0), body.get("from")
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            raise EventDecodeError("'from' must be a positive sequence number")
        if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
            raise EventDecodeError("'id' must be a non-negative int")
        return cls(request_id, start)


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """The header frame of a replay reply; the batch frames follow it (none when ``gone``)."""

    id: int
    epoch: str
    oldest: int
    last: int
    gone: bool

    def encode(self) -> bytes:
        body = {
            "v": EVENTS_VERSION,
            "id": self.id,
            "epoch": self.epoch,
            "oldest": self.oldest,
            "last": self.last,
        }
        return msgpack.packb({**body, "gone": self.gone})  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, frame: bytes | memoryview) -> ReplayReply:
        body = unpack_bounded(
            frame,
            max_bytes=MAX_REPLAY_REQUEST_BYTES,
            max_array_len=0,
            max_str_len=256,
            error=EventDecodeError,
        )
        if not isinstance(body, dict) or body.get("v") != EVENTS_VERSION:
            raise EventDecodeError(f"not a replay reply of version {EVENTS_VERSION}")
        request_id, epoch, oldest, last, gone = (
            body.get(k) for k in ("id", "epoch", "oldest", "last", "gone")
        )
        if not isinstance(epoch, str) or not isinstance(gone, bool):
            raise EventDecodeError("a replay reply names its epoch and whether the batches are gone")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (request_id, oldest, last)
        ):
            raise EventDecodeError("id, oldest and last must be non-negative ints")
        return cls(request_id, epoch, oldest, last, gone)  # type: ignore[arg-type]
