"""KV cache events: what a prefix-aware router consumes to know which node holds which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached.  ``token_ids`` covers exactly those blocks, in order (empty, with
    ``block_size`` 0, from a store, which keeps bytes, not tokens)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
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


def encode_batch(batch: EventBatch) -> bytes:
    import msgpack

    body = {
        "v": EVENTS_VERSION,
        "pub": batch.publisher,
        "epoch": batch.epoch,
        "seq": batch.seq,
        "ts": batch.ts,
        "dropped": batch.dropped,
        "events": [_encode_event(e) for e in batch.events],
    }
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


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


def decode_batch(frame: bytes | memoryview) -> EventBatch:
    """Parse one batch frame; ``EventDecodeError`` for anything that is not one (bounded: a hostile or
    garbled frame costs at most its size)."""
    import msgpack

    data = memoryview(frame)
    if data.nbytes > MAX_EVENT_FRAME_BYTES:
        raise EventDecodeError(f"an event frame of {data.nbytes} bytes; the limit is {MAX_EVENT_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_bin_len=64,
            max_str_len=256,
            max_array_len=MAX_EVENTS_PER_BATCH,
            max_map_len=16,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EventDecodeError(f"not msgpack: {type(exc).__name__}") from None
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
    return EventBatch(publisher, epoch, seq, float(ts), tuple(_decode_event(e) for e in events), dropped)
