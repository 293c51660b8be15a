"""The store server's wire protocol (ZeroMQ DEALER -> ROUTER), version 1.

Every message is one msgpack *header frame*, then raw frames sent without copies:

    request   [header, (put only) unit headers, payload 0, payload 1, ...]
    reply     [header, (get only) unit headers, payload 0, payload 1, ...]

    request header  {"v": 1, "id": u64, "op": "ping" | "lookup" | "get" | "put" | "delete" | "stats",
                     "ns": 16 bytes, "start": int, "hashes": [bytes], "anchors": [bytes]}
    reply header    {"v": 1, "id": u64, "ok": bool, "n": int, "reason": str | None, "error": str | None,
                     "info": map | None}
    unit headers    n x 96 bytes: the codec header of each block, in order (``kvstore.codec``)
    payload i       the payload of block i, exactly the length its header names

``n`` is the answer: leading blocks found (lookup), blocks sent (get), blocks stored (put), blocks deleted
(delete).  ``reason`` is the ``MissReason`` of the block after the last one served.  ``ok`` is false only
for a request the server refused (malformed, oversized, unknown op); ``error`` then says why.  Replies
carry the request's ``id``: a client drops a reply whose id is not the one it waits for (the late answer to
a request it gave up on).  ``ns``, ``start``, ``hashes`` and ``anchors`` describe a ``KeyRun``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvstore.keys import ANCHOR_SPAN, KeyRun

PROTOCOL_VERSION = 1
OPS = frozenset({"ping", "lookup", "get", "put", "delete", "stats"})
RUN_OPS = frozenset({"lookup", "get", "put", "delete"})
MAX_HEADER_FRAME = 1 << 20


class ProtocolError(ValueError):
    """A message that does not follow this protocol; the text says what is wrong."""


@dataclass(frozen=True)
class Limits:
    """What one request may carry; larger requests are refused with an error reply."""

    max_blocks: int = 8192
    max_unit_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.max_blocks <= 0 or self.max_unit_bytes <= 0:
            raise ValueError("server limits must be positive")


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    run: KeyRun | None


@dataclass(frozen=True)
class Reply:
    id: int
    ok: bool
    n: int
    reason: str | None
    error: str | None
    info: dict[str, Any] | None


def encode_request(request_id: int, op: str, run: KeyRun | None = None) -> bytes:
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request_id, "op": op}
    if run is not None:
        body.update(ns=run.namespace, start=run.start, hashes=list(run.hashes), anchors=list(run.anchors))
    return msgpack.packb(body, use_bin_type=True)


def decode_request(frame: Any, limits: Limits) -> Request:
    """Parse a request header frame; ``ProtocolError`` says what is wrong."""
    body = _unpack(frame, max_array_len=limits.max_blocks + 1, max_map_len=16, max_str_len=64)
    request_id = body.get("id")
    if not isinstance(request_id, int) or request_id < 0:
        raise ProtocolError("request id must be a non-negative int")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {body.get('v')!r} is not supported (server speaks {PROTOCOL_VERSION})"
        )
    op = body.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; ops: {', '.join(sorted(OPS))}")
    if op not in RUN_OPS:
        return Request(request_id, op, None)
    hashes = body.get("hashes")
    anchors = body.get("anchors")
    if not isinstance(hashes, list) or not isinstance(anchors, list):
        raise ProtocolError(f"{op} needs hashes and anchors lists")
    if len(hashes) > limits.max_blocks:
        raise ProtocolError(f"{len(hashes)} blocks in one request; the limit is {limits.max_blocks}")
    if len(anchors) > len(hashes) // ANCHOR_SPAN + 2:
        raise ProtocolError("too many anchors")
    try:
        run = KeyRun.from_wire(body.get("ns"), hashes, body.get("start"), anchors)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return Request(request_id, op, run)


def encode_reply(
    request_id: int,
    *,
    ok: bool = True,
    n: int = 0,
    reason: str | None = None,
    error: str | None = None,
    info: dict[str, Any] | None = None,
) -> bytes:
    body = {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": ok,
        "n": n,
        "reason": reason,
        "error": error,
        "info": info,
    }
    return msgpack.packb(body, use_bin_type=True)


def decode_reply(frame: Any) -> Reply:
    body = _unpack(frame, max_array_len=1024, max_map_len=4096, max_str_len=1 << 16)
    request_id, n = body.get("id"), body.get("n", 0)
    if body.get("v") != PROTOCOL_VERSION or not isinstance(request_id, int) or not isinstance(n, int):
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


def _unpack(frame: Any, *, max_array_len: int, max_map_len: int, max_str_len: int) -> dict[str, Any]:
    data = memoryview(frame)
    if data.nbytes > MAX_HEADER_FRAME:
        raise ProtocolError(f"header frame of {data.nbytes} bytes; the limit is {MAX_HEADER_FRAME}")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            max_bin_len=64,
            max_str_len=max_str_len,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            strict_map_key=True,
        )
    except Exception as exc:  # msgpack raises several types for bad input; all mean the same here
        raise ProtocolError(f"header frame is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("header frame must be a msgpack map")
    return body


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def send_frames(
    sock: zmq.Socket[Any], frames: Sequence[Any], *, track: bool = False
) -> zmq.MessageTracker | None:
    """Send ``frames`` as one message without copying its large frames; with ``track``, a tracker that is
    done once ZeroMQ has let go of every frame it did not copy.

    Only one frame is tracked: the last one ZeroMQ takes without a copy (pyzmq copies frames under its
    ``copy_threshold``, and those hold no caller memory).  ZeroMQ releases the frames of one message in
    order, so that one released means all are.  (pyzmq's ``send_multipart(track=True)`` tracks every
    frame, at about 40 us each, and returns the last one's tracker, which is done at once when that frame
    was small.)  A ``zmq.Frame`` among ``frames`` goes out sharing its buffer (by reference count).  Raises
    what ``Socket.send`` raises.
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
    for i, frame in enumerate(frames):
        flags = 0 if i == last else zmq.SNDMORE
        if i == tracked:
            tracker = sock.send(frame, flags, copy=False, track=True)
        else:
            sock.send(frame, flags, copy=False)
    return tracker


def _nbytes(frame: Any) -> int:
    return len(frame) if isinstance(frame, zmq.Frame) else memoryview(frame).nbytes
