"""Framing every ZeroMQ protocol of ours shares: the header frame, its bounded parse, the one error reply,
and sending a message's frames without copies.

Every message is one msgpack *header frame* (a map with ``"v"``, at most ``MAX_HEADER_BYTES``), then -- in
messages that carry blocks -- the unit headers frame and one payload frame per block (``wire.units``).
The store protocol (``wire.store_protocol``) and the p2p protocol (``wire.p2p_protocol``) are two sets of
messages over this framing; KV event batches (``wire.kv_events``) use its bounded parse.

A peer refuses a message it cannot use with **one** error reply, and answers about itself (a ping) with
one info reply, whatever the protocol::

    {"v", "id", "ok": false, "error": code, "msg": str}     (``ErrorCode``; ``msg`` at most 512 chars)
    {"v", "id", "ok": true, "info": map}

``id`` is the refused message's id when one could be read, else 0.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from wire.layout import BlockLayout

PROTOCOL_VERSION = 3
MAX_HEADER_BYTES = 1 << 20
MAX_ERROR_CHARS = 512
_U64 = 1 << 64


class ErrorCode(str, enum.Enum):
    """Why a peer refused a message.  Only ``UNKNOWN_LEASE`` is worth retrying."""

    MALFORMED = "malformed"  # not this protocol (bad msgpack, wrong types, extra frames, over a limit)
    VERSION = "version"  # another protocol version
    UNKNOWN_LEASE = "unknown_lease"  # p2p: no such lease (yet): the producer may not have registered it
    RELEASED = "released"  # p2p: the lease ended: acknowledged, stopped or aborted
    EXPIRED = "expired"  # p2p: the lease's time ran out
    BAD_RANGE = "bad_range"  # p2p: block indices outside the lease, or more than one read may carry
    HASH_MISMATCH = "hash_mismatch"  # p2p: the consumer's hashes are not the leased blocks' hashes
    INTERNAL = "internal"  # the peer failed serving it (a bug: logged there)


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong.  ``request_id`` is the
    message's id when one could be read (so the refusal can still be matched), ``code`` the reply's code."""

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.MALFORMED, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The one refusal every protocol of ours sends."""

    id: int
    code: ErrorCode
    msg: str

    def encode(self) -> bytes:
        return pack({"id": self.id, "ok": False, "error": self.code.value, "msg": self.msg[:MAX_ERROR_CHARS]})

    @classmethod
    def of(cls, exc: ProtocolError) -> ErrorReply:
        return cls(exc.request_id, exc.code, str(exc))

    @classmethod
    def from_body(cls, body: dict[Any, Any]) -> ErrorReply:
        """The error reply in a parsed header whose ``ok`` is false."""
        request_id = peek_id(body)
        try:
            code = ErrorCode(body.get("error"))
        except ValueError:
            raise ProtocolError(f"unknown error code {body.get('error')!r}", request_id=request_id) from None
        msg = body.get("msg")
        return cls(request_id, code, msg if isinstance(msg, str) else "")


@dataclass(frozen=True, slots=True)
class InfoReply:
    """A peer's answer about itself (a ping's, the store's stats), the same in every protocol of ours."""

    id: int
    info: dict[str, Any]

    def encode(self) -> bytes:
        return pack({"id": self.id, "ok": True, "info": self.info})


def answer_or_refusal(body: dict[Any, Any], request_id: int) -> ErrorReply | InfoReply | None:
    """The replies every protocol shares, from a parsed reply header: the refusal (``ok`` false), the
    info reply, or None for a protocol's own reply (``ok`` true, no ``info``)."""
    ok = body.get("ok")
    if ok is False:
        return ErrorReply.from_body(body)
    if ok is not True:
        raise ProtocolError("'ok' must be a bool", request_id=request_id)
    if "info" not in body:
        return None
    info = body["info"]
    if not isinstance(info, dict):
        raise ProtocolError("'info' must be a map", request_id=request_id)
    return InfoReply(request_id, info)


def unpack_bounded(
    frame: Any,
    *,
    max_bytes: int,
    max_array_len: int,
    max_map_len: int = 16,
    max_str_len: int = 64,
    max_bin_len: int = 64,
    error: type[ValueError] = ProtocolError,
) -> Any:
    """msgpack within bounds: a hostile or garbled frame costs at most its size.  ``error`` (raised for
    anything that is not msgpack within them) lets each protocol keep its own failure type."""
    view = memoryview(frame)
    if view.nbytes > max_bytes:
        raise error(f"a frame of {view.nbytes} bytes; the limit is {max_bytes}")
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            max_bin_len=max_bin_len,
            max_str_len=max_str_len,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            strict_map_key=True,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input; all mean the same here
        detail = f"{type(exc).__name__}: {exc}"[:160]  # e.g. "ValueError: 9 exceeds max_array_len(3)"
        raise error(f"not valid msgpack within this frame's limits ({detail})") from None


def pack(body: dict[str, Any]) -> bytes:
    """A header frame: ``body`` with the protocol version."""
    return msgpack.packb({"v": PROTOCOL_VERSION, **body}, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(frame: Any, *, max_array_len: int, max_map_len: int = 16, max_str_len: int = 64) -> dict[Any, Any]:
    """Parse a header frame within bounds and check its version; ``ProtocolError`` says what is wrong."""
    body = unpack_bounded(
        frame,
        max_bytes=MAX_HEADER_BYTES,
        max_array_len=max_array_len,
        max_map_len=max_map_len,
        max_str_len=max_str_len,
    )
    if not isinstance(body, dict):
        raise ProtocolError(f"header frame must be a msgpack map, got {type(body).__name__}")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {body.get('v')!r} is not supported (this peer speaks {PROTOCOL_VERSION})",
            code=ErrorCode.VERSION,
            request_id=peek_id(body),
        )
    return body


def peek_id(body: Any) -> int:
    """The message's id when it has a valid one, else 0."""
    value = body.get("id") if isinstance(body, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64 else 0


def peek_frame_id(frame: Any) -> int:
    """The id of a header frame we refuse, when one can be read (else 0)."""
    try:
        return peek_id(unpack(frame, max_array_len=1 << 16, max_map_len=64, max_str_len=1 << 16))
    except ProtocolError:
        return 0


def u64(body: dict[Any, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64:
        raise ProtocolError(f"{key!r} must be an unsigned 64-bit int, got {value!r}")
    return value


def count(body: dict[Any, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{key!r} must be a non-negative int, got {value!r}")
    return value


def with_id(request_id: int, exc: ProtocolError) -> ProtocolError:
    """``exc``, matched to the message it refuses."""
    exc.request_id = request_id
    return exc


def layout_to_wire(layout: BlockLayout) -> list[int]:
    return [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype_code]


def layout_from_wire(value: Any) -> BlockLayout:
    if not isinstance(value, list) or len(value) != 5 or not all(isinstance(v, int) for v in value):
        raise ProtocolError("'layout' must be [num_layers, num_kv_heads, head_dim, block_size, dtype code]")
    try:
        layers, heads, head_dim, block_size, dtype_code = value
        return BlockLayout.from_code(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype_code=dtype_code,
        )
    except ValueError as exc:
        raise ProtocolError(f"'layout' is not a layout: {exc}") from None


def send_frames(
    sock: zmq.Socket[Any], frames: Sequence[Any], *, track: bool = False, nonblocking: bool = False
) -> zmq.MessageTracker | None:
    """Send ``frames`` as one message without copying its large frames; with ``track``, a tracker that is
    done once ZeroMQ has let go of every frame it did not copy.

    Only one frame is tracked: the last one ZeroMQ takes without a copy (pyzmq copies frames under its
    ``copy_threshold``, and those hold no caller memory).  ZeroMQ releases the frames of one message in
    order, so that one released means all are.  (pyzmq's ``send_multipart(track=True)`` tracks every
    frame, at about 40 us each, and returns the last one's tracker, which is done at once when that frame
    was small.)  A ``zmq.Frame`` among ``frames`` goes out sharing its buffer (by reference count).  Raises
    what ``Socket.send`` raises; ``nonblocking`` raises ``zmq.Again`` instead of waiting for room (a
    message is queued whole or not at all).
    """
    frames = list(frames)
    tracked = -1
    if track:
        threshold = sock.copy_threshold
        for i in range(len(frames) - 1, -1, -1):
            if not isinstance(frames[i], bytes) and _nbytes(frames[i]) >= threshold:
                tracked = i
                break
        received = frames[tracked] if tracked >= 0 else None
        if isinstance(received, zmq.Frame) and received.tracker is None:
            # A received frame cannot be tracked: send a new zero-copy frame over its buffer instead.
            frames[tracked] = received.buffer
    tracker: zmq.MessageTracker | None = zmq.MessageTracker() if track else None  # nothing to wait for
    last = len(frames) - 1
    base = zmq.NOBLOCK if nonblocking else 0
    for i, frame in enumerate(frames):
        flags = base if i == last else base | zmq.SNDMORE
        if i == tracked:
            tracker = sock.send(frame, flags, copy=False, track=True)
        else:
            sock.send(frame, flags, copy=False)
    return tracker


def _nbytes(frame: Any) -> int:
    return len(frame) if isinstance(frame, zmq.Frame) else memoryview(frame).nbytes


def more(sock: zmq.Socket[Any]) -> bool:
    """Whether the message being received has another frame."""
    return bool(sock.getsockopt(zmq.RCVMORE))


def drain(sock: zmq.Socket[Any]) -> None:
    """Discard the rest of the message being received (its frames are all there once the first arrived)."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK, copy=False)
