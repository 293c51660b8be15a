"""The producer side of ``p2p``: serve leased blocks of the paged cache over a ZeroMQ ROUTER socket.

One background thread owns the socket and answers requests in arrival order (wire format:
``connectors.p2p_transfer``).  The engine thread adds leases and stops them; every piece of lease state
is guarded by one lock, which the serving thread holds from "is this lease still serving?" to "the send
is queued and its tracker recorded", so a lease that was stopped is never read again.

A lease's life::

    add_lease ──▶ SERVING ──(consumer release | expiry | engine stop)──▶ CLOSING
                                                    │ every tracked send of it done
                                                    ▼
                                     reported by take_finished(): its blocks may be reused

Right after a lease is added the serving thread *seals* it: it computes every block's payload checksum
(recorded in the block's codec header in the data replies) while no reader waits yet -- the decode
request is still on its way through the router -- so a transfer does not pay for it, and a block
overwritten between lease and send is caught by the consumer's check.  A read that comes before the seal
is done computes the missing sums itself.

Payload frames point into the engine's cache (no copy): ZeroMQ's I/O thread reads them after ``send``
returned.  Every data reply is sent with a ``MessageTracker`` (``wire.units.send_units``); a lease
reaches "finished" only when all its trackers are done (invariant 8).  ``stop`` -- the engine wants the
blocks back -- waits for them synchronously, so the lease is reported finished within the engine's step;
a peer that stopped reading cannot stall it for longer than ``stop_timeout_s``: then the socket is closed
(ZeroMQ drops what it queued, releasing the frames) and bound again at the same endpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from connectors.p2p_lease import Lease, LeaseState, wait_trackers
from connectors.p2p_transfer import BlockViews, TransferStats
from wire.codec import pack_header, payload_checksum
from wire.curve import server_socket, stop_authenticator
from wire.framing import MAX_HEADER_BYTES, ErrorCode, ErrorReply, InfoReply, ProtocolError
from wire.p2p_protocol import DataReply, PingRequest, ReadRequest, decode_p2p_request
from wire.units import send_units

if TYPE_CHECKING:
    from connectors.staging import StagedBlocks

logger = logging.getLogger(__name__)

_MAX_TOMBSTONES = 4096  # ended leases remembered, so a late reader gets a final answer


class BlockServer:
    """Serves leased blocks of one engine's cache; see the module docstring for the life of a lease."""

    def __init__(
        self,
        views: BlockViews,
        bind: str,
        *,
        stats: TransferStats,
        namespace: bytes,
        engine_id: str = "",
        max_read_blocks: int = 4096,
        stop_timeout_s: float = 5.0,
        poll_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.views = views
        self.stats = stats
        self.namespace = namespace  # the store namespace (hash namespace + layout) every header names
        self.engine_id = engine_id
        self.max_read_blocks = max_read_blocks
        self.stop_timeout_s = stop_timeout_s
        self.clock = clock
        self._poll_ms = max(1, int(poll_s * 1000))
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = self._open(bind)
        # The address actually bound (the port chosen for ":0"); a reset binds here again.
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._tombstones: OrderedDict[str, ErrorCode] = OrderedDict()
        # Releases that came before their lease (a consumer that holds every block releases at admission,
        # which can beat the lease's registration one engine step after the request finished).
        self._early_releases: OrderedDict[str, None] = OrderedDict()
        self._finished: list[str] = []
        self._unsealed: deque[Lease] = deque()
        self._reset_requested = threading.Event()
        self._reset_done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"p2p-server-{engine_id}", daemon=True)
        self._thread.start()

    def _open(self, bind: str) -> zmq.Socket[Any]:
        sock = server_socket(self._context, zmq.ROUTER)  # CURVE with $PDKV_CURVE_DIR
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)  # requests are headers only; bigger: disconnect
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer fails instead of vanishing
        try:
            sock.bind(bind)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    # ---- the engine thread's side ------------------------------------------------------------------------

    def add_lease(
        self,
        request_id: str,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        lease_s: float,
        staged: StagedBlocks | None = None,
    ) -> None:
        """Serve ``block_ids`` (the request's leading blocks, whose hashes are ``hashes``) for ``lease_s``;
        from ``staged`` (their host copies) when the cache is on a GPU."""
        assert len(block_ids) == len(hashes), "one hash per leased block"
        assert staged is not None or self.views.on_host, "a GPU cache's lease serves staged copies"
        lease = Lease(
            request_id,
            tuple(block_ids),
            tuple(hashes),
            deadline=self.clock() + lease_s,
            sums=[None] * len(block_ids),
            registered_at=self.clock(),
            staged=staged,
        )
        with self._lock:
            old = self._leases.get(request_id)
            if old is not None and old.state is LeaseState.SERVING:
                # The engine finished a request under the same id again: the old lease's reader lost.
                logger.warning("p2p: lease %s registered twice; closing the older one", request_id)
                self._close_locked(old, ErrorCode.RELEASED)
            if old is not None:
                # Keep the old lease's trackers: its blocks are reported free only when they are done.
                lease.trackers = old.trackers
            self._leases[request_id] = lease
            self._tombstones.pop(request_id, None)
            self._unsealed.append(lease)
            released = request_id in self._early_releases
            if released:  # its consumer released it already: it ends now, unread
                del self._early_releases[request_id]
                self._close_locked(lease, ErrorCode.RELEASED)
        self.stats.add("leases_registered")
        if released:
            self.stats.add("leases_released")

    def stop(self, request_id: str) -> bool:
        """End the lease (the engine wants its blocks back) and return once no send of it is in flight:
        the next ``take_finished`` reports it.  False if even a socket reset did not release the frames
        (logged).  A lease that is already gone is remembered as released, so a late reader is told."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                if request_id not in self._tombstones:
                    self._remember_locked(request_id, ErrorCode.RELEASED)
                # Confirm it anyway: the engine may hold blocks for a lease that never got here (a hold
                # ends only on a report; one for a request it no longer holds is ignored).
                self._finished.append(request_id)
                return True
            if lease.state is LeaseState.SERVING:
                self._close_locked(lease, ErrorCode.RELEASED)
                self.stats.add("leases_stopped")
            trackers = list(lease.pending_trackers())
        if wait_trackers(trackers, self.stop_timeout_s):
            return True
        logger.warning(
            "p2p: sends of lease %s still in flight after %.1fs (a peer stopped reading): resetting socket",
            request_id,
            self.stop_timeout_s,
        )
        self._reset_done.clear()
        self._reset_requested.set()
        self._reset_done.wait(self.stop_timeout_s + 1.0)
        if wait_trackers(trackers, self.stop_timeout_s):
            return True
        logger.error("p2p: sends of lease %s never completed; its blocks stay held", request_id)
        return False

    def take_finished(self) -> list[str]:
        """Request ids whose leases ended and whose blocks no send reads any more (each reported once)."""
        with self._lock:
            self._reap_locked()
            out, self._finished = self._finished, []
        return out

    def is_sealed(self, request_id: str) -> bool:
        """True once every block of the lease has its checksum (or the lease is gone)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is None or lease.sealed_upto == len(lease.block_ids)

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        stop_authenticator(self._context)
        self._context.term()

    # ---- lease bookkeeping (lock held) -------------------------------------------------------------------

    def _close_locked(self, lease: Lease, reason: ErrorCode) -> None:
        lease.state = LeaseState.CLOSING
        lease.reason = reason

    def _reap_locked(self) -> None:
        now = self.clock()
        for lease in list(self._leases.values()):
            if lease.state is LeaseState.SERVING and now >= lease.deadline:
                logger.info("p2p: lease %s expired; freeing its blocks", lease.request_id)
                self._close_locked(lease, ErrorCode.EXPIRED)
                self.stats.add("lease_expiries")
            if lease.state is LeaseState.CLOSING and not lease.pending_trackers():
                if lease.reason is ErrorCode.RELEASED and lease.served:
                    self.stats.observe_lease(now - lease.registered_at)
                del self._leases[lease.request_id]
                self._remember_locked(lease.request_id, lease.reason)
                self._finished.append(lease.request_id)

    def _remember_locked(self, request_id: str, reason: ErrorCode) -> None:
        self._tombstones[request_id] = reason
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    # ---- the serving thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        torch.set_num_threads(1)  # this thread moves data; see FLOORS.md
        while not self._stop.is_set():
            if self._reset_requested.is_set():
                self._reset_socket()
            try:
                ready = self._socket.poll(0 if self._unsealed else self._poll_ms, zmq.POLLIN)
            except zmq.ZMQError as exc:
                logger.error("p2p: server socket failed (%s); resetting it", exc)
                self._reset_socket()
                continue
            try:
                if ready:
                    self._serve_pending()
                with self._lock:
                    self._reap_locked()
                self._seal_some()
            except Exception:  # a bug: log it and keep serving (leases still end by expiry)
                logger.exception("p2p: server loop failed")

    def _serve_pending(self, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._serve_one(frames)
            except Exception:  # never let one request stop the server
                logger.exception("p2p: serving a request failed")
                self._reply(frames[0].bytes, [ErrorReply(0, ErrorCode.INTERNAL, "internal error").encode()])

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        try:
            if len(body) != 1:
                raise ProtocolError(f"a request is one header frame, got {len(body)} frames")
            request = decode_p2p_request(body[0].buffer)
        except ProtocolError as exc:
            self.stats.add("requests_refused")
            self._reply(identity, [ErrorReply.of(exc).encode()])
            return
        if isinstance(request, PingRequest):
            info = {"engine_id": self.engine_id, "leases": self.num_leases()}
            self._reply(identity, [InfoReply(request.id, info).encode()])
        elif isinstance(request, ReadRequest):
            self._serve_read(identity, request)
        else:
            with self._lock:
                lease = self._leases.get(request.rid)
                if lease is not None and lease.state is LeaseState.SERVING:
                    self._close_locked(lease, ErrorCode.RELEASED)
                    self.stats.add("leases_released")
                elif lease is None and request.rid not in self._tombstones:
                    self._early_releases[request.rid] = None  # remembered for its registration
                    while len(self._early_releases) > _MAX_TOMBSTONES:
                        self._early_releases.popitem(last=False)

    def _serve_read(self, identity: bytes, request: ReadRequest) -> None:
        if not self.views.on_host:  # a GPU cache's host copy: waited for here, never under the lock
            with self._lock:
                lease = self._leases.get(request.rid)
                staged = lease.staged if lease is not None else None
            if staged is not None:
                staged.ready()
        with self._lock:  # held until the tracker is recorded: a stop cannot slip in between
            refusal = self._check_read_locked(request)
            if refusal is not None:
                self.stats.add("requests_refused")
                self._reply(identity, [ErrorReply(request.id, *refusal).encode()])
                return
            lease = self._leases[request.rid]
            count = len(request.hashes)
            payloads = [self._payload(lease, i) for i in range(request.first, request.first + count)]
            layout = self.views.layout
            headers = b"".join(
                pack_header(self.namespace, lease.hashes[i], layout, self._checksum_locked(lease, i, p))
                for i, p in enumerate(payloads, start=request.first)
            )
            head = [identity, DataReply(request.id, request.first, count).encode()]
            try:
                tracker = send_units(self._socket, head, headers, payloads, track=True, nonblocking=True)
            except zmq.ZMQError as exc:  # the peer vanished (EHOSTUNREACH) or does not read (EAGAIN)
                logger.debug("p2p: reply dropped: %s", exc)
                self.stats.add("replies_dropped")
                return
            assert tracker is not None
            lease.trackers.append(tracker)
            lease.served = True
            self.stats.add("blocks_sent", count)
            self.stats.add("bytes_sent", count * self.views.block_nbytes)

    def _check_read_locked(self, request: ReadRequest) -> tuple[ErrorCode, str] | None:
        lease = self._leases.get(request.rid)
        if lease is None:
            code = self._tombstones.get(request.rid, ErrorCode.UNKNOWN_LEASE)
            return code, f"no lease for request {request.rid!r}"
        if lease.state is LeaseState.SERVING and self.clock() >= lease.deadline:
            self._close_locked(lease, ErrorCode.EXPIRED)
            self.stats.add("lease_expiries")
        if lease.state is not LeaseState.SERVING:
            return lease.reason, f"the lease of request {request.rid!r} has ended ({lease.reason.value})"
        count = len(request.hashes)
        if count > self.max_read_blocks or request.first + count > len(lease.block_ids):
            return (
                ErrorCode.BAD_RANGE,
                f"blocks [{request.first}, {request.first + count}) of a lease of {len(lease.block_ids)} "
                f"blocks (at most {self.max_read_blocks} per read)",
            )
        if lease.hashes[request.first : request.first + count] != request.hashes:
            return ErrorCode.HASH_MISMATCH, "the requested block hashes are not the leased blocks' hashes"
        return None

    def _seal_some(self, max_blocks: int = 64) -> None:
        """Checksum the next blocks of the oldest unsealed lease, outside the lock (requests keep flowing).

        Sealing at lease time, not at send time, means the consumer checks the bytes it received against
        what the blocks held when the request finished: a block overwritten in between is caught.  A
        lease stopped meanwhile keeps nothing computed here (its blocks may already hold other KV).
        """
        with self._lock:
            while self._unsealed and (
                self._unsealed[0].state is not LeaseState.SERVING
                or self._unsealed[0].sealed_upto == len(self._unsealed[0].block_ids)
            ):
                self._unsealed.popleft()
            if not self._unsealed:
                return
            lease = self._unsealed[0]
            start = lease.sealed_upto
            end = min(len(lease.block_ids), start + max_blocks)
            todo = [i for i in range(start, end) if lease.sums[i] is None]
        if lease.staged is not None:
            lease.staged.ready()
        sums = [payload_checksum(self._payload(lease, i)) for i in todo]
        with self._lock:
            if lease.state is LeaseState.SERVING:
                for i, value in zip(todo, sums, strict=True):
                    if lease.sums[i] is None:
                        lease.sums[i] = value
                lease.sealed_upto = end

    def _payload(self, lease: Lease, index: int) -> memoryview:
        """Leased block ``index``'s bytes: the cache itself, or its staged host copy (the callers waited
        for the copy, ``StagedBlocks.ready``, before taking the lock)."""
        if lease.staged is not None:
            return lease.staged.view(index)
        return self.views.block(lease.block_ids[index])

    @staticmethod
    def _checksum_locked(lease: Lease, index: int, payload: memoryview) -> int:
        cached = lease.sums[index]
        if cached is None:
            cached = lease.sums[index] = payload_checksum(payload)
        return cached

    def _reply(self, identity: bytes, parts: list[Any]) -> bool:
        """Send header-only ``parts`` to the peer ``identity`` without blocking; False if not queued."""
        try:
            self._socket.send_multipart([identity, *parts], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # the peer vanished (EHOSTUNREACH) or does not read (EAGAIN)
            logger.debug("p2p: reply dropped: %s", exc)
            self.stats.add("replies_dropped")
            return False

    def _reset_socket(self) -> None:
        """Close the socket (ZeroMQ drops every queued frame) and bind the same endpoint again."""
        self._reset_requested.clear()
        self.stats.add("socket_resets")
        self._socket.close(linger=0)
        while not self._stop.is_set():
            try:
                self._socket = self._open(self.endpoint)
                break
            except zmq.ZMQError as exc:
                logger.warning("p2p: cannot bind %s again yet: %s", self.endpoint, exc)
                self._stop.wait(0.1)
        self._reset_done.set()
