"""The one ZeroMQ block protocol, version 2: the store server's ops and the p2p transfer's, one framing.

Topology: the server side binds a ROUTER (the store server, ``kvstore.server``; a prefill engine's block
server, ``connectors.p2p_server``); clients connect DEALER sockets (the ``remote:`` tier; a decode
engine's puller).  Never REQ/REP: a timed-out REQ socket is stuck.

**Framing.**  Every message is one msgpack *header frame* (a map, at most ``MAX_HEADER_BYTES``), then --
in messages that carry blocks -- one *unit headers* frame and one raw payload frame per block::

    [header, unit headers (n x 96 bytes), payload 0, ..., payload n-1]

Each unit header is the block's codec header (``kvstore.codec``: namespace, block hash, layout, payload
length and checksum), so **every block on the wire is checked by its codec header** against what the
receiver asked for: the namespace, the block hash and the layout; then its payload against the
checksum.  Payload frames are sent without copies (``send_frames``) and received straight into their
destination (``recv_into``).

**Replies** carry their request's ``id``; a client drops a reply whose id it is not waiting for (the late
answer to a request it gave up on).  Every header has ``"v": 2``; another version is refused.

Store ops (``Request``/``Reply``)::

    request  {"v", "id", "op": ping|lookup|get|put|delete|stats,
              "ns": 16 bytes, "start": int, "hashes": [bin], "anchors": [bin],       (run ops)
              "layout": [num_layers, num_kv_heads, head_dim, block_size, dtype code]} (get, put)
             put: + unit headers + payloads
    reply    {"v", "id", "ok": bool, "n": int, "reason": str|None, "error": str|None, "info": map|None}
             get: + unit headers + payloads of the n leading blocks found

  ``n``: leading blocks found (lookup), sent (get), stored (put), deleted (delete).  ``reason`` is the
  ``MissReason`` of the block after the last one served.  ``ok`` is false only for a request the server
  refused (malformed, oversized, unknown op); ``error`` says why.  A get or put names the layout it
  expects: the server checks every block it accepts and every block it returns against the run's
  namespace and that layout, and drops a block that fails from the tier it came from.

p2p ops (``ReadRequest``/``ReleaseRequest``/``PingRequest``; ``DataReply``/``ErrorReply``/``Pong``)::

    read     {"v", "op": "read", "id", "rid": str, "first": int, "hashes": [bin]}
             blocks [first, first + len(hashes)) of the lease of request ``rid``; ``hashes`` are the
             consumer's own: the producer serves only if they are the leased blocks' hashes.
    release  {"v", "op": "release", "id", "rid"}      the consumer is done with the lease.  No reply.
    ping     {"v", "op": "ping", "id"}
    data     {"v", "id", "ok": true, "first": int, "n": int} + unit headers + n payloads
    error    {"v", "id", "ok": false, "error": code, "msg": str}   (``ErrorCode``)
    pong     {"v", "id", "ok": true, "info": map}

  ``unknown_lease`` is transient (the producer registers a lease one engine step after the request
  finished; a fast consumer retries until its pull deadline); every other error code is final.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvstore.codec import HEADER_SIZE
from kvstore.keys import ANCHOR_SPAN, KeyRun
from wire.layout import BlockLayout

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_ID_CHARS = 1024
_U64 = 1 << 64

# ---- framing -----------------------------------------------------------------------------------------------


class ErrorCode(str, enum.Enum):
    """Why a p2p producer refused a request.  Only ``UNKNOWN_LEASE`` is worth retrying."""

    MALFORMED = "malformed"  # not this protocol (bad msgpack, wrong types, extra frames)
    VERSION = "version"  # another protocol version
    UNKNOWN_LEASE = "unknown_lease"  # no such lease (yet): the producer may not have registered it
    RELEASED = "released"  # the lease ended: acknowledged, stopped or aborted
    EXPIRED = "expired"  # the lease's time ran out
    BAD_RANGE = "bad_range"  # block indices outside the lease, or more than one read may carry
    HASH_MISMATCH = "hash_mismatch"  # the consumer's hashes are not the leased blocks' hashes
    INTERNAL = "internal"  # the producer failed serving it (a bug: logged there)


class ProtocolError(ValueError):
    """A message that does not follow this protocol; the text says what is wrong.  ``request_id`` is the
    message's id when one could be read (so a refusal can still be matched), ``code`` the p2p code."""

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.MALFORMED, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """What one store request may carry; larger requests are refused with an error reply."""

    max_blocks: int = 8192
    max_unit_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.max_blocks <= 0 or self.max_unit_bytes <= 0:
            raise ValueError("server limits must be positive")


def pack(body: dict[str, Any]) -> bytes:
    """A header frame: ``body`` with the protocol version."""
    return msgpack.packb({"v": PROTOCOL_VERSION, **body}, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(frame: Any, *, max_array_len: int, max_map_len: int = 16, max_str_len: int = 64) -> dict[Any, Any]:
    """Parse a header frame within bounds and check its version; ``ProtocolError`` says what is wrong."""
    view = memoryview(frame)
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {view.nbytes} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        body = msgpack.unpackb(
            view,
            raw=False,
            max_bin_len=64,
            max_str_len=max_str_len,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            strict_map_key=True,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input; all mean the same here
        raise ProtocolError(f"header frame is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"header frame must be a msgpack map, got {type(body).__name__}")
    request_id = peek_id(body)
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {body.get('v')!r} is not supported (this peer speaks {PROTOCOL_VERSION})",
            code=ErrorCode.VERSION,
            request_id=request_id,
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


def _u64(body: dict[Any, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64:
        raise ProtocolError(f"{key!r} must be an unsigned 64-bit int, got {value!r}")
    return value


def _count(body: dict[Any, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{key!r} must be a non-negative int, got {value!r}")
    return value


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


def unit_header(frame: Any, i: int) -> memoryview:
    """Block ``i``'s codec header in a unit headers frame."""
    return memoryview(frame)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]


def check_unit_headers(frame: Any, n: int) -> None:
    nbytes = memoryview(frame).nbytes
    if nbytes != HEADER_SIZE * n:
        raise ProtocolError(f"unit headers frame is {nbytes} bytes; {n} blocks need {HEADER_SIZE * n}")


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


def drain(sock: zmq.Socket[Any]) -> None:
    """Discard the rest of the message being received (its frames are all there once the first arrived)."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK, copy=False)


# ---- store ops ---------------------------------------------------------------------------------------------

OPS = frozenset({"ping", "lookup", "get", "put", "delete", "stats"})
RUN_OPS = frozenset({"lookup", "get", "put", "delete"})
LAYOUT_OPS = frozenset({"get", "put"})


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    run: KeyRun | None
    layout: BlockLayout | None = None


@dataclass(frozen=True)
class Reply:
    id: int
    ok: bool
    n: int
    reason: str | None
    error: str | None
    info: dict[str, Any] | None


def encode_request(
    request_id: int, op: str, run: KeyRun | None = None, layout: BlockLayout | None = None
) -> bytes:
    body: dict[str, Any] = {"id": request_id, "op": op}
    if run is not None:
        body.update(ns=run.namespace, start=run.start, hashes=list(run.hashes), anchors=list(run.anchors))
    if layout is not None:
        body["layout"] = layout_to_wire(layout)
    return pack(body)


def decode_request(frame: Any, limits: Limits) -> Request:
    """Parse a store request header frame; ``ProtocolError`` says what is wrong."""
    body = unpack(frame, max_array_len=limits.max_blocks + 1)
    request_id = body.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
        raise ProtocolError("request id must be a non-negative int")
    op = body.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; ops: {', '.join(sorted(OPS))}", request_id=request_id)
    if op not in RUN_OPS:
        return Request(request_id, op, None)
    hashes = body.get("hashes")
    anchors = body.get("anchors")
    if not isinstance(hashes, list) or not isinstance(anchors, list):
        raise ProtocolError(f"{op} needs hashes and anchors lists", request_id=request_id)
    if len(hashes) > limits.max_blocks:
        raise ProtocolError(f"{len(hashes)} blocks in one request; the limit is {limits.max_blocks}")
    if len(anchors) > len(hashes) // ANCHOR_SPAN + 2:
        raise ProtocolError("too many anchors", request_id=request_id)
    try:
        run = KeyRun.from_wire(body.get("ns"), hashes, body.get("start"), anchors)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ProtocolError(str(exc), request_id=request_id) from None
    layout = None
    if op in LAYOUT_OPS:
        if "layout" not in body:
            raise ProtocolError(f"{op} needs the 'layout' its blocks must have", request_id=request_id)
        layout = layout_from_wire(body["layout"])
    return Request(request_id, op, run, layout)


def encode_reply(
    request_id: int,
    *,
    ok: bool = True,
    n: int = 0,
    reason: str | None = None,
    error: str | None = None,
    info: dict[str, Any] | None = None,
) -> bytes:
    return pack({"id": request_id, "ok": ok, "n": n, "reason": reason, "error": error, "info": info})


def decode_reply(frame: Any) -> Reply:
    body = unpack(frame, max_array_len=1024, max_map_len=4096, max_str_len=1 << 16)
    request_id, n = body.get("id"), body.get("n", 0)
    if not isinstance(request_id, int) or not isinstance(n, int):
        raise ProtocolError("malformed reply header")
    info = body.get("info")
    return Reply(
        request_id,
        bool(body.get("ok")),
        n,
        _str_or_none(body.get("reason")),
        _str_or_none(body.get("error")),
        info if isinstance(info, dict) else None,
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# ---- p2p ops -----------------------------------------------------------------------------------------------

MAX_READ_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class ReadRequest:
    id: int
    rid: str
    first: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    id: int
    rid: str


@dataclass(frozen=True, slots=True)
class PingRequest:
    id: int


@dataclass(frozen=True, slots=True)
class DataReply:
    id: int
    first: int
    n: int


@dataclass(frozen=True, slots=True)
class ErrorReply:
    id: int
    code: ErrorCode
    msg: str


@dataclass(frozen=True, slots=True)
class Pong:
    id: int
    info: dict[str, Any]


def encode_read(request_id: int, rid: str, first: int, hashes: Sequence[bytes]) -> bytes:
    return pack({"op": "read", "id": request_id, "rid": rid, "first": first, "hashes": list(hashes)})


def encode_release(request_id: int, rid: str) -> bytes:
    return pack({"op": "release", "id": request_id, "rid": rid})


def encode_ping(request_id: int) -> bytes:
    return pack({"op": "ping", "id": request_id})


def decode_p2p_request(frame: Any) -> ReadRequest | ReleaseRequest | PingRequest:
    """Parse a p2p request header frame; ``ProtocolError`` says what is wrong (and carries the id)."""
    body = unpack(frame, max_array_len=MAX_READ_BLOCKS + 1, max_str_len=MAX_REQUEST_ID_CHARS)
    request_id = peek_id(body)
    try:
        request_id = _u64(body, "id")
        op = body.get("op")
        if op == "ping":
            return PingRequest(request_id)
        if op not in ("read", "release"):
            raise ProtocolError(f"unknown op {op!r}; ops: read, release, ping")
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise ProtocolError("'rid' must be a non-empty string")
        if op == "release":
            return ReleaseRequest(request_id, rid)
        first = _count(body, "first")
        hashes = body.get("hashes")
        if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_READ_BLOCKS:
            raise ProtocolError(f"'hashes' must list 1 to {MAX_READ_BLOCKS} block hashes")
        if not all(isinstance(h, bytes) and len(h) in (16, 32) for h in hashes):
            raise ProtocolError("every entry of 'hashes' must be a 16- or 32-byte binary")
        return ReadRequest(request_id, rid, first, tuple(hashes))
    except ProtocolError as exc:
        exc.request_id = request_id
        raise


def encode_data(request_id: int, first: int, n: int) -> bytes:
    """The header frame of a data reply; the unit headers and ``n`` payload frames follow it."""
    return pack({"id": request_id, "ok": True, "first": first, "n": n})


def encode_error(request_id: int, code: ErrorCode, msg: str) -> bytes:
    return pack({"id": request_id, "ok": False, "error": code.value, "msg": msg[:512]})


def encode_pong(request_id: int, info: dict[str, Any]) -> bytes:
    return pack({"id": request_id, "ok": True, "info": info})


def decode_p2p_reply(frame: Any) -> DataReply | ErrorReply | Pong:
    """Parse a p2p reply header frame; ``ProtocolError`` for anything this protocol does not produce."""
    body = unpack(frame, max_array_len=64, max_str_len=MAX_REQUEST_ID_CHARS)
    request_id = _u64(body, "id")
    ok = body.get("ok")
    if ok is False:
        try:
            code = ErrorCode(body.get("error"))
        except ValueError:
            raise ProtocolError(f"unknown error code {body.get('error')!r}", request_id=request_id) from None
        msg = body.get("msg")
        return ErrorReply(request_id, code, msg if isinstance(msg, str) else "")
    if ok is not True:
        raise ProtocolError("'ok' must be a bool", request_id=request_id)
    if "info" in body:
        info = body["info"]
        return Pong(request_id, info if isinstance(info, dict) else {})
    try:
        return DataReply(request_id, _count(body, "first"), _count(body, "n"))
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
