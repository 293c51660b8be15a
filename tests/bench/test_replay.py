"""bench.replay's trace handling: bad lines named, deterministic tokens, and the ceiling."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from bench.replay import (
    Scale,
    TraceError,
    TraceRequest,
    ceiling,
    conversation_key,
    read_trace,
    sampled,
    scale_trace,
)
from serving.client import Completion

SCALE = Scale(tokens_per_block=4, time_scale=0.5, max_output=8)


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def row(t: int, n: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids})


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1}), "hash_ids"),
        (json.dumps({"timestamp": 1, "output_length": 1, "hash_ids": [1]}), "input_length"),
        (json.dumps([1, 2]), "JSON object"),
    ],
)
def test_a_bad_line_is_named_and_stops_the_replay(tmp_path: Path, bad: str, what: str) -> None:
    path = write(tmp_path, [row(0, 1024, [0, 1]), bad, row(2, 512, [0])])
    with pytest.raises(TraceError, match=rf"trace.jsonl:2: .*{what}"):
        read_trace(path, 0, 10)


def test_tokens_come_from_hash_ids_deterministically_and_scale(tmp_path: Path) -> None:
    path = write(tmp_path, [row(0, 1024, [0, 1]), row(1000, 1200, [0, 1, 2]), row(3000, 700, [5, 6])])
    a, b, c = scale_trace(read_trace(path, 0, 10), SCALE, vocab=512)
    assert (
        len(a.prompt) == 8
        and len(b.prompt) == round(1200 * 4 / 512)
        and len(c.prompt) == round(700 * 4 / 512)
    )
    assert b.prompt[:8] == a.prompt  # the same ids, the same tokens
    assert c.prompt[:4] != a.prompt[:4]
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 1.5)
    assert a.max_tokens == 8
    assert scale_trace(read_trace(path, 1, 1), SCALE, vocab=512)[0].prompt == b.prompt  # windows agree


def test_the_ceiling_counts_leading_blocks_seen_before_never_the_last_token() -> None:
    def req(ids: tuple[int, ...], n: int) -> TraceRequest:
        return TraceRequest(0.0, [0] * n, 1, ids)

    reqs = [req((0, 1, 2), 12), req((0, 1, 3), 12), req((0, 1, 2), 12), req((9, 1, 2), 12)]
    # Hits: 0, then blocks (0, 1) = 8 tokens, then the whole prompt but the last token = 11, then 0.
    assert ceiling(reqs, 4) == pytest.approx((0 + 8 + 11 + 0) / 48)


def test_a_sample_keeps_whole_conversations_the_same_in_every_run(tmp_path: Path) -> None:
    # 200 conversations of 3 turns each, interleaved; every request starts with the shared block 0.
    lines = [
        row(10 * (turn * 200 + c), 512 * (3 + turn), [0, 1000 + c, *range(turn + 1)])
        for turn in range(3)
        for c in range(200)
    ]
    path = write(tmp_path, lines)
    rows = read_trace(path, 0, 10_000, sample=0.25)
    conversations = {conversation_key(r["hash_ids"], r["line"]) for r in rows}
    # About a quarter of 200, and exactly these: a CRC of the key, the same in every process (Python's
    # hash of a str would not be).
    assert len(conversations) == 56 and sorted(conversations)[:3] == ["0,1000", "0,1004", "0,1008"]
    assert len(rows) == 3 * len(conversations)  # every turn of each sampled one
    assert rows == read_trace(path, 0, 10_000, sample=0.25)
    assert {r["line"] for r in rows} <= set(range(1, 601))  # lines are numbered from 1, as errors name them
    # --requests counts the replayed requests, read on past the lines left out.
    assert len(read_trace(path, 0, 5, sample=0.25)) == 5
    # A larger sample holds a smaller one, so a window's ceiling does not jump between fractions.
    assert conversations <= {
        conversation_key(r["hash_ids"], r["line"]) for r in read_trace(path, 0, 10_000, 0.5)
    }
    assert sampled([0, 7000], 1, 0.04) and not sampled([0, 7402], 1, 0.04)
    # A sample's ceiling: later turns reuse earlier ones, as in the whole trace.
    scaled = scale_trace(rows, SCALE, vocab=512)
    assert ceiling(scaled, SCALE.tokens_per_block) == pytest.approx(
        ceiling(scale_trace(read_trace(path, 0, 10_000), SCALE, vocab=512), SCALE.tokens_per_block), abs=0.05
    )


def test_a_request_of_one_block_is_a_conversation_of_its_own(tmp_path: Path) -> None:
    # Short requests that share only their one block are sampled one by one, at the fraction, not all
    # kept or all dropped together as one "conversation" of block 0.
    path = write(tmp_path, [row(i, 300, [0]) for i in range(400)] + [row(400, 300, [])])
    kept = len(read_trace(path, 0, 10_000, sample=0.25))
    assert 60 <= kept <= 140
    assert conversation_key([0], 3) != conversation_key([0], 4) and conversation_key([], 9) == "line 9"


def test_a_window_with_no_requests_stops_the_bench(tmp_path: Path) -> None:
    from bench.replay import main

    path = write(tmp_path, [row(0, 1024, [0, 1])])
    with pytest.raises(SystemExit, match=r"no requests in .* from line 5 on"):
        main(["--trace", str(path), "--start", "5"])


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
