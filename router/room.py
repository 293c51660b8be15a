"""Waiting for room on full nodes.

A node that already runs ``--max-num-requests`` answers RESOURCE_EXHAUSTED "the node is full: ..."
(``serving.errors.node_full``): it is well, only busy.  The router admits up to ``--max-inflight`` calls,
more than one node takes, so it is the queue: a request whose every candidate node is full waits, trying
them again after a short pause (20 ms, doubling to 250 ms), until one takes it -- for as long as its
deadline allows, and ``FULL_WAIT_S`` at most -- rather than failing as if the nodes were down (they were
not, and the request was accepted).  A full node is not a failed attempt: attempts count failures only.
"""

from __future__ import annotations

import time

import grpc

from router.events import CallScope, Cancellation
from router.nodes import NodeHandle
from serving.calls import time_remaining
from serving.errors import ServingError

FULL_WAIT_S = 300.0  # the longest a request waits for room before RESOURCE_EXHAUSTED
FIRST_PAUSE_S, MAX_PAUSE_S = 0.02, 0.25


class RoomWait:
    """One phase of one request (its prefill, or its decode) on a pool of ``kind`` nodes."""

    def __init__(
        self, kind: str, scope: CallScope, cancellation: Cancellation, limit_s: float = FULL_WAIT_S
    ) -> None:
        remaining = time_remaining(scope)
        self.kind = kind
        self.started = time.monotonic()
        self.deadline = self.started + (limit_s if remaining is None else min(limit_s, remaining))
        self.cancellation = cancellation
        self.full: list[NodeHandle] = []
        self.pause = FIRST_PAUSE_S

    def note_full(self, node: NodeHandle) -> None:
        if node not in self.full:
            self.full.append(node)

    def again(self, tried: list[NodeHandle]) -> bool:
        """No untried node is left.  Where some of those tried were full: pause, then let them be tried
        again (True).  False where none was full.  Raises CANCELLED when the client leaves meanwhile,
        RESOURCE_EXHAUSTED past the wait's limit."""
        if not self.full:
            return False
        end = min(time.monotonic() + self.pause, self.deadline)
        while not self.cancellation.cancelled and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, FIRST_PAUSE_S))
        if self.cancellation.cancelled:
            raise ServingError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        if time.monotonic() >= self.deadline:
            raise ServingError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every {self.kind} node that serves the request is full (max_num_requests); waited "
                f"{time.monotonic() - self.started:.1f}s for room; retry later",
            )
        self.pause = min(2 * self.pause, MAX_PAUSE_S)
        for node in self.full:
            if node in tried:
                tried.remove(node)
        self.full.clear()
        return True
