"""What the scheduler shows of itself: its stats (counters and gauges, by the keys of
``engine/metrics.py``) and the integrity check the tests run after every step."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

from engine.integrity import require
from engine.kv_cache_manager import KVCacheManager
from engine.metrics import StatsSnapshot
from engine.request import Request, RequestId, RequestStatus
from engine.scheduler.connector_books import ConnectorBooks, Hold
from telemetry.metrics import Counters


class Scheduler(Protocol):
    """What these functions read of ``engine.scheduler.scheduler.Scheduler`` (named structurally, so
    this module and the scheduler do not import each other)."""

    kv: KVCacheManager
    counters: Counters
    books: ConnectorBooks
    requests: dict[RequestId, Request]
    running: list[Request]

    @property
    def waiting(self) -> Sized: ...

    @property
    def loading(self) -> dict[RequestId, Request]: ...

    @property
    def holds(self) -> dict[RequestId, Hold]: ...


def prompt_tokens_to_compute(s: Scheduler, request: Request) -> int:
    """Prompt tokens ``request`` has still to compute: one with none computed (not scheduled yet,
    preempted, or cut back by a failed load) computes none of those its local prefix cache holds now
    (evictable blocks included: one evicted before it is scheduled is computed after all), one loading
    its KV none of those it loads.  A kv-aware router reads the sum as queued work, and sends such
    requests here because of those hits."""
    done = request.num_computed_tokens
    load_end = s.books.load_end(request.request_id)
    if load_end is not None:
        done = max(done, load_end)
    elif done == 0:
        done = s.kv.num_cached_prefix_tokens(request)
    return max(0, request.num_prompt_tokens - done)


def scheduler_stats(s: Scheduler) -> StatsSnapshot:
    """The scheduler's counters (with the KV manager's) and gauges, by the keys of engine/metrics.py."""
    counters = s.counters.snapshot()
    counters["prefix_cache_queries"] = float(s.kv.stats_queries)
    counters["prefix_cache_hits"] = float(s.kv.stats_hits)
    counters["kv_block_evictions"] = float(s.kv.num_evictions)
    gauges = {
        "num_requests_running": float(len(s.running)),
        "num_requests_waiting": float(len(s.waiting)),
        "num_requests_loading": float(len(s.loading)),
        "num_requests_held": float(len(s.holds)),
        "prefill_tokens_queued": float(
            sum(
                prompt_tokens_to_compute(s, r)
                for r in s.requests.values()
                if r.num_computed_tokens < r.num_prompt_tokens
            )
        ),
        "kv_cache_usage_perc": s.kv.usage,
        "kv_cache_free_blocks": float(s.kv.num_free_blocks),
        "kv_cache_blocks": float(s.kv.num_blocks),
    }
    return StatsSnapshot(counters, gauges, {})


def check_scheduler_integrity(s: Scheduler) -> None:
    """Every block owned by the requests that should own it: running, loading, held, or back from a
    load (``BlockPool.check_integrity`` first)."""
    s.kv.check_integrity()
    owners = set(s.kv.block_owners())
    running = {r.request_id for r in s.running}
    expected = running | set(s.loading) | set(s.holds)
    for rid in owners - expected:
        # Back from an async load, waiting to compute the rest: it keeps the blocks it loaded into.
        r = s.requests.get(rid)
        require(
            r is not None and r.status == RequestStatus.WAITING_LOADED,
            f"blocks owned by {rid}, which is {r.status.name if r else 'finished'}",
        )
    require(expected <= owners, f"{sorted(expected - owners)} should hold blocks but hold none")
    for rid in s.loading:
        status = s.requests[rid].status
        require(status == RequestStatus.WAITING_FOR_REMOTE_KV, f"{rid} is loading but {status.name}")
    for rid in s.holds:
        require(rid not in s.requests, f"{rid} is held for its connector but not finished")
