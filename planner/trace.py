"""Workloads: the Mooncake-format request trace (``read_trace``), scaled to a machine (``Scale``), its
infinite-cache ceiling, and the simulator's view of a request (``Arrival``: lengths and prefix blocks,
no tokens).

A trace line is one JSON object: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``
(512-token prefix blocks: equal ids, the same block).  ``bench.replay`` makes token ids from the same
rows and scaling; the simulator keeps only the block ids, chained (``prefix_keys``), which is what a
cache can share.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
)


class TraceError(ValueError):
    """A trace line that is not what the format says; the text names the file and line."""


@dataclass(frozen=True)
class Scale:
    """How a trace is fitted to a machine: ``tokens_per_block`` tokens stand for each 512-token block
    (input lengths scale alike, capped at ``max_input``), arrival times are multiplied by
    ``time_scale``, outputs are capped at ``max_output``."""

    tokens_per_block: int = TRACE_BLOCK_TOKENS
    time_scale: float = 1.0
    max_output: int = 1 << 30
    max_input: int = 1 << 30

    def describe(self, trace: bool = True) -> str:
        if not trace:  # the QA workload: no trace blocks, times or lengths to scale
            return f"{self.tokens_per_block}-token question blocks, outputs of {self.max_output} tokens"

        def cap(n: int) -> str:
            return "uncapped" if n >= 1 << 30 else f"capped at {n}"

        return (
            f"{self.tokens_per_block} tokens per 512-token block, time x{self.time_scale:g}, "
            f"inputs {cap(self.max_input)} tokens, outputs {cap(self.max_output)}"
        )

    def input_tokens(self, row: dict[str, Any]) -> int:
        scaled = round(row["input_length"] * self.tokens_per_block / TRACE_BLOCK_TOKENS)
        return max(1, min(self.max_input, scaled))

    def output_tokens(self, row: dict[str, Any]) -> int:
        return max(1, min(row["output_length"], self.max_output))


def conversation_key(hash_ids: list[int], line: int) -> str:
    """What groups a conversation's turns: its first two block ids.  Every turn of a conversation repeats
    the history before it, so its turns share their leading ids; the first alone is not enough in the
    Mooncake trace, whose every request starts with the same block (id 0, a shared system prompt).  A
    request of under two blocks cannot be told apart from others that share its one block: it is a
    conversation of its own (its line)."""
    if len(hash_ids) < 2:
        return f"line {line}"
    return f"{hash_ids[0]},{hash_ids[1]}"


def sampled(hash_ids: list[int], line: int, fraction: float) -> bool:
    """Whether a request's conversation is in a ``fraction`` sample of the conversations: the same
    answer for every turn of one conversation, and in every run (a CRC of the key, not Python's hash)."""
    if fraction >= 1.0:
        return True
    return zlib.crc32(conversation_key(hash_ids, line).encode()) / 2**32 < fraction


def check_row(row: Any, where: str) -> dict[str, Any]:
    """``row`` if it is a trace request; else a ``TraceError`` naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a line must be a JSON object")
    for key, kind in (("timestamp", (int, float)), ("input_length", int), ("output_length", int)):
        value = row.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise TraceError(f"{where}: field {key!r} is missing or not a finite non-negative number")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: field 'hash_ids' is missing or not a list of ints")
    return row


def read_trace(
    path: Path, start: int = 0, count: int | None = None, sample: float = 1.0
) -> list[dict[str, Any]]:
    """``count`` requests (all when None) from line ``start`` on (0-based): with ``sample`` below 1, only
    those of a deterministic sample of the conversations (``sampled``), so a window spans more of the
    trace at the same rate and keeps each sampled conversation's every turn.  Every line read is
    checked; a bad one stops with its number.  Each row gets its 1-based ``line``."""
    rows: list[dict[str, Any]] = []
    try:
        f = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    last = -math.inf
    with f:
        number = 0
        try:
            for number, line in enumerate(f, start=1):
                if number <= start:
                    continue
                if count is not None and len(rows) == count:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                check_row(row, f"{path}:{number}")
                if row["timestamp"] < last:  # arrivals are times from the first: one going back is lost
                    raise TraceError(
                        f"{path}:{number}: timestamp {row['timestamp']} is before the line above's ({last}): "
                        "a trace is in time order"
                    )
                last = row["timestamp"]
                if sampled(row["hash_ids"], number, sample):
                    row["line"] = number
                    rows.append(row)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text, near line {number + 1} ({exc.reason})") from None
    return rows


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the simulator sees it: when, how long, and its prefix blocks (``blocks``: one
    key per full block of the input, equal keys for equal prefixes)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    # The request that must have finished before this one is sent (its index): a QA user's previous
    # round, whose answer this one's prompt holds.  None: sent at its arrival time.
    after: int | None = None


class PrefixKeys:
    """Interns prefixes of block ids: the key of block k stands for ids[0..k], so two requests share a
    key exactly when they share that whole prefix (what a chained block hash gives a cache).  Keys are
    small ints, in order of first sight: deterministic, and no collisions."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, int], int] = {}

    def chain(self, ids: Iterable[int]) -> tuple[int, ...]:
        out: list[int] = []
        parent = -1
        for block_id in ids:
            key = self._keys.get((parent, block_id))
            if key is None:
                key = self._keys[(parent, block_id)] = len(self._keys)
            out.append(key)
            parent = key
        return tuple(out)

    def unique(self) -> int:
        """A key no prefix has (a request's own, unshared block)."""
        key = len(self._keys)
        self._keys[(-2, key)] = key
        return key


def arrivals(rows: Sequence[dict[str, Any]], scale: Scale, keys: PrefixKeys | None = None) -> list[Arrival]:
    """The rows scaled, as ``bench.replay`` scales them: a scaled block is a cache block, and the input's
    full blocks are the leading ids (ids past the input are dropped; an input longer than its ids ends
    in blocks of its own)."""
    keys = keys or PrefixKeys()
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for row in rows:
        n = scale.input_tokens(row)
        full = n // scale.tokens_per_block
        ids = row["hash_ids"][:full]
        chain = keys.chain(ids)
        chain += tuple(keys.unique() for _ in range(full - len(chain)))
        out.append(
            Arrival((row["timestamp"] - t0) / 1000.0 * scale.time_scale, n, scale.output_tokens(row), chain)
        )
    return out


def ceiling(requests: Sequence[Arrival], tokens_per_block: int) -> float:
    """The infinite-cache prompt hit rate: whole leading blocks seen before, never the last token."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        while k < len(r.blocks) and r.blocks[k] in seen:
            k += 1
        hit += min(k * tokens_per_block, r.input_tokens - 1)
        total += r.input_tokens
        seen.update(r.blocks)
    return hit / total if total else 0.0
