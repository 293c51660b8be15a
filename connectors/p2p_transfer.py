"""Streaming KV blocks from a prefill engine to a decode engine over ZeroMQ: the ``p2p`` wire format.

Topology: the producer's worker half binds one ZeroMQ ROUTER socket (``connectors.p2p_server``); a
consumer connects DEALER sockets to it (``connectors.p2p_client``).  Never REQ/REP: a timed-out REQ
socket is stuck.  Every message is one msgpack *header frame* (a map), followed -- in data replies only --
by raw payload frames sent without copies::

    consumer -> producer (one frame each)
      read     {"v": 1, "op": "read", "id": u64, "rid": str, "first": int, "hashes": [bin, ...]}
               blocks [first, first + len(hashes)) of the lease of request ``rid`` (indices into the
               request's block table).  ``hashes`` are the consumer's own block hashes for those blocks:
               the producer serves only if they equal the leased blocks' hashes (wrong KV is never sent).
      release  {"v": 1, "op": "release", "id": u64, "rid": str}
               the consumer is done with the lease (pulled it all, or gave up).  No reply.
      ping     {"v": 1, "op": "ping", "id": u64}

    producer -> consumer
      data     {"v": 1, "id": u64, "ok": true, "first": int, "sums": [u64, ...]}
               + len(sums) payload frames; frame j is the raw bytes of leased block ``first + j``:
                 [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] of the layout's dtype
                 (``kvstore.layout``), exactly ``layout.payload_nbytes`` bytes;
               sums[j] = xxh3_64 of payload j (``kvstore.codec.payload_checksum``).
      error    {"v": 1, "id": u64, "ok": false, "error": code, "msg": str}   (``ErrorCode``)
      pong     {"v": 1, "id": u64, "ok": true, "info": {...}}

Rules both sides keep:

- A reply carries its request's ``id``; a consumer drops a reply whose id it is not waiting for (the
  late answer to a read it gave up on).  Ids are unique per consumer socket.
- ``unknown_lease`` is transient: the producer registers a lease one engine step after the request
  finished, so a fast consumer may ask first; it retries until its pull deadline.  Every other error
  code is final for the pull.
- Flow control is the consumer's: at most ``window`` reads outstanding per pull, each of at most
  ``batch_blocks`` blocks.  That bounds what the producer's socket queues for one pull -- and so how
  long dropping a lease waits for sends in flight.
- The unit is a *batch of whole blocks*, not a layer: the engine's cache keeps a block contiguous across
  layers (``engine/kv_cache.py``), so one block is one frame and lands with one copy straight into the
  consumer's paged cache (``recv_into``).  The decode engine needs every layer before its first step
  anyway, so layer-by-layer streaming would only multiply the frames.
- Every payload is verified against its checksum before the block counts as loaded.

Header frames are bounded (``MAX_HEADER_BYTES``); a peer that sends more, or anything that is not this
protocol, gets an ``error`` reply (``malformed``/``version``) and the producer keeps serving.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from engine.metrics import SPECS, Histogram, HistogramSnapshot
from kvstore.layout import BlockLayout

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_READ_BLOCKS = 4096
MAX_REQUEST_ID_CHARS = 1024
_U64 = 1 << 64


class ErrorCode(str, enum.Enum):
    """Why the producer refused a request.  Only ``UNKNOWN_LEASE`` is worth retrying."""

    MALFORMED = "malformed"  # not this protocol (bad msgpack, wrong types, extra frames)
    VERSION = "version"  # another protocol version
    UNKNOWN_LEASE = "unknown_lease"  # no such lease (yet): the producer may not have registered it
    RELEASED = "released"  # the lease ended: acknowledged, dropped or aborted
    EXPIRED = "expired"  # the lease's time ran out
    BAD_RANGE = "bad_range"  # block indices outside the lease, or more than one read may carry
    HASH_MISMATCH = "hash_mismatch"  # the consumer's hashes are not the leased blocks' hashes
    INTERNAL = "internal"  # the producer failed serving it (a bug: logged there)


class ProtocolError(ValueError):
    """A frame that does not follow this protocol.  ``request_id`` is its id when one could be read."""

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.MALFORMED, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


# ---- requests (consumer -> producer) ---------------------------------------------------------------------


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


def _pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def encode_read(request_id: int, rid: str, first: int, hashes: list[bytes] | tuple[bytes, ...]) -> bytes:
    return _pack(
        {"v": PROTOCOL_VERSION, "op": "read", "id": request_id, "rid": rid, "first": first, "hashes": hashes}
    )


def encode_release(request_id: int, rid: str) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "op": "release", "id": request_id, "rid": rid})


def encode_ping(request_id: int) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "op": "ping", "id": request_id})


def _unpack_map(frame: Any, *, max_array_len: int) -> dict[Any, Any]:
    view = memoryview(frame)
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {view.nbytes} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        body = msgpack.unpackb(
            view,
            raw=False,
            max_array_len=max_array_len,
            max_map_len=16,
            max_str_len=MAX_REQUEST_ID_CHARS,
            max_bin_len=64,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"header frame is not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"header frame must be a msgpack map, got {type(body).__name__}")
    return body


def _u64(body: dict[Any, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64:
        raise ProtocolError(f"{key!r} must be an unsigned 64-bit int, got {value!r}")
    return value


def _peek_id(body: dict[Any, Any]) -> int:
    value = body.get("id")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64 else 0


def decode_request(frame: Any) -> ReadRequest | ReleaseRequest | PingRequest:
    """Parse a request header frame; ``ProtocolError`` says what is wrong (and carries the id if any)."""
    body = _unpack_map(frame, max_array_len=MAX_READ_BLOCKS + 1)
    request_id = _peek_id(body)
    try:
        if body.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {body.get('v')!r} is not supported (this peer speaks {PROTOCOL_VERSION})",
                code=ErrorCode.VERSION,
            )
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
        first = body.get("first")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ProtocolError(f"'first' must be a non-negative int, got {first!r}")
        hashes = body.get("hashes")
        if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_READ_BLOCKS:
            raise ProtocolError(f"'hashes' must list 1 to {MAX_READ_BLOCKS} block hashes")
        if not all(isinstance(h, bytes) and len(h) in (16, 32) for h in hashes):
            raise ProtocolError("every entry of 'hashes' must be a 16- or 32-byte binary")
        return ReadRequest(request_id, rid, first, tuple(hashes))
    except ProtocolError as exc:
        exc.request_id = request_id
        raise


# ---- replies (producer -> consumer) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataReply:
    id: int
    first: int
    sums: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    id: int
    code: ErrorCode
    msg: str


@dataclass(frozen=True, slots=True)
class Pong:
    id: int
    info: dict[str, Any]


def encode_data(request_id: int, first: int, sums: list[int]) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "first": first, "sums": sums})


def encode_error(request_id: int, code: ErrorCode, msg: str) -> bytes:
    return _pack(
        {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": code.value, "msg": msg[:512]}
    )


def encode_pong(request_id: int, info: dict[str, Any]) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "info": info})


def decode_reply(frame: Any) -> DataReply | ErrorReply | Pong:
    """Parse a reply header frame; ``ProtocolError`` for anything this protocol does not produce."""
    body = _unpack_map(frame, max_array_len=MAX_READ_BLOCKS)
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"reply of protocol version {body.get('v')!r}", code=ErrorCode.VERSION)
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
    first = body.get("first")
    sums = body.get("sums")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ProtocolError(f"'first' must be a non-negative int, got {first!r}", request_id=request_id)
    if not isinstance(sums, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and 0 <= s < _U64 for s in sums
    ):
        raise ProtocolError("'sums' must list u64 checksums", request_id=request_id)
    return DataReply(request_id, first, tuple(sums))


# ---- the paged cache as bytes ------------------------------------------------------------------------------


class BlockViews:
    """Byte views of an engine's paged cache, one per block, without copies.

    ``kv_cache`` is ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` (C-contiguous, on the
    CPU), so block ``i`` is the byte range ``[i * block_nbytes, (i + 1) * block_nbytes)`` of the tensor.
    The views are writable: a consumer receives frames straight into them.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        import torch

        if kv_cache.device.type != "cpu":
            raise ValueError(
                f"the p2p connector moves blocks of a CPU cache; this engine's cache is on {kv_cache.device}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("the p2p connector needs a contiguous paged cache tensor")
        self.layout = BlockLayout.from_kv_cache(kv_cache)
        self.num_blocks = int(kv_cache.shape[0])
        self.block_nbytes = self.layout.payload_nbytes
        self._tensor = kv_cache  # keeps the memory alive for as long as the views exist
        flat = kv_cache.reshape(-1).view(torch.uint8)  # [num_blocks * block_nbytes] uint8, same memory
        self._flat = memoryview(flat.numpy())  # type: ignore[arg-type]

    def block(self, block_id: int) -> memoryview:
        """Block ``block_id``'s bytes, writable.  ``IndexError`` for an id outside the cache."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the cache (0..{self.num_blocks - 1})")
        start = block_id * self.block_nbytes
        return self._flat[start : start + self.block_nbytes]


# ---- counters --------------------------------------------------------------------------------------------


class TransferStats:
    """Counters of one connector half's transfers, safe to bump from any thread.

    Keys (all exported by ``snapshot`` as floats; a key appears once it was bumped):

    - producer: ``leases_registered``, ``leases_released`` (the consumer acknowledged), ``lease_expiries``,
      ``leases_stopped`` (the engine asked for the blocks back), ``leases_unavailable``,
      ``socket_resets``, ``blocks_sent``, ``bytes_sent``, ``requests_refused``, ``replies_dropped``;
    - consumer: ``pulls_started``/``_ok``/``_failed``/``_cancelled``, ``blocks_received``,
      ``bytes_received``, ``late_replies``, ``failures.<reason>`` (timeout, checksum, expired, malformed,
      truncated, size, socket, unknown_lease, released, hash_mismatch, ...), ``params_rejected.<reason>``
      (namespace, layout, hash_mismatch, bad_params).

    Histograms (``histograms``): every successful pull (``kv_transfer_seconds.recv``, and
    ``kv_load_seconds.p2p``: the consumer's KV load) and every lease its consumer released
    (``kv_transfer_seconds.send``: registered to released).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self.recv_seconds = Histogram(SPECS["kv_transfer_seconds"])
        self.send_seconds = Histogram(SPECS["kv_transfer_seconds"])

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._counts[key] += value  # type: ignore[assignment]

    def failure(self, reason: str) -> None:
        self.add(f"failures.{reason}")

    def observe_pull(self, seconds: float) -> None:
        self.recv_seconds.observe(seconds)

    def observe_lease(self, seconds: float) -> None:
        self.send_seconds.observe(seconds)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        out = {}
        recv, send = self.recv_seconds.snapshot(), self.send_seconds.snapshot()
        if recv.count:
            out["kv_transfer_seconds.recv"] = out["kv_load_seconds.p2p"] = recv
        if send.count:
            out["kv_transfer_seconds.send"] = send
        return out

    def get(self, key: str) -> float:
        with self._lock:
            return float(self._counts.get(key, 0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}
