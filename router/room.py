"""Waiting for room on full nodes.

A node that already runs ``--max-num-requests`` answers RESOURCE_EXHAUSTED "the node is full: ..."
(``serving.errors.node_full``): it is well, only busy.  The router admits up to ``--max-inflight`` calls,
more than one node takes, so it is the queue: a request whose every candidate node is full waits, trying
them again after a short pause (20 ms, doubling to 250 ms), until one takes it -- for as long as its
deadline allows, and ``FULL_WAIT_S`` at most -- rather than failing as if the nodes were down (they were
not, and the request was accepted).  A full node is not a failed attempt: attempts count failures only.

So too for a planned restart of the last node of a kind (``pdkv restart prefill-0`` with one prefill
node; a one-replica rollout): while no node of the pool is up and one of them is stopping (it said
NOT_SERVING, or refused a call as draining), a request waits for it to come back -- ``RESTART_WAIT_S`` at
most -- instead of failing UNAVAILABLE at once (an outside probe: 8,749 refusals in the 15 s of one
prefill node's restart).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import grpc

from router.events import CallScope, Cancellation
from router.nodes import NodeHandle, NodePool
from serving.calls import time_remaining
from serving.errors import ServingError

FULL_WAIT_S = 300.0  # the longest a request waits for room before RESOURCE_EXHAUSTED
RESTART_WAIT_S = 60.0  # the longest it waits for a stopping node's return before UNAVAILABLE
FIRST_PAUSE_S, MAX_PAUSE_S = 0.02, 0.25


class RoomWait:
    """One phase of one request (its prefill, or its decode) on a pool of ``kind`` nodes."""

    def __init__(
        self, kind: str, scope: CallScope, cancellation: Cancellation, limit_s: float = FULL_WAIT_S
    ) -> None:
        remaining = time_remaining(scope)
        self.kind = kind
        self.started = time.monotonic()
        self.remaining = float("inf") if remaining is None else remaining
        self.deadline = self.started + min(limit_s, self.remaining)
        self.cancellation = cancellation
        self.full: list[NodeHandle] = []
        self.pause = FIRST_PAUSE_S

    def note_full(self, node: NodeHandle) -> None:
        if node not in self.full:
            self.full.append(node)

    def again(self, tried: list[NodeHandle], pool: NodePool | None = None) -> bool:
        """No untried node is left.  Where some of those tried were full, or none of ``pool`` is up and one
        is stopping (a planned restart): pause, then let them be tried again (True).  False otherwise.
        Raises CANCELLED when the client leaves meanwhile, RESOURCE_EXHAUSTED (full) or UNAVAILABLE
        (restarting) past the wait's limit."""
        if self.full:
            self._pause(
                self.deadline,
                random.uniform(0.5, 1.0),  # full nodes' waiters apart
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                lambda waited: (
                    f"every {self.kind} node that serves the request is full (max_num_requests); "
                    f"waited {waited:.1f}s for room; retry later"
                ),
            )
            back = [n for n in tried if n in self.full]
            self.full.clear()
        elif pool is not None and not pool.healthy() and any(n.stopping for n in pool.nodes()):
            self._pause(
                self.started + min(RESTART_WAIT_S, self.remaining),
                1.0,
                grpc.StatusCode.UNAVAILABLE,
                lambda waited: (
                    f"no {self.kind} node is up: waited {waited:.1f}s for one stopping to come "
                    "back; retry later"
                ),
            )
            back = [n for n in tried if n.healthy]  # back up: it may be tried again
        else:
            return False
        for node in back:
            tried.remove(node)
        return True

    def _pause(self, limit: float, jitter: float, code: grpc.StatusCode, why: Callable[[float], str]) -> None:
        """Sleep the pause (times ``jitter``, never past ``limit``), doubling it for the next; CANCELLED if
        the client leaves meanwhile, ``code`` with ``why(seconds waited)`` at ``limit``."""
        end = min(time.monotonic() + self.pause * jitter, limit)
        while not self.cancellation.cancelled and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, FIRST_PAUSE_S))
        if self.cancellation.cancelled:
            raise ServingError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        if time.monotonic() >= limit:
            raise ServingError(code, why(time.monotonic() - self.started))
        self.pause = min(2 * self.pause, MAX_PAUSE_S)
