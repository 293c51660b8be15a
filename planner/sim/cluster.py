"""A discrete-event simulation of a pdkv cluster over a workload: no threads, no sockets, no clock but
its own.

The router's part is the router's code: each pool's selector comes from ``router.policy.pool_selector``
(round-robin, least-loaded, or kv-aware over a ``router.kv_index.KVIndex``), the index is fed the nodes'
and the store's KV events as ``wire.kv_events.EventBatch`` -- applied the way ``KVEventSubscriber``
applies them -- and each health round updates a node's costs with ``router.costs.measure_costs`` from
the node's engine counters.  The nodes are ``planner.sim.node.SimNode``s stepping by the profile.

Colocated: a node computes the prompt and decodes.  P/D: a prefill node computes the prompt and the
first token, keeps the blocks until the decode node chosen then has pulled them (the profile's p2p
cost), and the decode node generates the rest.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.hashing import HashNamespace
from planner.profile import Profile
from planner.sim.cache import StoreSim
from planner.sim.job import Job, Record
from planner.sim.node import SimNode
from planner.sim.results import SimResult
from planner.trace import Arrival
from router.costs import measure_costs
from router.kv_index import KVIndex
from router.policy import POLICIES, STORE, NodeSelector, RoutingInfo, pool_selector
from wire.keys import BlockHash
from wire.kv_events import BlockRemoved, BlockStored, EventBatch, KVCacheEvent

ARRIVE, STEP_END, LAND, HEALTH, WATCH = range(5)
WATCH_S = 1.0  # how often the simulation looks for a request waiting past ``give_up_s``


@dataclass(frozen=True)
class ClusterSpec:
    """What to simulate: ``colocated`` nodes, or ``prefill`` + ``decode`` ones; the policy; the store's
    tiers as (kind, bytes), top first (none: no store)."""

    policy: str = "round-robin"
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    store: tuple[tuple[str, int], ...] = ()
    block_tokens: int = 512  # a cache block in the simulation (the trace's blocks, scaled)
    node_kv_tokens: int | None = None  # default: the profile's KV cache (num_blocks x block_size)
    health_interval_s: float = 0.5  # the router's default
    # Stop once a request has waited this long for its first token: the cluster is overloaded, and
    # simulating the rest of its queue says nothing more (the result is marked ``overloaded``).
    give_up_s: float | None = None
    # Every prompt block computed anywhere is a hit everywhere, free (the infinite-cache ceiling's work).
    oracle: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose {', '.join(POLICIES)}")
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("node counts cannot be negative")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("a cluster is colocated or P/D, not both")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("a cluster needs colocated nodes, or prefill and decode nodes")
        if self.block_tokens < 1 or self.health_interval_s <= 0:
            raise ValueError("block_tokens must be >= 1 and health_interval_s > 0")

    @property
    def nodes(self) -> int:
        return self.colocated or self.prefill + self.decode

    def describe(self) -> str:
        shape = f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"
        store = "+".join(f"{kind}:{size / 2**30:g}GiB" for kind, size in self.store) or "no store"
        return f"{shape}, {self.policy}, {store}"


@dataclass(frozen=True)
class SimInfo(RoutingInfo):
    """A request as the router's policies see it: the prompt's length, and its block hashes made from
    the simulation's prefix keys (the trace has no tokens to hash)."""

    keys: tuple[int, ...] = ()

    def block_hashes(self, namespace: HashNamespace) -> list[BlockHash]:
        return [block_hash(k) for k in self.keys]


def block_hash(key: int) -> BlockHash:
    return BlockHash(key.to_bytes(8, "little"))


@dataclass(frozen=True)
class _Sum:
    sum: float


@dataclass(frozen=True)
class _Figures:
    """A node's Stats as ``measure_costs`` reads them."""

    counters: Mapping[str, float]
    gauges: Mapping[str, float]
    histograms: Mapping[str, _Sum]


@dataclass
class _Publisher:
    address: str
    seq: int = 0


@dataclass
class Simulation:
    profile: Profile
    spec: ClusterSpec
    arrivals: Sequence[Arrival]
    records: list[Record] = field(default_factory=list)

    def run(self) -> SimResult:
        spec, profile = self.spec, self.profile
        namespace = HashNamespace("pdkv-sim", spec.block_tokens)
        kv_tokens = spec.node_kv_tokens or profile.engine.num_blocks * profile.engine.block_size
        node_blocks = kv_tokens // spec.block_tokens
        block_bytes = profile.engine.kv_bytes_per_token * spec.block_tokens
        self.store = StoreSim([(k, size // block_bytes) for k, size in spec.store]) if spec.store else None
        self.index = KVIndex() if spec.policy == "kv-aware" else None
        self.now = 0.0
        self._queue: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._live = 0  # events in the queue that are not the periodic health and watch rounds

        oracle: set[int] | None = set() if spec.oracle else None

        def node(name: str, store: StoreSim | None) -> SimNode:
            return SimNode(name, profile, spec.block_tokens, node_blocks, namespace, store, oracle)

        if spec.colocated:
            self.routed = [node(f"node-{i:03d}", self.store) for i in range(spec.colocated)]
            self.decoders: list[SimNode] = []
        else:  # a decode node takes its prompt KV from the prefill node only (no store)
            self.routed = [node(f"prefill-{i:03d}", self.store) for i in range(spec.prefill)]
            self.decoders = [node(f"decode-{i:03d}", None) for i in range(spec.decode)]
        self.all_nodes = self.routed + self.decoders
        clock = self._clock
        self.route: NodeSelector = pool_selector(spec.policy, self.index, computes_prompt=True, clock=clock)
        self.route_decode = pool_selector(spec.policy, self.index, computes_prompt=False, clock=clock)
        self._publishers = {n.address: _Publisher(n.address) for n in self.all_nodes}
        self._publishers[STORE] = _Publisher(STORE)
        self._figures: dict[str, _Figures] = {}
        self.records = [
            Record(i, a.arrival_s, a.input_tokens, a.output_tokens) for i, a in enumerate(self.arrivals)
        ]
        self._after: dict[int, list[int]] = defaultdict(list)
        refused = 0
        for i, a in enumerate(self.arrivals):
            if -(-(a.input_tokens + a.output_tokens) // spec.block_tokens) > node_blocks:
                refused += 1  # the engine refuses a request that cannot fit its cache
                continue
            if a.after is None:
                self._push(a.arrival_s, ARRIVE, i)
            else:
                self._after[a.after].append(i)
        self._pending = len(self.arrivals) - refused
        if self.index is not None:
            self._push(0.0, HEALTH, None)
        if spec.give_up_s is not None:
            self._push(WATCH_S, WATCH, None)
        self.overloaded = False
        while self._queue and self._pending and not self.overloaded:
            t, _, kind, what = heapq.heappop(self._queue)
            self.now = t
            if kind in (ARRIVE, STEP_END, LAND):
                self._live -= 1
            elif not self._live:  # only the periodic rounds are left: requests no event will move
                break
            if kind == ARRIVE:
                self._arrive(what)
            elif kind == STEP_END:
                sim_node, version = what
                if version == sim_node.version:
                    self._step_end(sim_node)
            elif kind == LAND:
                self._land(what)
            elif kind == HEALTH:
                self._health()
            else:
                self._watch()
        done = [r for r in self.records if r.finish_s >= 0]
        stuck = bool(self._pending) and not self.overloaded
        start = min((r.sent_s for r in done), default=0.0)
        span = max((r.finish_s for r in done), default=0.0) - start
        itl = [gap for n in self.all_nodes for gap in n.itl]
        return SimResult(
            self.records,
            itl,
            refused,
            self.overloaded,
            stuck,
            span,
            sum(n.busy_s for n in self.all_nodes),
            len(self.all_nodes),
            sum(n.steps for n in self.all_nodes),
        )

    # ---- events ------------------------------------------------------------------------------------------

    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, what: Any) -> None:
        if kind in (ARRIVE, STEP_END, LAND):
            self._live += 1
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, kind, what))

    def _arrive(self, i: int) -> None:
        a, record = self.arrivals[i], self.records[i]
        record.sent_s = self.now
        info = SimInfo(str(i), range(a.input_tokens), keys=a.blocks)
        node = self.route.choose(self.routed, info)
        pd = bool(self.decoders)
        job = Job(record, a.blocks, a.input_tokens, 1 if pd else a.output_tokens, first=True)
        self._submit(node, job)

    def _submit(self, node: SimNode, job: Job) -> None:
        node.inflight += 1
        node.waiting.append(job)
        self._wake(node)

    def _wake(self, node: SimNode) -> None:
        """Something changed on ``node``: an idle one steps now; a decode stretch in flight is cut at its
        next step boundary, and its end event moves there."""
        version = node.version
        if node.wake(self.now):
            self._kick(node)
        elif node.version != version:
            self._push(node.busy_until, STEP_END, (node, node.version))

    def _kick(self, node: SimNode) -> None:
        """Start the node's next step if it is idle."""
        if node.busy_until < 0:
            end = node.start_step(self.now)
            if end is not None:
                node.version += 1
                self._push(end, STEP_END, (node, node.version))
        for t in node.landings:
            self._push(t, LAND, node)
        node.landings.clear()
        self._publish(node)

    def _step_end(self, node: SimNode) -> None:
        for job in node.end_step(self.now):
            node.inflight -= 1
            self._done(node, job, self.now)
        self._kick(node)

    def _done(self, node: SimNode, job: Job, now: float) -> None:
        record = job.record
        if self.decoders and job.first and record.output_tokens > 1:  # the prefill half: hand off
            decoder = self.route_decode.choose(
                self.decoders, SimInfo(str(record.index), range(record.input_tokens), keys=job.keys)
            )
            follow = Job(
                record,
                job.keys,
                record.input_tokens + 1,
                record.output_tokens - 1,
                first=False,
                pulled=record.input_tokens,
                last_token_s=now,
                source=(node, job),
            )
            self._submit(decoder, follow)
            return
        node.release(job)
        record.finish_s = now
        self._pending -= 1
        for j in self._after.pop(record.index, ()):
            self._push(max(self.now, self.arrivals[j].arrival_s), ARRIVE, j)

    def _land(self, node: SimNode) -> None:
        """Pulls landed on ``node``: the prefill nodes they came from free those blocks."""
        for job in node.loading:
            if 0 <= job.loading_until <= self.now and job.source is not None:
                source, held = job.source
                job.source = None
                source.release(held)
                self._kick(source)
        self._wake(node)

    def _watch(self) -> None:
        """Give up on an overloaded cluster: the prompt tokens its nodes have queued would take them
        ``give_up_s`` to compute, shared out evenly (one long prompt ahead of a request is not that)."""
        assert self.spec.give_up_s is not None
        backlog = sum(node.queued_prefill_tokens() for node in self.routed)
        if backlog * self.profile.step.prefill_token_s / len(self.routed) > self.spec.give_up_s:
            self.overloaded = True
            return
        self._push(self.now + WATCH_S, WATCH, None)

    def _health(self) -> None:
        """A health round: every routed node's costs from its counters (the router's own code)."""
        for node in self.routed:
            figures = _Figures(
                dict(node.counters),
                {"prefill_tokens_queued": node.queued_prefill_tokens()},
                {"kv_load_seconds.offload": _Sum(node.load_seconds)} if self.store is not None else {},
            )
            node.costs = measure_costs(node.costs, self._figures.get(node.address), figures, at=self.now)
            self._figures[node.address] = figures
        self._push(self.now + self.spec.health_interval_s, HEALTH, None)

    def _publish(self, node: SimNode) -> None:
        """The node's (and the store's) KV events since the last batch, applied to the index as the
        router's subscriber applies a batch it received."""
        events = node.cache.take_events()
        store_events = self.store.take_events() if self.store is not None else []
        if self.index is None:
            return
        if events:
            self._apply(node.address, in_order(events))
        for s, r, medium in store_events:
            batch: list[KVCacheEvent] = []
            if s:
                batch.append(BlockStored([block_hash(k) for k in s], None, [], 0, medium=medium))
            if r:
                batch.append(BlockRemoved([block_hash(k) for k in r], medium=medium))
            self._apply(STORE, batch)

    def _apply(self, address: str, events: list[KVCacheEvent]) -> None:
        assert self.index is not None
        pub = self._publishers[address]
        pub.seq += 1
        batch = EventBatch(address, "sim", pub.seq, self.now, tuple(events))
        if self.index.expects(address, batch) is None:
            self.index.apply(address, batch)


def in_order(events: list[tuple[bool, int]]) -> list[KVCacheEvent]:
    """(stored?, key) events as KV events, runs of one kind each, in the order they happened."""
    out: list[KVCacheEvent] = []
    run: list[BlockHash] = []
    for i, (stored, key) in enumerate(events):
        run.append(block_hash(key))
        if i + 1 == len(events) or events[i + 1][0] != stored:
            out.append(BlockStored(run, None, [], 0) if stored else BlockRemoved(run))
            run = []
    return out


def simulate(profile: Profile, spec: ClusterSpec, arrivals: Sequence[Arrival]) -> SimResult:
    """One run of ``arrivals`` through the cluster ``spec`` with ``profile``'s costs."""
    return Simulation(profile, spec, arrivals).run()
