"""The router's index of which node holds which KV block, fed by the nodes' KV events.

``KVIndex`` is the bookkeeping (no sockets): block hash -> {node: medium}, and per node its publisher
epoch and the last batch sequence number applied.  ``KVEventSubscriber`` feeds it: one SUB socket per
publishing node (the endpoint its ``Stats`` names), a DEALER to each node's replay socket, one thread.

The rules (``wire/kv_events.py`` has the wire format):

- a batch from another **epoch** than the one the index knows for that node (the engine restarted):
  the node's entries are dropped, then the batch applies;
- a **gap** in sequence numbers (the subscriber missed batches, or the publisher dropped some): the
  missing batches are asked from the replay socket and applied in order; if they are gone, the node's
  entries are dropped and the index starts over from what comes next (it may then miss blocks the node
  has -- it never claims blocks the node lost);
- a batch that is **garbage**, or from a **publisher** other than the node's engine: counted
  (``garbage``, ``unknown_publisher``) and dropped; routing goes on;
- a node that **leaves** the pool or goes down: its entries leave the index (``drop_node``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from wire.curve import client_socket
from wire.keys import BlockHash
from wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    ReplayReply,
    ReplayRequest,
)

logger = logging.getLogger(__name__)


class KVIndex:
    """Which node holds which block, and in which medium.  Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, dict[str, set[str]]] = {}  # hash -> {node: media holding it}
        self._blocks: dict[str, set[BlockHash]] = {}  # node -> its hashes
        self._epochs: dict[str, str] = {}
        self._last_seq: dict[str, int] = {}
        self.counters: dict[str, int] = {
            "batches": 0,
            "epoch_changes": 0,
            "gaps": 0,
            "resyncs": 0,
            "garbage": 0,
            "unknown_publisher": 0,
            "caught_up": 0,
        }

    # ---- applying events -------------------------------------------------------------------------------

    def expects(self, node: str, batch: EventBatch) -> int | None:
        """The first sequence number missing before ``batch`` can apply, or None if it applies now.  A new
        epoch (the publisher restarted) drops the node's entries first."""
        with self._lock:
            if self._epochs.get(node) != batch.epoch:
                if node in self._epochs:
                    self.counters["epoch_changes"] += 1
                    logger.info("kv index: %s restarted (epoch %s): dropping its blocks", node, batch.epoch)
                self._drop_locked(node)
                self._epochs[node] = batch.epoch
                self._last_seq[node] = 0
            last = self._last_seq[node]
            if batch.seq <= last:
                return None  # already applied (a replay overlapping the live stream): apply() skips it
            return None if batch.seq == last + 1 else last + 1

    def apply(self, node: str, batch: EventBatch) -> bool:
        """Apply ``batch`` if it is the next one of the node's epoch; False (nothing done) otherwise."""
        with self._lock:
            if self._epochs.get(node) != batch.epoch or batch.seq != self._last_seq.get(node, 0) + 1:
                return False
            for event in batch.events:
                self._apply_locked(node, event)
            self._last_seq[node] = batch.seq
            self.counters["batches"] += 1
            return True

    def restart_from(self, node: str, batch: EventBatch) -> None:
        """The batches before ``batch`` are gone: forget the node's blocks and go on from ``batch``."""
        with self._lock:
            self.counters["resyncs"] += 1
            self._drop_locked(node)
            self._epochs[node] = batch.epoch
            self._last_seq[node] = batch.seq - 1
        self.apply(node, batch)

    def drop_node(self, node: str) -> None:
        """The node left or went down: its blocks leave the index."""
        with self._lock:
            self._drop_locked(node)
            self._epochs.pop(node, None)
            self._last_seq.pop(node, None)

    def count(self, what: str) -> None:
        with self._lock:
            self.counters[what] += 1

    def _apply_locked(self, node: str, event: Any) -> None:
        if isinstance(event, BlockStored):
            mine = self._blocks.setdefault(node, set())
            for h in event.block_hashes:
                self._holders.setdefault(h, {}).setdefault(node, set()).add(event.medium)
                mine.add(h)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._remove_locked(node, h, event.medium)
        elif isinstance(event, AllBlocksCleared):
            for h in list(self._blocks.get(node, ())):
                self._remove_locked(node, h, event.medium)

    def _remove_locked(self, node: str, h: BlockHash, medium: str) -> None:
        """``node`` no longer holds ``h`` in ``medium`` (a block may sit in several of its tiers)."""
        holders = self._holders.get(h)
        media = holders.get(node) if holders is not None else None
        if holders is None or media is None:
            return
        media.discard(medium)
        if not media:
            del holders[node]
            if not holders:
                del self._holders[h]
            self._blocks.get(node, set()).discard(h)

    def _drop_locked(self, node: str) -> None:
        for h in self._blocks.pop(node, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(node, None)
                if not holders:
                    del self._holders[h]

    # ---- queries --------------------------------------------------------------------------------------

    def prefix_blocks(self, node: str, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` ``node`` holds (any medium)."""
        with self._lock:
            n = 0
            for h in hashes:
                if node not in self._holders.get(h, {}):
                    break
                n += 1
            return n

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._epochs)

    def num_blocks(self, node: str) -> int:
        with self._lock:
            return len(self._blocks.get(node, ()))

    def last_seq(self, node: str) -> int:
        with self._lock:
            return self._last_seq.get(node, 0)


@dataclass(frozen=True)
class Publisher:
    """What a node's Stats says about its events."""

    node: str  # the node's address: the index's key
    publisher: str  # the engine id its batches carry
    endpoint: str
    replay_endpoint: str


class KVEventSubscriber:
    """Subscribes to every publisher ``targets()`` returns (polled each ``refresh_s``) and feeds ``index``."""

    def __init__(
        self,
        index: KVIndex,
        targets: Callable[[], Iterable[Publisher]],
        *,
        refresh_s: float = 0.25,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.index = index
        self.targets = targets
        self.refresh_s = refresh_s
        self.replay_timeout_s = replay_timeout_s
        self._context: zmq.Context[Any] = zmq.Context()
        self._subs: dict[str, tuple[Publisher, zmq.Socket[Any]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for _, sock in self._subs.values():
            sock.close(linger=0)
        self._context.term()

    # ---- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_refresh = 0.0
        poller = zmq.Poller()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_refresh:
                try:
                    self._refresh(poller)
                except Exception:
                    logger.exception("kv index: refreshing subscriptions failed")
                next_refresh = now + self.refresh_s
            for sock, _ in poller.poll(50):
                node = next((n for n, (_, s) in self._subs.items() if s is sock), None)
                if node is None:
                    continue
                for _ in range(256):
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.receive(node, frame)

    def _refresh(self, poller: zmq.Poller) -> None:
        wanted = {p.node: p for p in self.targets()}
        for node in list(self._subs):
            publisher, sock = self._subs[node]
            if wanted.get(node) != publisher:  # left, went down, or restarted somewhere else
                poller.unregister(sock)
                sock.close(linger=0)
                del self._subs[node]
                self.index.drop_node(node)
        for node, publisher in wanted.items():
            if node in self._subs:
                continue
            sock = client_socket(self._context, zmq.SUB)  # CURVE with $PDKV_CURVE_DIR
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 10000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(publisher.endpoint)
            self._subs[node] = (publisher, sock)
            poller.register(sock, zmq.POLLIN)
            self._catch_up(node, publisher)

    def _catch_up(self, node: str, publisher: Publisher) -> None:
        """What the publisher sent before we subscribed: its replay buffer, from the oldest batch it
        still has (a quiet publisher would otherwise never show us a gap to replay)."""
        batches = self._replay(publisher, 1, None)
        if batches is None:
            oldest = self._oldest(publisher)
            batches = self._replay(publisher, oldest, None) if oldest else None
        if not batches:
            return
        first = batches[0]
        if self.index.expects(node, first) is not None:  # the oldest ones are gone: start from this one
            self.index.restart_from(node, first)
            batches = batches[1:]
        for batch in batches:
            if self.index.apply(node, batch):
                self.index.count("caught_up")

    def receive(self, node: str, frame: bytes) -> None:
        """One frame from ``node``'s publisher: decode, check, apply -- replaying a gap first."""
        entry = self._subs.get(node)
        try:
            batch = EventBatch.decode(frame)
        except EventDecodeError as exc:
            self.index.count("garbage")
            logger.debug("kv index: garbage from %s dropped: %s", node, exc)
            return
        if entry is not None and batch.publisher != entry[0].publisher:
            self.index.count("unknown_publisher")
            logger.debug("kv index: a batch from %r on %s's socket dropped", batch.publisher, node)
            return
        missing = self.index.expects(node, batch)
        if missing is not None:
            self.index.count("gaps")
            replayed = self._replay(entry[0], missing, batch.epoch) if entry is not None else None
            if replayed is None:
                self.index.restart_from(node, batch)
                return
            for old in replayed:
                if old.seq < batch.seq:
                    self.index.apply(node, old)
            if self.index.last_seq(node) != batch.seq - 1:
                self.index.restart_from(node, batch)  # the replay did not cover the whole gap
                return
        self.index.apply(node, batch)

    def _ask(self, publisher: Publisher, start: int) -> tuple[ReplayReply, list[bytes]] | None:
        """One replay exchange: the reply's header and batch frames, or None (no answer, garbage)."""
        sock = client_socket(self._context, zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(publisher.replay_endpoint)
            sock.send(ReplayRequest(start, start).encode())
            if not sock.poll(int(self.replay_timeout_s * 1000)):
                return None
            header, *frames = sock.recv_multipart()
            return ReplayReply.decode(header), frames
        except (zmq.ZMQError, EventDecodeError):
            return None
        finally:
            sock.close(linger=0)

    def _oldest(self, publisher: Publisher) -> int:
        answer = self._ask(publisher, 1)
        return answer[0].oldest if answer is not None else 0

    def _replay(self, publisher: Publisher, start: int, epoch: str | None) -> list[EventBatch] | None:
        """The batches of ``publisher`` from ``start`` on (of ``epoch``, when given), or None if they are
        gone, of another epoch, or it did not answer."""
        answer = self._ask(publisher, start)
        if answer is None:
            return None
        info, frames = answer
        if info.gone or (epoch is not None and info.epoch != epoch):
            return None
        out = []
        for frame in frames:
            try:
                batch = EventBatch.decode(frame)
            except EventDecodeError:
                return None
            if batch.publisher != publisher.publisher:
                self.index.count("unknown_publisher")
                return None
            out.append(batch)
        return out
