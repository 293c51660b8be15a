"""Typed hand-offs between the scheduler, the model runner and back.

Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
    -> Scheduler.update_from_output() -> EngineCoreOutputs
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.connector.types import KVConnectorMetadata, KVConnectorOutput
from engine.hashing import AdapterId, BlockHash
from engine.request import Request, RequestId, TokenHistory
from engine.sampling_params import SamplingParams, TopLogprobs
from engine.structured import Matcher


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in one step.  Filled by the scheduler, read by the runner.

    The runner computes the KV of ``token_ids`` at positions ``[start_position, start_position +
    len(token_ids))`` into the request's ``block_ids`` (its whole block table, in order) and attends over
    everything before them too.  ``sample`` is True when this chunk ends at the request's last known
    token, so the logits of the last position yield the next token.  (Not frozen: a frozen dataclass
    costs a microsecond per construction, and the scheduler builds one per running request per step.)
    """

    request_id: RequestId
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    # Index of the output token this step samples, counting tokens another engine sampled before this one
    # took over (seeded sampling stays reproducible across preemption and across nodes).
    output_index: int = 0
    # The request's block hashes, one per full block so far (the request's own list, not a copy: read it
    # in build_connector_meta, never change it).  What a connector saves block i of ``block_ids`` under.
    block_hashes: Sequence[BlockHash] = ()
    # The request's tokens, for its logit processors (None unless its sampling parameters turn one on).
    history: TokenHistory | None = None
    # The request's structured-output constraint (None without one): the sampler masks by it.
    matcher: Matcher | None = None
    # With sampling_params.prompt_logprobs, the prompt token that follows each of this chunk's rows that
    # has one (rows start_position.. in order; the prompt's last position has none): the runner scores
    # them.  None otherwise.
    prompt_targets: list[int] | None = None
    # The LoRA adapter the request runs under (None: the base model): the runner applies its slot.
    adapter: AdapterId | None = None

    @classmethod
    def of(cls, request: Request, start: int, end: int, block_ids: list[int]) -> ScheduledRequest:
        """``request``'s tokens ``[start, end)`` this step, into its ``block_ids``."""
        params = request.sampling_params
        targets = None
        if request.scores_prompt and start < request.num_prompt_tokens - 1:
            targets = request.token_ids_slice(start + 1, min(end, request.num_prompt_tokens - 1) + 1)
        return cls(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end),
            start_position=start,
            block_ids=block_ids,
            sample=end == request.num_tokens,
            sampling_params=params,
            output_index=request.num_prior_output_tokens + request.num_output_tokens,
            block_hashes=request.block_hashes,
            history=request.token_history() if params.processes_logits else None,
            matcher=request.matcher,
            prompt_targets=targets,
            adapter=request.adapter,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens visible to the last query: cached prefix + this chunk."""
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one step does.  ``scheduled`` lists prefills and decodes together (a ragged batch)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[RequestId, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests admitted (or resumed) this step, and requests preempted this step.
    new_request_ids: list[RequestId] = field(default_factory=list)
    preempted_request_ids: list[RequestId] = field(default_factory=list)
    # Requests the scheduler failed this step (e.g. larger than the whole KV cache); the engine reports them.
    errored_request_ids: list[RequestId] = field(default_factory=list)
    # Requests that finished since the last step: the runner drops their per-request state.
    finished_request_ids: set[RequestId] = field(default_factory=set)
    # The connector's per-step instructions for its worker half (see engine/connector/base.py).
    kv_connector_metadata: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    # The connector raised building it: the runner calls no worker hook this step (connector_results.py)
    kv_connector_failed: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the runner produced: one sampled token per request whose chunk had ``sample`` set."""

    sampled_token_ids: dict[RequestId, int] = field(default_factory=dict)
    logprobs: dict[RequestId, float] = field(default_factory=dict)
    top_logprobs: dict[RequestId, TopLogprobs] = field(default_factory=dict)
    # Per request with prompt_targets: the targets' logprobs and alternatives, from the chunk's first row.
    prompt_scores: dict[RequestId, PromptScores] = field(default_factory=dict)
    # The connector worker half's report for the step (see engine/connector/base.py).
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Prompt tokens ``first``, ``first + 1``, ... each scored given the tokens before it."""

    first: int  # the prompt position of the first scored token
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]


@dataclass(slots=True)
class RequestUpdate:
    """New tokens of one request after one step, and its finish state if it just ended."""

    request_id: RequestId
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # The whole prompt's scores (sampling_params.prompt_logprobs), with the request's first update.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    updates: list[RequestUpdate] = field(default_factory=list)
