"""Recording proxies around the connector halves under test: every call is passed through unchanged.

The kit builds the halves itself (``connectors.registry.create_connector``) and hands the engine these
proxies, so it can check what the engine cannot: what each lookup answered, how often
``request_finished`` ran for each request, what the worker reported.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVTransferParams
from engine.connector.base import ConnectorStats
from engine.request import Request, RequestId
from wire.kv_events import KVCacheEvent

if TYPE_CHECKING:
    import torch

    from engine.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class Lookup:
    """One ``get_num_new_matched_tokens`` call and its answer, with the request as it was then."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    num_block_hashes: int
    answer: Any  # what the connector returned, unchecked (an int, None, or a contract violation)
    load_async: Any
    at: float


@dataclass(frozen=True, slots=True)
class Alloc:
    """One ``update_state_after_alloc`` call: the block table and where the external tokens sit in it."""

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # the local hit: the external tokens start here
    num_external_tokens: int


class CallClock:
    """Which connector calls are running now, and since when: the kit's watchdog reads it to fail a call
    that blocks (the check then ends instead of hanging the run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float, int]] = {}
        self._run = 0  # the check being watched; calls carry the one they started under

    def new_run(self) -> int:
        """A check starts: calls still running from earlier checks (abandoned threads) are not its own."""
        with self._lock:
            self._run += 1
            return self._run

    @contextmanager
    def call(self, name: str) -> Iterator[None]:
        key = threading.get_ident()
        with self._lock:
            outer = self._running.get(key)
            self._running[key] = (name, time.monotonic(), self._run)
        try:
            yield
        finally:
            with self._lock:
                if outer is None:
                    self._running.pop(key, None)
                else:
                    self._running[key] = outer

    def longest(self, run: int) -> tuple[str, float, int] | None:
        """Of the calls check ``run`` started, the one running longest now: its name, for how many
        seconds, on which thread (None: none)."""
        now = time.monotonic()
        with self._lock:
            mine = [(k, v) for k, v in self._running.items() if v[2] == run]
        if not mine:
            return None
        key, (name, start, _) = min(mine, key=lambda item: item[1][1])
        return name, now - start, key

    def pardon(self, seconds: float) -> None:
        """The watcher itself was held up (the whole process was): no call ran during that time."""
        with self._lock:
            self._running = {k: (n, start + seconds, r) for k, (n, start, r) in self._running.items()}

    def forget(self, thread: int) -> None:
        """Stop watching a thread the kit abandoned (its call may never return)."""
        with self._lock:
            self._running.pop(thread, None)


# Every spy of the process reports here: one watchdog watches whichever check runs.
CLOCK = CallClock()


class _Proxy(KVConnectorBase):
    def __init__(self, inner: KVConnectorBase) -> None:
        # No super().__init__: the options were validated when ``inner`` was built.
        self.inner = inner
        self.role = inner.role
        self.context = inner.context
        self.options = inner.options
        self.__dict__["name"] = inner.name  # the engine's log lines name the connector under test

    def shutdown(self) -> None:
        with CLOCK.call(f"{self.role.value} half: shutdown"):
            self.inner.shutdown()

    def bind_step_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        super().bind_step_metadata(metadata)
        self.inner.bind_step_metadata(metadata)

    def get_stats(self) -> ConnectorStats:
        with CLOCK.call(f"{self.role.value} half: get_stats"):
            return self.inner.get_stats()


class SchedulerSpy(_Proxy):
    def __init__(self, inner: KVConnectorBase) -> None:
        super().__init__(inner)
        self.lookups: list[Lookup] = []
        self.allocs: list[Alloc] = []
        self.finished: Counter[str] = Counter()
        self.finish_results: dict[str, tuple[Any, Any]] = {}
        # When each request was first asked about, and first got a number (not None) back.
        self.first_asked: dict[str, float] = {}
        self.first_answered: dict[str, float] = {}
        # Calls that raised (the engine survives them: the harness fails the check on them)
        self.raised: list[tuple[str, BaseException]] = []

    @contextmanager
    def _call(self, name: str) -> Iterator[None]:
        with CLOCK.call(name):
            try:
                yield
            except Exception as exc:
                self.raised.append((name, exc))
                raise

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with CLOCK.call("get_num_new_matched_tokens"):
            answer, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        rid, now = request.request_id, time.monotonic()
        self.lookups.append(
            Lookup(
                rid,
                num_computed_tokens,
                request.num_tokens,
                len(request.block_hashes),
                answer,
                load_async,
                now,
            )
        )
        self.first_asked.setdefault(rid, now)
        if answer is not None:
            self.first_answered.setdefault(rid, now)
        return answer, load_async

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.allocs.append(
            Alloc(request.request_id, tuple(block_ids), request.num_computed_tokens, num_external_tokens)
        )
        with self._call("update_state_after_alloc"):
            self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._call("build_connector_meta"):
            return self.inner.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        with self._call("update_connector_output"):
            self.inner.update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self.finished[request.request_id] += 1
        with self._call("request_finished"):
            result = self.inner.request_finished(request, block_ids)
        self.finish_results[request.request_id] = result
        return result

    def take_events(self) -> list[KVCacheEvent]:
        with self._call("take_events"):
            return self.inner.take_events()

    def lookups_of(self, request_id: str) -> list[Lookup]:
        return [lk for lk in self.lookups if lk.request_id == request_id]

    def first_load(self, request_id: str) -> Alloc | None:
        """The allocation that placed the request's external tokens (an async load has a second one)."""
        return next(
            (a for a in self.allocs if a.request_id == request_id and a.num_external_tokens > 0), None
        )


class WorkerSpy(_Proxy):
    def __init__(self, inner: KVConnectorBase) -> None:
        super().__init__(inner)
        self.finished_sending: Counter[str] = Counter()
        self.finished_recving: Counter[str] = Counter()
        self.load_errors: set[int] = set()

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        with CLOCK.call("register_kv_caches"):
            self.inner.register_kv_caches(kv_cache)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        with CLOCK.call("handle_preemptions"):
            self.inner.handle_preemptions(metadata)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        with CLOCK.call("start_load_kv"):
            self.inner.start_load_kv(metadata)

    def wait_for_layer_load(self, layer: int) -> None:
        with CLOCK.call("wait_for_layer_load"):
            self.inner.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        with CLOCK.call("save_kv_layer"):
            self.inner.save_kv_layer(layer, kv_cache, attn_metadata)

    def wait_for_save(self) -> None:
        with CLOCK.call("wait_for_save"):
            self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        with CLOCK.call("get_finished"):
            sending, recving = self.inner.get_finished(finished_req_ids)
        self.finished_sending.update(sending)
        self.finished_recving.update(recving)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        with CLOCK.call("get_block_ids_with_load_errors"):
            errors = self.inner.get_block_ids_with_load_errors()
        self.load_errors |= errors
        return errors
