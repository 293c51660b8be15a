"""Incremental detokenization and stop strings, driven with hand-made scheduler updates."""

from __future__ import annotations

from typing import Any

import pytest

from engine.hashing import HashNamespace
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestUpdate
from engine.tokenizer import Tokenizer, build_byte_level_tokenizer

NS = HashNamespace(model_fingerprint="test", block_size=4)
EOS = 257


class FakeScheduler:
    def __init__(self) -> None:
        self.finished: list[tuple[str, RequestStatus, Any]] = []

    def finish_request(
        self, rid: str, status: RequestStatus, *, stop_reason: Any = None, error: Any = None
    ) -> bool:
        self.finished.append((rid, status, stop_reason))
        return True


@pytest.fixture
def tokenizer() -> Tokenizer:
    tok = build_byte_level_tokenizer(vocab_size=300, bos_token_id=256, eos_token_id=EOS)
    return Tokenizer(tok, bos_token_id=256, eos_token_id=EOS, source="test")


def feed(
    tokenizer: Tokenizer,
    chunks: list[bytes | int],
    *,
    stop: tuple[str, ...] = (),
    finish: str | None = "length",
) -> tuple[list[RequestOutput], FakeScheduler]:
    """Feed byte tokens (one update per chunk); the last update finishes with ``finish``."""
    proc = OutputProcessor(tokenizer)
    sched = FakeScheduler()
    proc.add_request(Request("r", [1, 2], SamplingParams(max_tokens=100, stop=stop), namespace=NS))
    outs = []
    for i, chunk in enumerate(chunks):
        ids = list(chunk) if isinstance(chunk, bytes) else [chunk]
        last = i == len(chunks) - 1 and finish is not None
        update = RequestUpdate("r", ids, [], finished=last, finish_reason=finish if last else None)
        outs.extend(proc.process([update], sched))  # type: ignore[arg-type]
        if outs and outs[-1].finished:
            break
    return outs, sched


def test_partial_utf8_is_held_until_complete(tokenizer: Tokenizer) -> None:
    euro = "€".encode()  # 3 bytes
    outs, _ = feed(tokenizer, [b"a", euro[:1], euro[1:2], euro[2:], b"b"])
    assert [o.new_text for o in outs] == ["a", "", "", "€", "b"]
    assert outs[-1].finished


def test_incomplete_character_at_the_end_is_flushed(tokenizer: Tokenizer) -> None:
    outs, _ = feed(tokenizer, [b"a", "é".encode()[:1]])
    assert "".join(o.new_text for o in outs) == "a\ufffd"


def test_stop_string_is_cut_and_never_streamed(tokenizer: Tokenizer) -> None:
    outs, sched = feed(tokenizer, [b"xx", b"a", b"b", b"c", b"zz"], stop=("abc",), finish=None)
    assert [o.new_text for o in outs] == ["", "x", "x", ""]  # "ab" held back: it might start "abc"
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "abc"
    assert sched.finished == [("r", RequestStatus.FINISHED_STOPPED, "abc")]
    assert "".join(o.new_text for o in outs) == "xx"


def test_stop_string_inside_one_token_chunk(tokenizer: Tokenizer) -> None:
    outs, _ = feed(tokenizer, [b"hello STOP world"], stop=("STOP", "hello!"), finish=None)
    assert outs[-1].finished and "".join(o.new_text for o in outs) == "hello "


def test_held_back_text_is_released_when_no_stop_follows(tokenizer: Tokenizer) -> None:
    outs, sched = feed(tokenizer, [b"xxab", b"d", b"e"], stop=("abc",))
    assert "".join(o.new_text for o in outs) == "xxabde"
    assert outs[-1].finish_reason == "length" and not sched.finished


def test_stop_string_wins_over_length_on_the_same_token(tokenizer: Tokenizer) -> None:
    outs, sched = feed(tokenizer, [b"ab", b"c"], stop=("bc",))
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "bc"
    assert "".join(o.new_text for o in outs) == "a"
    assert not sched.finished  # the scheduler had already finished it (length)


def test_eos_token_contributes_no_text(tokenizer: Tokenizer) -> None:
    outs, _ = feed(tokenizer, [b"ok", EOS], finish="stop")
    assert "".join(o.new_text for o in outs) == "ok"
    assert outs[-1].new_token_ids == [EOS]
