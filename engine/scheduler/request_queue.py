"""Waiting-queue policies.  A policy only orders candidates; the scheduler decides who fits.

- ``fcfs``: arrival order; preempted requests go back to the front.
- ``priority``: lower ``Request.priority`` first, then arrival.
- ``lpm`` (longest prefix match): requests whose prompt has the longest cached prefix first, so shared
  prefixes are reused before they are evicted.  A request passed over ``max_passed_over`` times jumps
  ahead of every other, so no request starves.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator

from engine.request import Request, RequestId


class RequestQueue:
    """Interface.  ``candidates()`` yields waiting requests in the order the scheduler should try them."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """A preempted request: it should be tried before new arrivals."""
        raise NotImplementedError

    def remove(self, request_id: RequestId) -> Request | None:
        raise NotImplementedError

    def candidates(self) -> Iterator[Request]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, request_id: object) -> bool:
        raise NotImplementedError

    def passed_over(self, admitted: set[RequestId]) -> None:
        """Called once per step with the admitted ids; others waiting count one more pass."""


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._ids: dict[RequestId, Request] = {}

    def add(self, request: Request) -> None:
        self._q.append(request)
        self._ids[request.request_id] = request

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)
        self._ids[request.request_id] = request

    def remove(self, request_id: RequestId) -> Request | None:
        req = self._ids.pop(request_id, None)
        if req is not None:
            self._q.remove(req)
        return req

    def candidates(self) -> Iterator[Request]:
        return iter(list(self._q))

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


class PriorityQueue(RequestQueue):
    """Ordered by (priority, arrival); preempted requests keep their place (their arrival is earlier)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._ids: dict[RequestId, Request] = {}
        self._seq = 0

    def add(self, request: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._seq, request))
        self._ids[request.request_id] = request

    prepend = add

    def remove(self, request_id: RequestId) -> Request | None:
        req = self._ids.pop(request_id, None)
        if req is not None:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        return req

    def candidates(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(self._heap)])

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


class LPMQueue(FCFSQueue):
    """Longest cached prefix first, with a starvation bound.  ``prefix_len`` is a side-effect-free query."""

    def __init__(self, prefix_len: Callable[[Request], int], max_passed_over: int) -> None:
        super().__init__()
        self._prefix_len = prefix_len
        self._max_passed_over = max_passed_over

    def candidates(self) -> Iterator[Request]:
        reqs = list(self._q)
        starving = [r for r in reqs if r.times_passed_over >= self._max_passed_over]
        rest = [r for r in reqs if r.times_passed_over < self._max_passed_over]
        # Stable sort: among equal prefix lengths, arrival (queue) order decides.
        rest.sort(key=self._prefix_len, reverse=True)
        return iter(starving + rest)

    def passed_over(self, admitted: set[RequestId]) -> None:
        if not admitted:
            return  # nobody was served: nobody was passed over
        for r in self._q:
            if r.request_id not in admitted:
                r.times_passed_over += 1


def make_queue(policy: str, *, prefix_len: Callable[[Request], int], max_passed_over: int) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "lpm":
        return LPMQueue(prefix_len, max_passed_over)
    raise ValueError(f"unknown queue policy {policy!r}")
