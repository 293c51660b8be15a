"""The request bodies of the OpenAI-compatible API, as pydantic models (what the official SDK sends).

Fields pdkv does not serve are either accepted and ignored because they cannot change the output
(``user``, ``presence_penalty`` = 0, ...) or refused with 400 naming the field (``n`` > 1,
``top_logprobs`` > 0, non-zero penalties, tools).  ``cache_salt`` is vLLM's extension: requests with the
same salt share cached KV, and only they do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams

# A body field named as a SamplingParams field is that field: a new sampling field is one line below.
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI's own server does for fields an SDK version adds.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # pdkv extensions (vLLM's names): top_k, min_p, ignore_eos, stop_token_ids.
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets, by their names (null is unset).  OpenAI's own
        defaults and shapes apply: temperature 1, ``stop`` a string or a list, ``logprobs`` a flag (chat)
        or a count (completions, where 0 asks for the chosen token's logprob)."""
        fields = type(self).model_fields
        options = {
            name: getattr(self, name)
            for name in _SAMPLING_FIELDS
            if name in fields and getattr(self, name) is not None
        }
        options.setdefault("temperature", 1.0)
        if isinstance(self.stop, str):
            options["stop"] = (self.stop,)
        if "logprobs" in options:  # a flag, or a count: any count asks for the chosen token's
            options["logprobs"] = options["logprobs"] is not False
        return options


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, or a list of text parts ({"type": "text", "text": ...}) as newer SDKs send.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Sampling):
    # A string, a list of one string, token ids, or a list of one list of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
