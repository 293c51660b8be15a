"""The ``remote`` tier: a client of a ``pdkv kvstore serve`` process (``kvstore.server``), over ZeroMQ.

Each calling thread has its own DEALER socket (ZeroMQ sockets are not thread-safe), connected with
``IMMEDIATE`` (nothing is queued for a server that is not connected: the call fails at once -- after a new
socket's first wait for its connection, ``CONNECT_WAIT_S`` -- and counts as an error), ``LINGER 0`` and
automatic reconnection, so a server that restarts is reached again without any action here.  Every receive
waits with a poll bounded by the call's deadline; a request id tags each request, and a reply whose id is
not the awaited one (the late answer to a request given up on) is read and dropped.

Payloads travel without copies both ways: a put sends the blocks' memory (``copy=False``) and waits for
ZeroMQ to release it before returning; a get receives each payload frame straight into the caller's block
(``recv_into``), then checks the header and payload checksum like any untrusted medium.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvstore.buffers import BufferFence
from kvstore.config import RemoteTierConfig
from kvstore.deadline import Deadline
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit
from kvstore.tiers.base import Tier, TierError, TierPolicy, TierTimeout
from wire.codec import HEADER_SIZE, HeaderMatcher, parse_header
from wire.curve import client_socket
from wire.framing import ErrorReply, InfoReply, ProtocolError, drain, send_frames
from wire.keys import KeyRun
from wire.layout import BlockLayout
from wire.store_protocol import (
    CountReply,
    Delete,
    Get,
    Lookup,
    Ping,
    Put,
    Stats,
    StoreReply,
    StoreRequest,
    decode_store_reply,
)
from wire.units import BlockFrameError, receive_unit_frames, receive_units

logger = logging.getLogger(__name__)

# How long a new socket's first send waits for its connection: a loopback or LAN connect and CURVE
# handshake take milliseconds.
CONNECT_WAIT_S = 0.25
PUT_CHUNK = 32  # blocks per put request (8 MiB of 256 KiB blocks: fewer replies to wait for than 16)
GET_CHUNK = 16  # blocks per get request


class RemoteTier(Tier):
    kind = "remote"

    def __init__(
        self,
        config: RemoteTierConfig,
        *,
        policy: TierPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config.name, policy=policy, clock=clock)
        self.config = config
        self._context: zmq.Context[Any] = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket[Any]] = []
        self._sockets_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.late_replies = 0

    # ---- sockets and exchanges -------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] | None = getattr(self._local, "socket", None)
        if sock is None:
            sock = client_socket(self._context, zmq.DEALER)  # CURVE with $PDKV_CURVE_DIR
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(self.config.endpoint)
            self._local.socket, self._local.connecting = sock, True
            with self._sockets_lock:
                self._sockets.append(sock)
        return sock

    def _drop_socket(self) -> None:
        """Close this thread's socket (a send may still hold payloads); the next call opens a new one."""
        sock: zmq.Socket[Any] | None = getattr(self._local, "socket", None)
        if sock is not None:
            self._local.socket = None
            with self._sockets_lock:
                self._sockets.remove(sock)
            sock.close(linger=0)

    def _send(
        self, frames: list[Any], deadline: Deadline, *, track: bool = False
    ) -> zmq.MessageTracker | None:
        sock = self._socket()
        # A new socket's first send waits for its connection (and CURVE handshake) a while; after that a
        # send never waits: with IMMEDIATE a server that is down has no pipe, and a send fails at once
        # (it waited out the call's deadline: an outside probe saw every put to a dead server take 2 s of
        # a write lane, and every lookup its 50 ms).  A connected socket always has room: a request's
        # messages are far fewer than its high-water mark.
        connecting, self._local.connecting = self._local.connecting, False
        wait_s = min(deadline.remaining(), CONNECT_WAIT_S) if connecting else 0.0
        sock.setsockopt(zmq.SNDTIMEO, int(wait_s * 1000))
        try:
            return send_frames(sock, frames, track=track)
        except zmq.Again:
            raise TierError(
                f"store server {self.config.endpoint} is not connected (down, or the CURVE handshake failed: "
                "check both sides' $PDKV_CURVE_DIR)"
            ) from None

    def _await_reply(self, request_id: int, deadline: Deadline) -> CountReply | InfoReply:
        """The reply to ``request_id``; its further frames are left for the caller to read."""
        sock = self._socket()
        while True:
            wait_ms = int(deadline.remaining() * 1000)
            if wait_ms <= 0 or not sock.poll(wait_ms, zmq.POLLIN):
                raise TierTimeout(f"no reply from {self.config.endpoint} within the deadline")
            first = sock.recv(zmq.NOBLOCK, copy=True)
            try:
                reply: StoreReply = decode_store_reply(first)
            except ProtocolError as exc:
                drain(sock)
                raise TierError(f"bad reply from {self.config.endpoint}: {exc}") from None
            if reply.id == request_id:
                if isinstance(reply, ErrorReply):
                    drain(sock)
                    raise TierError(f"store server refused the request ({reply.code.value}): {reply.msg}")
                return reply
            self.late_replies += 1  # the answer to a request given up on: drop it
            drain(sock)

    def _exchange(self, request: StoreRequest, deadline: Deadline) -> CountReply | InfoReply:
        """One request that carries no blocks and whose reply carries none."""
        self._send([request.encode()], deadline)
        reply = self._await_reply(request.id, deadline)
        drain(self._socket())
        return reply

    def _count(self, request: StoreRequest, deadline: Deadline) -> int:
        reply = self._exchange(request, deadline)
        if not isinstance(reply, CountReply):
            raise TierError(f"store server answered {request.op} with {type(reply).__name__}")
        return reply.n

    def _info(self, request: StoreRequest, deadline: Deadline) -> dict[str, Any]:
        reply = self._exchange(request, deadline)
        if not isinstance(reply, InfoReply):
            raise TierError(f"store server answered {request.op} with {type(reply).__name__}")
        return reply.info

    def _expect_count(self, request_id: int, deadline: Deadline) -> CountReply:
        reply = self._await_reply(request_id, deadline)
        if not isinstance(reply, CountReply):
            drain(self._socket())
            raise TierError(f"store server answered a block request with {type(reply).__name__}")
        return reply

    # ---- tier operations -------------------------------------------------------------------------------

    def ping(self, deadline: Deadline | None = None) -> dict[str, Any]:
        """The server's ping info (raises ``TierError``/``TierTimeout``: a health check, not a data path)."""
        return self._info(Ping(next(self._ids)), deadline or Deadline.after(self.config.timeout_s))

    def _probe(self, deadline: Deadline) -> None:
        self.ping(deadline)

    def server_stats(self, deadline: Deadline | None = None) -> dict[str, Any]:
        return self._info(Stats(next(self._ids)), deadline or Deadline.after(self.config.timeout_s))

    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int:
        return self._count(Lookup(next(self._ids), run), deadline)

    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult:
        # One request per GET_CHUNK blocks, all sent at once: a reply arrives whole, so while this side
        # copies chunk k into the caller's blocks, chunk k + 1 is already on the wire.
        pending = []
        for lo in range(0, len(run), GET_CHUNK):
            request = Get(next(self._ids), run.slice(lo, lo + GET_CHUNK), layout)
            self._send([request.encode()], deadline)
            pending.append((request.id, lo, min(GET_CHUNK, len(run) - lo)))
        matcher = HeaderMatcher(run.namespace, layout)
        checksums: list[int | None] = []
        result: GetResult | None = None
        for request_id, lo, size in pending:
            if result is not None:  # already answered: let the rest of the replies go by
                self._skip_reply(request_id, deadline)
                continue
            reply = self._expect_count(request_id, deadline)
            n = min(reply.n, size)
            try:
                checksums.extend(
                    receive_units(self._socket(), n, run.hashes[lo : lo + n], matcher, *_fenced(fence, lo))
                )
            except BlockFrameError as exc:
                checksums.extend(exc.checksums)
                result = GetResult(lo + exc.verified, exc.reason, tuple(checksums))
                continue
            if n < size:
                result = GetResult(lo + n, reply.reason or MissReason.ABSENT, tuple(checksums))
        return result or GetResult(len(run), None, tuple(checksums))

    def _skip_reply(self, request_id: int, deadline: Deadline) -> None:
        try:
            self._await_reply(request_id, deadline)
        except (TierError, TierTimeout):
            return  # a reply that does not come is dropped by id later
        drain(self._socket())

    def _read(self, run: KeyRun, deadline: Deadline, layout: BlockLayout | None) -> ReadResult:
        if layout is None:
            raise TierError("reading units from a store server needs the layout they must have")
        request = Get(next(self._ids), run, layout)
        self._send([request.encode()], deadline)
        reply = self._expect_count(request.id, deadline)
        n = min(reply.n, len(run))
        try:
            received = receive_unit_frames(self._socket(), n, run.hashes, run.namespace, layout)
        except BlockFrameError as exc:
            return ReadResult([Unit(payload, raw) for raw, payload in exc.received], exc.reason)
        units = [Unit(payload, raw) for raw, payload in received]
        return ReadResult(units, None if n == len(run) else reply.reason or MissReason.ABSENT)

    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult:
        # Chunks of PUT_CHUNK blocks, all sent before the first reply is awaited: the server stores one
        # chunk while the next is on the wire, and this side seals (checksums) a chunk while the previous
        # one is being sent.
        pending: list[tuple[int, int]] = []  # (request id, blocks)
        trackers: list[zmq.MessageTracker] = []
        layout: BlockLayout | None = None
        try:
            for lo in range(0, len(run), PUT_CHUNK):
                chunk = units[lo : lo + PUT_CHUNK]
                request_id = next(self._ids)
                headers = b"".join(unit.seal() for unit in chunk)
                if layout is None:  # the units' own layout: the server checks every block against it
                    first = parse_header(headers[:HEADER_SIZE])
                    if isinstance(first, MissReason):
                        return PutResult(lo, first)
                    layout = first.layout
                request = Put(request_id, run.slice(lo, lo + len(chunk)), layout)
                tracker = self._send(
                    [request.encode(), headers, *(unit.payload for unit in chunk)], deadline, track=True
                )
                assert tracker is not None
                trackers.append(tracker)
                pending.append((request_id, len(chunk)))
            stored = 0
            for request_id, size in pending:
                reply = self._expect_count(request_id, deadline)
                drain(self._socket())
                stored += min(reply.n, size)
                if reply.n < size:
                    return PutResult(stored, reply.reason or MissReason.ERROR)
            return PutResult(stored)
        finally:
            if not all(tracker.done for tracker in trackers):
                # ZeroMQ may still read the payloads: close the socket so it lets go of them before we return.
                self._drop_socket()
                for tracker in trackers:
                    try:
                        tracker.wait(max(0.05, deadline.remaining()))
                    except zmq.NotDone:
                        logger.warning(
                            "kvstore remote tier %s: a put's payloads outlived its socket", self.name
                        )
                        break

    def _delete(self, run: KeyRun, deadline: Deadline) -> int:
        return self._count(Delete(next(self._ids), run), deadline)

    def _backend_stats(self) -> dict[str, Any]:
        return {"endpoint": self.config.endpoint, "late_replies": self.late_replies}

    def _close(self) -> None:
        with self._sockets_lock:
            self._sockets.clear()
        self._context.destroy(linger=0)  # closes every thread's socket


def _fenced(fence: BufferFence, lo: int) -> tuple[Callable[[int], memoryview], Callable[[int], None]]:
    """Where ``receive_units`` writes block ``lo + j`` of a get, and how it lets go of it."""

    def into(j: int) -> memoryview:
        return fence.hold(lo + j)

    def let_go(_j: int) -> None:
        fence.let_go()

    return into, let_go
