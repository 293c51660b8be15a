"""Scheduler <-> connector integration, scheduler half only (no model): a scripted fake connector."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from connectors.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from engine.connector.base import LOOKUP_DEADLINE_S
from engine.request import Request, RequestStatus
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from engine.scheduler.config import CacheConfig, SchedulerConfig
from tests.factories import make_request


class ScriptedConnector(KVConnectorBase):
    """Answers lookups from a dict ``request_id -> (tokens, async)``; records every call."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__(KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
        self.answers: dict[str, tuple[int | None, bool]] = {}
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: Counter[str] = Counter()
        self.hold = False
        self.outputs: list[KVConnectorOutput] = []
        self.lookups: Counter[str] = Counter()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.lookups[request.request_id] += 1
        return self.answers.get(request.request_id, (0, False))

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished[request.request_id] += 1
        return self.hold, {"block_ids": list(block_ids)}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    conn: ScriptedConnector, *, policy: str = "recompute", num_blocks: int = 32, clock: Clock | None = None
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, kv_load_failure_policy=policy, kv_hold_timeout_s=10.0),
        CacheConfig(block_size=4, num_blocks=num_blocks),
        connector=conn,
        clock=clock or Clock(),
    )


def step(
    s: Scheduler, kv_out: KVConnectorOutput | None = None, token: int = 7
) -> tuple[SchedulerOutput, Any]:
    so = s.schedule()
    out = s.update_from_output(
        so,
        ModelRunnerOutput(
            {sr.request_id: token for sr in so.scheduled if sr.sample}, kv_connector_output=kv_out
        ),
    )
    s.check_integrity()
    return so, out


def test_sync_external_hit_starts_after_local_and_external_tokens() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    s.add_request(make_request("warm", range(5), max_tokens=1))
    step(s)  # caches block 0 (tokens 0..3)
    conn.answers["r"] = (8, False)
    s.add_request(make_request("r", range(17), max_tokens=1))
    so = s.schedule()
    sr = next(x for x in so.scheduled if x.request_id == "r")
    assert (sr.start_position, sr.num_tokens) == (12, 5)  # 4 local + 8 external, then compute 5
    assert conn.allocs[-1] == ("r", sr.block_ids, 8)
    r = s.get_request("r")
    assert r is not None and (r.num_local_cached_tokens, r.num_external_computed_tokens) == (4, 8)
    s.update_from_output(so, ModelRunnerOutput({"r": 1}))  # type: ignore[dict-item]
    st = s.stats()
    assert st.counter("prompt_tokens.local_cache_hit") == 4
    assert st.counter("prompt_tokens.external_kv_transfer") == 8
    assert st.counter("prompt_tokens.local_compute") == 5 + 5  # warm's 5 + r's tail


def test_none_means_ask_again_next_step_without_blocking_others() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["slow"] = (None, False)
    s.add_request(make_request("slow", range(9), max_tokens=1))
    s.add_request(make_request("other", range(50, 55), max_tokens=1))
    so, _ = step(s)
    assert [sr.request_id for sr in so.scheduled] == ["other"]
    conn.answers["slow"] = (4, False)
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position) for sr in so.scheduled] == [("slow", 4)]
    assert conn.lookups["slow"] == 2


def test_a_lookup_still_looking_past_the_deadline_counts_as_zero_hits() -> None:
    """A connector answering None for ever (a stuck backend, a bug) must not park the request for ever:
    past LOOKUP_DEADLINE_S the prompt is computed, and the lookup counted as failed."""
    conn, clock = ScriptedConnector(), Clock()
    s = make(conn, clock=clock)
    conn.answers["stuck"] = (None, False)
    s.add_request(make_request("stuck", range(9), max_tokens=1))
    for now in (0.0, LOOKUP_DEADLINE_S / 2, LOOKUP_DEADLINE_S - 0.01):  # the first None, then inside
        clock.now = now
        so, _ = step(s)
        assert not so.scheduled
    clock.now = LOOKUP_DEADLINE_S + 0.01
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position, sr.num_tokens) for sr in so.scheduled] == [("stuck", 0, 9)]
    assert s.stats().counter("connector_lookup_failures") == 1


def test_a_lookup_that_raises_counts_as_zero_hits_and_the_scheduler_goes_on() -> None:
    """A plugin's lookup that raises (rule 3's backend gone, a bug) was a dead engine loop, taking the node
    down: now zero hits for that request, computed as without the connector; other requests unaffected."""

    class Raising(ScriptedConnector):
        def get_num_new_matched_tokens(
            self, request: Request, num_computed_tokens: int
        ) -> tuple[int | None, bool]:
            if request.request_id == "bad":
                raise OSError("index unreadable")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    conn = Raising()
    s = make(conn)
    conn.answers["good"] = (4, False)
    s.add_request(make_request("bad", range(9), max_tokens=2))
    s.add_request(make_request("good", range(50, 59), max_tokens=2))
    so, _ = step(s)
    starts = {sr.request_id: (sr.start_position, sr.num_tokens) for sr in so.scheduled}
    assert starts == {"bad": (0, 9), "good": (4, 5)}
    assert s.stats().counter("connector_lookup_failures") == 1
    while s.has_unfinished_requests():
        step(s)


def test_async_load_parks_the_request_until_the_worker_reports_it() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (8, True)
    s.add_request(make_request("r", range(10), max_tokens=1))
    so, _ = step(s)
    assert so.scheduled == []
    r = s.get_request("r")
    assert r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(s.kv.get_block_ids("r")) == 2 and s.kv.pool.cached == {}  # allocated, not cached
    so, _ = step(s)  # nothing landed yet
    assert so.scheduled == []
    so, _ = step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    assert len(s.kv.pool.cached) == 2  # the loaded blocks are cached once they landed
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position, sr.num_tokens) for sr in so.scheduled] == [("r", 8, 2)]
    assert not s.has_unfinished_requests()
    assert conn.finished["r"] == 1


def test_failed_sync_load_cuts_back_to_the_first_bad_block_and_recomputes() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (12, False)
    s.add_request(make_request("r", range(14), max_tokens=2))
    so = s.schedule()
    ids = so.scheduled[0].block_ids
    assert so.scheduled[0].start_position == 12
    out = s.update_from_output(
        so,
        ModelRunnerOutput({"r": 5}, kv_connector_output=KVConnectorOutput(invalid_block_ids={ids[1]})),  # type: ignore[dict-item]
    )
    assert out.updates == []  # the token sampled over bad KV is dropped
    r = s.get_request("r")
    assert r is not None and r.num_computed_tokens == 4 and r.num_output_tokens == 0
    assert ids[1] not in [b.block_id for b in s.kv.pool.cached.values()]
    so = s.schedule()
    assert (so.scheduled[0].start_position, so.scheduled[0].num_tokens) == (4, 10)
    assert s.stats().counter("kv_load_failures") == 1


def test_failed_load_with_fail_policy_errors_the_request() -> None:
    conn = ScriptedConnector()
    s = make(conn, policy="fail")
    conn.answers["r"] = (8, False)
    s.add_request(make_request("r", range(10), max_tokens=2))
    so = s.schedule()
    bad = so.scheduled[0].block_ids[0]
    out = s.update_from_output(
        so,
        ModelRunnerOutput({"r": 5}, kv_connector_output=KVConnectorOutput(invalid_block_ids={bad})),  # type: ignore[dict-item]
    )
    assert [(u.request_id, u.finish_reason) for u in out.updates] == [("r", "error")]
    assert "kv_load_failure_policy" in (out.updates[0].error or "")
    assert conn.finished["r"] == 1
    s.check_integrity()
    assert s.kv.num_free_blocks == 32


def test_a_failed_async_load_under_the_fail_policy_holds_nothing() -> None:
    """The landed load failed the request: its load is over, so its blocks are freed at once (a receive
    hold here waited 30 s for a report nobody sends, then blamed the connector)."""
    conn = ScriptedConnector()
    s = make(conn, policy="fail")
    conn.answers["r"] = (8, True)
    s.add_request(make_request("r", range(10), max_tokens=2))
    step(s)
    bad = s.kv.get_block_ids("r")[1]  # type: ignore[arg-type]
    step(s, KVConnectorOutput(invalid_block_ids={bad}))
    _, out = step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    assert [(u.request_id, u.finish_reason) for u in out.updates] == [("r", "error")]
    assert s.holds == {} and s.kv.num_free_blocks == 32
    so, _ = step(s)
    assert so.kv_connector_metadata.stop_request_ids == []


def test_failed_async_load_keeps_only_the_good_leading_blocks() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (12, True)
    s.add_request(make_request("r", range(14), max_tokens=1))
    step(s)
    ids = s.kv.get_block_ids("r")  # type: ignore[arg-type]
    step(s, KVConnectorOutput(invalid_block_ids={ids[2]}))
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    assert len(s.kv.pool.cached) == 2
    so, _ = step(s)
    assert (so.scheduled[0].start_position, so.scheduled[0].num_tokens) == (8, 6)


def test_a_hold_keeps_the_blocks_until_finished_sending() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    s = make(conn)
    s.add_request(make_request("r", range(6), max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests() and "r" in s.holds
    assert s.kv.num_free_blocks == 30
    step(s, KVConnectorOutput(finished_sending={"r"}))  # type: ignore[arg-type]
    assert s.holds == {} and s.kv.num_free_blocks == 32
    assert conn.finished["r"] == 1


def test_an_expired_hold_is_stopped_and_freed_only_once_the_worker_confirms() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    clock = Clock()
    s = make(conn, clock=clock)
    s.add_request(make_request("r", range(6), max_tokens=1))
    step(s)
    clock.now = 9.9
    so, _ = step(s)
    assert "r" in s.holds and so.kv_connector_metadata.stop_request_ids == []
    clock.now = 10.1
    so, _ = step(s)
    assert so.kv_connector_metadata.stop_request_ids == ["r"]  # asked once ...
    assert "r" in s.holds and s.kv.num_free_blocks == 30  # ... and the blocks stay until it confirms
    so, _ = step(s)
    assert so.kv_connector_metadata.stop_request_ids == []
    assert s.kv.num_free_blocks == 30
    step(s, KVConnectorOutput(finished_sending={"r"}))  # type: ignore[arg-type]
    assert s.holds == {} and s.kv.num_free_blocks == 32
    stats = s.stats()
    assert stats.counter("kv_hold_expiries") == 1 and stats.counter("kv_hold_stop_timeouts") == 0


def test_a_stop_the_worker_never_confirms_ends_at_the_stop_deadline() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    clock = Clock()
    s = make(conn, clock=clock)
    s.add_request(make_request("r", range(6), max_tokens=1))
    step(s)
    clock.now = 10.1
    step(s)  # asked to stop; kv_stop_timeout_s is 30 s
    clock.now = 40.0
    step(s)
    assert "r" in s.holds
    clock.now = 40.2
    step(s)
    assert s.holds == {} and s.kv.num_free_blocks == 32
    assert s.stats().counter("kv_hold_stop_timeouts") == 1


def test_abort_of_a_held_request_asks_the_worker_to_stop_first() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    s = make(conn)
    s.add_request(make_request("held", range(6), max_tokens=1))
    step(s)
    assert s.abort_request("held") is None  # already finished for its client
    assert "held" in s.holds and s.kv.num_free_blocks == 30
    so, _ = step(s)
    assert so.kv_connector_metadata.stop_request_ids == ["held"]
    assert s.abort_request("held") is None  # a second abort asks nothing more
    so, _ = step(s, KVConnectorOutput(finished_sending={"held"}))  # type: ignore[arg-type]
    assert so.kv_connector_metadata.stop_request_ids == []
    assert s.holds == {} and s.kv.num_free_blocks == 32
    assert conn.finished == Counter({"held": 1})


@pytest.mark.parametrize("hold", [False, True])
def test_a_request_that_ends_while_loading_is_held_until_the_receive_stopped(hold: bool) -> None:
    """Whatever the connector answers: its worker is still writing into the blocks."""
    conn = ScriptedConnector()
    conn.answers["r"] = (8, True)
    s = make(conn)
    s.add_request(make_request("r", range(10), max_tokens=1))
    step(s)
    conn.hold = hold
    update = s.abort_request("r")
    assert update is not None and update.finish_reason == "abort"
    assert "r" in s.holds and s.kv.num_free_blocks == 30
    so, _ = step(s, KVConnectorOutput(finished_sending={"r"}))  # type: ignore[arg-type]
    assert so.kv_connector_metadata.stop_request_ids == ["r"]
    assert "r" in s.holds  # a send report does not end a hold that waits for a receive
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    assert s.holds == {} and s.kv.num_free_blocks == 32
    assert conn.finished == Counter({"r": 1})


def test_a_held_request_id_cannot_be_reused_until_its_hold_ends() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    s = make(conn)
    s.add_request(make_request("r", range(6), max_tokens=1))
    step(s)
    with pytest.raises(ValueError, match="still in use"):
        s.add_request(make_request("r", range(6), max_tokens=1))
    step(s, KVConnectorOutput(finished_sending={"r"}))  # type: ignore[arg-type]
    s.add_request(make_request("r", range(6), max_tokens=1))


@pytest.mark.parametrize("answer", [(5, False), (100, False), (9, True)])
def test_answers_that_break_the_contract_are_clamped(answer: tuple[int, bool]) -> None:
    conn = ScriptedConnector()
    conn.answers["r"] = answer
    s = make(conn)
    s.add_request(make_request("r", range(10), max_tokens=1))
    so = s.schedule()
    # 10 tokens: at most 2 whole blocks (8 tokens) may come from outside; never a partial block.
    start = so.scheduled[0].start_position if so.scheduled else s.get_request("r").num_computed_tokens  # type: ignore[union-attr]
    assert start in (0, 4, 8)
    r = s.get_request("r")
    assert r is not None and r.num_external_computed_tokens in (4, 8)


def test_request_finished_exactly_once_on_every_path() -> None:
    conn = ScriptedConnector()
    s = make(conn, num_blocks=6)
    s.add_request(make_request("done", range(5), max_tokens=2))
    s.add_request(make_request("aborted", range(10, 15), max_tokens=20))
    s.add_request(make_request("waiting", range(20, 25), max_tokens=2))
    step(s)
    s.abort_request("aborted")
    s.abort_request("waiting")
    s.abort_request("aborted")
    while s.has_unfinished_requests():
        step(s)
    assert conn.finished == Counter({"done": 1, "aborted": 1, "waiting": 1})


# ---- a plugin that breaks the contract: the node goes on (an outside probe of a plugin's failures) -----


def test_request_finished_that_raises_stops_the_hold_and_the_engine_goes_on() -> None:
    """A probe's plugin raised from request_finished: the request was already marked finished, the
    engine loop died, its cleanup asserted "finished twice", and pdkv up restarted the node into the same
    crash.  Now: the call counted, the blocks held and the worker asked to stop (a transfer it started may
    still read them: ``multi`` with one child holding and another raising), freed once it confirms."""

    class Raising(ScriptedConnector):
        def request_finished(
            self, request: Request, block_ids: Sequence[int]
        ) -> tuple[bool, dict[str, Any] | None]:
            super().request_finished(request, block_ids)
            raise RuntimeError("boom from request_finished")

    conn = Raising()
    s = make(conn)
    s.add_request(make_request("a", range(9), max_tokens=2))
    s.add_request(make_request("b", range(50, 59), max_tokens=4))
    finished, stops = [], []
    while s.has_unfinished_requests():
        so, out = step(s)
        stops += so.kv_connector_metadata.stop_request_ids
        finished += [(u.request_id, u.finish_reason) for u in out.updates if u.finished]
    assert finished == [("a", "length"), ("b", "length")]
    assert conn.finished == Counter({"a": 1, "b": 1})
    assert s.stats().counter("connector_call_failures.request_finished") == 2
    assert s.abort_request("a") is None  # an abort after it: nothing to finish twice
    so, _ = step(s, KVConnectorOutput(finished_sending={"b"}))  # type: ignore[arg-type]
    stops += so.kv_connector_metadata.stop_request_ids
    assert sorted(stops) == ["a", "b"] and set(s.holds) == {"a"}  # the worker confirmed b's stop
    step(s, KVConnectorOutput(finished_sending={"a"}))  # type: ignore[arg-type]
    assert not s.holds
    s.check_integrity()
    assert s.kv.num_free_blocks == 32


def test_build_connector_meta_that_raises_fails_the_step_s_requests_by_name() -> None:
    """The step's loads and saves are in no metadata then: its requests fail, naming the connector, no
    worker call runs (``kv_connector_failed``: the runner hands the worker nothing), the step's
    preemptions and stops go in the next step's metadata, and the next step serves new requests."""

    class Raising(ScriptedConnector):
        broken = True

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
            if self.broken:
                raise RuntimeError("boom from build_connector_meta")
            return super().build_connector_meta(scheduler_output)

    conn = Raising()
    conn.broken = False
    conn.hold = True
    s = make(conn)
    s.add_request(make_request("held", range(9), max_tokens=1))
    step(s)  # it finishes, held for a send
    assert set(s.holds) == {"held"}
    s.abort_request("held")  # a stop is owed to the worker now
    conn.broken = True
    conn.hold = False
    conn.answers["loads"] = (8, True)  # an async load admitted in the failing step
    for rid, tokens in (("a", range(20, 29)), ("loads", range(40, 50))):
        s.add_request(make_request(rid, tokens, max_tokens=2))
    so = s.schedule()
    assert so.kv_connector_failed and not so.scheduled and sorted(so.errored_request_ids) == ["a", "loads"]
    assert s.get_request("a") is None and s.get_request("loads") is None and not s.loading
    assert s.stats().counter("connector_call_failures.build_connector_meta") == 1
    assert set(s.holds) == {"held"}  # the load never started: no hold waits for it
    conn.broken = False
    s.add_request(make_request("c", range(60, 65), max_tokens=1))
    s.add_request(make_request("a-again", range(20, 29), max_tokens=1))  # a's blocks were never written
    so, _ = step(s, KVConnectorOutput(finished_sending={"held"}))  # type: ignore[arg-type]
    assert so.kv_connector_metadata.stop_request_ids == ["held"]  # carried from the failed step
    assert [(sr.request_id, sr.start_position) for sr in so.scheduled] == [("c", 0), ("a-again", 0)]
    assert not s.has_unfinished_requests() and not s.holds
    s.check_integrity()
    assert s.kv.num_free_blocks == 32


def test_update_state_after_alloc_that_raises_fails_that_request_and_the_engine_goes_on() -> None:
    """An outside probe's plugin raised from update_state_after_alloc: the engine loop died and the node
    stopped.  Now that request fails, naming the connector (what the plugin planned for its blocks is
    unknown); its blocks are freed and the others run."""

    class Raising(ScriptedConnector):
        def update_state_after_alloc(
            self, request: Request, block_ids: Sequence[int], num_external_tokens: int
        ) -> None:
            if request.request_id == "bad":
                raise RuntimeError("boom from update_state_after_alloc")
            super().update_state_after_alloc(request, block_ids, num_external_tokens)

    conn = Raising()
    conn.answers["bad"] = (8, False)
    s = make(conn)
    for rid, tokens in (("a", range(9)), ("bad", range(20, 31)), ("c", range(40, 49))):
        s.add_request(make_request(rid, tokens, max_tokens=2))
    so = s.schedule()
    assert so.errored_request_ids == ["bad"] and sorted(sr.request_id for sr in so.scheduled) == ["a", "c"]
    assert s.get_request("bad") is None and conn.finished["bad"] == 1
    assert s.stats().counter("connector_call_failures.update_state_after_alloc") == 1
    s.update_from_output(so, ModelRunnerOutput({sr.request_id: 7 for sr in so.scheduled if sr.sample}))
    while s.has_unfinished_requests():
        step(s)
    # A review's find: its blocks were cached as they were allocated and never written -- the same
    # prompt again must not hit them.  Nor is its prompt counted as served.
    assert s.stats().counter("prompt_tokens.external_kv_transfer") == 0
    s.add_request(make_request("again", range(20, 31), max_tokens=1))
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position) for sr in so.scheduled] == [("again", 0)]
    s.check_integrity()
    assert s.kv.num_free_blocks == 32


def test_update_connector_output_that_raises_changes_nothing_and_the_engine_goes_on() -> None:
    """The same probe: update_connector_output raising killed the node.  The engine applied the report
    before telling the plugin; a raise is counted and the step's results stand."""

    class Raising(ScriptedConnector):
        def update_connector_output(self, output: KVConnectorOutput) -> None:
            raise RuntimeError("boom from update_connector_output")

    conn = Raising()
    s = make(conn)
    s.add_request(make_request("a", range(9), max_tokens=3))
    finished = []
    while s.has_unfinished_requests():
        _, out = step(s)
        finished += [(u.request_id, u.finish_reason) for u in out.updates if u.finished]
    assert finished == [("a", "length")]
    assert s.stats().counter("connector_call_failures.update_connector_output") == 3
    assert s.kv.num_free_blocks == 32


def test_load_errors_for_blocks_nobody_was_loading_are_ignored() -> None:
    """A probe's plugin reported blocks it never loaded as failed loads, every step: each running request
    holding one was cut back and recomputed, for ever.  Only the blocks of requests admitted with
    external tokens (this step's, or an async load's) count now; the rest are logged and counted."""
    conn = ScriptedConnector()
    s = make(conn)
    s.add_request(make_request("plain", range(9), max_tokens=6))
    so, _ = step(s)
    plain_blocks = so.scheduled[0].block_ids
    conn.answers["loads"] = (8, False)
    s.add_request(make_request("loads", range(20, 30), max_tokens=2))
    so = s.schedule()
    loaded = next(sr for sr in so.scheduled if sr.request_id == "loads").block_ids
    bad = {plain_blocks[0], loaded[1]}  # one foreign block, one the load filled
    out = s.update_from_output(
        so,
        ModelRunnerOutput(
            {sr.request_id: 7 for sr in so.scheduled if sr.sample},  # type: ignore[misc]
            kv_connector_output=KVConnectorOutput(invalid_block_ids=bad),
        ),
    )
    assert s.get_request("loads").num_computed_tokens == 4  # type: ignore[union-attr]  # cut back to block 1
    assert [u.request_id for u in out.updates] == ["plain"]  # its token stands
    assert s.stats().counter("connector_call_failures.get_block_ids_with_load_errors") == 1
    assert s.stats().counter("kv_load_failures") == 1
    steps = 0
    while s.has_unfinished_requests():
        step(s, KVConnectorOutput(invalid_block_ids={plain_blocks[0]}))  # every step, as the probe's
        steps += 1
        assert steps < 20, "a foreign load error kept a request from finishing"
    s.check_integrity()
