"""The scheduler's books for its KV connector: who is loading, whose blocks are held, which loads failed.

Mechanism only: the scheduler decides what a landed load or a failed block means for a request (cut it
back, recompute, fail it); these books keep the state that outlives one step, and give blocks back.

    loading   WAITING_FOR_REMOTE_KV: blocks allocated, an async load filling them; where the request's KV
              ends once the load lands (local hit + this load's tokens)
    held      finished, blocks kept for the connector (delayed free) until it reports the send done, the
              request is aborted, or ``delay_free_timeout_s`` passes (then reclaimed, and the connector is
              told at once)
    failed    block ids reported as failed loads, kept until the loading request they belong to lands
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from connectors.base import KVConnectorBase, KVConnectorOutput
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestId

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LandedLoad:
    """An async load that landed: where the request's KV ends, and its first block reported bad (if any)."""

    request: Request
    loaded_end: int
    first_bad: int | None


class ConnectorBooks:
    def __init__(
        self,
        kv: KVCacheManager,
        connector: KVConnectorBase,
        clock: Callable[[], float],
        delay_free_timeout_s: float,
    ) -> None:
        self.kv = kv
        self.connector = connector
        self.clock = clock
        self.delay_free_timeout_s = delay_free_timeout_s
        self.loading: dict[RequestId, Request] = {}
        self._load_ends: dict[RequestId, int] = {}
        self.held: dict[RequestId, tuple[Request, float]] = {}  # request, deadline to reclaim its blocks
        self._failed_blocks: set[int] = set()
        self.num_delay_free_expired = 0

    # -- external hits ------------------------------------------------------------------------------------

    def external_hit(self, request: Request, num_local: int) -> tuple[int | None, bool]:
        """Ask the connector; clamp an answer that breaks the contract (and say so) rather than crash."""
        num, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num is None or num == 0:
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

    # -- async loads --------------------------------------------------------------------------------------

    def start_loading(self, request: Request, loaded_end: int) -> None:
        self.loading[request.request_id] = request
        self._load_ends[request.request_id] = loaded_end

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
        ids = self.kv.req_to_block_ids.get(rid, [])
        first_bad = next((i for i, b in enumerate(ids) if b in self._failed_blocks), None)
        # A failed block another loading request shares (a local hit on it) stays recorded for that one.
        still_loading = {b for r in self.loading for b in self.kv.req_to_block_ids.get(r, [])}
        self._failed_blocks -= set(ids) - still_loading
        return LandedLoad(request, loaded_end, first_bad)

    def record_failed(self, invalid: set[int]) -> None:
        self._failed_blocks |= invalid

    def forget_failed_outside_loads(self) -> None:
        """Blocks of requests still loading stay recorded until their load lands; others are done with."""
        pending = {b for r in self.loading for b in self.kv.req_to_block_ids.get(r, [])}
        self._failed_blocks &= pending

    # -- delayed frees ------------------------------------------------------------------------------------

    def hold(self, request: Request) -> None:
        self.held[request.request_id] = (request, self.clock() + self.delay_free_timeout_s)

    def release(self, rid: RequestId) -> bool:
        """Free a held request's blocks (the connector is done with them); False if none are held."""
        entry = self.held.pop(rid, None)
        if entry is None:
            return False
        self.kv.free(entry[0])
        return True

    def reclaim(self, rid: RequestId) -> None:
        """Free a held request's blocks without the connector's say-so, and tell it at once."""
        self.release(rid)
        # Tell the connector now, not with the next step's report: its scheduler half puts the reclaim in
        # this step's metadata, so the worker stops reading these blocks before the forward can reuse them.
        self.connector.update_connector_output(KVConnectorOutput(reclaimed={rid}))

    def expire(self) -> None:
        """Reclaim the blocks of every hold past its deadline."""
        if not self.held:
            return
        now = self.clock()
        for rid in [rid for rid, (_, deadline) in self.held.items() if deadline <= now]:
            logger.warning(
                "delayed free of %s expired after %.1fs: reclaiming its blocks",
                rid,
                self.delay_free_timeout_s,
            )
            self.num_delay_free_expired += 1
            self.reclaim(rid)
