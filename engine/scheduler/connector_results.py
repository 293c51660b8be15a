"""What the scheduler makes of its KV connector's results and failures: a landed async load, blocks whose
load failed, and a scheduler-side call that raised (``Scheduler`` inherits these; ``ConnectorBooks``
keeps the state).

A connector must never raise into the engine nor report what it was not asked (docs/connectors.md; the
kit fails both), but a node outlives a broken plugin: a lookup that raises counts as zero hits
(``ConnectorBooks.external_hit``), ``update_state_after_alloc`` that raises fails that request,
``request_finished`` that raises holds the request's blocks and asks the worker to stop (freed once it
confirms), ``build_connector_meta`` that raises fails the step's requests -- as a worker call that
raises does -- with the connector named, and no worker call runs that step; ``update_connector_output``
that raises changes nothing (the engine applied the report already); a load error for a block no
request was loading is ignored.  Each is logged and counted (``connector_call_failures``, by call).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.connector.base import KVConnectorBase, KVConnectorMetadata, KVTransferParams
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestId, RequestStatus
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.connector_books import ConnectorBooks, HoldKind
from engine.scheduler.output import EngineCoreOutputs, RequestUpdate, SchedulerOutput
from engine.scheduler.prompt_sources import PromptSources
from engine.scheduler.request_queue import RequestQueue
from telemetry.metrics import Counters

logger = logging.getLogger(__name__)


class ConnectorResults:
    """The connector half of ``Scheduler`` (its attributes, set by its ``__init__``)."""

    config: SchedulerConfig
    connector: KVConnectorBase
    kv: KVCacheManager
    books: ConnectorBooks
    sources: PromptSources
    counters: Counters
    requests: dict[RequestId, Request]
    running: list[Request]
    waiting: RequestQueue
    # requests admitted by the last schedule with external tokens (loaded now, or by an async load)
    _step_loads: set[RequestId]
    # the last schedule's admissions -> the token from which their blocks hold nothing yet
    _step_admitted: dict[RequestId, int]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        raise NotImplementedError  # Scheduler's

    def _connector_failed(self, call: str, detail: str) -> None:
        logger.exception("KV connector %s: %s raised (%s)", self.connector.name, call, detail)
        self.counters.add(f"connector_call_failures.{call}")

    def _request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None, bool]:
        """The connector told of a finished request: whether it holds the blocks, its params, and whether
        the call raised -- then the blocks are held and the worker asked to stop (a transfer it started
        may still read them: ``multi`` with one child holding and another raising)."""
        try:
            return (*self.connector.request_finished(request, block_ids), False)
        except Exception:
            self._connector_failed("request_finished", f"for {request.request_id}; its hold is stopped")
            return True, None, True

    def _after_alloc(self, request: Request, num_external: int, out: SchedulerOutput) -> bool:
        """Tell the connector the request's blocks (``update_state_after_alloc``); False where it raised:
        the request fails, its connector named -- what the connector planned for its blocks is unknown,
        so neither a load into them nor a recompute beside that plan is safe."""
        try:
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), num_external
            )
            return True
        except Exception as exc:
            self._connector_failed("update_state_after_alloc", f"for {request.request_id}; it fails")
            request.error = (
                f"the KV connector {self.connector.name} failed to take the request's blocks: {exc!r}"
            )
        # Its blocks past the local hit were cached as they were allocated, and nothing will write them:
        # no later request may hit them.  Nor was any of its prompt served: nothing to count.
        self.kv.uncache_from(request, request.num_computed_tokens // self.kv.block_size)
        self.sources.forget(request)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        out.errored_request_ids.append(request.request_id)
        return False

    def _build_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        """The connector's instructions for the step; None where it raised: the step's requests fail
        (their loads and saves are in no metadata), the step computes nothing and no worker call runs
        (the worker would be handed metadata not its own), and the scheduler carries the step's
        preemptions and the books their stops to the next step's metadata."""
        try:
            return self.connector.build_connector_meta(out)
        except Exception as exc:
            self._connector_failed("build_connector_meta", "the step's requests fail")
            error = f"the KV connector {self.connector.name} failed to plan the step: {exc!r}"
        victims = dict.fromkeys(
            [*(sr.request_id for sr in out.scheduled), *out.new_request_ids, *self._step_loads]
        )
        # What the step would have written (and an admission's loads) was cached as allocated: no later
        # request may hit it.  A running request's from its chunk's start; an admission's past its hit.
        unwritten = {sr.request_id: sr.start_position for sr in out.scheduled} | self._step_admitted
        for rid in victims:
            request = self.requests.get(rid)
            if request is not None:
                if rid in unwritten:
                    self.kv.uncache_from(request, unwritten[rid] // self.kv.block_size)
                self.books.stop_loading(rid)  # its load never started: nothing to wait for
                request.error = error
                self._finish(request, RequestStatus.FINISHED_ERROR)
                out.errored_request_ids.append(rid)
        out.scheduled, out.num_scheduled_tokens, out.total_num_scheduled_tokens = [], {}, 0
        out.kv_connector_failed = True
        return None

    def _loaded_blocks(self, invalid: set[int]) -> set[int]:
        """Of the blocks reported as failed loads, those of requests the connector was loading (an async
        load, one stopped while it ran, or the last schedule's admissions with external tokens).  A
        reported block another request holds is a broken report: logged, counted, dropped; a free one
        (its request failed with the step meanwhile) is dropped quietly."""
        if not invalid:
            return invalid
        recv = [rid for rid, hold in self.books.holds.items() if hold.waits_for is HoldKind.RECV]
        loading = self.kv.blocks_of([*self.books.loading, *self._step_loads, *recv])
        foreign = (invalid - loading) & self.kv.blocks_of([*self.requests, *self.books.holds])
        if foreign:
            logger.error(
                "KV connector %s reported load errors for blocks no request was loading (%s): ignored",
                self.connector.name,
                sorted(foreign)[:8],
            )
            self.counters.add("connector_call_failures.get_block_ids_with_load_errors")
        return invalid & loading

    def _finish_loading(self, rid: RequestId, result: EngineCoreOutputs) -> None:
        """An async load landed: cache the good blocks, then the request waits to compute the rest."""
        if self.books.end_hold(rid, HoldKind.RECV):
            return  # it ended while loading; the receive is over now
        landed = self.books.land(rid)
        if landed is None:
            return
        request, loaded_end, first_bad = landed.request, landed.loaded_end, landed.first_bad
        bs = self.kv.block_size
        if first_bad is not None and first_bad * bs < loaded_end:
            self.counters.add("kv_load_failures")
            if self.config.kv_load_failure_policy == "fail":
                self._fail_load(request, result)
                return
            # The bad block may come before this request's own load: a local hit on a block that another
            # request's load failed to fill.  Recompute from it, and let nobody else take it as cached.
            self.kv.uncache_from(request, first_bad)
            loaded_end = first_bad * bs
            self.sources.correct(request, loaded_end)
        request.num_computed_tokens = loaded_end
        self.kv.cache_blocks(request, loaded_end)
        request.set_status(RequestStatus.WAITING_LOADED)
        self.waiting.prepend(request)

    def _apply_load_errors(self, invalid: set[int], result: EngineCoreOutputs) -> set[RequestId]:
        """Cut running requests back to their first bad block; return those whose sample is void.  Only
        blocks the connector was loading count: a block of a request it never loaded into is a broken
        report (logged, counted, ignored) -- recomputing for it would repeat each step, never finishing."""
        invalid = self._loaded_blocks(invalid)
        if not invalid:
            return set()
        self.books.record_failed(invalid)
        tainted: set[RequestId] = set()
        bs = self.kv.block_size
        for request in list(self.running):
            first_bad = self.kv.first_block_in(request.request_id, invalid)
            if first_bad is None:
                continue
            tainted.add(request.request_id)
            self.counters.add("kv_load_failures")
            self.kv.uncache_from(request, first_bad)
            if self.config.kv_load_failure_policy == "fail":
                self._fail_load(request, result)
                continue
            request.num_computed_tokens = min(request.num_computed_tokens, first_bad * bs)
            self.sources.correct(request, first_bad * bs)
        self.books.forget_failed_outside_loads()
        return tainted

    def _fail_load(self, request: Request, result: EngineCoreOutputs) -> None:
        request.error = "loading the prompt's KV from the connector failed (kv_load_failure_policy=fail)"
        self._finish(request, RequestStatus.FINISHED_ERROR)
        result.updates.append(RequestUpdate(request.request_id, [], [], True, "error", error=request.error))
