"""``LLM``: offline batch generation on one local engine.

    llm = LLM(model="path/to/hf-folder", dtype="float32")      # model=None: the embedded default
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))

``generate`` submits every prompt, steps the engine until all of them finish, and returns one
``GenerationOutput`` per prompt in input order.  Submission is all or nothing: if one prompt is refused
(a ValueError naming the field), the prompts already submitted are aborted before the error propagates.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import StatsSnapshot
from engine.outputs import GenerationOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """``options`` are ``EngineConfig`` fields (dtype, device, block_size, num_blocks, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> StatsSnapshot:
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapters: str | Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """``adapters``: the LoRA adapter every prompt runs under, or one per prompt (None: the base)."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        names = [adapters] * len(batch) if adapters is None or isinstance(adapters, str) else list(adapters)
        if len(names) != len(batch):
            raise ValueError(f"adapters has {len(names)} entries for {len(batch)} prompts")
        results: dict[str, GenerationOutput] = {}
        started: dict[str, float] = {}
        order: list[str] = []
        try:
            for prompt, p, adapter in zip(batch, params, names, strict=True):
                rid = f"llm-{next(self._ids)}"
                request = self.engine.add_request(rid, prompt, p, adapter=adapter)
                order.append(rid)
                started[rid] = time.perf_counter()
                results[rid] = GenerationOutput(
                    request_id=rid,
                    prompt_token_ids=list(request.prompt_token_ids),
                    logprobs=[] if p.logprobs else None,
                    top_logprobs=[] if p.top_logprobs else None,
                )
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        pending = set(order)
        while pending:
            for out in self.engine.step():
                result = results.get(out.request_id)
                if result is None:
                    continue  # a request someone else submitted to this engine
                if result.time_to_first_token is None and out.new_token_ids:
                    result.time_to_first_token = time.perf_counter() - started[out.request_id]
                result.add(out)
                if out.finished:
                    pending.discard(out.request_id)
        return [results[rid] for rid in order]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    out = list(params)
    if len(out) != n:
        raise ValueError(f"sampling_params has {len(out)} entries for {n} prompts")
    return out
