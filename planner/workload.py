"""Workloads with tokens, for runs on real nodes (``bench.replay``): the trace's rows made into prompts
(the same block id, the same tokens) and the synthetic multi-round QA workload; ``as_arrivals`` gives
the simulator the same requests as lengths and prefix blocks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.trace import Arrival, PrefixKeys, Scale


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # scaled
    prompt: list[int]
    max_tokens: int
    block_ids: tuple[int, ...]
    # The request that must have finished before this one is sent (its index in the replay): a QA
    # user's previous round, whose answer this one's prompt holds.  None: sent at its arrival time.
    after: int | None = None


def token_ids(rng: random.Random, n: int, vocab: int, low: int) -> list[int]:
    """``n`` ids of ordinary tokens: ids below ``low`` (the special tokens) avoided."""
    return [low + rng.randrange(vocab - low) for _ in range(n)]


def block_tokens(block_id: int, n: int, vocab: int, low: int = 2) -> list[int]:
    """The tokens that stand for one trace block: the same id, the same tokens."""
    return token_ids(random.Random(block_id * 1_000_003 + 17), n, vocab, low)


def scale_trace(rows: list[dict[str, Any]], scale: Scale, vocab: int, low: int = 2) -> list[TraceRequest]:
    t0 = rows[0]["timestamp"] if rows else 0
    out: list[TraceRequest] = []
    for row in rows:
        n = scale.input_tokens(row)
        ids = tuple(row["hash_ids"])
        tokens: list[int] = []
        for block_id in ids:
            tokens += block_tokens(block_id, scale.tokens_per_block, vocab, low)
            if len(tokens) >= n:
                break
        if len(tokens) < n:  # the ids cover less than the input: the rest is unique to the request
            tokens += block_tokens(-len(out) - 1, n - len(tokens), vocab, low)
        out.append(
            TraceRequest(
                (row["timestamp"] - t0) / 1000.0 * scale.time_scale,
                tokens[:n],
                scale.output_tokens(row),
                ids,
            )
        )
    return out


def qa_workload(
    users: int, rounds: int, scale: Scale, vocab: int, gap_s: float, low: int = 2, seed: int = 7
) -> list[TraceRequest]:
    """Multi-round QA: a shared system prompt; user u's round k asks its history plus a new question,
    at the round's slot in the schedule or once the user's previous answer is in, whichever is later
    (``after``): as LMCache's users, no one asks again before being answered."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return token_ids(rng, n, vocab, low)

    system = tokens(8 * scale.tokens_per_block)
    out: list[TraceRequest] = []
    histories = {u: list(system) for u in range(users)}
    last: dict[int, int] = {}  # user -> the index of its latest round
    tpb = scale.tokens_per_block
    for k in range(rounds):
        order = list(range(users))
        rng.shuffle(order)  # users answer at their own pace: no fixed order a round-robin could align with
        for slot, u in enumerate(order):
            prompt = histories[u] + tokens(2 * scale.tokens_per_block)
            answer = tokens(scale.max_output)
            histories[u] = prompt + answer
            arrival = (k * users + slot) * gap_s
            after = last.get(u)
            last[u] = len(out)
            out.append(TraceRequest(arrival, prompt, scale.max_output, _chain_ids(prompt, tpb), after))
    return out


def _chain_ids(prompt: list[int], block: int) -> tuple[int, ...]:
    """Prefix block ids of a prompt, as the trace's are: equal ids, equal prefixes up to that block."""
    ids: list[int] = []
    parent = 0
    for k in range(len(prompt) // block):
        parent = hash((parent, tuple(prompt[k * block : (k + 1) * block])))
        ids.append(parent)
    return tuple(ids)


def as_arrivals(requests: Sequence[TraceRequest], tokens_per_block: int) -> list[Arrival]:
    """The simulator's view of ``requests``: lengths, the prompt's full blocks as prefix keys (the trace's
    ids, chained), and who waits for whom."""
    keys = PrefixKeys()
    out = []
    for r in requests:
        full = len(r.prompt) // tokens_per_block
        chain = keys.chain(r.block_ids[:full])
        chain += tuple(keys.unique() for _ in range(full - len(chain)))
        out.append(Arrival(r.arrival_s, len(r.prompt), r.max_tokens, chain, r.after))
    return out
