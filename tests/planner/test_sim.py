"""The cluster simulator: exact times on cases small enough to compute by hand, the router's own policy
code doing the routing, determinism, and bad profiles named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.profile import EngineShape, LinearCost, Profile, ProfileError, StepCost
from planner.sim import ClusterSpec, simulate
from planner.trace import Arrival, PrefixKeys

# Every step 10 ms, plus 1 ms a prompt token; decode rows and attention free: times add up by hand.
STEP = StepCost(0.010, 0.010, 0.001, 0.0, 0.0, 0.0)
PROFILE = Profile(
    machine={"cpu": "test"},
    model={"name": "test"},
    engine=EngineShape(16, 2048, 64, 1024, 1000, 4096),
    step=STEP,
    loads={"cpu": LinearCost(0.002, 1e-5)},
    p2p=LinearCost(0.005, 0.0),
)
BS = 16


def requests(*specs: tuple[float, int, int, list[int]]) -> list[Arrival]:
    """(arrival, input, output, block ids) each, the ids chained as the trace's are."""
    keys = PrefixKeys()
    out = []
    for t, n, m, ids in specs:
        chain = keys.chain(ids[: n // BS])
        chain += tuple(keys.unique() for _ in range(n // BS - len(chain)))
        out.append(Arrival(t, n, m, chain))
    return out


def ttfts(result) -> list[float]:  # type: ignore[no-untyped-def]
    return [round(r.first_token_s - r.sent_s, 9) for r in result.records]


def test_one_node_continuous_batching_gives_the_times_computed_by_hand() -> None:
    # A: 100 tokens at 0 -> its prefill step is 10 + 100 ms: first token at 0.11.  B arrives at 0.05
    # and waits; the next step decodes A and computes B's 50 tokens: 10 + 50 ms, B's first token at 0.17
    # (TTFT 0.12), A's second then too.  One more 10 ms step: A's third and B's second token, both done.
    arrivals = requests((0.0, 100, 3, list(range(7))), (0.05, 50, 2, [100, 101, 102]))
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS), arrivals)
    assert ttfts(result) == [0.11, 0.12]
    assert [round(r.finish_s, 9) for r in result.records] == [0.18, 0.18]
    assert sorted(round(gap, 9) for gap, n in result.itl for _ in range(n)) == [0.01, 0.01, 0.06]
    assert result.figures()["hit_local"] == 0.0


def test_a_decode_stretch_is_cut_when_a_request_arrives_mid_way() -> None:
    # A decodes 10 ms steps from 0.11 on (20 tokens to go).  B arrives at 0.155: the step in flight ends
    # at 0.16, and the next one computes B's 16 tokens with A's decode row: 10 + 16 ms.
    arrivals = requests((0.0, 100, 21, list(range(7))), (0.155, 16, 1, [50]))
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS), arrivals)
    a, b = result.records
    assert round(b.first_token_s, 9) == 0.186 and round(b.finish_s, 9) == 0.186
    # A: 0.11, then 5 steps to 0.16, one of 26 ms, then 14 more of 10 ms.
    assert round(a.finish_s, 9) == round(0.11 + 0.05 + 0.026 + 0.14, 9)


def test_a_repeated_prompt_hits_the_local_cache_whole_blocks_never_the_last_token() -> None:
    arrivals = requests((0.0, 100, 1, list(range(7))), (1.0, 100, 1, list(range(7))))
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS), arrivals)
    # The second one holds 6 full blocks (96 tokens) and computes 4: 10 + 4 ms.
    assert ttfts(result) == [0.11, 0.014]
    assert result.records[1].local_tokens == 96


def test_the_store_serves_another_node_at_the_profiles_load_cost() -> None:
    arrivals = requests((0.0, 100, 1, list(range(7))), (1.0, 100, 1, list(range(7))))
    spec = ClusterSpec(colocated=2, block_tokens=BS, store=(("cpu", 1 << 30),))
    result = simulate(PROFILE, spec, arrivals)  # round-robin: the second request on the other node
    # 96 tokens loaded (2 ms + 96 x 10 us) and 4 computed (10 + 4 ms), in one step.
    assert ttfts(result) == [0.11, round(0.002 + 96e-5 + 0.014, 9)]
    assert result.records[1].store_tokens == 96 and result.records[1].local_tokens == 0


def test_prefill_hands_off_to_decode_after_the_pull() -> None:
    arrivals = requests((0.0, 100, 3, list(range(7))))
    result = simulate(PROFILE, ClusterSpec(prefill=1, decode=1, block_tokens=BS), arrivals)
    (r,) = result.records
    # First token at 0.11 from the prefill node; the pull takes 5 ms; two 10 ms decode steps.
    assert round(r.first_token_s, 9) == 0.11 and round(r.finish_s, 9) == 0.135
    assert r.remote_tokens == 100


def test_the_routing_is_the_routers_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.policy

    arrivals = requests(*[(0.001 * i, 64, 1, [i, i + 1000]) for i in range(8)])
    spec = ClusterSpec(colocated=4, block_tokens=BS)
    spread = simulate(PROFILE, spec, arrivals)
    # A planted change in the router's round-robin: every request to the first node.
    monkeypatch.setattr(router.policy.RoundRobin, "choose", lambda self, nodes, info: nodes[0])
    piled = simulate(PROFILE, spec, arrivals)
    assert max(ttfts(piled)) > 2 * max(ttfts(spread))


def test_kv_aware_routes_a_repeat_to_the_node_holding_its_prefix() -> None:
    prefix = list(range(40))
    arrivals = requests(
        (0.0, 640, 1, prefix),
        *[(1.0 + 0.3 * i, 100, 1, [1000 + i]) for i in range(4)],  # round-robin comes round again
        (3.0, 660, 1, [*prefix, 99]),
    )
    rr = simulate(PROFILE, ClusterSpec(colocated=4, block_tokens=BS), arrivals)
    kv = simulate(PROFILE, ClusterSpec(policy="kv-aware", colocated=4, block_tokens=BS), arrivals)
    assert rr.records[-1].local_tokens == 0
    assert kv.records[-1].local_tokens == 640


def test_the_same_input_gives_the_same_result() -> None:
    arrivals = requests(*[(0.02 * i, 64 + 16 * (i % 5), 1 + i % 7, [i % 3, i]) for i in range(60)])
    spec = ClusterSpec(policy="kv-aware", prefill=2, decode=2, block_tokens=BS, store=(("cpu", 1 << 20),))
    a, b = simulate(PROFILE, spec, arrivals), simulate(PROFILE, spec, arrivals)
    assert a.records == b.records and a.itl == b.itl and a.figures() == b.figures()


def test_a_request_larger_than_a_nodes_cache_is_refused_not_waited_for() -> None:
    arrivals = requests((0.0, 100, 1, [1]), (0.0, 2000, 10, [2]))
    spec = ClusterSpec(colocated=1, block_tokens=BS, node_kv_tokens=1024)
    result = simulate(PROFILE, spec, arrivals)
    assert result.refused == 1 and len(result.done) == 1 and not result.meets(10.0, 10.0)


def test_a_bad_profile_is_named_by_its_field(tmp_path: Path) -> None:
    good = PROFILE.to_json()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good))
    assert Profile.load(path) == PROFILE
    bad = json.loads(json.dumps(good))
    bad["step"]["decode_row_s"] = -1
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"p.json: field 'step.decode_row_s' must be a finite number"):
        Profile.load(path)
    del bad["p2p"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"field 'p2p' is missing"):
        Profile.load(path)
    bad = json.loads(json.dumps(good))
    bad["loads"]["cpu"].pop("token_s")
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"field 'loads.cpu.token_s' is missing"):
        Profile.load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="no load cost for tier 'disk'"):
        PROFILE.load_seconds("disk", 10)


def test_a_decode_node_full_of_landed_pulls_frees_one_and_finishes_every_request() -> None:
    # One 4-block decode node: two pulls of 2 blocks each fill it, and each needs a third block to
    # decode.  The engine's _release_parked frees the newest (it computes its prompt later); without it
    # both would wait forever.
    arrivals = requests((0.0, 32, 10, [500, 600]), (0.0, 32, 10, [501, 601]))
    for policy in ("round-robin", "kv-aware"):
        spec = ClusterSpec(
            policy=policy, prefill=2, decode=1, block_tokens=BS, node_kv_tokens=64, give_up_s=1.0
        )
        result = simulate(PROFILE, spec, arrivals)
        assert len(result.done) == 2 and not result.stuck and not result.overloaded


def test_freed_blocks_are_evicted_tail_first_so_a_prefix_survives() -> None:
    # An 8-block cache: A's 4 blocks cached, B's 5 evict one of them -- A's last, as the engine frees
    # a chain end first -- and A's repeat still hits its first 3 blocks.
    arrivals = requests(
        (0.0, 64, 1, [1, 2, 3, 4]), (1.0, 80, 1, [7, 8, 9, 10, 11]), (2.0, 64, 1, [1, 2, 3, 4])
    )
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS, node_kv_tokens=128), arrivals)
    assert result.records[2].local_tokens == 48


def test_a_block_another_request_cached_first_does_not_stop_the_rest_being_cached() -> None:
    shared = list(range(190))
    arrivals = requests(
        (0.0, 4000, 1, list(range(250))),
        (0.001, 3200, 1, [*shared, *range(1000, 1010)]),  # computed beside A: its first 190 collide
        (100.0, 3200, 1, [*shared, *range(1000, 1010)]),
    )
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS, node_kv_tokens=16384), arrivals)
    assert result.records[2].local_tokens == (3200 - 1) // BS * BS
