"""``n`` choices of one request: the prompt is prefilled once, and each choice samples on from it.

    choice 0 ──▶ a node (the policy's choice) ── prompt computed, its blocks cached ──▶ first token
                   │
                   └─ then choices 1..n-1, each on the same node(s) ──▶ prefix hit on every full block
                      of the prompt (the node's prefix cache), the rest (under one block) computed

A choice is an ordinary request of the pipeline -- its own engine request, its own seed stream (``seed +
i`` when the client set a seed, as vLLM numbers them; else the engine draws one per choice), failover
and resume as any request -- so what holds for one request holds for each choice, on every path.  The
choices after the first wait for its first token: by then the prompt's blocks are in the prefix cache
of the node that computed them (the prefill node, or the colocated node), and the others are sent there
(``Placement``), where they find them.  In disaggregated mode they also prefer the decode node of the
first choice, whose cache holds the prompt once it received it.

The sharing is the prefix cache's: every full block of the prompt is computed once and shared by
reference; the last, partial block is recomputed by each choice (fewer than ``block_size`` tokens)
rather than copied -- the same KV, without a copy-on-write path in the engine.

Events are relayed as they come, each with its choice's ``index``; the request fails when a choice
fails (the client's call then ends, which cancels the others).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.events import CallScope, Delta, Event

if TYPE_CHECKING:
    from router.admission import AdmittedRequest
    from router.nodes import NodeHandle


@dataclass
class Placement:
    """The nodes one request went to (set by the pipeline as it chooses them), or should go to first.

    A later choice follows ``leader`` (choice 0's placement) for a node it has not been given: in
    disaggregated mode choice 0 picks its decode node only after its first token is out, when the later
    choices have already started, so they read it when they get there."""

    prefill: NodeHandle | None = None
    decode: NodeHandle | None = None
    leader: Placement | None = None

    def prefill_hint(self) -> NodeHandle | None:
        return self.prefill or (self.leader.prefill if self.leader else None)

    def decode_hint(self) -> NodeHandle | None:
        return self.decode or (self.leader.decode if self.leader else None)


RunChoice = Callable[["AdmittedRequest", CallScope, Placement], Iterator[Event]]


def choice_request(request: AdmittedRequest, i: int) -> AdmittedRequest:
    """Choice ``i`` of ``request``: one sequence, seeded ``seed + i`` where the client set a seed.  The
    prompt's scores (prompt_logprobs) are the first choice's: the others do not score it again, and so
    find its blocks cached (``fork_choices`` hands them its scores)."""
    params = request.params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=(params.seed + i) % 2**64)  # gRPC seeds are uint64
    if i and params.prompt_logprobs is not None and params.max_tokens:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(request, params=params, n=1)


def run_choices(
    request: AdmittedRequest, scope: CallScope, run: RunChoice, release: Callable[[int], None]
) -> Iterator[Event]:
    """Every choice's events, each with its ``index``: ``repeat_choice`` when nothing is generated, else
    ``fork_choices``."""
    choices = repeat_choice if request.params.max_tokens == 0 else fork_choices
    return choices(request, scope, run, release)


def fork_choices(
    request: AdmittedRequest, scope: CallScope, run: RunChoice, release: Callable[[int], None]
) -> Iterator[Event]:
    """Every choice's events, each with its ``index``.  ``run(choice, scope, placement)`` runs one choice
    (releasing its ``max_inflight`` slot when it ends); ``release(k)`` gives back the slots of ``k``
    choices never started."""
    n = request.n
    events: queue.Queue[tuple[int, Event | BaseException | None]] = queue.Queue()
    first = Placement()

    def worker(i: int, placement: Placement) -> None:
        try:
            for event in run(choice_request(request, i), scope, placement):
                events.put((i, event))
        except BaseException as exc:  # relayed to the caller's thread, which raises it
            events.put((i, exc))
        else:
            events.put((i, None))

    def start(i: int, placement: Placement) -> None:
        threading.Thread(target=worker, args=(i, placement), name=f"choice-{i}", daemon=True).start()

    started, finished = 0, 0  # started: threads that did start (each gives back its own slot)
    scores: Delta | None = None  # choice 0's first delta: the prompt's scores, for every choice's first
    unscored = set(range(1, n))  # the choices whose first delta has not gone out yet
    try:
        start(0, first)
        started = 1
        while finished < n:
            i, item = events.get()
            if item is None:
                finished += 1
                continue
            if isinstance(item, BaseException):
                raise item
            if started == 1:  # choice 0's first event: its prompt is computed and cached
                scores = item if isinstance(item, Delta) and item.prompt_logprobs is not None else None
                for j in range(1, n):
                    start(j, Placement(leader=first))
                    started += 1
            elif i in unscored and isinstance(item, Delta):
                unscored.discard(i)
                if scores is not None:
                    item = dataclasses.replace(
                        item,
                        prompt_logprobs=scores.prompt_logprobs,
                        prompt_top_logprobs=scores.prompt_top_logprobs,
                    )
            yield dataclasses.replace(item, index=i)
    finally:
        release(n - started)


def repeat_choice(
    request: AdmittedRequest, scope: CallScope, run: RunChoice, release: Callable[[int], None]
) -> Iterator[Event]:
    """``n`` choices that generate nothing (``max_tokens`` 0: echo's prompt scores, all the choices'
    output): they are all the same, so the prompt is scored once and each event is sent under every
    index; the other choices' slots are given back at once."""
    release(request.n - 1)
    for event in run(choice_request(request, 0), scope, Placement()):
        for i in range(request.n):
            yield dataclasses.replace(event, index=i)
