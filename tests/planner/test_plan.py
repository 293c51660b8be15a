"""pdkv plan and pdkv profile: the search, the fit, the command lines and their errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from planner.measure import StepSample, fit_linear, fit_steps
from planner.plan import Targets, max_rate, smallest
from planner.profile import Profile, StepCost
from planner.sim import ClusterSpec, simulate
from tests.planner.test_sim import BS, PROFILE, requests


def steady(n: int, gap: float, tokens: int = 200) -> list:  # type: ignore[type-arg]
    """``n`` unrelated requests of ``tokens`` tokens, one every ``gap`` seconds, 4 tokens out each."""
    return requests(*[(gap * i, tokens, 4, [10_000 + i]) for i in range(n)])


def test_the_smallest_cluster_is_the_first_that_meets_the_targets() -> None:
    # A 200-token prompt takes 0.21 s alone; one every 0.1 s needs at least 3 nodes to keep up.
    # Two nodes fall 10 ms further behind with every request (TTFT p90 near 0.48 s); three keep up.
    work = steady(60, 0.1)
    targets = Targets(ttft_p90_s=0.35, itl_p90_s=1.0)
    base = ClusterSpec(colocated=1, block_tokens=BS, give_up_s=5.0)
    found, smaller = smallest(PROFILE, work, targets, base, "colocated", max_nodes=16)
    assert found is not None and smaller is not None
    assert found.meets and not smaller.meets
    assert found.spec.colocated == smaller.spec.colocated + 1
    for n in range(1, found.spec.colocated):  # none smaller meets them
        spec = ClusterSpec(colocated=n, block_tokens=BS, give_up_s=5.0)
        assert not simulate(PROFILE, spec, work).meets(0.35, 1.0)


def test_no_cluster_meets_a_target_below_the_idle_prefill_time() -> None:
    work = steady(10, 1.0)
    base = ClusterSpec(colocated=1, block_tokens=BS)
    found, largest = smallest(PROFILE, work, Targets(0.05, 1.0), base, "colocated", max_nodes=8)
    assert found is None and largest is not None and largest.spec.colocated == 8


def test_an_overloaded_cluster_is_given_up_on_and_misses() -> None:
    work = steady(400, 0.01)  # 100 requests a second of 0.21 s each, on one node
    result = simulate(PROFILE, ClusterSpec(colocated=1, block_tokens=BS, give_up_s=2.0), work)
    assert result.overloaded and not result.meets(100.0, 100.0)
    assert len(result.done) < 400


def test_the_max_rate_is_where_the_targets_stop_holding() -> None:
    work = steady(40, 0.5)
    spec = ClusterSpec(colocated=1, block_tokens=BS, give_up_s=5.0)
    targets = Targets(0.5, 1.0)
    rate, outcome = max_rate(PROFILE, spec, work, targets, low=0.25, high=16.0, steps=8)
    assert outcome is not None and outcome.meets
    assert 1.0 < rate < 16.0
    from planner.plan import at_rate

    assert not simulate(PROFILE, spec, at_rate(work, rate * 1.2)).meets(0.5, 1.0)


def test_the_oracle_hits_every_reusable_block_wherever_it_runs() -> None:
    prefix = list(range(8))
    work = requests(*[(0.5 * i, 160, 1, [*prefix, 100 + i]) for i in range(8)])
    spec = ClusterSpec(colocated=4, block_tokens=BS)
    plain = simulate(PROFILE, spec, work)
    oracle = simulate(PROFILE, ClusterSpec(colocated=4, block_tokens=BS, oracle=True), work)
    # Round-robin over 4 nodes: the first visit to each node misses; the oracle never does after one.
    assert sum(r.local_tokens for r in plain.records) == 4 * 128
    assert sum(r.local_tokens for r in oracle.records) == 7 * 128
    assert oracle.busy_s < plain.busy_s


def test_the_step_fit_recovers_the_coefficients_it_was_made_with() -> None:
    truth = StepCost(0.004, 0.009, 0.002, 7e-7, 0.0022, 2e-6)
    rng = random.Random(1)
    samples = []
    for _ in range(60):
        chunks = tuple((rng.randint(2, 2048), rng.choice((0, 512, 2048))) for _ in range(rng.randint(0, 2)))
        rows = rng.randint(0 if chunks else 1, 32)
        context = rows * rng.randint(16, 2048)
        samples.append(StepSample(chunks, rows, context, truth.seconds(list(chunks), rows, context)))
    fitted = fit_steps(samples)
    for name in ("decode_base_s", "prefill_base_s", "prefill_token_s", "decode_row_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fitted.error_p90 < 1e-6 and fitted.samples == 60
    line = fit_linear([(64, 0.001 + 64e-6), (512, 0.001 + 512e-6), (2048, 0.001 + 2048e-6)])
    assert line.base_s == pytest.approx(0.001) and line.per == pytest.approx(1e-6) and line.samples == 3


def test_pdkv_plan_prints_the_smallest_cluster_beside_the_next_smaller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdkv.cli import main

    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 200, "output_length": 4, "hash_ids": [i]} for i in range(60)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_json = tmp_path / "plan.json"
    code = main(
        ["plan", "--trace", str(trace), "--profile", str(profile), "--slo-ttft-p90", "0.35",
         "--slo-itl-p90", "1", "--policy", "round-robin", "--shape", "colocated", "--json", str(out_json)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "colocated: 3 colocated, round-robin, no store meets the targets" in out
    assert "2 colocated, round-robin" in out and "goodput" in out and "TTFT p50 / p90 / p99" in out
    report = json.loads(out_json.read_text())
    assert report["shapes"]["colocated"]["chosen"]["cluster"].startswith("3 colocated")
    # Where its figures come from (an outside probe: neither output named the profile or its machine).
    assert f"  measured: {profile}: " in out and f"on {PROFILE.machine['cpu']}" in out
    assert report["profile"] == {"file": str(profile), "machine": PROFILE.machine, "model": PROFILE.model}


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (lambda p, t: t.write_text('{"timestamp": 0}\n'), "trace.jsonl:1: field 'input_length'"),
        (lambda p, t: p.write_text("{}"), "profile.json: field 'version' is None"),
        (lambda p, t: None, "--store: tier 'redis' has no load cost in the profile"),
    ],
)
def test_pdkv_plan_names_a_bad_trace_line_profile_or_store(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit,
    what: str,  # type: ignore[no-untyped-def]
) -> None:
    from pdkv.cli import main

    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    PROFILE.save(profile)
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}) + "\n"
    )
    edit(profile, trace)
    store = ["--store", "redis://127.0.0.1:1/0"] if "redis" in what else []
    code = main(
        ["plan", "--trace", str(trace), "--profile", str(profile), "--slo-ttft-p90", "1",
         "--slo-itl-p90", "1", *store]
    )  # fmt: skip
    assert code == 2
    assert what in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "what"),
    [
        (["--rate", "0"], "--rate must be a positive number"),  # was a ZeroDivisionError traceback
        (["--rate", "nan"], "--rate must be a positive number"),  # was "no cluster meets" after 256 nodes
        (["--max-input", "0"], "--max-input must be at least 1"),  # 0 was silently the default
        (["--node-kv-tokens", "-100"], "--node-kv-tokens must be at least 1"),
        (["--requests", "-1"], "--requests must be at least 1"),  # was the whole trace
        (["--start", "-5"], "--start must be a line number >= 0"),
        (["--sample", "-1"], "--sample must be a fraction in (0, 1]"),
        (["--shape", "pd", "--max-nodes", "1"], "--max-nodes must be at least 2 for --shape pd"),
        (["--workload", "qa", "--qa-users", "0"], "--qa-users and --qa-rounds must be at least 1"),
        (["--workload", "qa", "--qa-gap-ms", "nan"], "--qa-gap-ms must be a number >= 0"),
        (["--json", "."], "is a folder: give a file"),  # was an IsADirectoryError after the simulation
        (["--json", "/nonexistent/x.json"], "does not exist"),  # was found after the simulation
    ],
)
def test_pdkv_plan_checks_every_number_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], what: str
) -> None:
    from pdkv.cli import main

    profile, trace = tmp_path / "profile.json", tmp_path / "trace.jsonl"
    PROFILE.save(profile)
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}) + "\n"
    )
    source = [] if "qa" in options else ["--trace", str(trace)]
    code = main(
        ["plan", *source, "--profile", str(profile), "--slo-ttft-p90", "1", "--slo-itl-p90", "1", *options]
    )
    assert code == 2
    assert what in capsys.readouterr().err


def test_a_plan_s_json_is_strict_json_even_when_nothing_was_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A node too small for any request: every figure of no request is NaN, which JSON has not (strict
    parsers refused the file); null now."""
    from pdkv.cli import main

    profile, trace, out = tmp_path / "profile.json", tmp_path / "trace.jsonl", tmp_path / "plan.json"
    PROFILE.save(profile)
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 2, "hash_ids": [1, 2, 3, 4]})
        + "\n"
    )
    code = main(
        ["plan", "--trace", str(trace), "--profile", str(profile), "--slo-ttft-p90", "1",
         "--slo-itl-p90", "1", "--node-kv-tokens", "16", "--max-nodes", "2", "--shape", "colocated",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 1  # no cluster meets the targets: a script can tell (it was 0, as for a plan)
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert "1 of 1 requests need more KV than a node holds" in capsys.readouterr().out


def test_pdkv_profile_quick_writes_a_profile_plan_can_read(tmp_path: Path) -> None:
    from engine.model.make_model import TinyLlamaSpec, make_model
    from pdkv.cli import main

    model = make_model(tmp_path / "model", TinyLlamaSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=300))
    out = tmp_path / "node.json"
    code = main(
        ["profile", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--num-blocks", "128",
         "--threads", "1", "--quick", "--repeat", "1", "--out", str(out), "--tier", "cpu=cpu:64MiB"]
    )  # fmt: skip
    assert code == 0
    profile = Profile.load(out)
    assert profile.engine.block_size == 16 and profile.engine.num_blocks == 128
    # the model's context, not the 2048 tokens this node's cache cut it to: a plan sizes other nodes
    assert profile.engine.max_model_len == 4096
    assert profile.engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x K,V x heads x dim x fp32
    assert set(profile.loads) == {"cpu"} and profile.loads["cpu"].samples >= 2
    assert profile.step.samples > 10
    # prefill grows with the chunk: by the per-token or the attention term (a tiny model's quick fit may put
    # it all in either one: on a noisy host prefill_token_s alone came out 0 in 1 run of ~20)
    assert profile.step.prefill_seconds(512) > profile.step.prefill_seconds(16) > 0
    assert profile.p2p.per > 0 and profile.machine["threads"] == 1


def test_pdkv_plan_on_the_qa_workload_is_the_same_for_a_seed(tmp_path: Path) -> None:
    from pdkv.cli import main

    profile = tmp_path / "profile.json"
    PROFILE.save(profile)

    def plan(seed: int) -> dict:  # type: ignore[type-arg]
        out = tmp_path / f"plan-{seed}.json"
        code = main(
            ["plan", "--workload", "qa", "--qa-users", "4", "--qa-rounds", "3", "--qa-gap-ms", "100",
             "--tokens-per-block", "16", "--profile", str(profile), "--slo-ttft-p90", "0.5",
             "--slo-itl-p90", "1", "--shape", "both", "--seed", str(seed), "--json", str(out)]
        )  # fmt: skip
        assert code == 0
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    first = plan(3)
    assert first == plan(3)
    assert first["workload"].endswith("seed 3") and first["ceiling"] > 0.5  # histories repeat
    assert first["shapes"]["colocated"]["chosen"]["hit_local"] > 0
    assert "chosen" in first["shapes"]["pd"]


def test_pdkv_profile_refuses_an_out_file_it_could_not_write_before_it_measures(tmp_path: Path) -> None:
    """An outside probe: an --out in a missing folder was found after the whole profile (minutes), as a
    raw ``[Errno 2]``."""
    from pdkv.cli import main

    with pytest.raises(SystemExit, match=r"--out .*does not exist"):
        main(["profile", "--model", str(tmp_path / "never-read"), "--out", str(tmp_path / "no" / "p.json")])
