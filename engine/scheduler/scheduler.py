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
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestId, RequestStatus
from engine.scheduler.output import (
    EngineCoreOutputs,
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.scheduler.request_queue import make_queue


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_model_len: int | None = None,
    ) -> None:
        self.config = scheduler_config
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
        self._finished_since_last_step: set[RequestId] = set()
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        assert request.status == RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Abort in any state; everything the request holds is freed.  None if it is unknown/finished."""
        request = self.requests.get(RequestId(request_id))
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestUpdate(request.request_id, [], [], True, "abort")

    def finish_request(self, request_id: str, status: RequestStatus, *, stop_reason: int | str | None = None,
                       error: str | None = None) -> bool:
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

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(RequestId(request_id))

    # -- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        for sr in out.scheduled:
            self.requests[sr.request_id].num_computed_tokens += sr.num_tokens
        out.finished_request_ids = self._finished_since_last_step
        self._finished_since_last_step = set()
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
            hit = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - hit.num_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if self.config.long_prefill_token_threshold:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            if self.kv.allocate_slots(request, num_new, hit) is None:
                if not self.running and not out.scheduled:
                    # Alone with an empty pool and still no room: it can never run.
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    request.error = (
                        f"request needs more KV blocks than the cache has ({self.kv.pool.num_blocks} blocks "
                        f"of {self.kv.block_size} tokens); raise num_blocks or shorten the request"
                    )
                    out.errored_request_ids.append(request.request_id)
                break  # the pool is full: later candidates would not fit better without preemption
            self.waiting.remove(request.request_id)
            if request.num_cached_tokens < 0:  # first admission: record where the prompt came from
                request.num_cached_tokens = hit.num_tokens
                request.num_local_cached_tokens = hit.num_tokens
                self.kv.record_prefix_query(request.num_prompt_tokens, hit.num_tokens)
            request.num_computed_tokens = hit.num_tokens
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            admitted.add(request.request_id)
            out.new_request_ids.append(request.request_id)
            self._emit(out, request, num_new)
            budget -= num_new
        self.waiting.passed_over(admitted)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_slice(start, end),
                start_position=start,
                block_ids=self.kv.get_block_ids(request.request_id),
                sample=end == request.num_tokens,
                sampling_params=request.sampling_params,
                output_index=request.num_output_tokens,
            )
        )
        out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.set_status(RequestStatus.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # -- results ------------------------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> EngineCoreOutputs:
        result = EngineCoreOutputs()
        for sr in scheduler_output.scheduled:
            if not sr.sample:
                continue
            request = self.requests.get(sr.request_id)
            if request is None or request.is_finished:
                continue  # aborted after scheduling
            token = output.sampled_token_ids[sr.request_id]
            request.append_output_token_ids(token)
            logprobs: list[float] = []
            if sr.request_id in output.logprobs:
                request.output_logprobs.append(output.logprobs[sr.request_id])
                logprobs.append(output.logprobs[sr.request_id])
            status = self._stop_status(request, token)
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
                )
            )
        return result

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Every finish goes through here: take the request out of its queue and free its blocks."""
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KV):
            self.waiting.remove(request.request_id)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.set_status(status)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)

    # -- observability ------------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.stats_queries,
            prefix_cache_hits=self.kv.stats_hits,
            num_preemptions=self.num_preemptions,
            num_evictions=self.kv.pool.num_evictions,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.req_to_blocks)
        running = {r.request_id for r in self.running}
        assert held <= set(self.requests), f"blocks held by finished requests: {held - set(self.requests)}"
        for rid in held - running:
            assert self.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KV, (
                f"{rid} holds blocks but is {self.requests[rid].status.name}"
            )
