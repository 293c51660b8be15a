"""The trace as planner/trace.py reads it (bench.replay and the simulator both): bad lines named,
deterministic tokens, and the ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.trace import Scale, TraceError, ceiling, conversation_key, read_trace, sampled
from planner.workload import TraceRequest, as_arrivals, scale_trace

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


def test_a_line_going_back_in_time_or_not_finite_is_named(tmp_path: Path) -> None:
    """Arrivals are times from the first line: one before it arrived at a negative time and was dropped
    from the results, silently; NaN passed the non-negative check."""
    path = write(tmp_path, [row(5000, 64, [0]), row(0, 64, [1])])
    with pytest.raises(TraceError, match=r"trace.jsonl:2: timestamp 0 is before"):
        read_trace(path, 0, 10)
    path.write_text(
        row(0, 64, [0]) + "\n" + '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
    )
    with pytest.raises(TraceError, match=r"trace.jsonl:2: field 'timestamp'"):
        read_trace(path, 0, 10)
    path.write_bytes(row(0, 64, [0]).encode() + b"\n\xff\xfe garbage\n")
    with pytest.raises(TraceError, match=r"trace.jsonl: not UTF-8 text"):
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
    assert ceiling(as_arrivals(reqs, 4), 4) == pytest.approx((0 + 8 + 11 + 0) / 48)


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
    whole = scale_trace(read_trace(path, 0, 10_000), SCALE, vocab=512)
    tpb = SCALE.tokens_per_block
    assert ceiling(as_arrivals(scaled, tpb), tpb) == pytest.approx(
        ceiling(as_arrivals(whole, tpb), tpb), abs=0.05
    )


def test_a_request_of_one_block_is_a_conversation_of_its_own(tmp_path: Path) -> None:
    # Short requests that share only their one block are sampled one by one, at the fraction, not all
    # kept or all dropped together as one "conversation" of block 0.
    path = write(tmp_path, [row(i, 300, [0]) for i in range(400)] + [row(400, 300, [])])
    kept = len(read_trace(path, 0, 10_000, sample=0.25))
    assert 60 <= kept <= 140
    assert conversation_key([0], 3) != conversation_key([0], 4) and conversation_key([], 9) == "line 9"
