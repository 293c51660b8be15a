"""Scheduler: continuous batching, chunked prefill, preemption, admission, queue policies, abort."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.scheduler import ModelRunnerOutput
from tests.factories import fake_output, make_request, make_scheduler, run_to_completion


def chunks(so):  # type: ignore[no-untyped-def]
    return [(sr.request_id, sr.start_position, sr.num_tokens, sr.sample) for sr in so.scheduled]


def test_prefill_then_decode_with_exact_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", range(6), max_tokens=3))
    so = s.schedule()
    assert chunks(so) == [("a", 0, 6, True)]
    assert so.scheduled[0].block_ids == [0, 1]
    s.update_from_output(so, fake_output(so, 40))
    so = s.schedule()
    assert chunks(so) == [("a", 6, 1, True)]
    assert so.scheduled[0].token_ids == [40]
    s.update_from_output(so, fake_output(so, 41))
    so = s.schedule()
    assert so.scheduled[0].block_ids == [0, 1]  # 8 tokens fit in two blocks
    out = s.update_from_output(so, fake_output(so, 42))
    assert out.updates[0].finished and out.updates[0].finish_reason == "length"
    assert not s.has_unfinished_requests()
    s.check_integrity()
    assert s.kv.num_free_blocks == 16


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=32)
    s.add_request(make_request("long", range(20), max_tokens=1))
    assert chunks(s.schedule()) == [("long", 0, 8, False)]
    assert chunks(s.schedule()) == [("long", 8, 8, False)]
    so = s.schedule()
    assert chunks(so) == [("long", 16, 4, True)]
    s.update_from_output(so, fake_output(so))
    assert not s.has_unfinished_requests()


def test_unsampled_chunks_append_no_token() -> None:
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=32)
    s.add_request(make_request("long", range(20), max_tokens=1))
    so = s.schedule()
    out = s.update_from_output(so, ModelRunnerOutput())
    assert out.updates == []


def test_prefix_hit_skips_to_the_first_uncached_token() -> None:
    s = make_scheduler(num_blocks=32)
    s.add_request(make_request("a", range(13), max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("b", [*range(12), 99, 98], max_tokens=1))
    so = s.schedule()
    assert chunks(so) == [("b", 12, 2, True)]
    assert s.get_request("b").num_cached_tokens == 12  # type: ignore[union-attr]
    assert so.scheduled[0].block_ids[:3] == [0, 1, 2]


def test_running_requests_are_served_before_waiting_ones() -> None:
    s = make_scheduler(max_num_batched_tokens=10, num_blocks=32)
    s.add_request(make_request("a", range(8), max_tokens=5))
    so = s.schedule()
    s.update_from_output(so, fake_output(so))
    s.add_request(make_request("b", range(100, 120), max_tokens=5))
    so = s.schedule()
    assert chunks(so) == [("a", 8, 1, True), ("b", 0, 9, False)]


def test_max_num_seqs_caps_running_requests() -> None:
    s = make_scheduler(max_num_seqs=2, num_blocks=32)
    for i in range(3):
        s.add_request(make_request(f"r{i}", range(i * 10, i * 10 + 4), max_tokens=2))
    so = s.schedule()
    assert [sr.request_id for sr in so.scheduled] == ["r0", "r1"]
    s.update_from_output(so, fake_output(so))
    so = s.schedule()
    assert [sr.request_id for sr in so.scheduled] == ["r0", "r1"]
    s.update_from_output(so, fake_output(so))
    assert [sr.request_id for sr in s.schedule().scheduled] == ["r2"]


def test_preemption_takes_the_most_recently_admitted_and_resumes_with_prefix_hits() -> None:
    # 6 blocks of 4 tokens.  a and b each take 3 blocks for an 8-token prompt + decode room.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    s.add_request(make_request("a", range(8), max_tokens=8))
    s.add_request(make_request("b", range(100, 108), max_tokens=8))
    so = s.schedule()
    assert [sr.block_ids for sr in so.scheduled] == [[0, 1], [2, 3]]
    s.update_from_output(so, fake_output(so))  # both now hold 9 tokens: need a third block each
    so = s.schedule()
    assert [sr.block_ids for sr in so.scheduled] == [[0, 1, 4], [2, 3, 5]]
    for _ in range(3):
        s.update_from_output(so, fake_output(so))
        so = s.schedule()
    # 12 tokens each now; the 13th needs a fourth block each, the pool is dry: b (admitted last) goes.
    s.update_from_output(so, fake_output(so))
    so = s.schedule()
    assert so.preempted_request_ids == ["b"]
    assert chunks(so) == [("a", 12, 1, True)]
    b = s.get_request("b")
    assert b is not None and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    s.check_integrity()
    # b keeps its sampled tokens; when a finishes, b is resumed and finds its prompt blocks cached.
    steps = 0
    while s.get_request("a") is not None:
        s.update_from_output(so, fake_output(so))
        so = s.schedule()
        steps += 1
    assert so.new_request_ids == ["b"]
    # b's prompt blocks survived in the cache.  Its third block held 12 tokens but only 11 had KV when it
    # was preempted, so it was never cached: b recomputes from token 8.
    assert so.scheduled[0].start_position == 8
    assert so.scheduled[0].block_ids[:2] == [2, 3]
    assert b.num_preemptions == 1 and b.num_output_tokens == 5
    s.update_from_output(so, fake_output(so))
    run_to_completion(s)
    assert s.stats().counter("num_preemptions") == 1
    assert s.kv.num_free_blocks == 6


def test_a_scoring_request_preempted_after_its_first_token_takes_its_prefix_hits() -> None:
    """Its prompt's scores went out with its first token: resumed, it has nothing left to score, so its
    cached prompt blocks are hits like any request's (before, it recomputed the whole prompt)."""
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    s.add_request(make_request("a", range(8), max_tokens=8))
    s.add_request(make_request("b", range(100, 108), max_tokens=8, prompt_logprobs=1))
    so = s.schedule()
    assert so.scheduled[1].prompt_targets == list(range(101, 108))
    while not so.preempted_request_ids:
        s.update_from_output(so, fake_output(so))
        so = s.schedule()
    assert so.preempted_request_ids == ["b"]
    while s.get_request("a") is not None:
        s.update_from_output(so, fake_output(so))
        so = s.schedule()
    assert so.new_request_ids == ["b"]
    assert so.scheduled[0].start_position == 8 and so.scheduled[0].prompt_targets is None
    s.update_from_output(so, fake_output(so))
    run_to_completion(s)


def test_a_request_larger_than_the_whole_cache_fails_with_an_error() -> None:
    s = make_scheduler(num_blocks=2)
    s.add_request(make_request("huge", range(20)))
    s.add_request(make_request("small", range(3), max_tokens=2))
    so = s.schedule()
    assert so.errored_request_ids == ["huge"]
    assert s.get_request("huge") is None
    run_to_completion(s)  # the other request still completes
    s.check_integrity()


@pytest.mark.parametrize("state", ["waiting", "running_prefill", "running_decode", "preempted"])
def test_abort_in_every_state_frees_everything(state: str) -> None:
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=8)
    s.add_request(make_request("a", range(8), max_tokens=20))
    s.add_request(make_request("victim", range(100, 120), max_tokens=20))
    if state == "running_prefill":
        so = s.schedule()  # a takes the whole budget; victim waits
        s.update_from_output(so, fake_output(so))
        so = s.schedule()
        assert ("victim", 0, 7, False) in chunks(so)
        s.update_from_output(so, fake_output(so))  # victim is now mid-prefill: 7 of 20 tokens computed
    elif state == "running_decode":
        s = make_scheduler(num_blocks=16)
        s.add_request(make_request("victim", range(5), max_tokens=20))
        so = s.schedule()
        s.update_from_output(so, fake_output(so))
    elif state == "preempted":
        s = make_scheduler(num_blocks=4)
        s.add_request(make_request("a", range(7), max_tokens=20))
        s.add_request(make_request("victim", range(100, 107), max_tokens=20))
        for _ in range(3):
            so = s.schedule()
            s.update_from_output(so, fake_output(so))
        assert s.get_request("victim").status == RequestStatus.PREEMPTED  # type: ignore[union-attr]
    update = s.abort_request("victim")
    assert update is not None and update.finished and update.finish_reason == "abort"
    assert s.get_request("victim") is None
    assert s.abort_request("victim") is None  # unknown now: a second abort is a no-op
    s.check_integrity()
    assert "victim" not in s.kv.req_to_blocks
    so = s.schedule()
    assert "victim" in so.finished_request_ids
    assert "victim" not in [sr.request_id for sr in so.scheduled]
    s.update_from_output(so, fake_output(so))
    run_to_completion(s)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    s = make_scheduler()
    s.add_request(make_request("stop", range(4), max_tokens=10, stop_token_ids=(7,)))
    r = make_request("eos", range(10, 14), max_tokens=10)
    r.eos_token_id = 7
    s.add_request(r)
    r2 = make_request("ignore", range(20, 24), max_tokens=3, ignore_eos=True)
    r2.eos_token_id = 7
    s.add_request(r2)
    so = s.schedule()
    out = s.update_from_output(so, fake_output(so, 7))
    by_id = {u.request_id: u for u in out.updates}
    assert by_id["stop"].finished and by_id["stop"].stop_reason == 7
    assert by_id["eos"].finished and by_id["eos"].finish_reason == "stop"
    assert not by_id["ignore"].finished
    run_to_completion(s)


def test_max_model_len_caps_generation() -> None:
    from engine.scheduler import Scheduler
    from engine.scheduler.config import CacheConfig, SchedulerConfig

    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=8), max_model_len=6)
    s.add_request(make_request("a", range(4), max_tokens=100))
    run_to_completion(s)


def test_duplicate_request_id_is_refused() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", range(4)))
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        s.add_request(make_request("a", range(4)))


def test_priority_policy_orders_by_priority_then_arrival() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("late-low", range(4), priority=5, arrival_time=1.0))
    s.add_request(make_request("high", range(10, 14), priority=0, arrival_time=2.0))
    s.add_request(make_request("early-low", range(20, 24), priority=5, arrival_time=0.5))
    order = []
    while s.has_unfinished_requests():
        so = s.schedule()
        order += [sr.request_id for sr in so.scheduled if sr.request_id not in order]
        s.update_from_output(so, fake_output(so))
    assert order == ["high", "early-low", "late-low"]


def _warm(s, prefix: list[int]) -> None:  # type: ignore[no-untyped-def]
    s.add_request(make_request("warm", [*prefix, 1000], max_tokens=1))
    run_to_completion(s)


def test_queued_prefill_work_leaves_out_what_the_prefix_cache_holds() -> None:
    s = make_scheduler(max_num_seqs=1, num_blocks=32)
    shared = list(range(16))
    _warm(s, shared)
    s.add_request(make_request("hot", [*shared, 7, 8], max_tokens=1))  # 16 of 18 cached
    s.add_request(make_request("cold", range(500, 510), max_tokens=1))
    assert s.stats().gauges["prefill_tokens_queued"] == 2 + 10
    so = s.schedule()  # one at a time: "hot" runs its last 2, "cold" still waits
    assert chunks(so) == [("hot", 16, 2, True)]
    assert s.stats().gauges["prefill_tokens_queued"] == 10


def test_lpm_serves_the_longest_cached_prefix_first() -> None:
    s = make_scheduler(policy="lpm", max_num_seqs=1, num_blocks=32)
    shared = list(range(16))
    _warm(s, shared)
    s.add_request(make_request("cold", range(500, 517), max_tokens=1))
    s.add_request(make_request("hot", [*shared, 7], max_tokens=1))
    so = s.schedule()
    assert [sr.request_id for sr in so.scheduled] == ["hot"]
    assert so.scheduled[0].start_position == 16


def test_fcfs_keeps_arrival_order_despite_hits() -> None:
    s = make_scheduler(policy="fcfs", max_num_seqs=1, num_blocks=32)
    shared = list(range(16))
    _warm(s, shared)
    s.add_request(make_request("cold", range(500, 517), max_tokens=1))
    s.add_request(make_request("hot", [*shared, 7], max_tokens=1))
    assert [sr.request_id for sr in s.schedule().scheduled] == ["cold"]


def test_lpm_starvation_bound() -> None:
    s = make_scheduler(policy="lpm", max_num_seqs=1, num_blocks=64, max_passed_over=2)
    shared = list(range(16))
    _warm(s, shared)
    s.add_request(make_request("cold", range(500, 517), max_tokens=1))
    served = []
    for i in range(4):
        s.add_request(make_request(f"hot{i}", [*shared, 100 + i], max_tokens=1))
    while s.has_unfinished_requests():
        so = s.schedule()
        served += [sr.request_id for sr in so.scheduled if sr.request_id not in served]
        s.update_from_output(so, fake_output(so))
    # cold is passed over twice, then served before the remaining hot requests.
    assert served == ["hot0", "hot1", "cold", "hot2", "hot3"]
