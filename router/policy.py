"""Node selection: which of the healthy nodes gets a request.

A policy sees the candidates and the request's ``RoutingInfo`` (its tokens and salt, and its block hashes
on demand, computed exactly as the nodes compute them), so a prefix-aware policy -- send a request where
its leading blocks are cached -- is one more class here, not a change to the router.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from engine.hashing import AdapterId, BlockHash, HashNamespace, hash_blocks
from router.costs import NodeCosts
from router.kv_index import KVIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingInfo:
    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None
    adapter: AdapterId | None = None

    def block_hashes(self, namespace: HashNamespace) -> list[BlockHash]:
        """The prompt's full-block hashes in ``namespace`` (a node's, from its Stats): an adapter's
        blocks match only that adapter's (its name and digest are in every hash)."""
        return hash_blocks(
            self.prompt_token_ids, namespace=namespace, cache_salt=self.cache_salt, adapter=self.adapter
        )


class RoutedNode(Protocol):
    """What a policy reads of a node: a ``NodeHandle`` in the router, a simulated node in
    ``planner/sim`` (which routes with these very classes)."""

    @property
    def address(self) -> str: ...

    @property
    def inflight(self) -> int: ...

    @property
    def costs(self) -> NodeCosts: ...

    @property
    def namespace(self) -> HashNamespace | None: ...


N = TypeVar("N", bound=RoutedNode)


class NodeSelector(Protocol):
    def choose(self, nodes: Sequence[N], info: RoutingInfo) -> N:
        """One of ``nodes`` (never empty) for the request."""
        ...


class RoundRobin:
    """Each node in turn (by address, so the order does not depend on discovery order)."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, nodes: Sequence[N], info: RoutingInfo) -> N:
        ordered = sorted(nodes, key=lambda n: n.address)
        with self._lock:
            i = next(self._counter)
        return ordered[i % len(ordered)]


class LeastLoaded:
    """The node with the fewest calls in flight from this router; ties go round-robin."""

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(self, nodes: Sequence[N], info: RoutingInfo) -> N:
        least = min(n.inflight for n in nodes)
        return self._tiebreak.choose([n for n in nodes if n.inflight == least], info)


@dataclass(frozen=True)
class Estimate:
    """A node's predicted time to first token for one request, and what it is made of."""

    node: RoutedNode
    seconds: float
    local_tokens: int  # prompt tokens the node holds (its KV events say)
    store_tokens: int  # prompt tokens past those it would load from the shared store
    compute_tokens: int
    queued_tokens: float


DEFAULT_PREFILL_S_PER_TOKEN = 1e-4  # until some node has measured its own: only the ratios matter then
STORE = "store"  # the index's key for the shared store's blocks (its publisher's events)
SPREAD = 2.0  # a node's prefill cost per token is taken within [median / SPREAD, median x SPREAD]


class KVAware:
    """The node with the least predicted time to first token, from measured costs (``NodeCosts``):

        (queued prefill tokens + tokens to compute) x the node's prefill seconds per token
          + tokens to load from the store x the node's store-load seconds per token

    The tokens it holds come from the index of the nodes' KV events; the store's from the index entries
    of the store's publisher (``STORE``), used only by a node that has measured its own store loads
    (a node with no store, or none measured yet, computes them).  A node that has not measured its
    prefill speed yet is taken at the median of those that have, and every node within a factor
    ``SPREAD`` of that median.  Ties (within ``tie_ratio``) go to the
    least loaded, then round-robin.

    The queued tokens a node reports are as old as the last health round: they are taken as drained at
    the node's own rate since, and requests routed since would all see the same idle node and pile onto
    it.  So the policy also keeps its own ledger: every request
    it sends adds its tokens to compute to the chosen node until the time its estimate says the prefill
    is done, and a node's queue is the larger of what it reported and what the ledger holds.
    """

    def __init__(
        self, index: KVIndex, *, tie_ratio: float = 0.02, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.index = index
        self.tie_ratio = tie_ratio
        self.clock = clock
        self._tiebreak = LeastLoaded()
        self._lock = threading.Lock()
        self._ledger: dict[str, deque[tuple[float, int]]] = {}  # node -> (predicted done, tokens)

    def _pending(self, address: str, now: float) -> int:
        entries = self._ledger.get(address)
        if not entries:
            return 0
        while entries and entries[0][0] <= now:
            entries.popleft()
        return sum(tokens for done, tokens in entries if done > now)

    def estimates(self, nodes: Sequence[RoutedNode], info: RoutingInfo) -> list[Estimate]:
        """One estimate a node, in the order of ``nodes``."""
        measured = sorted(n.costs.prefill_s_per_token for n in nodes if n.costs.prefill_s_per_token)
        typical = measured[len(measured) // 2] if measured else DEFAULT_PREFILL_S_PER_TOKEN
        hashes_by_ns: dict[HashNamespace, list[BlockHash]] = {}
        n_prompt = len(info.prompt_token_ids)
        out = []
        for node in nodes:
            local = store = 0
            load_per_token = node.costs.load_s_per_token
            if node.namespace is not None:
                hashes = hashes_by_ns.get(node.namespace)
                if hashes is None:
                    hashes = hashes_by_ns[node.namespace] = info.block_hashes(node.namespace)
                bs = node.namespace.block_size
                # Whole blocks, never the last token (it is computed to produce logits).
                usable = (n_prompt - 1) // bs
                local = min(self.index.prefix_blocks(node.address, hashes), usable) * bs
                if load_per_token is not None:
                    in_store = min(self.index.prefix_blocks(STORE, hashes), usable) * bs
                    store = max(0, in_store - local)
            compute = n_prompt - local - store
            # Within a factor of the fleet's median: one node's measurement from a few steps (its first
            # ones pay one-time costs) must not outweigh the work a cached prefix saves.
            per_token = min(
                max(node.costs.prefill_s_per_token or typical, typical / SPREAD), typical * SPREAD
            )
            now = self.clock()
            with self._lock:
                pending = self._pending(node.address, now)
            # The node's own figure is as old as its last Stats: it has been computing since.
            drained = max(0.0, now - node.costs.measured_at) / per_token if node.costs.measured_at else 0.0
            reported = max(0.0, node.costs.queued_prefill_tokens - drained)
            queued = max(reported, float(pending))
            seconds = (queued + compute) * per_token + store * (load_per_token or 0.0)
            out.append(Estimate(node, seconds, local, store, compute, queued))
        return out

    def choose(self, nodes: Sequence[N], info: RoutingInfo) -> N:
        estimates = self.estimates(nodes, info)
        best = min(e.seconds for e in estimates)
        close = [
            n
            for n, e in zip(nodes, estimates, strict=True)
            if e.seconds <= best * (1 + self.tie_ratio) + 1e-9
        ]
        chosen = close[0] if len(close) == 1 else self._tiebreak.choose(close, info)
        estimate = next(e for e in estimates if e.node is chosen)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv-aware: %s -> %s; estimates %s",
                info.request_id,
                chosen.address,
                ", ".join(
                    f"{e.node.address}: {e.seconds * 1e3:.2f} ms (local {e.local_tokens}, "
                    f"store {e.store_tokens}, compute {e.compute_tokens}, queued {e.queued_tokens:.0f})"
                    for e in estimates
                ),
            )
        with self._lock:  # its work counts against the node until the estimate says it is done
            entries = self._ledger.setdefault(chosen.address, deque())
            entries.append((self.clock() + max(estimate.seconds, 1e-3), estimate.compute_tokens))
            while len(entries) > 4096:
                entries.popleft()
        return chosen


POLICIES = ("round-robin", "least-loaded", "kv-aware")


def make_selector(
    policy: str, index: KVIndex | None = None, *, clock: Callable[[], float] = time.monotonic
) -> NodeSelector:
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "kv-aware":
        if index is None:
            raise ValueError("policy 'kv-aware' needs the router's KV index")
        return KVAware(index, clock=clock)
    raise ValueError(f"policy {policy!r} is unknown; choose {', '.join(POLICIES)}")


def pool_selector(
    policy: str,
    index: KVIndex | None,
    *,
    computes_prompt: bool,
    clock: Callable[[], float] = time.monotonic,
) -> NodeSelector:
    """The selector of one pool under ``policy``: kv-aware routes the pool that computes the prompt
    (prefill, or colocated) by the index of KV events; the decode nodes of a disaggregated request,
    which receive the prompt's KV whatever they hold, stay least-loaded."""
    if policy == "kv-aware" and not computes_prompt:
        return LeastLoaded()
    return make_selector(policy, index, clock=clock)
