"""The scheduler: continuous batching under a token budget.  Policy only; blocks are the manager's.

One step (``schedule``):

1. Running requests first, in admission order: each gets its remaining prefill chunk or one decode token.
   When the pool runs dry, the most recently admitted running request is preempted (its blocks freed,
   its computed tokens forgotten; it goes back to the front of the waiting queue and will come back
   with whatever prefix hits survive).
2. If nothing was preempted, waiting requests in queue-policy order: local prefix hits first, then room
   for the rest (admission counts only the blocks the request really needs after its hits).
3. Every scheduled request's ``num_computed_tokens`` advances by its chunk: the runner computes them.

``update_from_output`` appends the sampled tokens (which extends ``block_hashes``), applies stop rules,
and frees finished requests.

The KV connector (a ``NullConnector`` when none is configured: nothing here branches on it) is asked for
external hits after the local ones (contract: ``engine/connector/base.py``).  A request's blocks are:

    running        computing (prefill chunks or decodes)
    loading        WAITING_FOR_REMOTE_KV: blocks allocated, an async load filling them, not yet cached
    loaded         WAITING_LOADED: the load landed; in the waiting queue, owning the blocks it loaded into
    held           finished, blocks kept for the connector's worker (a hold) until it reports its send or
                   receive done; on abort or past ``kv_hold_timeout_s`` the worker is asked to stop
                   and the blocks are freed once it confirms (two-phase: never under a transfer)

``ConnectorBooks`` (``connector_books.py``) keeps the loading and held requests and the failed loads; this
module decides what they mean for each request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.connector.base import KVConnectorBase, KVConnectorOutput
from engine.connector.null import NullConnector
from engine.kv_cache_manager import NO_HIT, KVCacheManager
from engine.metrics import SPECS, StatsSnapshot
from engine.request import Request, RequestId, RequestStatus
from engine.scheduler.config import CacheConfig, SchedulerConfig
from engine.scheduler.connector_books import ConnectorBooks, Hold, HoldKind
from engine.scheduler.connector_results import ConnectorResults
from engine.scheduler.observe import check_scheduler_integrity, scheduler_stats
from engine.scheduler.output import (
    EngineCoreOutputs,
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.scheduler.prompt_sources import PromptSources
from engine.scheduler.request_queue import make_queue
from engine.scheduler.stopping import stop_status
from telemetry.metrics import Counters


class Scheduler(ConnectorResults):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_model_len: int | None = None,
        connector: KVConnectorBase | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.connector = connector if connector is not None else NullConnector()
        self.clock = clock
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            enable_kv_events=cache_config.enable_kv_events,
        )
        self.requests: dict[RequestId, Request] = {}
        self.waiting = make_queue(
            scheduler_config.policy,
            prefix_len=self.kv.num_cached_prefix_tokens,
            max_passed_over=scheduler_config.max_passed_over,
        )
        self.running: list[Request] = []
        # Declared in engine/metrics.py; counted here and in the books.
        self.counters = Counters(SPECS)
        self.books = ConnectorBooks(
            self.kv,
            self.connector,
            clock,
            self.counters,
            hold_timeout_s=scheduler_config.kv_hold_timeout_s,
            stop_timeout_s=scheduler_config.kv_stop_timeout_s,
        )
        self._finished_since_last_step: set[RequestId] = set()
        self._step_loads: set[RequestId] = set()
        # this step's admissions -> the token from which their blocks hold nothing yet (after the local hit)
        self._step_admitted: dict[RequestId, int] = {}
        self._carried_preemptions: list[RequestId] = []  # of a step whose metadata the connector failed
        self.sources = PromptSources(self.kv, self.counters, clock)

    @property
    def loading(self) -> dict[RequestId, Request]:
        """Requests whose async load is in flight (read-only: ``books`` keeps them)."""
        return self.books.loading

    @property
    def holds(self) -> dict[RequestId, Hold]:
        """Finished requests whose blocks are held for the connector's worker (read-only)."""
        return self.books.holds

    # -- requests in and out ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.request_id in self.holds or self.kv.owns_blocks(request.request_id):
            # Its blocks are still held for a connector (e.g. a remote reader): a new request under the
            # same id would be mistaken for their owner.
            raise ValueError(
                f"request_id {request.request_id!r} is still in use: its KV is held for a transfer; "
                "use a new request_id"
            )
        assert request.status == RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Abort in any state; everything the request holds is freed.  None if it is unknown/finished."""
        rid = RequestId(request_id)
        if rid in self.holds:
            # Already finished for its client: the worker is asked to stop the transfer holding its
            # blocks, which are freed once it confirms.
            self.books.stop(rid)
            return None
        request = self.requests.get(rid)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestUpdate(request.request_id, [], [], True, "abort")

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> bool:
        """End a request from outside the step (a stop string matched, an error).  False if unknown."""
        assert status.is_finished
        request = self.requests.get(RequestId(request_id))
        if request is None:
            return False
        request.stop_reason = stop_reason
        request.error = error
        self._finish(request, status)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Unfinished requests or blocks still held for a connector."""
        return bool(self.requests or self.holds)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(RequestId(request_id))

    # -- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.books.expire()
        self._step_loads, self._step_admitted = set(), {}
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        for sr in out.scheduled:
            self.requests[sr.request_id].num_computed_tokens += sr.num_tokens
        out.finished_request_ids = self._finished_since_last_step
        self._finished_since_last_step = set()
        meta = self._build_meta(out)
        if meta is None:  # it raised: no worker call this step; its preemptions and stops wait for the next
            self._carried_preemptions += out.preempted_request_ids
            return out
        # The engine's own instructions to the worker half, whatever the connector built.
        meta.preempted_request_ids = [*self._carried_preemptions, *out.preempted_request_ids]
        self._carried_preemptions = []
        meta.stop_request_ids = self.books.take_stops()
        out.kv_connector_metadata = meta
        return out

    def _chunk(self, request: Request, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, budget)
            assert num_new > 0, f"{request} is running with nothing to compute"
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    return budget
            self._emit(out, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted: set[RequestId] = set()
        for request in self.waiting.candidates():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._adapter_fits(request):
                continue  # the step runs max_loras other adapters: it waits, never runs on the base model
            if request.status == RequestStatus.WAITING_LOADED:
                # Back from an async load: it already holds its blocks (up to num_computed_tokens, which is
                # 0 if the first loaded block failed; the connector is not asked again for the same blocks).
                hit, num_external, load_async = NO_HIT, 0, False
            elif request.scores_prompt:
                # Scoring the prompt needs every position's logits: a hit (local or loaded) has none.
                hit, num_external, load_async = NO_HIT, 0, False
            else:
                hit = self.kv.get_computed_blocks(request)
                answer, load_async = self.books.external_hit(request, hit.num_tokens)
                if answer is None:
                    continue  # the connector is still looking: ask again next step
                num_external = answer
            computed = request.num_computed_tokens + hit.num_tokens + num_external
            remaining = request.num_tokens - computed
            if load_async:
                remaining = 0  # nothing to compute until the load lands
            elif not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if self.config.long_prefill_token_threshold:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            if self.kv.allocate_slots(request, num_new, hit, num_external, delay_caching=load_async) is None:
                idle = not self.running and not out.scheduled and not self.loading and not self.holds
                if idle and not self._release_parked(request, out):
                    # Alone with an empty pool (nothing held for a connector either) and still no room: it
                    # can never run.
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    request.error = (
                        f"request needs more KV blocks than the cache has ({self.kv.num_blocks} blocks "
                        f"of {self.kv.block_size} tokens); raise num_blocks or shorten the request"
                    )
                    out.errored_request_ids.append(request.request_id)
                break  # the pool is full: later candidates would not fit better without preemption
            if request.num_cached_tokens < 0:  # first admission: record where the prompt came from
                self.sources.record(request, hit.num_tokens, num_external)
            # The connector sees num_computed_tokens = the local hit: its external tokens start there.
            request.num_computed_tokens += hit.num_tokens
            if not self._after_alloc(request, num_external, out):
                continue  # the connector raised: the request failed (connector_results.py)
            self.waiting.remove(request.request_id)
            admitted.add(request.request_id)
            self._step_admitted[request.request_id] = request.num_computed_tokens
            if num_external:
                self._step_loads.add(request.request_id)
            if load_async:
                request.set_status(RequestStatus.WAITING_FOR_REMOTE_KV)
                self.books.start_loading(request, computed)
                continue
            request.num_computed_tokens = computed
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            out.new_request_ids.append(request.request_id)
            self._emit(out, request, num_new)
            budget -= num_new
        self.waiting.passed_over(admitted)

    def _adapter_fits(self, request: Request) -> bool:
        if request.adapter is None:  # the common case: no set of the running requests' adapters built
            return True
        held = {r.adapter for r in self.running if r.adapter is not None}
        return request.adapter in held or len(held) < self.config.max_loras

    def _release_parked(self, request: Request, out: SchedulerOutput) -> bool:
        """Free the blocks of another request parked after its async load; False if there is none.  Called
        only when nothing runs, loads or is held: two parked requests can fill the pool so that neither
        fits; the most recently allocated lets go, like a preemption (its blocks stay cached)."""
        parked = [rid for rid in self.kv.block_owners() if rid != request.request_id]
        if not parked:
            return False
        victim = self.requests[parked[-1]]
        assert victim.status == RequestStatus.WAITING_LOADED, f"{victim} owns blocks while the engine is idle"
        self.kv.free(victim)
        victim.set_status(RequestStatus.WAITING)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.counters.add("num_preemptions")
        out.preempted_request_ids.append(victim.request_id)
        return True

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        out.scheduled.append(
            ScheduledRequest.of(request, start, end, self.kv.get_block_ids(request.request_id))
        )
        out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.set_status(RequestStatus.PREEMPTED)
        self.counters.add("num_preemptions")
        self.waiting.prepend(request)

    # -- results ------------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        result = EngineCoreOutputs()
        kv_out = output.kv_connector_output or KVConnectorOutput()
        tainted = self._apply_load_errors(kv_out.invalid_block_ids, result)
        for rid in kv_out.finished_recving:
            self._finish_loading(rid, result)
        for rid in kv_out.finished_sending:
            self.books.end_hold(rid, HoldKind.SEND)
        try:
            self.connector.update_connector_output(kv_out)
        except Exception:  # the engine applied the report already; only the plugin's own books lag
            self._connector_failed("update_connector_output", "the report is applied; the node goes on")
        for sr in scheduler_output.scheduled:
            scores = output.prompt_scores.get(sr.request_id)
            if scores is not None and (request := self.requests.get(sr.request_id)) is not None:
                request.record_prompt_scores(scores.first, scores.logprobs, scores.top_logprobs)
            if not sr.sample or sr.request_id in tainted:
                continue
            request = self.requests.get(sr.request_id)
            if request is None or request.is_finished:
                continue  # aborted after scheduling
            prompt_scores = request.finished_prompt_scores()
            if request.sampling_params.max_tokens == 0:  # the prompt scored: nothing to generate
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                update = RequestUpdate(request.request_id, [], [], finished=True, finish_reason="length")
                update.prompt_logprobs, update.prompt_top_logprobs = prompt_scores
                result.updates.append(update)
                continue
            token = output.sampled_token_ids[sr.request_id]
            request.append_output_token_ids(token)
            self.sources.count(request)
            logprobs: list[float] = []
            if sr.request_id in output.logprobs:
                request.output_logprobs.append(output.logprobs[sr.request_id])
                logprobs.append(output.logprobs[sr.request_id])
            top = output.top_logprobs.get(sr.request_id)
            status = stop_status(request, token, self.max_model_len)
            if status is not None:
                self._finish(request, status)
            result.updates.append(
                RequestUpdate(
                    request.request_id,
                    [token],
                    logprobs,
                    finished=status is not None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    error=request.error,
                    new_top_logprobs=[top] if top is not None else [],
                    prompt_logprobs=prompt_scores[0],
                    prompt_top_logprobs=prompt_scores[1],
                )
            )
        return result

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Every finish goes through here: out of its queue, the connector told once, blocks freed or held."""
        rid = request.request_id
        # Its load still runs (not: its status says so -- a load that landed and failed it is over).
        was_loading = rid in self.books.loading
        if request.status in (RequestStatus.WAITING, RequestStatus.WAITING_LOADED, RequestStatus.PREEMPTED):
            self.waiting.remove(rid)
        elif was_loading:
            self.books.stop_loading(rid)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.set_status(status)
        self.sources.count(request)
        hold, params, raised = self._request_finished(request, self.kv.get_block_ids(rid))
        request.finished_kv_transfer_params = params
        if was_loading:
            # Its load is still writing the blocks: they are kept until the worker stopped it.
            self.books.hold(request, HoldKind.RECV)
            self.books.stop(rid)
        elif hold and self.kv.owns_blocks(rid):
            self.books.hold(request, HoldKind.SEND)
            if raised:  # a transfer may still read the blocks: freed once the worker confirms its stop
                self.books.stop(rid)
        else:
            self.kv.free(request)
        del self.requests[rid]
        self._finished_since_last_step.add(rid)

    def stats(self) -> StatsSnapshot:  # observability: engine/scheduler/observe.py
        return scheduler_stats(self)

    def check_integrity(self) -> None:  # engine/scheduler/observe.py
        check_scheduler_integrity(self)
