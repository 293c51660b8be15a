"""What the engine hands back: a per-step delta for streaming, and the finished result for offline use."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.connector.params import KVTransferParams
from engine.sampling_params import TopLogprobs


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's progress in one ``LLMEngine.step``: what is new since the previous output.

    ``new_text`` never ends inside a UTF-8 character, and while a stop string could still be completing
    it holds back the characters that might belong to it.  When ``finished``, ``finish_reason`` is
    "stop" (EOS, a stop token id or a stop string; ``stop_reason`` is the stop token id or string, None
    for EOS or a completed constraint, vLLM's rule), "length", "abort" or
    "error" (``error`` says why).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens served from the local prefix cache (known once the request was first scheduled).
    num_cached_tokens: int = 0
    # Prompt tokens loaded by the KV connector (a store, another node) instead of computed.
    num_external_tokens: int = 0
    # What the connector returned when the request finished (e.g. where a prefill node holds its KV).
    kv_transfer_params: KVTransferParams | None = None
    # One per new token, when the request asked for top_logprobs: the most likely tokens there.
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With sampling_params.prompt_logprobs, in the request's first output: per prompt position, the token's
    # logprob given the ones before it (None at position 0) and its most likely alternatives.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    @property
    def num_computed_prompt_tokens(self) -> int:
        return max(0, self.num_prompt_tokens - self.num_cached_tokens - self.num_external_tokens)


@dataclass(slots=True)
class GenerationOutput:
    """One finished request of ``LLM.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    num_cached_tokens: int = 0
    num_external_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    # Seconds from submission to the first output token (None if none was produced).
    time_to_first_token: float | None = None
    # With sampling_params.prompt_logprobs: the prompt's scores (see RequestOutput).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    def add(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        if self.logprobs is not None:
            self.logprobs.extend(delta.new_logprobs)
        if self.top_logprobs is not None:
            self.top_logprobs.extend(delta.new_top_logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_external_tokens = delta.num_external_tokens
        self.num_computed_prompt_tokens = delta.num_computed_prompt_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_top_logprobs = delta.prompt_top_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error
            self.kv_transfer_params = delta.kv_transfer_params
