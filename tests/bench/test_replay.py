"""bench.replay end to end: the modes run, QA users wait for their answers, figures and ratios."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from planner.trace import TraceError, read_trace
from planner.workload import TraceRequest, scale_trace
from serving.client import Completion
from tests.planner.test_trace import SCALE, row, write


def test_a_window_with_no_requests_stops_the_bench(tmp_path: Path) -> None:
    from bench.replay import main

    path = write(tmp_path, [row(0, 1024, [0, 1])])
    with pytest.raises(SystemExit, match=r"no requests in .* from line 5 on"):
        main(["--trace", str(path), "--start", "5"])


def test_a_missing_trace_stops_each_trace_bench_with_a_line(tmp_path: Path) -> None:
    """bench.simulate ended in a TraceError traceback (bench.replay already said it in a line)."""
    from bench.replay import main as replay
    from bench.simulate import main as simulate

    for main in (replay, simulate):
        with pytest.raises(SystemExit, match=r"nowhere.jsonl: cannot be read"):
            main(["--quick", "--trace", str(tmp_path / "nowhere.jsonl")])


def test_bench_simulate_says_each_bad_input_in_a_line_before_any_model_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe met tracebacks: an empty trace (IndexError), a bad line past the first (after the
    model was made), a profile that is not one, a negative target; and a target of 0 taken as none."""
    from bench.simulate import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "bad").mkdir()
    broken = write(tmp_path / "bad", [row(0, 1024, [0, 1]), "{broken"])
    profile = tmp_path / "profile.json"
    profile.write_text('{"version": 1}')
    good = write(tmp_path, [row(0, 1024, [0, 1])])
    for argv, what in (
        (["--trace", str(empty)], "empty.jsonl: no request in it"),
        (["--trace", str(broken)], "trace.jsonl:2: not valid JSON"),
        (["--trace", str(good), "--profile", str(profile)], "profile.json: field 'machine' is missing"),
    ):
        with pytest.raises(SystemExit, match=what):
            main(["--quick", *argv])
    for value in ("-1", "0", "nan"):
        with pytest.raises(SystemExit):
            main(["--quick", "--trace", str(good), "--slo-ttft-p90", value])
        assert "--slo-ttft-p90 must be a positive number of seconds" in capsys.readouterr().err


def test_a_bad_line_is_named_even_where_the_sample_leaves_it_out(tmp_path: Path) -> None:
    path = write(tmp_path, [row(0, 1024, [0, 1]), row(1, 1024, [0, 2]), "{broken"])
    with pytest.raises(TraceError, match=r"trace.jsonl:3: not valid JSON"):
        read_trace(path, 0, 10, sample=0.01)


def test_real_model_prompts_keep_clear_of_its_special_tokens(tmp_path: Path) -> None:
    from bench.replay import MODELS, qa_workload

    smollm2 = MODELS["smollm2"]
    path = write(tmp_path, [row(0, 4096, [0, 1, 2, 3]), row(10, 4096, [0, 1, 7])])
    trace = scale_trace(read_trace(path, 0, 10), SCALE, smollm2.vocab, smollm2.low_id)
    qa = qa_workload(3, 2, SCALE, smollm2.vocab, 0.1, smollm2.low_id)
    tokens = [t for r in trace + qa for t in r.prompt]
    assert min(tokens) >= smollm2.low_id and max(tokens) < smollm2.vocab
    assert trace[1].prompt[:8] == trace[0].prompt[:8]
    # QA: each user's next round starts with its whole previous prompt.
    first, second = qa[:3], qa[3:]
    assert all(any(s.prompt[: len(f.prompt)] == f.prompt for f in first) for s in second)


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["--nodes", "0"], "--nodes must be at least 2, got 0"),
        (["--requests", "0"], "--requests must be at least 1, got 0"),
        (["--node-threads", "0"], "--node-threads must be at least 1, got 0"),
        (["--max-output", "0"], "--max-output must be at least 1, got 0"),
        (["--tokens-per-block", "0"], "--tokens-per-block must be at least 1, got 0"),
        (["--workload", "qa", "--time-scale", "1"], "--workload qa takes --qa-gap-ms"),
        (["--workload", "qa", "--qa-gap-ms", "-1"], "--qa-gap-ms not negative"),
        (["--workload", "qa", "--sample", "0.5"], "--sample scale the trace"),
        (["--sample", "0"], r"--sample must be in \(0, 1\], got 0"),
        (["--sample", "1.5"], r"--sample must be in \(0, 1\], got 1.5"),
        # An outside probe's: each was taken, and printed in the header as given.
        (["--start", "-5"], "--start must be at least 0, got -5"),
        (["--max-input", "-4"], "--max-input must be at least 1, got -4"),
        (["--time-scale", "nan"], "--time-scale must be a positive number, got nan"),
        (["--time-scale", "-1"], "--time-scale must be a positive number, got -1.0"),
        (["--slo-ttft-ms", "-3"], "--slo-ttft-ms must be a positive number, got -3.0"),
    ],
)
def test_bad_options_stop_the_bench_with_their_name(argv: list[str], what: str) -> None:
    from bench.replay import main

    with pytest.raises(SystemExit, match=what):  # before any model is made or cluster started
        main(argv)


class FakeClient:
    """Stands for ``GenerationClient``: records when each prompt was sent and finished; a prompt whose
    first token is 0 fails."""

    log: ClassVar[list[tuple[str, int, float]]] = []
    lock = threading.Lock()

    def __init__(self, address: str, options: object = None) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, request: object, timeout: float) -> Completion:
        ids = list(request.token_ids.ids)  # type: ignore[attr-defined]
        with self.lock:
            self.log.append(("sent", ids[1], time.perf_counter()))
        time.sleep(0.15)
        with self.lock:
            self.log.append(("done", ids[1], time.perf_counter()))
        if ids[0] == 0:
            raise RuntimeError("refused")
        return Completion(token_ids=[1])


def test_a_qa_user_asks_again_only_once_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.replay as replay_module

    monkeypatch.setattr(replay_module, "GenerationClient", FakeClient)
    FakeClient.log = []
    # User A's rounds 0 and 2 (the second fails, the third must still go), user B's round 1: all due at 0.
    reqs = [
        TraceRequest(0.0, [1, 10], 1, ()),
        TraceRequest(0.0, [1, 11], 1, ()),
        TraceRequest(0.0, [0, 12], 1, (), after=0),
        TraceRequest(0.0, [1, 13], 1, (), after=2),
    ]
    result = replay_module.replay("unused", reqs)
    at = {(kind, n): t for kind, n, t in FakeClient.log}
    assert at[("sent", 12)] >= at[("done", 10)]  # not before its predecessor's answer
    assert at[("sent", 13)] >= at[("done", 12)]  # a failed round still lets the user go on
    assert at[("sent", 11)] < at[("done", 10)]  # other users do not wait
    assert len(result.completions) == 3 and result.errors == 1


def test_qa_rounds_follow_the_same_users_previous_round() -> None:
    from bench.replay import qa_workload

    reqs = qa_workload(3, 3, SCALE, vocab=512, gap_s=0.1)
    for i, r in enumerate(reqs):
        if i < 3:
            assert r.after is None  # first rounds wait for no one
        else:
            prev = reqs[r.after]  # type: ignore[index]
            assert r.after < i and r.prompt[: len(prev.prompt)] == prev.prompt  # the same user's history
