"""The store protocol: what the ``remote:`` tier asks a store server (``kvstore.server``), one frozen
message per op.  It knows blocks -- namespaces, hashes, layouts -- and nothing of requests.

Topology: the server binds a ROUTER; clients connect DEALER sockets (never REQ/REP: a timed-out REQ
socket is stuck).  Framing: ``wire.framing``; blocks: ``wire.units``.  Every message has an ``id``: the
reply to a message carries its id, and a client drops a reply whose id it no longer waits for (the late
answer to a call it gave up on).

Requests (``StoreRequest``)::

    ping | stats     {"v", "id", "op"}
    lookup | delete  {"v", "id", "op", "ns": 16 bytes, "start": int, "hashes": [bin], "anchors": [bin]}
    get              ... + "layout": [num_layers, num_kv_heads, head_dim, block_size, dtype code]
    put              ... + "layout" + unit headers + payloads

Replies::

    count   {"v", "id", "ok": true, "n": int, "reason": str|nil}    lookup, get (+ blocks), put, delete
    info    {"v", "id", "ok": true, "info": map}                     ping, stats
    error   {"v", "id", "ok": false, "error": code, "msg": str}      (``wire.framing.ErrorReply``)

``n``: leading blocks found (lookup), sent (get), stored (put), deleted (delete).  ``reason`` is the
``MissReason`` of the block after the last one served.  An error reply answers a request the server
refused (malformed, oversized, unknown op) or failed.  A get or put names the layout its blocks must
have: the server checks every block it accepts and every block it returns against the run's namespace
and that layout, and drops a block that fails from the tier it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wire.framing import (
    ErrorReply,
    InfoReply,
    ProtocolError,
    answer_or_refusal,
    layout_from_wire,
    layout_to_wire,
    pack,
    peek_id,
    unpack,
    with_id,
)
from wire.keys import ANCHOR_SPAN, KeyRun
from wire.layout import BlockLayout
from wire.reasons import MissReason


@dataclass(frozen=True)
class Limits:
    """What one store request may carry; larger requests are refused with an error reply."""

    max_blocks: int = 8192
    max_unit_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.max_blocks <= 0 or self.max_unit_bytes <= 0:
            raise ValueError("server limits must be positive")


def _run_body(run: KeyRun) -> dict[str, Any]:
    return {"ns": run.namespace, "start": run.start, "hashes": list(run.hashes), "anchors": list(run.anchors)}


@dataclass(frozen=True, slots=True)
class Ping:
    """Is the server there, and what does it hold (its tiers, which are degraded)?"""

    id: int
    op: ClassVar[str] = "ping"

    def encode(self) -> bytes:
        return pack({"id": self.id, "op": self.op})


@dataclass(frozen=True, slots=True)
class Stats:
    """The server's tier counters and request counts."""

    id: int
    op: ClassVar[str] = "stats"

    def encode(self) -> bytes:
        return pack({"id": self.id, "op": self.op})


@dataclass(frozen=True, slots=True)
class Lookup:
    """How many leading blocks of ``run`` the server holds."""

    id: int
    run: KeyRun
    op: ClassVar[str] = "lookup"

    def encode(self) -> bytes:
        return pack({"id": self.id, "op": self.op, **_run_body(self.run)})


@dataclass(frozen=True, slots=True)
class Delete:
    """Drop ``run``'s blocks from every tier."""

    id: int
    run: KeyRun
    op: ClassVar[str] = "delete"

    def encode(self) -> bytes:
        return pack({"id": self.id, "op": self.op, **_run_body(self.run)})


@dataclass(frozen=True, slots=True)
class Get:
    """The leading blocks of ``run`` held, each of ``layout``; the reply carries them."""

    id: int
    run: KeyRun
    layout: BlockLayout
    op: ClassVar[str] = "get"

    def encode(self) -> bytes:
        return pack(
            {"id": self.id, "op": self.op, **_run_body(self.run), "layout": layout_to_wire(self.layout)}
        )


@dataclass(frozen=True, slots=True)
class Put:
    """Store ``run``'s blocks, each of ``layout``; the message carries them."""

    id: int
    run: KeyRun
    layout: BlockLayout
    op: ClassVar[str] = "put"

    def encode(self) -> bytes:
        return pack(
            {"id": self.id, "op": self.op, **_run_body(self.run), "layout": layout_to_wire(self.layout)}
        )


StoreRequest = Ping | Stats | Lookup | Delete | Get | Put
OPS = {cls.op: cls for cls in (Ping, Stats, Lookup, Delete, Get, Put)}


def decode_store_request(frame: Any, limits: Limits) -> StoreRequest:
    """Parse a store request header frame; ``ProtocolError`` says what is wrong (with the id when read)."""
    body = unpack(frame, max_array_len=limits.max_blocks + 1)
    request_id = peek_id(body)
    raw_id = body.get("id")
    if not isinstance(raw_id, int) or isinstance(raw_id, bool) or raw_id < 0 or raw_id != request_id:
        raise ProtocolError("request id must be an unsigned 64-bit int")
    try:
        op = body.get("op")
        if op not in OPS:
            raise ProtocolError(f"unknown op {op!r}; ops: {', '.join(sorted(OPS))}")
        if op == "ping":
            return Ping(request_id)
        if op == "stats":
            return Stats(request_id)
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
        if op == "lookup":
            return Lookup(request_id, run)
        if op == "delete":
            return Delete(request_id, run)
        if "layout" not in body:
            raise ProtocolError(f"{op} needs the 'layout' its blocks must have")
        layout = layout_from_wire(body["layout"])
        return Get(request_id, run, layout) if op == "get" else Put(request_id, run, layout)
    except ProtocolError as exc:
        raise with_id(request_id, exc) from None


@dataclass(frozen=True, slots=True)
class CountReply:
    """How many leading blocks a lookup found, a get sends (they follow), a put stored, a delete
    dropped; ``reason``: why the block after them was not."""

    id: int
    n: int
    reason: MissReason | None = None

    def encode(self) -> bytes:
        return pack(
            {"id": self.id, "ok": True, "n": self.n, "reason": self.reason.value if self.reason else None}
        )


StoreReply = CountReply | InfoReply | ErrorReply


def _reason(value: Any) -> MissReason | None:
    if value is None:
        return None
    try:
        return MissReason(value)
    except ValueError:
        return (
            MissReason.ERROR
        )  # a reason this build does not know: the server failed in a way we cannot name


def decode_store_reply(frame: Any) -> StoreReply:
    """Parse a store reply header frame; ``ProtocolError`` for anything the server does not send."""
    body = unpack(frame, max_array_len=1024, max_map_len=4096, max_str_len=1 << 16)
    request_id = peek_id(body)
    shared = answer_or_refusal(body, request_id)
    if shared is not None:
        return shared
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ProtocolError(f"'n' must be a non-negative int, got {n!r}", request_id=request_id)
    return CountReply(request_id, n, _reason(body.get("reason")))
