"""A request as the engine sees it: tokens, lifecycle state and its own block hashes.

``block_hashes`` holds one hash per *full* block of ``all_token_ids``.  It is filled in ``__init__`` from
the prompt and extended in ``append_output_token_ids`` -- the same call that appends output tokens -- so
it is always current.  No other component computes block hashes; the pool, the connectors, the store
and the router read them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from engine.connector.params import KVTransferParams
from engine.hashing import AdapterId, BlockHash, HashNamespace, extend_block_hashes
from engine.sampling_params import SamplingParams, TopLogprobs
from engine.structured import Matcher

RequestId = NewType("RequestId", str)


class RequestStatus(enum.IntEnum):
    """The request lifecycle, in order.  Everything above ``PREEMPTED`` is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    # Back from an async load: waiting to compute the rest, and already owning the blocks it loaded into.
    WAITING_LOADED = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# Which transitions are legal.  ``Request.set_status`` is the one place a status changes.
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING}
    ),
    RequestStatus.WAITING_FOR_REMOTE_KV: frozenset({RequestStatus.WAITING_LOADED}),
    # Admitted with its loaded blocks, or let go of them (another parked request needed the room).
    RequestStatus.WAITING_LOADED: frozenset({RequestStatus.RUNNING, RequestStatus.WAITING}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}),
    RequestStatus.PREEMPTED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING}
    ),
}
_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a request's logit processors read: its token lists (the request's own, not copies: read them
    during the step only).  The last ``num_prior`` prompt tokens are outputs another engine sampled."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_prior: int
    stop_token_ids: tuple[int, ...]  # what ``min_tokens`` holds back: EOS (unless ignored) and stop ids

    def outputs(self) -> list[int]:
        """Every output token so far, whichever engine sampled it."""
        if not self.num_prior:
            return list(self.output_token_ids)
        return [*self.prompt_token_ids[-self.num_prior :], *self.output_token_ids]


class Request:
    """One generation request inside an engine."""

    __slots__ = (
        "_namespace",
        "adapter",
        "admitted_time",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_id",
        "error",
        "finished_kv_transfer_params",
        "kv_transfer_params",
        "lookup_since",
        "matcher",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_local_cached_tokens",
        "num_preemptions",
        "num_prior_output_tokens",
        "output_logprobs",
        "output_token_ids",
        "priority",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_top_logprobs",
        "request_id",
        "sampling_params",
        "status",
        "stop_reason",
        "times_passed_over",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        namespace: HashNamespace,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        adapter: AdapterId | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        num_prior_output_tokens: int = 0,
    ) -> None:
        self.request_id = RequestId(request_id)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        # With sampling_params.prompt_logprobs: per prompt position, the token's logprob given the ones
        # before it (None at position 0, which has none) and its most likely alternatives; filled by the
        # scheduler as the prompt's chunks are computed (a recompute after preemption writes the same).
        wants = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: list[float | None] = [None] * len(prompt_token_ids) if wants else []
        self.prompt_top_logprobs: list[TopLogprobs] = [()] * len(prompt_token_ids) if wants else []
        self.matcher: Matcher | None = None  # its structured-output constraint's state, if it has one
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.adapter = adapter  # the LoRA adapter it runs under (None: the base model)
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.admitted_time: float | None = None  # when first admitted (blocks allocated), by the scheduler
        # Transfer parameters this request arrived with (e.g. where a decode node pulls its prompt KV) ...
        self.kv_transfer_params = kv_transfer_params
        # ... and those its connector returned when it finished (e.g. where the prefill node holds them).
        self.finished_kv_transfer_params: KVTransferParams | None = None
        # When its connector first answered "still looking" (None) to the lookup now running, if it did.
        self.lookup_since: float | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Tokens whose KV is in this request's blocks (local hits + external loads + computed).
        self.num_computed_tokens = 0
        # Where the prompt's KV came from, set when the request is first admitted.
        self.num_local_cached_tokens = 0
        self.num_external_computed_tokens = 0
        self.num_cached_tokens = -1  # -1 until first scheduled
        self.num_preemptions = 0
        self.times_passed_over = 0
        # Output tokens another engine sampled before this one took over (they end the prompt): this
        # request's first sampled token is output number num_prior_output_tokens, for seeded sampling too.
        self.num_prior_output_tokens = num_prior_output_tokens
        self._namespace = namespace
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(
            self.block_hashes,
            self.prompt_token_ids,
            namespace=namespace,
            cache_salt=cache_salt,
            adapter=adapter,
        )

    # -- tokens -------------------------------------------------------------------------------------------

    def record_prompt_scores(self, first: int, logprobs: list[float], tops: list[TopLogprobs]) -> None:
        """Prompt positions ``first``.. scored (a recomputed chunk writes the same values again)."""
        at = slice(first, first + len(logprobs))
        self.prompt_logprobs[at] = logprobs
        self.prompt_top_logprobs[at] = tops

    @property
    def scores_prompt(self) -> bool:
        """Whether this request still owes its prompt's scores (``prompt_logprobs``): until its first
        output token, which carries them -- a request preempted or resumed after it needs none again."""
        return self.sampling_params.prompt_logprobs is not None and not (
            self.num_output_tokens or self.num_prior_output_tokens
        )

    def finished_prompt_scores(self) -> tuple[list[float | None] | None, list[TopLogprobs] | None]:
        """The whole prompt's scores, when this request scores its prompt and samples for the first time
        (its prompt is computed); else (None, None)."""
        if not self.scores_prompt:
            return None, None
        return list(self.prompt_logprobs), list(self.prompt_top_logprobs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_history(self) -> TokenHistory:
        """What the request's logit processors read (its own lists: valid during the step)."""
        params = self.sampling_params
        eos = () if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        stops = tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
        return TokenHistory(self.prompt_token_ids, self.output_token_ids, self.num_prior_output_tokens, stops)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens and hash every block they complete (invariant 1)."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
        bs = self._namespace.block_size
        if self.num_tokens // bs > len(self.block_hashes):
            offset = len(self.block_hashes) * bs
            extend_block_hashes(
                self.block_hashes,
                self.token_ids_slice(offset, self.num_tokens),
                namespace=self._namespace,
                cache_salt=self.cache_salt,
                adapter=self.adapter,
                offset=offset,
            )

    # -- lifecycle ----------------------------------------------------------------------------------------

    def set_status(self, status: RequestStatus) -> None:
        """The one place a request changes state; illegal transitions are bugs, not input errors."""
        if status in _FINISHED:
            assert not self.status.is_finished, (
                f"{self.request_id}: finished twice ({self.status} -> {status})"
            )
        else:
            allowed = _TRANSITIONS.get(self.status, frozenset())
            assert status in allowed, (
                f"{self.request_id}: illegal transition {self.status.name} -> {status.name}"
            )
        self.status = status

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks_hashed={len(self.block_hashes)})"
        )
