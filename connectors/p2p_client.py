"""The consumer side of ``p2p``: pull a request's blocks from a producer straight into the paged cache.

``BlockPuller`` runs up to ``threads`` pulls at once, each on a background thread (never on the engine's
step loop).  A thread keeps one DEALER socket per producer endpoint and speaks the p2p ops of
``wire.p2p_protocol``: it keeps up to ``window`` reads of at most ``batch_blocks`` blocks outstanding,
receives each payload frame with ``recv_into`` directly into the destination block's bytes, checks the
block by its codec header (this engine's namespace and layout, the block's hash, the payload checksum),
and finally sends ``release`` so the producer frees its blocks.

A pull ends in one ``PullResult``:

- success: every block landed and verified;
- failure (peer silent for ``recv_timeout_s``, pull longer than ``pull_timeout_s``, an error reply, a
  malformed or truncated reply, a checksum mismatch): ``num_loaded`` leading blocks are good, and
  ``failed_block_ids`` lists every block from the first bad one on -- the engine recomputes from there;
- cancelled (``stop``): the pull stopped writing; nothing is reported as loaded or failed.

A socket that timed out, or whose stream is in an unknown state, is closed and reconnected on the next
use, so nothing late can land in a block; a reply whose id is not outstanding (the answer to a read
abandoned by an earlier, cancelled pull) is drained and dropped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from connectors.p2p_transfer import BlockViews, TransferStats
from wire.codec import HeaderMatcher
from wire.curve import client_socket
from wire.framing import MAX_HEADER_BYTES, ErrorCode, ErrorReply, ProtocolError, drain
from wire.p2p_protocol import DataReply, ReadRequest, ReleaseRequest, decode_p2p_reply
from wire.units import BlockFrameError, receive_units

if TYPE_CHECKING:
    from connectors.staging import StagedBlocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullJob:
    """Pull blocks ``[first, first + len(block_ids))`` of the producer's lease ``remote_request_id``."""

    request_id: str  # the local request the blocks belong to
    endpoint: str
    remote_request_id: str
    first: int  # index of the first block in the request's block table (same on both engines)
    block_ids: tuple[int, ...]  # local destination block of each index
    hashes: tuple[bytes, ...]  # the local request's hash of each block


@dataclass(frozen=True, slots=True)
class PullResult:
    request_id: str
    num_loaded: int  # leading blocks of the job that landed and verified
    failed_block_ids: tuple[int, ...] = ()  # from the first block that did not, to the end of the job
    reason: str | None = None  # why it failed (a ``failures.<reason>`` counter); None on success
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None and not self.cancelled


class _PullFailed(Exception):
    def __init__(self, reason: str, detail: str = "", *, peer_alive: bool = True) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.peer_alive = peer_alive  # worth telling the producer to release the lease


class _Cancelled(Exception):
    pass


class PullHandle:
    """One submitted pull: cancel it, or wait for its result."""

    def __init__(self, job: PullJob, into: StagedBlocks | None = None) -> None:
        self.job = job
        self.into = into  # receive into these host buffers (a GPU cache's staging), not the cache
        self.cancel_event = threading.Event()
        self.done = threading.Event()
        self.result: PullResult | None = None

    def wait(self, timeout: float | None = None) -> PullResult | None:
        self.done.wait(timeout)
        return self.result


@dataclass(frozen=True, slots=True)
class _Release:
    """Tell a producer this engine will not read a lease (a pull thread sends it: sockets are per thread)."""

    endpoint: str
    lease_id: str


class BlockPuller:
    """Pulls blocks into ``views`` on background threads; see the module docstring."""

    def __init__(
        self,
        views: BlockViews,
        *,
        stats: TransferStats,
        namespace: bytes,
        threads: int = 4,
        recv_timeout_s: float = 5.0,
        pull_timeout_s: float = 30.0,
        batch_blocks: int = 32,
        window: int = 2,
        poll_s: float = 0.02,
    ) -> None:
        self.views = views
        self.stats = stats
        # Every block received must name this namespace (hash namespace + layout) and this cache's layout.
        self.matcher = HeaderMatcher(namespace, views.layout)
        self.recv_timeout_s = recv_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.batch_blocks = batch_blocks
        self.window = window
        self._poll_ms = max(1, int(poll_s * 1000))
        self._context: zmq.Context[Any] = zmq.Context()
        self._ids = itertools.count(1)
        self._queue: queue.SimpleQueue[PullHandle | _Release | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._handles: dict[str, PullHandle] = {}
        self._finished: list[PullResult] = []
        self._threads = [
            threading.Thread(target=self._worker, name=f"p2p-pull-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # ---- the engine thread's side ------------------------------------------------------------------------

    def submit(self, job: PullJob, into: StagedBlocks | None = None) -> PullHandle:
        """Start pulling ``job``: into the cache's blocks, or into ``into`` (one staged block per job block,
        when the cache is on a GPU: the caller copies them in once the pull is done)."""
        assert into is not None or self.views.on_host, "a GPU cache's pull receives into staging"
        assert into is None or len(into) == len(job.block_ids), "one staged block per job block"
        handle = PullHandle(job, into)
        with self._lock:
            assert job.request_id not in self._handles, f"{job.request_id} is already pulling"
            self._handles[job.request_id] = handle
        self.stats.add("pulls_started")
        self._queue.put(handle)
        return handle

    def release(self, endpoint: str, lease_id: str) -> None:
        """Release a lease unread (fire and forget: a lost release ends at the lease's ``lease_s``)."""
        self.stats.add("leases_unused")
        self._queue.put(_Release(endpoint, lease_id))

    def stop(self, request_id: str, timeout_s: float) -> bool:
        """Cancel a pull and wait until it no longer writes into its blocks (its result, ``cancelled``,
        is then in the next ``take_finished``).  True if it stopped."""
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is None:
            return True
        handle.cancel_event.set()
        if handle.done.wait(timeout_s):
            return True
        logger.error("p2p: pull of %s did not stop within %.1fs", request_id, timeout_s)
        return False

    def take_finished(self) -> list[PullResult]:
        """Results of pulls that ended since the last call (each reported once)."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def close(self) -> None:
        with self._lock:
            handles = list(self._handles.values())
        for handle in handles:
            handle.cancel_event.set()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._context.term()

    # ---- pull threads ------------------------------------------------------------------------------------

    def _worker(self) -> None:
        import torch

        torch.set_num_threads(1)  # this thread moves data; see FLOORS.md
        sockets: dict[str, zmq.Socket[Any]] = {}
        try:
            while True:
                handle = self._queue.get()
                if handle is None:
                    return
                if isinstance(handle, _Release):
                    self._release(sockets, handle.endpoint, handle.lease_id)
                    continue
                try:
                    result = self._run(handle, sockets)
                except Exception:  # a bug: still report the pull, or its request would wait forever
                    logger.exception("p2p: pull of %s crashed", handle.job.request_id)
                    self._discard(sockets, handle.job.endpoint)
                    self.stats.add("pulls_failed")
                    self.stats.failure("internal")
                    job = handle.job
                    result = PullResult(job.request_id, 0, job.block_ids, "internal")
                with self._lock:
                    del self._handles[handle.job.request_id]
                    self._finished.append(result)
                handle.result = result
                handle.done.set()
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _socket(self, sockets: dict[str, zmq.Socket[Any]], endpoint: str) -> zmq.Socket[Any]:
        sock = sockets.get(endpoint)
        if sock is None:
            sock = client_socket(self._context, zmq.DEALER)  # CURVE with $PDKV_CURVE_DIR
            sock.setsockopt(zmq.LINGER, 0)
            # A frame larger than one block is not ours: ZeroMQ disconnects a peer that sends one.
            sock.setsockopt(zmq.MAXMSGSIZE, max(self.views.block_nbytes, MAX_HEADER_BYTES))
            sock.connect(endpoint)
            sockets[endpoint] = sock
        return sock

    @staticmethod
    def _discard(sockets: dict[str, zmq.Socket[Any]], endpoint: str) -> None:
        """Close a socket whose stream can no longer be trusted; late replies die with it."""
        sock = sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def _release(self, sockets: dict[str, zmq.Socket[Any]], endpoint: str, rid: str) -> None:
        try:
            self._socket(sockets, endpoint).send(ReleaseRequest(next(self._ids), rid).encode(), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("p2p: release of %s not sent: %s", rid, exc)

    def _run(self, handle: PullHandle, sockets: dict[str, zmq.Socket[Any]]) -> PullResult:
        job = handle.job
        started = time.monotonic()
        loaded = [False] * len(job.block_ids)
        try:
            self._pull(handle, self._socket(sockets, job.endpoint), loaded)
        except _Cancelled:
            self._discard(sockets, job.endpoint)
            self._release(sockets, job.endpoint, job.remote_request_id)
            self.stats.add("pulls_cancelled")
            return PullResult(job.request_id, 0, cancelled=True)
        except (_PullFailed, zmq.ZMQError) as exc:
            failure = (
                exc if isinstance(exc, _PullFailed) else _PullFailed("socket", str(exc), peer_alive=False)
            )
            self._discard(sockets, job.endpoint)
            if failure.peer_alive:
                self._release(sockets, job.endpoint, job.remote_request_id)
            good = loaded.index(False) if False in loaded else len(loaded)
            # "released": the producer ended the lease on purpose (its request was aborted, e.g. the
            # client cancelled): the request recomputes, and nothing is wrong with either node.
            level = logging.INFO if failure.reason == ErrorCode.RELEASED.value else logging.WARNING
            logger.log(
                level,
                "p2p: pull of %s from %s failed after %d of %d blocks: %s",
                job.request_id,
                job.endpoint,
                good,
                len(loaded),
                failure,
            )
            self.stats.add("pulls_failed")
            self.stats.failure(failure.reason)
            return PullResult(job.request_id, good, job.block_ids[good:], failure.reason)
        self._release(sockets, job.endpoint, job.remote_request_id)
        self.stats.add("pulls_ok")
        self.stats.observe_pull(time.monotonic() - started)
        return PullResult(job.request_id, len(loaded))

    def _pull(self, handle: PullHandle, sock: zmq.Socket[Any], loaded: list[bool]) -> None:
        """Fill ``loaded`` (one flag per job block); raise ``_PullFailed``/``_Cancelled`` to stop."""
        job = handle.job
        n = len(job.block_ids)
        todo = deque((i, min(self.batch_blocks, n - i)) for i in range(0, n, self.batch_blocks))
        outstanding: dict[int, tuple[int, int]] = {}  # read id -> (job offset, count)
        now = time.monotonic()
        deadline = now + self.pull_timeout_s
        heard = now  # when the producer last answered (or the pull started)
        retry_at = 0.0
        backoff = 0.005
        while todo or outstanding:
            if handle.cancel_event.is_set():
                raise _Cancelled
            now = time.monotonic()
            if now >= deadline:
                raise _PullFailed("timeout", f"pull took over {self.pull_timeout_s}s", peer_alive=False)
            if outstanding and now - heard >= self.recv_timeout_s:
                raise _PullFailed("timeout", f"no reply for {self.recv_timeout_s}s", peer_alive=False)
            while todo and len(outstanding) < self.window and now >= retry_at:
                offset, count = todo.popleft()
                read_id = next(self._ids)
                first = job.first + offset
                read = ReadRequest(read_id, job.remote_request_id, first, job.hashes[offset : offset + count])
                sock.send(
                    read.encode(), zmq.NOBLOCK
                )  # a full queue means a peer that does not read: zmq.Again
                if not outstanding:
                    heard = now  # the silence clock runs from the oldest outstanding read
                outstanding[read_id] = (offset, count)
            if not sock.poll(self._poll_ms, zmq.POLLIN):
                continue
            header = sock.recv(zmq.NOBLOCK)
            heard = time.monotonic()
            try:
                reply = decode_p2p_reply(header)
            except ProtocolError as exc:
                raise _PullFailed("malformed", str(exc)) from None
            entry = outstanding.pop(reply.id, None)
            if entry is None:
                self._drain(sock)
                self.stats.add("late_replies")
                continue
            offset, count = entry
            if isinstance(reply, ErrorReply):
                self._drain(sock)
                if reply.code is ErrorCode.UNKNOWN_LEASE:
                    # Not registered yet (the producer registers it a step after the request finished).
                    todo.appendleft(entry)
                    retry_at = time.monotonic() + backoff
                    backoff = min(backoff * 2, 0.2)
                    continue
                raise _PullFailed(reply.code.value, reply.msg, peer_alive=reply.code is not ErrorCode.EXPIRED)
            if not isinstance(reply, DataReply):
                self._drain(sock)
                raise _PullFailed("malformed", "a pong where blocks were expected")
            self._receive_blocks(sock, reply, handle, offset, count, loaded)

    def _receive_blocks(
        self,
        sock: zmq.Socket[Any],
        reply: DataReply,
        handle: PullHandle,
        offset: int,
        count: int,
        loaded: list[bool],
    ) -> None:
        """Receive one data reply's blocks into the job's blocks ``[offset, offset + count)``, each checked
        by its codec header before it counts as loaded."""
        job = handle.job
        if reply.first != job.first + offset or reply.n != count:
            self._drain(sock)
            raise _PullFailed("malformed", f"reply for blocks at {reply.first} x {reply.n}")
        staged, views = handle.into, self.views

        def into(j: int) -> memoryview:
            return staged.view(offset + j) if staged is not None else views.block(job.block_ids[offset + j])

        try:
            receive_units(sock, count, job.hashes[offset : offset + count], self.matcher, into)
        except BlockFrameError as exc:
            loaded[offset : offset + exc.verified] = [True] * exc.verified  # the blocks before it verified
            raise _PullFailed(exc.reason.value, f"blocks from {reply.first}: {exc}") from None
        loaded[offset : offset + count] = [True] * count
        self.stats.add("blocks_received", count)
        self.stats.add("bytes_received", count * views.block_nbytes)

    @staticmethod
    def _drain(sock: zmq.Socket[Any]) -> None:
        drain(sock)
