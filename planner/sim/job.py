"""A request in the simulation: its ``Record`` (what it did, across nodes) and a ``Job`` on one node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Record:
    """What a request did, across the nodes it went through."""

    index: int
    sent_s: float  # when the router got it
    input_tokens: int
    output_tokens: int
    first_token_s: float = -1.0
    finish_s: float = -1.0
    local_tokens: int = 0  # prompt tokens the computing node's prefix cache held
    store_tokens: int = 0  # prompt tokens loaded from the store
    remote_tokens: int = 0  # prompt tokens a decode node pulled from the prefill node
    preemptions: int = 0


@dataclass(slots=True, eq=False)
class Job:
    """A request on one node: ``prompt`` tokens whose KV it needs (hits, loads or compute), then
    ``max_out`` tokens to generate."""

    record: Record
    keys: tuple[int, ...]  # the prompt's full blocks (prefix keys)
    prompt: int
    max_out: int
    first: bool  # its first generated token is the request's first (colocated, prefill)
    pulled: int = 0  # prompt tokens a peer's KV covers (a decode job): loaded, not computed
    computed: int = 0
    generated: int = 0
    blocks: int = 0  # allocated
    keyed: list[int] = field(default_factory=list)  # the cached keys it holds, in order
    loading_until: float = -1.0
    last_token_s: float = 0.0
    # Where a decode job pulls from, (the prefill SimNode, its job): released once the pull landed.
    source: tuple[Any, Job] | None = None
    cached_upto: int = 0  # prompt blocks already cached (or found taken by another request's copy)
    recorded: bool = False  # where its prompt came from is counted (at its first admission only)

    @property
    def known(self) -> int:
        return self.prompt + self.generated
