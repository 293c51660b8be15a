"""The router's view of its nodes: one channel and stubs per node, health, and in-flight counts.

A ``NodePool`` holds the nodes of one kind (prefill, or decode/colocated).  ``HealthMonitor`` asks every
node's health service each ``interval`` and marks it up or down (down where its checks run past their
deadline ``LATE_CHECKS_DOWN`` times in a row, or it refuses them); a call that fails with UNAVAILABLE marks
its node down at once, so the next request avoids it without waiting for the monitor.  With DNS discovery
a configured ``name:port`` stands for every address the name resolves to (compose replicas).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc

from engine.driver import NODE_DRAINING
from engine.hashing import AdapterId, HashNamespace
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc, types_pb2
from router.costs import NodeCosts, measure_costs
from router.kv_index import Publisher
from serving.health import SERVING, check
from serving.tls import TLSFolder, channel

logger = logging.getLogger(__name__)

# The largest message the router takes from a node: the first carries a scored prompt's logprobs
# (prompt_logprobs, echo), with up to 20 alternatives a token about 130 bytes a token -- over gRPC's
# default 4 MiB from 32k tokens on.
MAX_NODE_MESSAGE_BYTES = 256 * 1024 * 1024
# Reconnect quickly to a node that restarts (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_NODE_MESSAGE_BYTES),
]
ABORT_TIMEOUT_S = 2.0


# A node up until now is marked down when this many health checks in a row run past their deadline (one
# late answer on a loaded host is not a dead node); a refused connection marks it down at once.
LATE_CHECKS_DOWN = 2
LATE = "UNREACHABLE: DEADLINE_EXCEEDED"
STOPPING_GRACE_S = 30.0  # what reroute_unreachable allows a stopping node beyond --reroute-after-s
# A node no longer resolved (a pod leaving its Service) keeps its open calls this long at most: it drains
# them within its own grace period (Kubernetes' terminationGracePeriodSeconds), or dies and fails them.
LEAVING_GRACE_S = 600.0


class NodeHandle:
    """One node: stubs over one channel, whether it is healthy, and how many router calls it serves."""

    def __init__(self, address: str, service: str, tls: TLSFolder | None = None) -> None:
        self.address = address
        self.service = service  # the health service name to check
        self.channel = channel(address, tls, CHANNEL_OPTIONS)  # TLS (mutual where the folder allows)
        self.prefill = node_pb2_grpc.PrefillNodeStub(self.channel)
        self.decode = node_pb2_grpc.DecodeNodeStub(self.channel)
        self.control = node_pb2_grpc.NodeStub(self.channel)
        # The node's block-hash namespace (from Stats): its model, for prefix-aware policies and for which
        # nodes may continue one another's work (router/candidates.py).
        self.namespace: HashNamespace | None = None
        # Its compute dtype ("" until it answered) and whether it runs deterministic (from Stats).
        self.dtype = ""
        self.deterministic = False
        # Its LoRA adapters by name (from Stats, or at once after the router loaded one), which of them
        # sit in a slot now, and what each is.
        self.adapters: dict[str, AdapterId] = {}
        # Every identity it has served since it started, replaced or unloaded ones too: it still runs the
        # requests admitted with them (engine/lora/manager.py's resolve).
        self.known_adapters: set[AdapterId] = set()
        self._engine_id = ""  # the engine the above belong to (a restarted node knows only what it loads)
        self._adapter_changes = 0  # the router's own loads and unloads (a Stats read before one is stale)
        self.resident_adapters: set[AdapterId] = set()
        self.adapter_infos: dict[AdapterId, types_pb2.AdapterInfo] = {}
        self.max_lora_rank = 0
        self.max_model_len = 0  # the longest request it serves (from Stats; 0 until it answered)
        # Its measured costs and where it publishes KV events (from Stats, each health round).
        self.costs = NodeCosts()
        self.kv_events: Publisher | None = None
        self._last_stats: node_pb2.NodeStats | None = None
        self._lock = threading.Lock()
        self._healthy = False
        self._inflight = 0
        # The router's open calls to it: each one's cancel function and the adapter it runs under.
        self._calls: dict[Callable[[], object], AdapterId | None] = {}
        # When its health checks began to go unanswered (a dead or frozen node); None while it answers.
        self.unreachable_since: float | None = None
        self.late_checks = 0  # health checks in a row that ran past their deadline
        self.stopping = False  # its last answer was NOT_SERVING: draining (its calls finish in its grace)
        self.last_error = "not checked yet"

    def __repr__(self) -> str:
        return f"NodeHandle({self.address!r}, healthy={self._healthy}, inflight={self._inflight})"

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def inflight(self) -> int:
        return self._inflight

    def mark_down(self, reason: str) -> None:
        with self._lock:
            was_up, self._healthy, self.last_error = self._healthy, False, reason
            if reason.startswith(NODE_DRAINING):  # its refusal says so before a health round does
                self.stopping = True
        if was_up:
            logger.warning("node %s is down: %s", self.address, reason)

    def mark_up(self) -> None:
        with self._lock:
            was_up, self._healthy, self.last_error = self._healthy, True, ""
        if not was_up:
            logger.info("node %s is up", self.address)

    def runs(self, adapter: AdapterId | None) -> bool:
        """Whether it runs a request admitted under ``adapter``: it serves it, or served it since it
        started (replaced or unloaded since: what was admitted before finishes on it).  New requests only
        ever name what is served now (``RouterAdapters.resolve``)."""
        return adapter is None or self.adapters.get(adapter.name) == adapter or adapter in self.known_adapters

    @contextlib.contextmanager
    def busy(
        self, cancel: Callable[[], object] | None = None, adapter: AdapterId | None = None
    ) -> Iterator[None]:
        """Count one router call against this node while the block runs (least-loaded reads it); ``cancel``
        ends the call (under ``adapter``) should the node stop answering (``cut_calls``)."""
        with self._lock:
            self._inflight += 1
            if cancel is not None:
                self._calls[cancel] = adapter
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= 1
                if cancel is not None:
                    self._calls.pop(cancel, None)

    def cut_calls(self, elsewhere: Sequence[NodeHandle]) -> int:
        """Cancel the router's open calls to this node that one of ``elsewhere`` can run (its adapter):
        each fails as CANCELLED without the client having asked, which the pipeline takes for the node's
        failure (a decode stream resumes on another node).  The others wait for it."""
        with self._lock:
            calls = [c for c, adapter in self._calls.items() if any(n.runs(adapter) for n in elsewhere)]
        for cancel in calls:
            cancel()
        return len(calls)

    def abort_async(self, request_id: str) -> None:
        """Tell the node to abort ``request_id`` (and free what it holds for it); never blocks."""
        try:
            future = self.control.Abort.future(
                node_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S
            )
        except ValueError as exc:  # the channel is closed: the router is shutting down
            logger.info("abort of %s on %s not sent: %s", request_id, self.address, exc)
            return
        future.add_done_callback(lambda f: _log_abort_failure(self.address, request_id, f))

    def check(self, timeout: float) -> None:
        status = check(self.address, service=self.service, timeout=timeout, channel=self.channel)
        if not status.startswith("UNREACHABLE"):  # it answers (NOT_SERVING while draining: calls finish)
            self.unreachable_since, self.stopping, self.late_checks = None, status == "NOT_SERVING", 0
        elif self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        if status.startswith(LATE) and self._healthy:
            # A live node on a loaded host can answer one check late; a dead one refuses the connection
            # (UNAVAILABLE: down at once), and a frozen one misses check after check.
            self.late_checks += 1
            if self.late_checks < LATE_CHECKS_DOWN:
                logger.info("node %s answered no health check in %.1f s; still up", self.address, timeout)
                return
        if status != SERVING:
            self.mark_down(status)
            return
        self._refresh_stats(timeout)
        if self.namespace is None:  # its Stats never answered: which model it runs is not known yet
            self.mark_down("its Stats did not answer yet (the model it runs is not known)")
            return
        self.mark_up()

    def _refresh_stats(self, timeout: float) -> None:
        """The node's namespace, its KV events endpoints, and its measured costs."""
        changes = self._adapter_changes
        try:
            stats = self.control.Stats(node_pb2.StatsRequest(), timeout=timeout)
            if stats.model_fingerprint:  # every node says it; a node restarted here may run another model
                self.namespace = HashNamespace(stats.model_fingerprint, stats.block_size, stats.hash_algo)
            self.dtype, self.deterministic = stats.dtype, stats.deterministic
            infos = {AdapterId(a.name, a.digest): a for a in stats.adapters}
            with self._lock:
                if stats.engine_id != self._engine_id:
                    self._engine_id, self.known_adapters = stats.engine_id, set()
                self.known_adapters = self.known_adapters | set(infos)
                if changes == self._adapter_changes:  # else the router's load/unload is newer: kept
                    self.adapters = {aid.name: aid for aid in infos}
                    self.adapter_infos = infos
            self.resident_adapters = {aid for aid, a in infos.items() if a.resident}
            self.max_lora_rank, self.max_model_len = stats.max_lora_rank, stats.max_model_len
        except (grpc.RpcError, ValueError) as exc:
            logger.debug("no stats from %s yet: %r", self.address, exc)
            return
        self.kv_events = (
            Publisher(
                self.address, stats.engine_id, stats.kv_events_endpoint, stats.kv_events_replay_endpoint
            )
            if stats.kv_events_endpoint
            else None
        )
        # A node in a long step answers with its last figures and their age: they are as of then.
        self.costs = measure_costs(self.costs, self._last_stats, stats, time.monotonic() - stats.stats_age_s)
        self._last_stats = stats

    def note_adapter(self, info: types_pb2.AdapterInfo) -> None:
        """The node loaded ``info`` (the router's call): route to it before the next health round."""
        aid = AdapterId(info.name, info.digest)
        with self._lock:
            self._adapter_changes += 1
            self.adapters = {**self.adapters, info.name: aid}
            self.known_adapters = self.known_adapters | {aid}
            self.adapter_infos = {**self.adapter_infos, aid: info}

    def forget_adapter(self, name: str) -> None:
        """The node unloaded ``name`` (the router's call): no new request goes to it for that name, even
        from a health round's Stats read before the unload."""
        with self._lock:
            self._adapter_changes += 1
            self.adapters = {k: v for k, v in self.adapters.items() if k != name}

    def close(self) -> None:
        self.channel.close()


def _log_abort_failure(address: str, request_id: str, future: grpc.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.info("abort of %s on %s failed: %s", request_id, address, future.exception())


class NodePool:
    """The nodes of one kind; ``service`` is the health service they must report SERVING."""

    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        service: str,
        *,
        dns_discovery: bool = False,
        tls: TLSFolder | None = None,
    ) -> None:
        self.kind = kind
        self.tls = tls
        self.configured = tuple(addresses)
        self.service = service
        self.dns_discovery = dns_discovery
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeHandle] = {}
        # Nodes no longer resolved whose calls still run, and since when: chosen for nothing new.
        self._leaving: dict[str, tuple[NodeHandle, float]] = {}
        self._resolved: dict[str, set[str]] = {}  # each configured name -> what it resolved to last
        self.refresh()

    def nodes(self) -> list[NodeHandle]:
        with self._lock:
            return list(self._nodes.values())

    def healthy(self, exclude: Sequence[NodeHandle] = ()) -> list[NodeHandle]:
        return [n for n in self.nodes() if n.healthy and n not in exclude]

    def leaving(self) -> list[NodeHandle]:
        """Nodes no longer resolved whose calls still run: checked, and rerouted when frozen, as any."""
        with self._lock:
            return [node for node, _ in self._leaving.values()]

    def watched(self) -> list[NodeHandle]:
        """Every node with calls to watch: the pool's and those leaving it."""
        return [*self.nodes(), *self.leaving()]

    def refresh(self) -> None:
        """Add the nodes the configured addresses stand for now; drop those they no longer do -- their
        open calls finish first.  A pod leaving its Service in a rolling update is no longer resolved the
        moment it is told to stop, and drains its streams within its grace period: closing its channel
        then cut them (an outside probe's rolling restart resumed three streams elsewhere, where a
        planned stop must resume none).  So it gets nothing new, and its channel closes once its calls
        have ended (or after LEAVING_GRACE_S); should it resolve again meanwhile, it is back."""
        targets = self._targets()
        now = time.monotonic()
        with self._lock:
            for address in targets - set(self._nodes):
                back = self._leaving.pop(address, None)
                self._nodes[address] = back[0] if back else NodeHandle(address, self.service, self.tls)
            # (those that left in an earlier round: a call chosen just before this one may start yet)
            closing = [
                n for n, since in self._leaving.values() if n.inflight == 0 or now - since >= LEAVING_GRACE_S
            ]
            for node in closing:
                del self._leaving[node.address]
            left = [self._nodes.pop(a) for a in set(self._nodes) - targets]
            self._leaving.update((node.address, (node, now)) for node in left)
        for node in left:
            logger.warning(
                "node %s left pool %s (no longer resolved): no new calls; its %d open call(s) finish first",
                node.address,
                self.kind,
                node.inflight,
            )
        for node in closing:
            if node.inflight:
                logger.warning(
                    "node %s: %d call(s) still open after %.0f s: cut",
                    node.address,
                    node.inflight,
                    LEAVING_GRACE_S,
                )
            node.close()

    def _targets(self) -> set[str]:
        if not self.dns_discovery:
            return set(self.configured)
        found: set[str] = set()
        for address in self.configured:
            host, _, port = address.rpartition(":")
            try:
                infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
            except OSError as exc:  # a resolver's hiccup: what the name stood for last time stands
                logger.warning("cannot resolve %s (%s): its last addresses stay", address, exc)
                found |= self._resolved.get(address, set())
                continue
            ips = {str(info[4][0]) for info in infos}
            self._resolved[address] = {f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips}
            found |= self._resolved[address]
        return found

    def close(self) -> None:
        for node in self.watched():
            node.close()

    def reroute_unreachable(self, after_s: float) -> None:
        """Cancel the open calls of every node whose health checks went unanswered for ``after_s`` while
        another node of the pool serves: the pipeline goes on there (a decode stream resumes).  A frozen
        node (a stopped process, a hung VM) keeps its connections open and fails none of its calls: its
        streams would wait for it, however long, with a healthy node beside it."""
        healthy = self.healthy()
        if not healthy:
            return  # nowhere to go: a node that thaws finishes them
        now = time.monotonic()
        for node in self.watched():
            since = node.unreachable_since
            # A node that said it was stopping ends its calls within its grace: cut them only well after.
            wait = after_s + (STOPPING_GRACE_S if node.stopping else 0.0)
            if since is not None and not node.healthy and now - since >= wait:  # one late check: still up
                cut = node.cut_calls(healthy)
                if cut:
                    logger.warning(
                        "node %s unanswered for %.1f s: its %d open call(s) go on on other %s nodes",
                        node.address,
                        now - since,
                        cut,
                        self.kind,
                    )


class HealthMonitor:
    """Checks every node of ``pools`` each ``interval`` seconds on a daemon thread; calls ``on_round``
    after each round (the router updates its own health from it)."""

    def __init__(
        self,
        pools: Sequence[NodePool],
        *,
        interval: float,
        timeout: float,
        reroute_after_s: float = float("inf"),
        on_round: Callable[[], None] = lambda: None,
    ) -> None:
        self.pools = tuple(pools)
        self.interval = interval
        self.timeout = timeout
        self.reroute_after_s = reroute_after_s
        self.on_round = on_round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)

    def start(self) -> HealthMonitor:
        self._thread.start()
        return self

    def check_all(self) -> None:
        """One round: every node checked in parallel (a dead node's timeout does not delay the others)."""
        checks = []
        for pool in self.pools:
            if pool.dns_discovery:
                pool.refresh()
            for node in pool.watched():
                t = threading.Thread(target=node.check, args=(self.timeout,), daemon=True)
                t.start()
                checks.append(t)
        for t in checks:
            t.join(self.timeout + 1.0)
        for pool in self.pools:
            pool.reroute_unreachable(self.reroute_after_s)
        self.on_round()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_all()
            except Exception:
                logger.exception("health round failed")
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 2.0)


def numerics(nodes: Iterable[NodeHandle]) -> tuple[str, bool]:
    """What the nodes that answered compute in: their dtypes ("bfloat16"; "bfloat16,float32" for a mixed
    fleet; "" before any answered) and whether every one of them runs deterministic."""
    answered = [n for n in nodes if n.dtype]
    dtypes = ",".join(sorted({n.dtype for n in answered}))
    return dtypes, bool(answered) and all(n.deterministic for n in answered)


def pool_numerics(*pools: NodePool | None) -> tuple[str, bool]:
    """``numerics`` of every node of ``pools`` (None: a pool the mode has not)."""
    return numerics(n for pool in pools if pool is not None for n in pool.nodes())


def served_context(pools: Iterable[NodePool]) -> int:
    """The longest request every healthy node serves (its ``max_model_len`` from Stats); 0 when none has
    said.  A node whose KV cache holds less than the model's context serves less."""
    lengths = [n.max_model_len for pool in pools for n in pool.healthy() if n.max_model_len]
    return min(lengths, default=0)
