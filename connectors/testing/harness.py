"""The kit's workbench: a tiny random model, fixed prompts, and engines whose connector halves are spied on.

Every engine runs the same tiny Llama (written once per process into a temporary folder), on the CPU in
float32 with 4-token blocks unless the target says otherwise, so a check takes milliseconds.  Prompts
are fixed: their lengths cover a partial last block and an exact multiple of the block size.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from connectors.base import ConnectorContext, KVConnectorRole
from connectors.registry import KVConnectorConfig, create_connector
from connectors.testing.items import (
    ASYNC_LOADS,
    HOLD_ENDS,
    NONE_ANSWER,
    STOP_CONFIRMED,
    WORKER_RAISES,
    ConformanceError,
)
from connectors.testing.reports import check_reports, check_stats
from connectors.testing.spy import SchedulerSpy, WorkerSpy
from connectors.testing.target import MIN_KIT_BLOCKS, ConformanceTarget
from connectors.testing.workload import BLOCK_SIZE, KIT_MODEL_SPEC, PARAMS
from engine.engine_config import EngineConfig
from engine.hashing import BlockHash
from engine.llm_engine import STEP_FAILED, LLMEngine
from engine.model.make_model import make_model
from engine.outputs import GenerationOutput
from engine.request import Request
from engine.sampling_params import SamplingParams


@functools.cache
def kit_model_dir(variant: str = "") -> Path:
    """The kit's tiny model, written once per process.  ``variant="other"``: the same geometry with other
    weights (another model, as far as a cache may tell)."""
    root = Path(tempfile.mkdtemp(prefix="pdkv-conformance-"))
    atexit.register(shutil.rmtree, root, True)
    spec = KIT_MODEL_SPEC if not variant else dataclasses.replace(KIT_MODEL_SPEC, seed=1)
    return make_model(root / f"kit-llama{'-' + variant if variant else ''}", spec)


def engine_config(target: ConformanceTarget | None, engine_id: str, **options: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "num_blocks": MIN_KIT_BLOCKS,
    }
    if target is not None:
        base.update(target.engine_options)
    base.update(options)
    model = base.pop("model", None) or kit_model_dir()
    return EngineConfig(model=model, engine_id=engine_id, **base)


@functools.cache
def _context(config: EngineConfig) -> ConnectorContext:
    """What the engine would tell its connector: built from a probe engine with no connector."""
    probe = LLMEngine(config)
    return ConnectorContext(probe.namespace, probe.kv_spec, engine_id=config.engine_id)


class KitEngine:
    """An ``LLMEngine`` running the connector under test behind spies; steps with deadlines.

    Every failure that is the connector's fault surfaces as a ``ConformanceError`` naming ``item``.
    """

    def __init__(
        self,
        target: ConformanceTarget,
        connector: KVConnectorConfig,
        *,
        item: str,
        engine_id: str,
        poison_freed: bool = False,
        **options: Any,
    ) -> None:
        self.item = item
        self.lookup_deadline_s = target.lookup_deadline_s
        self.load_deadline_s = target.load_deadline_s
        self._loading_since: dict[str, float] = {}
        config = engine_config(target, engine_id, **options)
        context = _context(config)
        try:
            self.scheduler_spy = SchedulerSpy(create_connector(connector, KVConnectorRole.SCHEDULER, context))
            self.worker_spy = WorkerSpy(create_connector(connector, KVConnectorRole.WORKER, context))
            self.engine = LLMEngine(config, connectors=(self.scheduler_spy, self.worker_spy))
        except Exception as exc:
            raise ConformanceError(item, f"building an engine with {connector} raised {exc!r}") from exc
        self.block_size = self.engine.kv_spec.block_size
        self.results: dict[str, GenerationOutput] = {}
        self._ids = 0
        # poison_freed: the KV of every block is replaced by NaN the moment its last reference goes (the
        # engine may reuse it then); what it held is kept here, by block hash, for the comparison.
        self.freed_kv: dict[bytes, Any] = {}
        if poison_freed:
            self._poison_freed_blocks()

    def __enter__(self) -> KitEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.engine.shutdown()
        except Exception as err:
            if exc is None:
                raise ConformanceError(self.item, f"connector shutdown() raised {err!r}") from err

    def _poison_freed_blocks(self) -> None:
        import torch

        pool = self.engine.scheduler.kv.pool
        free_blocks = pool.free_blocks
        kv = self.engine.runner.kv_cache

        def free_and_poison(blocks: Any) -> None:
            blocks = list(blocks)
            free_blocks(blocks)
            for block in blocks:
                if block.ref_cnt:
                    continue
                if block.block_hash is not None:
                    self.freed_kv.setdefault(
                        bytes(block.block_hash), kv[block.block_id].clone().view(torch.uint8)
                    )
                    pool.uncache(block)  # no local hit may read the poison
                kv[block.block_id].fill_(float("nan"))

        pool.free_blocks = free_and_poison  # type: ignore[method-assign,assignment]

    # -- requests -----------------------------------------------------------------------------------------

    def add(
        self,
        prompt: Sequence[int],
        params: SamplingParams = PARAMS,
        *,
        cache_salt: str | None = None,
        decoys: Mapping[int, bytes] | None = None,
        adapter: str | None = None,
    ) -> str:
        """Submit ``prompt`` (under LoRA ``adapter``).  ``decoys`` (block index -> hash) replace those
        blocks' hashes before the connector sees the request: the connector saves them under keys no other
        request has, so an engine asking for the real prompt later finds a hole there (the kit's own)."""
        rid = f"{self.engine.config.engine_id}-{self._ids}"
        self._ids += 1
        self.engine.add_request(rid, prompt, params, cache_salt=cache_salt, adapter=adapter)
        self.results[rid] = GenerationOutput(rid, list(prompt))
        if decoys:
            hashes = self.request(rid).block_hashes
            for index, decoy in decoys.items():
                hashes[index] = BlockHash(decoy)
        return rid

    def request(self, rid: str) -> Request:
        request = self.engine.scheduler.get_request(rid)
        assert request is not None, f"kit bug: {rid} is not in the engine"
        return request

    def abort(self, rid: str) -> None:
        out = self._guard(lambda: self.engine.abort_request(rid), f"abort_request({rid!r})")
        if out is not None:
            self.results[rid].add(out)

    def lookup(self, rid: str, num_computed_tokens: int = 0) -> tuple[int | None, bool]:
        """Ask the connector directly (through the spy) about a request that is still waiting."""
        request = self.request(rid)
        return self._guard(
            lambda: self.scheduler_spy.get_num_new_matched_tokens(request, num_computed_tokens),
            "get_num_new_matched_tokens",
        )

    def lookup_answer(self, rid: str, num_computed_tokens: int = 0) -> int:
        """Ask until the answer is not ``None`` (an async lookup still running); fail past the deadline."""
        end = time.monotonic() + self.lookup_deadline_s
        asks = 0
        while True:
            answer, _ = self.lookup(rid, num_computed_tokens)
            asks += 1
            if answer is not None:
                return answer
            if time.monotonic() > end:
                raise ConformanceError(
                    NONE_ANSWER,
                    f"get_num_new_matched_tokens answered None {asks} times over {self.lookup_deadline_s:g}s "
                    "for one request: None means 'ask again next step', and an answer must follow in "
                    "bounded time",
                )
            time.sleep(0.001)  # poll: the connector's async lookup runs on its own

    # -- stepping -----------------------------------------------------------------------------------------

    def _guard(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except ConformanceError:
            raise
        except Exception as exc:
            raise ConformanceError(
                self.item,
                f"{what} raised {exc!r}: a connector reports problems, it never raises into the engine",
            ) from exc

    def step(self) -> int:
        """One engine step; returns how many outputs it produced."""
        outs = self._guard(self.engine.step, "engine.step()")
        check_reports(self.engine, self.scheduler_spy, self.worker_spy)
        check_stats(self.scheduler_spy, self.worker_spy)  # a node reads them between any two steps
        for out in outs:
            self.results[out.request_id].add(out)
            if out.error is not None and out.error.startswith(STEP_FAILED):  # the runner caught a raise
                raise ConformanceError(
                    WORKER_RAISES,
                    f"request {out.request_id} failed with {out.error!r}: a worker call raised, and the "
                    "engine failed every request of the step (the kit's other checks stop here)",
                )
        return len(outs)

    def wait(self, rids: Sequence[str], *, deadline_s: float = 60.0) -> list[GenerationOutput]:
        """Step until every request in ``rids`` finished."""

        def done() -> bool:
            return all(self.results[r].finish_reason is not None for r in rids)

        if not self.step_until(done, deadline_s):
            late = [r for r in rids if self.results[r].finish_reason is None]
            raise ConformanceError(self.item, f"requests {late} did not finish within {deadline_s:g}s")
        return [self.results[r] for r in rids]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams = PARAMS, *, deadline_s: float = 60.0
    ) -> list[GenerationOutput]:
        return self.wait([self.add(p, params) for p in prompts], deadline_s=deadline_s)

    def step_until(self, done: Callable[[], bool], deadline_s: float, what: str = "") -> bool:
        """Step until ``done()``; False if the deadline passed first (``what`` set: raise instead)."""
        end = time.monotonic() + deadline_s
        while not done():
            if time.monotonic() > end:
                if what:
                    raise ConformanceError(self.item, what)
                return False
            if self.step() == 0:
                time.sleep(0.0005)  # nothing advanced: an async load or send is in flight elsewhere
            self._check_lookups_progress()
            self._check_loads_progress()
        return True

    def _check_loads_progress(self) -> None:
        """No request may wait for an async load longer than the load deadline."""
        now = time.monotonic()
        loading = set(self.engine.scheduler.loading)
        for rid in list(self._loading_since):
            if rid not in loading:
                del self._loading_since[rid]
        for rid in loading:
            since = self._loading_since.setdefault(rid, now)
            if now - since > self.load_deadline_s:
                raise ConformanceError(
                    ASYNC_LOADS,
                    f"{rid} has waited {now - since:.1f}s for its load (the deadline is "
                    f"{self.load_deadline_s:g}s): after get_num_new_matched_tokens answered load_async=True "
                    "the worker must list the request in get_finished()'s finished_recving once the load "
                    "is done -- or failed, with the failed blocks in get_block_ids_with_load_errors -- "
                    "else the request waits forever",
                )

    def _check_lookups_progress(self) -> None:
        """No request may be told ``None`` ("still looking") for longer than the lookup deadline."""
        spy, now = self.scheduler_spy, time.monotonic()
        for rid, asked in spy.first_asked.items():
            if (
                rid not in spy.first_answered
                and now - asked > self.lookup_deadline_s
                and self.engine.scheduler.get_request(rid) is not None  # not aborted meanwhile
            ):
                asks = len(spy.lookups_of(rid))
                raise ConformanceError(
                    NONE_ANSWER,
                    f"{rid} was asked {asks} times over {now - asked:.1f}s and answered None every time "
                    f"(the deadline is {self.lookup_deadline_s:g}s): a lookup that never finishes stalls "
                    "its request forever",
                )

    def settle(self, seconds: float) -> None:
        """Keep stepping the idle engine for ``seconds``: a connector's background work (a save on a
        thread of its own) runs meanwhile, while the freed blocks stay as they are (nothing reuses them)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.step() == 0:
                time.sleep(0.005)

    def drain(self, deadline_s: float, what: str) -> None:
        """Step until no request is unfinished and no block is held for the connector.

        Blocks still held past the deadline are the connector's doing: it returned ``hold=True`` and
        never listed the request in ``finished_sending``, or never confirmed a stop.
        """
        if self.step_until(lambda: not self.engine.has_pending_work(), deadline_s):
            return
        holds = self.engine.scheduler.holds
        if holds and not self.engine.has_unfinished_requests():
            stopped = sorted(rid for rid, hold in holds.items() if hold.stop_deadline is not None)
            if stopped:
                raise ConformanceError(
                    STOP_CONFIRMED,
                    f"{what}: {len(stopped)} held requests ({', '.join(stopped)}) were in "
                    f"metadata.stop_request_ids and still not reported {deadline_s:g}s later; the worker "
                    "must stop their transfers and list them in get_finished() (finished_sending, or "
                    "finished_recving for a load) -- the engine frees their blocks only then",
                )
            raise ConformanceError(
                HOLD_ENDS,
                f"{what}: {len(holds)} finished requests ({', '.join(sorted(holds))}) still hold their "
                f"blocks {deadline_s:g}s after request_finished returned hold=True; the worker must list "
                "them in get_finished()'s finished_sending once its sends are done (the engine's stop "
                "after kv_hold_timeout_s is a safety net for a lost peer, not the protocol)",
            )
        raise ConformanceError(self.item, f"{what}: work still pending after {deadline_s:g}s")

    # -- books --------------------------------------------------------------------------------------------

    def assert_no_leak(self, after: str) -> None:
        scheduler = self.engine.scheduler
        try:
            scheduler.check_integrity()
        except AssertionError as exc:
            raise ConformanceError(
                self.item, f"after {after}, the block books do not balance: {exc}"
            ) from exc
        if scheduler.holds or scheduler.loading:
            raise ConformanceError(
                self.item,
                f"after {after}, blocks are still held for {sorted(scheduler.holds)} and loading for "
                f"{sorted(scheduler.loading)}",
            )
        timeouts = int(scheduler.stats().counter("kv_hold_stop_timeouts"))
        if timeouts:
            raise ConformanceError(
                STOP_CONFIRMED,
                f"after {after}, the engine freed the blocks of {timeouts} held requests whose stop the "
                "worker never confirmed (kv_stop_timeout_s passed): a transfer may have touched reused "
                "blocks",
            )
        free, total = scheduler.kv.num_free_blocks, scheduler.kv.pool.num_blocks
        if free != total:
            raise ConformanceError(
                self.item, f"after {after}, {total - free} of {total} blocks are still in use"
            )

    def scheduler_state_holding(self, request_ids: set[str]) -> list[str]:
        """Where the connector's scheduler half still refers to any of ``request_ids`` (an id, or the
        ``Request``), as attribute paths; it walks dicts, lists, sets, tuples and nested connectors."""
        found: list[str] = []
        seen: set[int] = set()

        def visit(obj: Any, path: str, depth: int) -> None:
            if len(found) >= 5 or depth > 5 or id(obj) in seen:
                return
            if isinstance(obj, str):
                if obj in request_ids:
                    found.append(f"{path} holds {obj!r}")
                return
            if isinstance(obj, Request):
                if obj.request_id in request_ids:
                    found.append(f"{path} holds the Request {obj.request_id!r}")
                return
            seen.add(id(obj))
            if isinstance(obj, dict):
                for k, v in list(obj.items())[:10_000]:
                    visit(k, f"{path} (a key)", depth + 1)
                    visit(v, f"{path}[{k!r}]", depth + 1)
            elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
                for i, v in enumerate(list(obj)[:10_000]):
                    visit(v, f"{path}[{i}]", depth + 1)
            elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] not in ("torch", "zmq"):
                for name, v in vars(obj).items():
                    if name not in ("context", "options", "inner"):
                        visit(v, f"{path}.{name}", depth + 1)

        inner = self.scheduler_spy.inner
        for name, value in vars(inner).items():
            if name not in ("context", "options"):
                visit(value, f"self.{name}", 0)
        return found

    def block_hashes(self, prompt: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        probe = Request("kit-probe", prompt, PARAMS, namespace=self.engine.namespace, cache_salt=cache_salt)
        return list(probe.block_hashes)

    def cached_block_bytes(self, block_hash: bytes) -> Any:
        """A copy of the KV of the block cached locally under ``block_hash`` (a torch uint8 tensor)."""
        import torch

        block = self.engine.scheduler.kv.pool.get_cached_block(block_hash)  # type: ignore[arg-type]
        assert block is not None, "kit bug: the block is no longer in the engine's prefix cache"
        return self.block_bytes(block.block_id).clone().view(torch.uint8)

    def block_bytes(self, block_id: int) -> Any:
        import torch

        return self.engine.runner.kv_cache[block_id].view(torch.uint8)


def max_hit_tokens(prompt_len: int, num_hashes: int, block_size: int) -> int:
    """Whole blocks, never the last token: the most a connector may offer for a fresh request."""
    return min(num_hashes, (prompt_len - 1) // block_size) * block_size
