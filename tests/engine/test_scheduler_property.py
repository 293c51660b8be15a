"""Random interleavings of add / schedule / update / abort / preempt against a tiny pool.

After every operation the pool's books balance (``check_integrity``), every running request holds blocks
for exactly the tokens it has computed, and once everything finishes every block is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache_manager import cdiv
from engine.request import RequestStatus
from engine.scheduler import SchedulerOutput
from tests.factories import fake_output, make_request, make_scheduler

# Prompts drawn from a small alphabet of shared prefixes so prefix hits and evictions happen often.
PREFIXES = [list(range(0, 12)), list(range(100, 108)), list(range(0, 4)) + list(range(50, 58))]

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, 2),
        st.lists(st.integers(0, 500), max_size=9),
        st.integers(1, 6),
        st.sampled_from(["none", "salt"]),
    ),
    st.tuples(st.just("step"), st.integers(0, 1000)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("preempt")),
)


def check_books(s) -> None:  # type: ignore[no-untyped-def]
    s.check_integrity()
    bs = s.kv.block_size
    for r in s.running:
        held = len(s.kv.req_to_blocks.get(r.request_id, ()))
        assert held >= cdiv(r.num_computed_tokens, bs), f"{r} holds {held} blocks"
    for rid in s.kv.req_to_blocks:
        assert s.requests[rid].status == RequestStatus.RUNNING


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=60),
    num_blocks=st.integers(4, 12),
    budget=st.integers(4, 24),
    policy=st.sampled_from(["fcfs", "priority", "lpm"]),
)
def test_random_interleavings_keep_the_books(ops, num_blocks, budget, policy) -> None:  # type: ignore[no-untyped-def]
    s = make_scheduler(
        num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4, policy=policy, max_passed_over=3
    )
    pending: SchedulerOutput | None = None
    n_added = 0
    for o in ops:
        kind = o[0]
        if kind == "add":
            _, prefix, tail, max_tokens, salt = o
            n_added += 1
            s.add_request(
                make_request(
                    f"r{n_added}",
                    PREFIXES[prefix] + tail,
                    max_tokens=max_tokens,
                    cache_salt="t" if salt == "salt" else None,
                    priority=n_added % 3,
                )
            )
        elif kind == "step":
            # schedule and update alternate, as in the engine loop; a step may be split by other ops.
            if pending is None:
                pending = s.schedule()
            else:
                s.update_from_output(pending, fake_output(pending, o[1]))
                pending = None
        elif kind == "abort":
            if pending is None:
                s.abort_request(f"r{o[1]}")
        elif kind == "preempt" and pending is None and s.running:
            victim = s.running.pop()
            s._preempt(victim)
        check_books(s)
    if pending is not None:
        s.update_from_output(pending, fake_output(pending))
    steps = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, fake_output(so))
        check_books(s)
        steps += 1
        assert steps < 2000, "no progress"
    s.check_integrity()
    assert s.kv.num_free_blocks == num_blocks
    assert s.kv.req_to_blocks == {}
