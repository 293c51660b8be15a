"""The p2p protocol: how a decode engine's puller reads a finished prefill's blocks from the prefill
engine's block server (``connectors.p2p_server``), one frozen message per kind.

The producer leases a request's blocks when it finishes; the consumer reads them by the lease's id
(``rid``, the producer's request id) and releases the lease when done.  Framing: ``wire.framing``;
blocks: ``wire.units``::

    read     {"v", "op": "read", "id", "rid": str, "first": int, "hashes": [bin]}
             blocks [first, first + len(hashes)) of lease ``rid``; ``hashes`` are the consumer's own:
             the producer serves only if they are the leased blocks' hashes.
    release  {"v", "op": "release", "id", "rid"}      the consumer is done with the lease.  No reply.
    ping     {"v", "op": "ping", "id"}
    data     {"v", "id", "ok": true, "first": int, "n": int} + unit headers + n payloads
    pong     {"v", "id", "ok": true, "info": map}                  (``wire.framing.InfoReply``)
    error    {"v", "id", "ok": false, "error": code, "msg": str}   (``wire.framing.ErrorReply``)

``unknown_lease`` is transient (the producer registers a lease one engine step after the request
finished; a fast consumer retries until its pull deadline); every other error code is final.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.framing import (
    ErrorReply,
    InfoReply,
    ProtocolError,
    answer_or_refusal,
    count,
    pack,
    peek_id,
    u64,
    unpack,
    with_id,
)

MAX_READ_BLOCKS = 4096
MAX_LEASE_ID_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ReadRequest:
    id: int
    rid: str
    first: int
    hashes: tuple[bytes, ...]

    def encode(self) -> bytes:
        return pack(
            {"op": "read", "id": self.id, "rid": self.rid, "first": self.first, "hashes": list(self.hashes)}
        )


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    id: int
    rid: str

    def encode(self) -> bytes:
        return pack({"op": "release", "id": self.id, "rid": self.rid})


@dataclass(frozen=True, slots=True)
class PingRequest:
    id: int

    def encode(self) -> bytes:
        return pack({"op": "ping", "id": self.id})


@dataclass(frozen=True, slots=True)
class DataReply:
    """The header of a data reply; the unit headers and ``n`` payload frames follow it."""

    id: int
    first: int
    n: int

    def encode(self) -> bytes:
        return pack({"id": self.id, "ok": True, "first": self.first, "n": self.n})


P2PRequest = ReadRequest | ReleaseRequest | PingRequest
P2PReply = DataReply | InfoReply | ErrorReply


def decode_p2p_request(frame: Any) -> P2PRequest:
    """Parse a p2p request header frame; ``ProtocolError`` says what is wrong (and carries the id)."""
    body = unpack(frame, max_array_len=MAX_READ_BLOCKS + 1, max_str_len=MAX_LEASE_ID_CHARS)
    request_id = peek_id(body)
    try:
        request_id = u64(body, "id")
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
        first = count(body, "first")
        hashes = body.get("hashes")
        if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_READ_BLOCKS:
            raise ProtocolError(f"'hashes' must list 1 to {MAX_READ_BLOCKS} block hashes")
        if not all(isinstance(h, bytes) and len(h) in (16, 32) for h in hashes):
            raise ProtocolError("every entry of 'hashes' must be a 16- or 32-byte binary")
        return ReadRequest(request_id, rid, first, tuple(hashes))
    except ProtocolError as exc:
        raise with_id(request_id, exc) from None


def decode_p2p_reply(frame: Any) -> P2PReply:
    """Parse a p2p reply header frame; ``ProtocolError`` for anything this protocol does not produce."""
    body = unpack(frame, max_array_len=64, max_str_len=MAX_LEASE_ID_CHARS)
    request_id = u64(body, "id")
    shared = answer_or_refusal(body, request_id)
    if shared is not None:
        return shared
    try:
        return DataReply(request_id, count(body, "first"), count(body, "n"))
    except ProtocolError as exc:
        raise with_id(request_id, exc) from None
