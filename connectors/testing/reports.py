"""The kit's checks after every engine step: what the engine survives but a connector must not do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.base import ConnectorStats, KVConnectorBase
from connectors.testing.items import REPORTS, SCHEDULER_RAISES, STATS, ConformanceError

if TYPE_CHECKING:
    from connectors.testing.spy import SchedulerSpy, WorkerSpy
    from engine.llm_engine import LLMEngine


def check_reports(engine: LLMEngine, spy: SchedulerSpy, worker: WorkerSpy) -> None:
    """What the engine survives but a connector must not do: a scheduler call that raised (the engine
    failed the step's requests, or freed a finished request's blocks without a hold), a load error
    for blocks no request was loading (ignored), a send or receive reported for a request id the engine
    never had (ignored)."""
    if spy.raised:
        name, exc = spy.raised[0]
        raise ConformanceError(
            SCHEDULER_RAISES,
            f"{name} raised {exc!r}: a connector reports problems, it never raises into the engine "
            "(which survives it by failing the step's requests, or freeing the request's blocks)",
        )
    if engine.scheduler.counters.get("connector_call_failures.get_block_ids_with_load_errors"):
        raise ConformanceError(
            REPORTS,
            "get_block_ids_with_load_errors reported blocks of requests the connector was not loading (the "
            f"engine's log names them; all it reported so far: {sorted(worker.load_errors)[:8]}): only a "
            "block a load was filling can fail to load",
        )
    # ids the engine never handed over at all (a request id made up, or another engine's): ignored
    if not worker.finished_sending and not worker.finished_recving:
        return
    known = {lk.request_id for lk in spy.lookups} | set(spy.finished) | {a.request_id for a in spy.allocs}
    for what in ("finished_sending", "finished_recving"):
        foreign = sorted(set(getattr(worker, what)) - known)
        if foreign:
            raise ConformanceError(
                REPORTS, f"get_finished listed {foreign[:4]} in {what}: no request of this engine has that id"
            )


def check_stats(*halves: KVConnectorBase) -> None:
    """Each half's ``get_stats``, as a node's Stats call and /metrics scrape read it between steps: a
    ``ConnectorStats``, never a raise (the node leaves a raising half's stats out, and counts it)."""
    for half in halves:
        try:
            stats = half.get_stats()
        except Exception as exc:
            raise ConformanceError(
                STATS,
                f"the {half.role.value} half's get_stats raised {exc!r}: the node then leaves its stats out "
                "of Stats and /metrics (connector_call_failures.get_stats)",
            ) from exc
        if not isinstance(stats, ConnectorStats):
            raise ConformanceError(
                STATS,
                f"the {half.role.value} half's get_stats returned {type(stats).__name__}, "
                "not a ConnectorStats",
            )
