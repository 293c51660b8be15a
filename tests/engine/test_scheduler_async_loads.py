"""Scheduler <-> connector corner cases the conformance kit found (async loads, delayed frees), pinned here
with the scripted connector of test_scheduler_connector."""

from __future__ import annotations

from connectors.base import KVConnectorOutput
from engine.request import RequestStatus
from engine.scheduler import ModelRunnerOutput
from tests.engine.test_scheduler_connector import ScriptedConnector, make, step
from tests.factories import make_request


def test_async_load_failing_at_its_first_block_recomputes_without_asking_again() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (8, True)
    s.add_request(make_request("r", range(10), max_tokens=1))
    step(s)
    ids = s.kv.get_block_ids("r")  # type: ignore[arg-type]
    step(s, KVConnectorOutput(invalid_block_ids={ids[0]}))
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    so, _ = step(s)
    # Recomputed from token 0 in the blocks it holds; the connector, which offered the bad block, is not
    # asked again (it would offer the same block, and the request would load it forever).
    assert [(sr.request_id, sr.start_position, sr.num_tokens) for sr in so.scheduled] == [("r", 0, 10)]
    assert conn.lookups["r"] == 1
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 32
    assert s.stats().counter("kv_load_failures") == 1


def test_a_second_async_load_after_preemption_counts_its_own_tokens() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (8, True)
    s.add_request(make_request("r", range(10), max_tokens=4))
    step(s)
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    step(s)  # computes tokens 8..9, samples one
    r = s.get_request("r")
    assert r is not None and r.status == RequestStatus.RUNNING
    s.running.remove(r)
    s._preempt(r)
    assert s.kv.reset_prefix_cache()  # its blocks are gone: no local hit on the way back
    conn.answers["r"] = (4, True)  # the second load brings one block, not two
    step(s)
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position, sr.num_tokens) for sr in so.scheduled] == [("r", 4, 7)]


def test_blocks_held_for_a_connector_make_a_waiting_request_wait_not_fail() -> None:
    conn = ScriptedConnector()
    conn.hold = True
    s = make(conn, num_blocks=4)
    s.add_request(make_request("first", range(10), max_tokens=1))
    step(s)
    assert "first" in s.holds and s.kv.num_free_blocks == 1
    s.add_request(make_request("second", range(20, 30), max_tokens=1))
    so, _ = step(s)
    assert so.errored_request_ids == [] and so.scheduled == []  # waits for the held blocks
    step(s, KVConnectorOutput(finished_sending={"first"}))  # type: ignore[arg-type]
    so, _ = step(s)
    assert [sr.request_id for sr in so.scheduled] == ["second"]


def test_requests_parked_after_their_loads_never_starve_each_other_into_an_error() -> None:
    """Two loaded requests wait holding 2 blocks each; each needs 3 more and 2 are free.  One lets go
    (like a preemption) instead of the other being failed as "larger than the cache"."""
    conn = ScriptedConnector()
    s = make(conn, num_blocks=6)
    for rid in ("r1", "r2"):
        conn.answers[rid] = (8, True)
        s.add_request(make_request(rid, range(20) if rid == "r1" else range(30, 50), max_tokens=1))
    errored: list[str] = []
    for _ in range(30):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s, KVConnectorOutput(finished_recving=set(s.loading)))
        errored += so.errored_request_ids
    assert errored == [] and not s.has_unfinished_requests()
    assert s.stats().counter("num_preemptions") >= 1 and s.kv.num_free_blocks == 6
    assert conn.finished == {"r1": 1, "r2": 1}


def test_a_failed_sync_load_is_not_kept_by_an_async_loader_that_took_it_as_a_local_hit() -> None:
    """A synchronous loader (under multi, say) brings blocks 0..1 of "a"; "b", admitted in the same step,
    takes them as local hits and waits on its own asynchronous load of block 2.  The synchronous load of
    block 0 fails and "a" is aborted before it recomputes it: "b" must recompute block 0 too, not keep
    the failed block as computed when its own load lands."""
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["a"] = (8, False)  # tokens 0..7 loaded synchronously, in this step's forward
    conn.answers["b"] = (4, True)  # tokens 8..11 loaded asynchronously
    prompt = list(range(100, 108))
    s.add_request(make_request("a", [*prompt, 1, 2, 3, 4, 5], max_tokens=4))
    s.add_request(make_request("b", [*prompt, 50, 51, 52, 53, 54, 55], max_tokens=1))
    so = s.schedule()
    assert [sr.request_id for sr in so.scheduled] == ["a"]
    a_ids = s.kv.get_block_ids("a")  # type: ignore[arg-type]
    b = s.get_request("b")
    assert b is not None and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.kv.get_block_ids("b")[:2] == a_ids[:2]  # type: ignore[arg-type]  # b shares a's blocks 0..1
    s.update_from_output(
        so,
        ModelRunnerOutput({"a": 7}, kv_connector_output=KVConnectorOutput(invalid_block_ids={a_ids[0]})),  # type: ignore[dict-item]
    )
    s.abort_request("a")  # gone before it recomputes block 0: nothing heals that block now
    so, _ = step(s, KVConnectorOutput(finished_recving={"b"}))  # type: ignore[arg-type]
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position) for sr in so.scheduled] == [("b", 0)]
    assert s.stats().counter("kv_load_failures") >= 2


def test_a_failed_block_shared_by_two_async_loaders_is_recomputed_by_both() -> None:
    """As above with two waiting requests on the failed block: the first to land (then aborted before it
    recomputes) must not clear the block's failure for the second."""
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["a"] = (8, False)
    conn.answers["b"] = (4, True)
    conn.answers["c"] = (4, True)
    prompt = list(range(100, 108))
    s.add_request(make_request("a", [*prompt, 1, 2, 3, 4, 5], max_tokens=4))
    s.add_request(make_request("b", [*prompt, 50, 51, 52, 53, 54, 55], max_tokens=1))
    s.add_request(make_request("c", [*prompt, 60, 61, 62, 63, 64, 65], max_tokens=1))
    so = s.schedule()
    a_ids = s.kv.get_block_ids("a")  # type: ignore[arg-type]
    for rid in ("b", "c"):
        assert s.kv.get_block_ids(rid)[:2] == a_ids[:2]  # type: ignore[arg-type]
    s.update_from_output(
        so,
        ModelRunnerOutput({"a": 7}, kv_connector_output=KVConnectorOutput(invalid_block_ids={a_ids[0]})),  # type: ignore[dict-item]
    )
    s.abort_request("a")
    step(s, KVConnectorOutput(finished_recving={"b"}))  # type: ignore[arg-type]
    s.abort_request("b")  # gone before it recomputes block 0
    step(s, KVConnectorOutput(finished_recving={"c"}))  # type: ignore[arg-type]
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position) for sr in so.scheduled] == [("c", 0)]


def test_queued_prefill_work_leaves_out_what_a_request_is_loading() -> None:
    conn = ScriptedConnector()
    s = make(conn)
    conn.answers["r"] = (8, True)
    s.add_request(make_request("r", range(10), max_tokens=1))
    assert s.stats().gauges["prefill_tokens_queued"] == 10  # the connector is not asked before scheduling
    step(s)  # loading tokens 0..7
    assert s.stats().gauges["prefill_tokens_queued"] == 2
    step(s, KVConnectorOutput(finished_recving={"r"}))  # type: ignore[arg-type]
    so, _ = step(s)
    assert [(sr.request_id, sr.start_position, sr.num_tokens) for sr in so.scheduled] == [("r", 8, 2)]
