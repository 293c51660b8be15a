"""Where each prompt's KV came from -- the local prefix cache, the connector, or computed here -- kept on
the request (its usage) and counted once, when it is final (``prompt_tokens.<source>`` counters)."""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache_manager import KVCacheManager
from engine.metrics import EXTERNAL_KV_TRANSFER, LOCAL_CACHE_HIT, LOCAL_COMPUTE
from engine.request import Request, RequestId
from telemetry.metrics import Counters


class PromptSources:
    def __init__(self, kv: KVCacheManager, counters: Counters, clock: Callable[[], float]) -> None:
        self.kv = kv
        self.counters = counters
        self.clock = clock
        # Admitted, prompt sources not counted yet: they are final once the prefill is done (a load that
        # fails moves tokens from loaded to computed, and a counter never goes down).
        self._pending: dict[RequestId, Request] = {}

    def record(self, request: Request, num_local: int, num_external: int) -> None:
        """``request`` is admitted with ``num_local`` tokens hit locally and ``num_external`` from the
        connector."""
        request.num_cached_tokens = num_local
        request.num_local_cached_tokens = num_local
        request.num_external_computed_tokens = num_external
        request.admitted_time = self.clock()
        self.kv.record_prefix_query(request.num_prompt_tokens, num_local)
        self._pending[request.request_id] = request

    def forget(self, request: Request) -> None:
        """``request`` was recorded but none of its prompt was served (its admission failed)."""
        self._pending.pop(request.request_id, None)

    def count(self, request: Request) -> None:
        """Count where the prompt's KV came from, once, when that is final (prefill done, or finished)."""
        if self._pending.pop(request.request_id, None) is None:
            return
        local, external = request.num_cached_tokens, request.num_external_computed_tokens
        self.counters.add(f"prompt_tokens.{LOCAL_CACHE_HIT}", local)
        self.counters.add(f"prompt_tokens.{EXTERNAL_KV_TRANSFER}", external)
        self.counters.add(
            f"prompt_tokens.{LOCAL_COMPUTE}", max(0, request.num_prompt_tokens - local - external)
        )

    @staticmethod
    def correct(request: Request, valid_end: int) -> None:
        """A load failed from token ``valid_end`` on: what lies past it is recomputed, not cached or
        loaded, and the request's usage (and the counters, counted once the prefill is done) say what
        really was."""
        if request.num_cached_tokens < 0:
            return  # sources not recorded yet
        local = min(request.num_cached_tokens, valid_end)
        external = min(request.num_external_computed_tokens, max(0, valid_end - local))
        request.num_cached_tokens, request.num_external_computed_tokens = local, external
        # What a failed step uncaches from: blocks past the valid end are no longer a local hit.
        request.num_local_cached_tokens = min(request.num_local_cached_tokens, valid_end)
