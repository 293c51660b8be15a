"""One simulated node: the engine's scheduler over a ``NodeCache``, stepping in simulated time.

Each step is the engine's (``engine/scheduler/scheduler.py``): running requests first, in admission
order -- the rest of a prompt chunk or one decode token each, under the token budget -- and when blocks
run out the most recently admitted one is preempted (its blocks freed, its tokens to compute again);
then, if nothing was preempted, waiting requests in order: local prefix hits, then the store's
(loaded in the step, its time added), then room for the chunk.  A request whose KV comes from a peer
(the decode half of a P/D request) holds its blocks while the pull runs and waits for it, as
``WAITING_FOR_REMOTE_KV`` does.  A step's time is the profile's ``StepCost`` of what it computes.

Steps that only decode, with nothing waiting, repeat until the first request finishes: the node runs
them as one stretch (its steps' times are an arithmetic series), cut short at the next step boundary
when a request arrives.  That is what makes a whole trace on 64 nodes take seconds.
"""

from __future__ import annotations

from collections import deque

from engine.hashing import HashNamespace
from planner.profile import Profile
from planner.sim.cache import NodeCache, StoreSim
from planner.sim.job import Job
from router.costs import NodeCosts

DECODE_ROW = 1


class SimNode:
    """A node of the simulated cluster; ``address``, ``inflight``, ``costs`` and ``namespace`` are what
    the router's policies read (``router.policy.RoutedNode``)."""

    def __init__(
        self,
        address: str,
        profile: Profile,
        block_tokens: int,
        num_blocks: int,
        namespace: HashNamespace,
        store: StoreSim | None,
        oracle: set[int] | None = None,
    ) -> None:
        self.address = address
        self.namespace: HashNamespace | None = namespace
        self.costs = NodeCosts()
        self.inflight = 0
        self.profile = profile
        self.cost = profile.step
        self.bs = block_tokens
        self.budget = profile.engine.max_num_batched_tokens
        self.max_seqs = profile.engine.max_num_seqs
        self.cache = NodeCache(num_blocks)
        self.store = store
        self.oracle = oracle  # every block computed anywhere: free hits (ClusterSpec.oracle)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.loading: list[Job] = []
        # The step in flight: its jobs and chunks, when it started and ends, and for a decode stretch
        # its steps' times (first, increment, count).
        self.busy_until = -1.0
        self.step_start = 0.0
        self.step_jobs: list[tuple[Job, int]] = []
        self.stretch: tuple[float, float, int] | None = None
        self.version = 0  # bumps when the step in flight is cut short: older end events are stale
        self._retry = False
        self.itl: list[tuple[float, int]] = []  # (gap, how many tokens had it)
        self.landings: list[float] = []  # when pulls started since the caller last looked will land
        # Engine counters a router's cost model reads (``router.costs.measure_costs``).
        self.counters = {
            "prefill_compute_tokens": 0.0,
            "prefill_compute_seconds": 0.0,
            "prompt_tokens.external_kv_transfer": 0.0,
        }
        self.load_seconds = 0.0
        self.busy_s = 0.0
        self.steps = 0

    # ---- the router's side -------------------------------------------------------------------------------

    def queued_prefill_tokens(self) -> float:
        """The engine's ``prefill_tokens_queued``: prompt tokens its requests have still to compute (one
        not started counts what its local cache does not hold now)."""
        total = 0
        for job in self.running:
            if job.computed < job.prompt:
                total += job.prompt - job.computed
        for job in self.waiting:
            if job.pulled:
                total += max(0, job.prompt - max(job.computed, job.pulled))
            elif job.computed == 0:
                usable = min(len(job.keys), (job.prompt - 1) // self.bs)
                total += job.prompt - self.cache.prefix(job.keys, usable) * self.bs
            else:
                total += max(0, job.prompt - job.computed)
        return float(total)

    def wake(self, now: float) -> bool:
        """Something changed: True when an idle node must step now; a decode stretch in flight is cut at
        its next step boundary (its end event moves: the caller reschedules ``busy_until``)."""
        if self.busy_until < 0:
            return True
        if self.stretch is not None:
            self._cut_stretch(now)
        return False

    # ---- a step ------------------------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Schedule the next step at ``now``; its end time, or None (nothing to do: idle)."""
        self._admit_loaded(now)
        for _ in range(len(self.running) + len(self.waiting) + 1):
            end = self._try_step(now)
            if end is not None:
                return end
            # Nothing could run.  A step that only preempted tries again with the blocks it freed; a
            # node with nothing running whose queue head cannot fit frees the newest request parked
            # with blocks (a landed pull), which computes its prompt later (``_release_parked``).
            if not self._retry or not (self.waiting or self.running):
                break
        self.busy_until = -1.0
        return None

    def _try_step(self, now: float) -> float | None:
        self._retry = False
        if not self.running and not self.waiting:
            self.busy_until = -1.0
            return None
        if not self.waiting and all(j.known - j.computed == 1 and j.generated for j in self.running):
            end = self._start_stretch(now)
            if end is not None:
                return end
        chunks: list[tuple[int, int]] = []
        rows = context = 0
        extra_s = 0.0
        budget = self.budget
        scheduled: list[tuple[Job, int]] = []
        preempted = False
        for job in list(self.running):
            if budget == 0:
                break
            if job not in self.running:  # preempted by one before it
                continue
            chunk = min(job.known - job.computed, budget)
            need = -(-(job.computed + chunk) // self.bs) - job.blocks
            while need > 0 and not self.cache.allocate(need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            if job not in self.running:
                continue
            job.blocks += max(0, need)
            scheduled.append((job, chunk))
            budget -= chunk
        if not preempted:
            while self.waiting and len(self.running) < self.max_seqs and budget > 0:
                job = self.waiting[0]
                admitted = self._admit(job, budget, now)
                if admitted is None:
                    break
                chunk, load_s = admitted
                self.waiting.popleft()
                if job.loading_until >= 0:  # blocks held, the pull in flight
                    continue
                self.running.append(job)
                extra_s += load_s
                if chunk:
                    scheduled.append((job, chunk))
                    budget -= chunk
        for job, chunk in scheduled:
            if chunk == DECODE_ROW:  # the engine's decode rows: one token (its counters say so too)
                rows += 1
                context += job.computed + 1
            else:
                chunks.append((chunk, job.computed))
        if not scheduled:  # waiting for blocks, or for pulls: a release or a landing wakes the node
            self._retry = preempted or (not self.running and self._release_parked())
            return None
        seconds = self.cost.seconds(chunks, rows, context) + extra_s
        prefill = sum(c for c, _ in chunks)
        if prefill:
            self.counters["prefill_compute_tokens"] += prefill
            self.counters["prefill_compute_seconds"] += seconds * prefill / (prefill + rows)
        self.step_jobs = scheduled
        self.stretch = None
        self.step_start = now
        self.busy_until = now + seconds
        return self.busy_until

    def _release_parked(self) -> bool:
        """The engine's ``_release_parked``: the newest waiting request holding blocks gives them back."""
        for job in reversed(self.waiting):
            if job.blocks:
                self._free(job)
                return True
        return False

    def _admit_loaded(self, now: float) -> None:
        """Jobs whose pull landed go to the front of the queue, their blocks filled."""
        done = [j for j in self.loading if 0 <= j.loading_until <= now]
        for job in done:
            self.loading.remove(job)
            job.computed, job.pulled = job.pulled, 0  # preempted later, it computes its prompt here
            job.loading_until = -1.0
            self.waiting.appendleft(job)

    def _admit(self, job: Job, budget: int, now: float) -> tuple[int, float] | None:
        """Room for ``job``'s hits and first chunk: (chunk, store load seconds), or None (no room)."""
        if job.computed:  # its blocks are in (a pull landed): the rest of its prompt
            chunk = min(job.known - job.computed, budget)
            need = -(-(job.computed + chunk) // self.bs) - job.blocks
            if need > 0 and not self.cache.allocate(need):
                return None
            job.blocks += max(0, need)
            return chunk, 0.0
        usable = min(len(job.keys), (job.known - 1) // self.bs)
        if self.oracle is not None and not job.pulled:
            return self._admit_oracle(job, usable, budget)
        local = self.cache.prefix(job.keys, usable)
        served: list[int] = []
        if self.store is not None and not job.pulled:
            served = self.store.lookup(job.keys, local, usable)
        loaded = sum(served)
        hit = (local + loaded) * self.bs
        if job.pulled:  # a decode job: its peer has the whole prompt; it holds blocks while pulling
            need = -(-job.pulled // self.bs) - local
            if not self._hold(job.keys[:local], need):
                return None
            job.keyed = list(job.keys[:local])
            job.cached_upto = local
            job.blocks = local + need
            job.record.remote_tokens += max(0, job.pulled - local * self.bs)
            job.loading_until = now + self.profile.transfer_seconds(max(0, job.pulled - local * self.bs))
            self.loading.append(job)
            self.landings.append(job.loading_until)
            return 0, 0.0
        chunk = min(job.known - hit, budget)
        need = -(-(hit + chunk) // self.bs) - local
        if not self._hold(job.keys[:local], need):
            return None
        job.keyed = list(job.keys[:local])
        job.cached_upto = local + loaded
        job.blocks = local + need
        if job.first and not job.recorded:
            job.record.local_tokens = local * self.bs
            job.record.store_tokens = loaded * self.bs
            job.recorded = True
        load_s = 0.0
        if loaded and self.store is not None:
            start = local
            for tier, count in zip(self.store.tiers, served, strict=True):
                if count:
                    load_s += self.profile.load_seconds(tier.kind, count * self.bs)
            self.store.read(job.keys[start : start + loaded])
            # Loaded blocks are the request's, cached as they land (the engine's connector fills them).
            for key in job.keys[start : start + loaded]:
                if self.cache.cache(key):
                    job.keyed.append(key)
            self.counters["prompt_tokens.external_kv_transfer"] += loaded * self.bs
            self.load_seconds += load_s
        job.computed = hit
        return chunk, load_s

    def _admit_oracle(self, job: Job, usable: int, budget: int) -> tuple[int, float] | None:
        """Every block computed anywhere before is a hit, in blocks of the request's own."""
        assert self.oracle is not None
        hits = 0
        while hits < usable and job.keys[hits] in self.oracle:
            hits += 1
        hit = hits * self.bs
        chunk = min(job.known - hit, budget)
        need = -(-(hit + chunk) // self.bs)
        if not self.cache.allocate(need):
            return None
        job.blocks = need
        job.cached_upto = hits
        if job.first and not job.recorded:
            job.record.local_tokens = hit
            job.recorded = True
        job.computed = hit
        return chunk, 0.0

    def _hold(self, hits: tuple[int, ...], need: int) -> bool:
        """The hit blocks pinned first (an allocation must not evict them), then ``need`` new ones; on
        no room, the hits go back and False."""
        self.cache.acquire(hits)
        if self.cache.allocate(need):
            return True
        self.cache.release(hits, 0, 0)
        return False

    def _preempt(self, job: Job) -> None:
        self.running.remove(job)
        self._free(job)
        job.record.preemptions += 1
        self.waiting.appendleft(job)

    def _free(self, job: Job) -> None:
        full = job.computed // self.bs
        own = job.blocks - len(job.keyed)
        self.cache.release(job.keyed, max(0, min(own, full - len(job.keyed))), own)
        job.keyed = []
        job.blocks = 0
        job.computed = 0
        job.cached_upto = 0

    def end_step(self, now: float) -> list[Job]:
        """The step in flight ended at ``now``: tokens advance; the jobs that finished."""
        finished: list[Job] = []
        if self.stretch is not None:
            first, inc, count = self.stretch
            jobs = [j for j, _ in self.step_jobs]
            for job in jobs:  # the first step's gap is each one's own (it may have sat out a step)
                self.itl.append((self.step_start + first - job.last_token_s, 1))
            for k in range(1, count):
                self.itl.append((first + inc * k, len(jobs)))
            for job in jobs:
                job.computed += count
                job.generated += count
                job.last_token_s = now
                need = -(-job.computed // self.bs) - job.blocks
                if need > 0:
                    self.cache.allocate(need)  # checked when the stretch started
                    job.blocks += need
            self.steps += count
        else:
            self.steps += 1
            for job, chunk in self.step_jobs:
                job.computed += chunk
                self._cache_new_blocks(job)
                if job.computed == job.known:
                    job.generated += 1
                    if job.first and job.generated == 1:
                        job.record.first_token_s = now
                    else:
                        self.itl.append((now - job.last_token_s, 1))
                    job.last_token_s = now
        self.busy_s += now - self.step_start
        for job, _ in self.step_jobs:
            if job.generated >= job.max_out and job in self.running:
                self.running.remove(job)
                finished.append(job)
        self.step_jobs = []
        self.stretch = None
        self.busy_until = -1.0
        return finished

    def _cache_new_blocks(self, job: Job) -> None:
        """The prompt's full blocks computed since the last step are cached -- each unless another
        request cached the same block first (the engine keeps that copy the request's own) -- and
        saved to the store (the offload connector saves every new full block)."""
        n = min(len(job.keys), job.computed // self.bs)
        if n <= job.cached_upto:
            return
        new = job.keys[job.cached_upto : n]
        job.cached_upto = n
        if self.oracle is not None:
            self.oracle.update(new)
            return
        for key in new:
            if self.cache.cache(key):
                job.keyed.append(key)
        if self.store is not None:
            self.store.put(new)

    def release(self, job: Job) -> None:
        """The job is done here (a prefill job: once its KV was pulled)."""
        self._free(job)

    # ---- decode stretches -------------------------------------------------------------------------------

    def _start_stretch(self, now: float) -> float | None:
        jobs = self.running
        count = min(j.max_out - j.generated for j in jobs)
        if count < 2:
            return None
        need = sum(-(-(j.computed + count) // self.bs) - j.blocks for j in jobs)
        if need > self.cache.available():
            return None
        rows = len(jobs)
        context = sum(j.computed + 1 for j in jobs)
        first = self.cost.decode_seconds(rows, context)
        inc = self.cost.decode_context_s * rows
        self.stretch = (first, inc, count)
        self.step_jobs = [(j, DECODE_ROW) for j in jobs]
        self.step_start = now
        self.busy_until = now + count * first + inc * count * (count - 1) / 2
        return self.busy_until

    def _cut_stretch(self, now: float) -> None:
        """End the stretch at the first step boundary at or after ``now`` (at least one step)."""
        assert self.stretch is not None
        first, inc, count = self.stretch
        elapsed = now - self.step_start
        lo, hi = 1, count
        while lo < hi:  # the fewest steps whose total time reaches ``elapsed``
            mid = (lo + hi) // 2
            if mid * first + inc * mid * (mid - 1) / 2 >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        if lo < count:
            self.stretch = (first, inc, lo)
            self.busy_until = self.step_start + lo * first + inc * lo * (lo - 1) / 2
            self.version += 1
