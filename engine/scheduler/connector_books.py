"""The scheduler's books for its KV connector: who is loading, whose blocks are held, which loads failed.

Mechanism only: the scheduler decides what a landed load or a failed block means for a request (cut it
back, recompute, fail it); these books keep the state that outlives one step, and give blocks back.

    loading   WAITING_FOR_REMOTE_KV: blocks allocated, an async load filling them; where the request's KV
              ends once the load lands (local hit + this load's tokens)
    holds     finished, blocks kept for the connector's worker until it reports the transfer done: a send
              (the connector asked for the hold) or a receive (the request ended while its load ran).
              Two-phase: on abort or past ``hold_timeout_s`` the books ask the worker to stop
              (``stop_request_ids``) and free the blocks only once it confirms -- or, should it never
              confirm, after ``stop_timeout_s``.  A held block is never reused under a transfer.
    failed    block ids reported as failed loads, kept until the loading request they belong to lands
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.connector.base import LOOKUP_DEADLINE_S, KVConnectorBase
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestId
from telemetry.metrics import Counters

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LandedLoad:
    """An async load that landed: where the request's KV ends, and its first block reported bad (if any)."""

    request: Request
    loaded_end: int
    first_bad: int | None


class HoldKind(enum.Enum):
    """What a hold waits for: the report that ends it."""

    SEND = "send"  # finished_sending: the connector asked for the hold (request_finished)
    RECV = "receive"  # finished_recving: the request ended while its async load was writing its blocks


@dataclass(slots=True)
class Hold:
    """A finished request's blocks, kept for the connector's worker."""

    request: Request
    waits_for: HoldKind
    deadline: float  # past it, the worker is asked to stop
    stop_deadline: float | None = None  # set once asked: past it, the blocks are freed regardless


class ConnectorBooks:
    def __init__(
        self,
        kv: KVCacheManager,
        connector: KVConnectorBase,
        clock: Callable[[], float],
        counters: Counters,
        *,
        hold_timeout_s: float,
        stop_timeout_s: float,
    ) -> None:
        self.kv = kv
        self.connector = connector
        self.clock = clock
        self.counters = counters
        self.hold_timeout_s = hold_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.loading: dict[RequestId, Request] = {}
        self._load_ends: dict[RequestId, int] = {}
        self.holds: dict[RequestId, Hold] = {}
        self._stops: list[RequestId] = []
        self._failed_blocks: set[int] = set()

    # -- external hits ------------------------------------------------------------------------------------

    def external_hit(self, request: Request, num_local: int) -> tuple[int | None, bool]:
        """Ask the connector; clamp an answer that breaks the contract (and say so) rather than crash.  A
        lookup that raises, or answers None past ``LOOKUP_DEADLINE_S``, is zero hits (rule 3): the prompt
        is computed, the node lives on."""
        try:
            num, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        except Exception as exc:
            return self._no_hits(request, f"get_num_new_matched_tokens raised ({exc!r})")
        if num is None:
            now = self.clock()
            if request.lookup_since is None:
                request.lookup_since = now
            elif now - request.lookup_since > LOOKUP_DEADLINE_S:
                return self._no_hits(request, f"the lookup still had no answer after {LOOKUP_DEADLINE_S:g}s")
            return None, False
        request.lookup_since = None
        if num == 0:
            return num, False
        bs = self.kv.block_size
        limit = self.kv.max_hit_blocks(request) * bs - num_local
        clamped = min(num - num % bs, max(0, limit))
        if clamped != num:
            logger.warning(
                "connector %s offered %d tokens for %s after %d local; the contract allows %d (whole blocks, "
                "never the last token): using %d",
                self.connector.name,
                num,
                request.request_id,
                num_local,
                clamped,
                clamped,
            )
        return clamped, bool(load_async) and clamped > 0

    def _no_hits(self, request: Request, why: str) -> tuple[int, bool]:
        """A lookup given up on (rule 3): zero hits, counted and logged."""
        request.lookup_since = None
        self.counters.add("connector_lookup_failures")
        logger.warning(
            "connector %s, request %s: %s; counting zero hits", self.connector.name, request.request_id, why
        )
        return 0, False

    # -- async loads --------------------------------------------------------------------------------------

    def start_loading(self, request: Request, loaded_end: int) -> None:
        self.loading[request.request_id] = request
        self._load_ends[request.request_id] = loaded_end

    def load_end(self, rid: RequestId) -> int | None:
        """Where the prompt's KV will end once the load of ``rid`` lands; None if it is not loading."""
        return self._load_ends.get(rid)

    def stop_loading(self, rid: RequestId) -> None:
        """The request finished (aborted, failed) while its load was in flight."""
        self.loading.pop(rid, None)
        self._load_ends.pop(rid, None)

    def land(self, rid: RequestId) -> LandedLoad | None:
        """The load of ``rid`` landed: it is no longer loading.  None if it was not (finished before)."""
        request = self.loading.pop(rid, None)
        if request is None:
            return None
        # Not num_external_computed_tokens: that records the first admission, and a request preempted
        # after its first load may load again, a different number of tokens.
        loaded_end = self._load_ends.pop(rid)
        first_bad = self.kv.first_block_in(rid, self._failed_blocks)
        # A failed block another loading request shares (a local hit on it) stays recorded for that one.
        still_loading = self.kv.blocks_of(self.loading)
        self._failed_blocks -= self.kv.blocks_of([rid]) - still_loading
        return LandedLoad(request, loaded_end, first_bad)

    def record_failed(self, invalid: set[int]) -> None:
        self._failed_blocks |= invalid

    def forget_failed_outside_loads(self) -> None:
        """Blocks of requests still loading stay recorded until their load lands; others are done with."""
        self._failed_blocks &= self.kv.blocks_of(self.loading)

    # -- holds ------------------------------------------------------------------------------------------

    def hold(self, request: Request, waits_for: HoldKind) -> None:
        """Keep a finished request's blocks until the worker reports ``waits_for`` done for it."""
        self.holds[request.request_id] = Hold(request, waits_for, self.clock() + self.hold_timeout_s)

    def end_hold(self, rid: RequestId, reported: HoldKind) -> bool:
        """The worker reported ``rid`` done (its send or its receive): free the blocks of a hold that waits
        for that report.  False if there is none."""
        hold = self.holds.get(rid)
        if hold is None or hold.waits_for is not reported:
            return False
        del self.holds[rid]
        self.kv.free(hold.request)
        return True

    def stop(self, rid: RequestId) -> None:
        """Ask the worker to stop the transfer of a hold (in the next step's metadata).  The blocks stay
        allocated until the worker confirms, or ``stop_timeout_s`` passes."""
        hold = self.holds.get(rid)
        if hold is None or hold.stop_deadline is not None:
            return
        hold.stop_deadline = self.clock() + self.stop_timeout_s
        self._stops.append(rid)

    def take_stops(self) -> list[RequestId]:
        """The holds to stop this step (for ``KVConnectorMetadata.stop_request_ids``)."""
        stops, self._stops = self._stops, []
        return stops

    def expire(self) -> None:
        """Stop every hold past its deadline; free, as a last resort, those the worker never confirmed."""
        if not self.holds:
            return
        now = self.clock()
        for rid, hold in list(self.holds.items()):
            if hold.stop_deadline is None and hold.deadline <= now:
                logger.warning(
                    "the hold on %s's blocks passed its %.1fs deadline: asking the connector to stop its %s",
                    rid,
                    self.hold_timeout_s,
                    hold.waits_for.value,
                )
                self.counters.add("kv_hold_expiries")
                self.stop(rid)
            elif hold.stop_deadline is not None and hold.stop_deadline <= now:
                # The connector broke the contract (a stop is confirmed within a step); the deadline still
                # bounds the hold, so the blocks go back, and this may be the start of wrong KV.
                logger.error(
                    "connector %s did not confirm stopping the %s of %s within %.1fs: freeing its blocks "
                    "anyway (a transfer may still touch them)",
                    self.connector.name,
                    hold.waits_for.value,
                    rid,
                    self.stop_timeout_s,
                )
                self.counters.add("kv_hold_stop_timeouts")
                del self.holds[rid]
                self.kv.free(hold.request)
