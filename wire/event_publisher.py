"""Publishing an engine's KV events: a ZeroMQ PUB socket for batches, a ROUTER socket to replay them.

Wire format: ``wire/kv_events.py`` (``EventBatch``: publisher, epoch, sequence number, events).

    engine thread: publish(events)  ->  bounded queue  ->  sender thread: PUB.send(batch)
                                                                          keeps the last N batches
    subscriber:    REQ-less DEALER  ->  replay {"from": seq}  ->  [header, batch, batch, ...]

The step loop only appends to a bounded queue (``publish`` never blocks and never encodes): when the
queue is full the batch is dropped, counted (``num_dropped``), and its sequence number skipped, so the
subscriber sees the gap -- and the next batch says how many went missing (``dropped``).  The sender keeps
the last ``replay_size`` encoded batches; a subscriber that missed some asks the replay socket for every
batch from a sequence number on, and is told ``gone`` when they are older than that, so it forgets the
publisher's blocks and starts over.

Replay request and reply: ``wire.kv_events`` (``ReplayRequest``, ``ReplayReply``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import zmq

from wire.curve import server_socket, stop_authenticator
from wire.kv_events import EventBatch, EventDecodeError, KVCacheEvent, ReplayReply, ReplayRequest

logger = logging.getLogger(__name__)


def replay_endpoint_for(bind: str) -> str:
    """The replay socket's default bind beside a PUB bind: the same host on a free port (tcp), or a
    sibling socket file (ipc)."""
    return f"{bind.rpartition(':')[0]}:0" if bind.startswith("tcp://") else f"{bind}.replay"


class KVEventPublisher:
    """One publisher (an engine, a store server): ``publish`` from its owner thread, the rest is ours.
    ``replay_bind`` defaults to ``replay_endpoint_for(bind)``."""

    def __init__(
        self,
        publisher: str,
        bind: str = "tcp://127.0.0.1:0",
        replay_bind: str | None = None,
        *,
        queue_size: int = 1024,
        replay_size: int = 8192,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if queue_size <= 0 or replay_size <= 0:
            raise ValueError("queue_size and replay_size must be positive")
        if replay_bind is None:
            replay_bind = replay_endpoint_for(bind)
        self.publisher = publisher
        self.epoch = secrets.token_hex(
            8
        )  # a fresh one every start: subscribers forget the old epoch's blocks
        self.queue_size = queue_size
        self.replay_size = replay_size
        self._own_context = context is None
        self._context: zmq.Context[Any] = context or zmq.Context()
        # CURVE with $PDKV_CURVE_DIR: block hashes say which prefixes are cached (wire/curve.py).
        self._pub = server_socket(self._context, zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, queue_size)
        self._replay = server_socket(self._context, zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.MAXMSGSIZE, 4096)
        try:
            self._pub.bind(bind)
            self._replay.bind(replay_bind)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            raise OSError(f"cannot listen on {bind} or {replay_bind}: {exc.strerror}") from exc
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._queue: deque[EventBatch] = deque()
        self._seq = 0
        self._dropped_since_sent = 0
        self.num_dropped = 0  # batches not queued (full): their sequence numbers were skipped
        self.num_published = 0
        self._history: OrderedDict[int, bytes] = OrderedDict()  # sender thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{publisher}", daemon=True)
        self._thread.start()

    # ---- the owner's side (never blocks) --------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        with self._lock:
            self._seq += 1
            if len(self._queue) >= self.queue_size:
                self.num_dropped += 1
                self._dropped_since_sent += 1
                return
            self._queue.append(
                EventBatch(
                    self.publisher,
                    self.epoch,
                    self._seq,
                    time.time(),
                    tuple(events),
                    self._dropped_since_sent,
                )
            )
            self._dropped_since_sent = 0
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        if self._own_context:
            stop_authenticator(self._context)
            self._context.term()

    # ---- the sender thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            self._send_queued()
            if dict(poller.poll(10)).get(self._replay):
                self._serve_replays()
            if not self._queue:
                self._wake.wait(0.05)
                self._wake.clear()

    def _send_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                batch = self._queue.popleft()
            frame = batch.encode()
            self._history[batch.seq] = frame
            while len(self._history) > self.replay_size:
                self._history.popitem(last=False)
            try:
                self._pub.send(frame, zmq.NOBLOCK)
                self.num_published += 1
            except zmq.Again:  # a subscriber too slow for the high-water mark: it replays the gap
                pass

    def _serve_replays(self, limit: int = 16) -> None:
        for _ in range(limit):
            try:
                identity, *body = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(body) != 1:
                    raise EventDecodeError(f"a replay request is one frame, got {len(body)}")
                request = ReplayRequest.decode(body[0])
            except EventDecodeError as exc:
                logger.debug("kv events: a malformed replay request from a subscriber: dropped (%s)", exc)
                continue
            start = request.start
            oldest = next(iter(self._history), 0)
            last = next(reversed(self._history), 0)
            gone = (bool(self._history) and start < oldest) or (not self._history and start <= self._seq)
            header = ReplayReply(request.id, self.epoch, oldest, last, gone)
            frames = [] if gone else [f for seq, f in self._history.items() if seq >= start]
            try:
                self._replay.send_multipart([identity, header.encode(), *frames], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("kv events: replay reply dropped: %s", exc)
