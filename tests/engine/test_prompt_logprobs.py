"""Scoring the prompt (``SamplingParams.prompt_logprobs``): each prompt token's log-probability given the
tokens before it equals transformers' ``log_softmax`` of the same logits (float32, within 1e-3 -- measured
~1e-5), whatever the chunking, with the most likely alternatives; a cached prefix does not cut the scores
short (a hit has no logits: the prompt is computed whole); ``max_tokens`` 0 scores and generates nothing."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.tiny_models import hf_logits, tiny_model_dir

MODEL = "llama"
PROMPT = [5 + (i * 37) % 200 for i in range(41)]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return hf_logits(MODEL, "float32", PROMPT).log_softmax(-1)


def _llm(budget: int) -> LLM:
    return LLM(
        tiny_model_dir(MODEL),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=budget,
    )


@pytest.mark.parametrize("budget", [7, 64])  # chunks of 7 tokens (none on a block edge), or one chunk
def test_prompt_scores_equal_transformers_log_softmax(budget: int, reference: torch.Tensor) -> None:
    llm = _llm(budget)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    want = [float(reference[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]
    got = out.prompt_logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True) if a is not None) < 1e-3
    assert all(a is not None for a in got)
    for i, top in enumerate(out.prompt_top_logprobs[1:]):
        values, ids = reference[i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) < 1e-3


def test_a_cached_prefix_still_scores_the_whole_prompt(reference: torch.Tensor) -> None:
    llm = _llm(64)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2))[0]  # caches the prompt's blocks
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0 and scored.num_computed_prompt_tokens == len(PROMPT)
    assert scored.token_ids == plain.token_ids
    assert scored.prompt_logprobs is not None and all(x is not None for x in scored.prompt_logprobs[1:])
    assert scored.prompt_top_logprobs is not None and not any(scored.prompt_top_logprobs)
    again = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert again.prompt_logprobs == scored.prompt_logprobs


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
