"""Sampling: seeds reproduce across batch compositions and preemption, filters, stop rules, ignore_eos."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import TokenHistory
from engine.sampler import Sampler, SamplingRow, mix_seed
from tests.tiny_models import pdkv_tiny_model_dir, random_prompts

PROMPT = "Once upon a time, there was a little house"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(pdkv_tiny_model_dir(), dtype="float32", device="cpu", block_size=4, num_blocks=512)


def sample(llm: LLM, prompt: str | list[int] = PROMPT, **params: object) -> list[int]:
    [out] = llm.generate([prompt], SamplingParams(**{"max_tokens": 12, **params}))  # type: ignore[arg-type]
    return out.token_ids


def test_seed_reproduces_alone_and_in_any_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = random_prompts([3, 30, 11], seed=5, vocab=256)
    batch = [others[0], PROMPT, others[1], others[2]]
    mixed_params = [
        SamplingParams(max_tokens=5, temperature=0.7, ignore_eos=True),
        params,
        SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True),
    ]
    in_batch = llm.generate(batch, mixed_params)[1].token_ids
    assert in_batch == alone
    assert (
        llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True))[
            0
        ].token_ids
        != alone
    )


def test_seed_reproduces_across_preemption() -> None:
    llm = LLM(pdkv_tiny_model_dir(), dtype="float32", device="cpu", block_size=4, num_blocks=14)
    prompts = random_prompts([20, 20, 20], seed=3, vocab=256)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.stats().counter("num_preemptions") > 0
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_top_k_1_and_tiny_top_p_and_min_p_1_equal_greedy(llm: LLM) -> None:
    greedy = sample(llm, ignore_eos=True)
    assert sample(llm, temperature=1.5, top_k=1, seed=3, ignore_eos=True) == greedy
    assert sample(llm, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True) == greedy
    assert sample(llm, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True) == greedy


def test_a_vanishing_temperature_is_greedy_not_token_zero(llm: LLM) -> None:
    """logits / 1e-300 overflow to inf and softmax(inf) is NaN, whose argmax is token 0: an outside client
    saw every output token be 0.  Temperatures below 1e-5 are greedy."""
    greedy = sample(llm, ignore_eos=True)
    assert set(greedy) != {0}
    for t in (1e-300, 1e-30, 1e-6):
        assert sample(llm, temperature=t, seed=5, ignore_eos=True) == greedy, t
        assert sample(llm, temperature=t, ignore_eos=True) == greedy, t


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_numbers_are_refused_naming_the_field(field: str, value: float) -> None:
    from pdkv_proto.pdkv.v1 import types_pb2
    from serving.convert import sampling_params
    from serving.errors import ServingError

    with pytest.raises(ValueError, match=rf"^{field} must be a finite number"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ServingError, match=rf"sampling\.{field} must be a finite number") as err:
        sampling_params(types_pb2.SamplingParams(**{field: value}))
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_sampler_filters_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler(seed=0)

    def support(**params: object) -> set[int]:
        p = SamplingParams(temperature=1.0, **params)  # type: ignore[arg-type]
        return {sampler(logits, [SamplingRow(p, i)]).token_ids[0] for i in range(300)}

    assert support() == set(range(6))  # seeds per output index: 300 draws reach every token
    assert support(top_k=2) == {0, 1}
    # softmax: [0.64, 0.24, 0.09, ...]: the top two hold 0.87 >= 0.8
    assert support(top_p=0.8) == {0, 1}
    assert support(top_p=0.0) == {0}  # OpenAI's range starts at 0: the most likely token only
    # min_p 0.3: keep tokens with p >= 0.3 * 0.64, i.e. tokens 0 and 1
    assert support(min_p=0.3) == {0, 1}


def test_seeded_sampler_depends_only_on_seed_and_index() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=11)
    a = Sampler(seed=1)(logits, [SamplingRow(p, 0), SamplingRow(p, 1), SamplingRow(p, 2)]).token_ids
    b = Sampler(seed=2)(logits[1:2], [SamplingRow(p, 1)]).token_ids
    assert a[1] == b[0]
    assert mix_seed(11, 1) != mix_seed(11, 2) != mix_seed(12, 1)


def test_logprobs_are_of_the_chosen_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    out = Sampler()(logits, [SamplingRow(SamplingParams(logprobs=True), 0)])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 0]))


def test_bfloat16_logits_give_the_float32_logits_tokens_and_logprobs() -> None:
    """The runner hands the sampler the LM head's bfloat16 logits: greedy rows read by the native argmax as
    they are, any other row (logprobs, a processor, a temperature) through their float32 copy -- the same
    tokens and logprobs as the float32 logits give, rows mixed or not."""
    from engine.native import native_kernels

    kernels = native_kernels()
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 301, generator=gen) * 4).to(torch.bfloat16)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the first wins
    greedy = SamplingParams()
    cases = [
        [greedy] * 6,
        [greedy, SamplingParams(logprobs=True, top_logprobs=2), greedy, greedy, greedy, greedy],
        [greedy, greedy, SamplingParams(temperature=0.8, seed=5), greedy, greedy, greedy],
        [greedy, greedy, greedy, SamplingParams(repetition_penalty=1.3), greedy, greedy],
    ]
    history = TokenHistory([5, 7, 250], [7], 0, ())
    for params in cases:
        rows = [SamplingRow(p, 0, history) for p in params]
        for argmax in (None, kernels.argmax if kernels is not None else None):
            sampler, reference = Sampler(seed=9), Sampler(seed=9)
            sampler.argmax = reference.argmax = argmax
            got, want = sampler(logits, rows), reference(logits.float(), rows)
            assert got == want
    assert Sampler()(logits, [SamplingRow(greedy, 0)] * 6).token_ids[1] == 7


def test_stop_string_cuts_text_exactly(llm: LLM) -> None:
    [full] = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))
    text = full.text
    assert len(text) >= 8, "the tiny model must produce some text for this test"
    stop = text[5:8]
    cut = text.find(stop)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop, "\x00never")))
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_without_its_text(llm: LLM) -> None:
    full = sample(llm, max_tokens=16, ignore_eos=True)
    k = 4
    token = full[k]
    first = full.index(token)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(token,)))
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token
    assert out.text == llm.tokenizer.decode(full[:first])


def test_eos_stops_unless_ignored(tmp_path: Path) -> None:
    """Make a greedy output token the model's EOS: generation stops there, unless ignore_eos."""
    src = pdkv_tiny_model_dir()
    probe = LLM(src, dtype="float32", device="cpu", block_size=4, num_blocks=128)
    full = probe.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    eos = full[3]
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(folder, dtype="float32", device="cpu", block_size=4, num_blocks=128)
    [stopped] = llm.generate([PROMPT], SamplingParams(max_tokens=12))
    assert stopped.token_ids == full[: full.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    [ignored] = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert ignored.token_ids == full and ignored.finish_reason == "length"


def test_max_tokens_caps_the_output(llm: LLM) -> None:
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("options", "limit"),
    [
        ({"stop": [f"s{i}" for i in range(200_000)]}, "the limit is 32"),
        ({"stop": ["x" * 5000]}, "the limit is 1024"),
        ({"stop_token_ids": list(range(100_000))}, "the limit is 256"),
    ],
)
def test_unbounded_stop_conditions_are_refused_naming_the_limit(options: dict, limit: str) -> None:  # type: ignore[type-arg]
    from engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=limit):  # counted before any entry is looked at
        SamplingParams(**options)
