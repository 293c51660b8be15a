"""The contract items the kit checks, as its failure messages name them (``[item] what happened``), and
the one failure type."""

from __future__ import annotations

# The contract items, as failure messages name them ("[item] what happened").
LOOKUP = "idempotent, side-effect-free lookups"
WHOLE_BLOCKS = "whole-block prefix hits, never the last token"
NONE_ANSWER = "None means 'ask again', and an answer follows in bounded time"
LOADS = "loads reproduce the saved KV bit for bit"
LOAD_ERRORS = "load errors are reported, not raised"
FINISHED_ONCE = "request_finished exactly once"
ABORT_LEAK = "no block leaked after an abort"
PREEMPT_LEAK = "no block leaked after preemption"
HOLD_ENDS = "a hold ends with finished_sending, in bounded time"
STOP_CONFIRMED = "a stopped hold is confirmed within a step, and nothing leaks"
UNREACHABLE = "an unreachable backend costs bounded time and gives zero hits"
BOUNDED_CALLS = "every connector call returns in bounded time"
ASYNC_LOADS = "an async load ends with finished_recving, in bounded time"
NAMESPACE = "blocks are keyed by the whole namespace: salt, model, dtype and adapter"
HOLES = "a hit is a contiguous prefix: a missing block ends it"
FREED = "a block is not read after request_finished returned hold=False"
RELEASED = "nothing is kept for a finished request"
SCHEDULER_RAISES = "a scheduler call never raises into the engine"
REPORTS = "a report names only what the engine handed over: its requests, the blocks it was loading"
WORKER_RAISES = "a worker call never raises: load errors are reported, a failed save is caught and counted"
STATS = "get_stats returns a ConnectorStats, never raising"


class ConformanceError(AssertionError):
    """A contract item the connector under test violates.  The message starts with ``[item]``."""

    def __init__(self, item: str, detail: str) -> None:
        super().__init__(f"[{item}] {detail}")
        self.item = item
