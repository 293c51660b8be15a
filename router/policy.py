"""Node selection: which of the healthy nodes gets a request.

A policy sees the candidates and the request's ``RoutingInfo`` (its tokens and salt, and its block hashes
on demand, computed exactly as the nodes compute them), so a prefix-aware policy -- send a request where
its leading blocks are cached -- is one more class here, not a change to the router.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.hashing import BlockHash, HashNamespace, hash_blocks
from router.nodes import NodeHandle


@dataclass(frozen=True)
class RoutingInfo:
    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None

    def block_hashes(self, namespace: HashNamespace) -> list[BlockHash]:
        """The prompt's full-block hashes in ``namespace`` (a node's, from its Stats)."""
        return hash_blocks(self.prompt_token_ids, namespace=namespace, cache_salt=self.cache_salt)


class NodeSelector(Protocol):
    def choose(self, nodes: Sequence[NodeHandle], info: RoutingInfo) -> NodeHandle:
        """One of ``nodes`` (never empty) for the request."""
        ...


class RoundRobin:
    """Each node in turn (by address, so the order does not depend on discovery order)."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, nodes: Sequence[NodeHandle], info: RoutingInfo) -> NodeHandle:
        ordered = sorted(nodes, key=lambda n: n.address)
        with self._lock:
            i = next(self._counter)
        return ordered[i % len(ordered)]


class LeastLoaded:
    """The node with the fewest calls in flight from this router; ties go round-robin."""

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(self, nodes: Sequence[NodeHandle], info: RoutingInfo) -> NodeHandle:
        least = min(n.inflight for n in nodes)
        return self._tiebreak.choose([n for n in nodes if n.inflight == least], info)


def make_selector(policy: str) -> NodeSelector:
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"policy {policy!r} is unknown; choose round-robin or least-loaded")
