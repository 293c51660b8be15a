"""Logit processors (``engine/sampler.py``): ``logit_bias``, ``min_tokens``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty`` -- equal to transformers' processors on the same inputs (and to
OpenAI's formula where transformers has none), in greedy generation equal to transformers' ``generate``
token for token, and the same whether a request runs on one engine or is split prefill -> decode."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.request import TokenHistory
from engine.sampler import Sampler, SamplingRow, process_logits
from tests.p2p_harness import run_local_and_split
from tests.tiny_models import hf_model, random_prompts, tiny_model_dir

VOCAB = 320
PROMPT = [5, 17, 17, 200, 3, 9]
OUTPUT = [17, 40, 40, 40, 8]


def _processed(
    params: SamplingParams, logits: torch.Tensor, history: TokenHistory, index: int
) -> torch.Tensor:
    return process_logits(logits.clone()[None, :], [SamplingRow(params, index, history)])[0]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _hf(processor: transformers.LogitsProcessor, logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return processor(torch.tensor([ids]), logits.clone()[None, :])[0]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    logits = _logits(1)
    history = TokenHistory(PROMPT, OUTPUT, 0, ())
    ours = _processed(SamplingParams(repetition_penalty=penalty), logits, history, len(OUTPUT))
    theirs = _hf(transformers.RepetitionPenaltyLogitsProcessor(penalty), logits, PROMPT + OUTPUT)
    assert torch.equal(ours, theirs)


def test_min_tokens_equals_transformers_and_masks_every_stop_token() -> None:
    logits = _logits(2)
    eos = [7, 11]
    params = SamplingParams(min_tokens=4, max_tokens=8)
    history = TokenHistory(PROMPT, OUTPUT[:2], 0, tuple(eos))
    processor = transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, eos)
    for n in range(6):
        history = TokenHistory(PROMPT, OUTPUT[:n], 0, tuple(eos))
        ours = _processed(params, logits, history, n)
        assert torch.equal(ours, _hf(processor, logits, PROMPT + OUTPUT[:n])), f"after {n} output tokens"
        assert (ours[eos] == float("-inf")).all() == (n < 4)


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(3)
    bias = {3: -100.0, 50: 5.5, 319: -0.25}
    ours = _processed(SamplingParams(logit_bias=bias), logits, TokenHistory(PROMPT, OUTPUT, 0, ()), 0)
    processor = transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    assert torch.allclose(ours, _hf(processor, logits, PROMPT + OUTPUT))


def test_presence_and_frequency_follow_openai_over_the_output_only() -> None:
    logits = _logits(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = _processed(params, logits, TokenHistory(PROMPT, OUTPUT, 0, ()), len(OUTPUT))
    want = logits.clone()
    for t in set(OUTPUT):
        want[t] -= 0.5 + 0.25 * OUTPUT.count(t)
    assert torch.allclose(ours, want)
    assert ours[5] == logits[5]  # a prompt token that is not in the output is not penalized


def test_outputs_another_engine_sampled_count_as_outputs() -> None:
    """A decode node's prompt ends with the tokens the prefill node sampled: they are outputs."""
    logits = _logits(5)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2)
    here = _processed(params, logits, TokenHistory(PROMPT, OUTPUT, 0, ()), len(OUTPUT))
    split = _processed(params, logits, TokenHistory(PROMPT + OUTPUT[:2], OUTPUT[2:], 2, ()), len(OUTPUT))
    assert torch.equal(here, split)


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = _logits(6)[None, :]
    params = SamplingParams(logprobs=True, logit_bias={int(logits[0].argmin()): 100.0})
    out = Sampler()(logits.clone(), [SamplingRow(params, 0, TokenHistory(PROMPT, [], 0, ()))])
    assert out.token_ids == [int(logits[0].argmin())]  # the bias decided the token ...
    assert out.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1).min()))  # ... not its logprob


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101.0}}, "logit_bias[1]"),
    ],
)
def test_bad_processor_parameters_are_refused_naming_them(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        SamplingParams(**bad)


# ---- in generation ----------------------------------------------------------------------------------------

PROMPTS = random_prompts([9, 23], seed=11)
NEW = 12


def _hf_generate(prompt: list[int], **kwargs: object) -> list[int]:
    model = hf_model("llama")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_model_dir("llama"), dtype="float32", device="cpu", block_size=4, num_blocks=128)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        # 150 and 278: the greedy first tokens of the two prompts, banned
        ({"logit_bias": {150: -100.0, 278: -100.0}}, {"sequence_bias": {(150,): -100.0, (278,): -100.0}}),
    ],
    ids=["repetition_penalty", "logit_bias"],
)
def test_greedy_generation_equals_transformers(llm: LLM, ours: dict, theirs: dict) -> None:
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, **ours)
    for prompt in PROMPTS:
        [out] = llm.generate([prompt], params)
        assert out.token_ids == _hf_generate(prompt, **theirs)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in plain] != [o.token_ids for o in llm.generate(PROMPTS, params)]  # it did act


def test_min_tokens_holds_back_eos_like_transformers(llm: LLM) -> None:
    """The stop token is the greedy choice at once; min_tokens keeps it back for 5 tokens."""
    prompt = PROMPTS[0]
    eos = llm.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    params = SamplingParams(max_tokens=NEW, min_tokens=5, stop_token_ids=(eos,))
    [out] = llm.generate([prompt], params)
    theirs = _hf_generate(prompt, min_new_tokens=5, eos_token_id=eos)
    assert len(out.token_ids) >= 5 and out.token_ids == theirs[: len(out.token_ids)]
    assert eos not in out.token_ids[:5]


def test_penalties_are_the_same_split_prefill_to_decode() -> None:
    """The prefill engine samples the first token with the penalties, the decode engine counts it as an
    output: the tokens equal one engine's."""
    params = SamplingParams(
        max_tokens=NEW, presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.2
    )
    run = run_local_and_split("pen", PROMPTS[1], params)
    want = [t for o in run.local for t in o.new_token_ids]
    assert [*run.first.new_token_ids, *(t for o in run.decoded for t in o.new_token_ids)] == want


def test_min_tokens_is_the_same_split_prefill_to_decode() -> None:
    """min_tokens counts the prefill engine's token too (the review's finding: every split request with
    min_tokens >= 2 was refused)."""
    params = SamplingParams(max_tokens=6, min_tokens=6, stop_token_ids=(1, 2, 3))
    run = run_local_and_split("mintok", PROMPTS[0], params)
    want = [t for o in run.local for t in o.new_token_ids]
    assert len(want) == 6
    assert [*run.first.new_token_ids, *(t for o in run.decoded for t in o.new_token_ids)] == want


# ---- top logprobs -----------------------------------------------------------------------------------------


def test_top_logprobs_are_transformers_log_softmax_and_lead_with_the_greedy_token(llm: LLM) -> None:
    from tests.tiny_models import hf_logits

    prompt = PROMPTS[1]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=6, top_logprobs=5, ignore_eos=True))
    assert out.top_logprobs is not None and out.logprobs is not None and len(out.top_logprobs) == 6
    reference = hf_logits("llama", "float32", [*prompt, *out.token_ids]).log_softmax(-1)[len(prompt) - 1 : -1]
    for i, (token, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
        assert len(top) == 5 and top[0][0] == token and top[0][1] == pytest.approx(out.logprobs[i])
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        want = reference[i].topk(5)
        assert [t for t, _ in top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-3)


def test_top_logprobs_are_the_same_split_prefill_to_decode() -> None:
    run = run_local_and_split("top", PROMPTS[0], SamplingParams(max_tokens=5, top_logprobs=3))
    want = [t for o in run.local for t in o.new_top_logprobs]
    got = [*run.first.new_top_logprobs, *(t for o in run.decoded for t in o.new_top_logprobs)]
    assert [[t for t, _ in top] for top in got] == [[t for t, _ in top] for top in want]
    for a, b in zip(got, want, strict=True):
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)


def test_top_logprobs_among_ties_follow_greedy_s_rule_whatever_the_batch() -> None:
    """bfloat16 logits tie often.  The alternatives are ordered as greedy reads the logits -- highest
    first, the lowest token id among equals -- so the first is the token greedy chose, and a row's
    alternatives are its own: torch.topk picked among ties by the batch's largest k (an outside probe saw
    '.' / ',' alone become '.' / ' and' beside requests asking for more)."""
    vocab = 64
    row = torch.linspace(-3.0, 0.0, vocab)  # distinct, below the ties
    row[[10, 3]] = 5.0
    row[[50, 20, 7]] = 4.0
    history = TokenHistory(PROMPT, [], 0, ())

    def alternatives(n: int, companions: list[int]) -> list[tuple[int, float]]:
        params = [SamplingParams(max_tokens=4, top_logprobs=n)] + [
            SamplingParams(max_tokens=4, top_logprobs=k) for k in companions
        ]
        logits = torch.stack([row] + [torch.randn(vocab) for _ in companions])
        out = Sampler()(logits, [SamplingRow(p, 0, history) for p in params])
        assert out.token_ids[0] == 3  # argmax: the first index of the maximum
        return list(out.top_logprobs[0] or ())

    for n, want in ((1, [3]), (2, [3, 10]), (3, [3, 10, 7]), (5, [3, 10, 7, 20, 50])):
        alone = alternatives(n, [])
        assert [t for t, _ in alone] == want
        for companions in ([20], [1, 5], [n, 20, 7]):
            assert alternatives(n, companions) == alone
