"""Structured outputs (engine/structured.py): every kind of constraint holds, greedy output is the
unconstrained one wherever its tokens are allowed, a constraint holds across a prefill -> decode split,
constrained and free requests share a batch without changing each other, and a constraint that does not
compile is refused naming it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.connector.params import RemoteDecode
from engine.structured import GrammarError, StructuredOutput
from tests.p2p_harness import make_engine, run_until
from tests.tiny_models import pdkv_tiny_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about a person.", "Describe a colour", "Hello"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(pdkv_tiny_model_dir(), dtype="float32", device="cpu", block_size=4, num_blocks=256)


def _generate(llm: LLM, spec: StructuredOutput, prompts: list[str] = PROMPTS, **params: object) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, structured=spec, **params))  # type: ignore[arg-type]
    assert all(o.finish_reason == "stop" for o in outs), [o.finish_reason for o in outs]
    return [o.text for o in outs]


def test_a_json_schema_holds(llm: LLM) -> None:
    for text in _generate(llm, StructuredOutput.json_schema(SCHEMA)):
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok", "color"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert isinstance(value["ok"], bool) and value["color"] in SCHEMA["properties"]["color"]["enum"]  # type: ignore[index]


def test_json_object_regex_choice_and_grammar_hold(llm: LLM) -> None:
    assert all(isinstance(json.loads(t), dict) for t in _generate(llm, StructuredOutput("json_object")))
    for text in _generate(llm, StructuredOutput("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")):
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text)
    choices = ["alpha", "beta gamma", 'quo"te']
    assert all(t in choices for t in _generate(llm, StructuredOutput.choice(choices)))
    grammar = 'start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
    for text in _generate(llm, StructuredOutput("grammar", grammar)):
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text)


def test_ignore_eos_still_stops_when_the_constraint_is_complete(llm: LLM) -> None:
    assert _generate(llm, StructuredOutput.choice(["yes", "no"]), ignore_eos=True)[0] in ("yes", "no")


def test_the_mask_only_removes_tokens(llm: LLM) -> None:
    """Greedy with a constraint the unconstrained output satisfies is the unconstrained output."""
    prompts = [*PROMPTS, "One two three", "The capital of", "Once upon a time", "Numbers: 1, 2,"]
    free = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    # Outputs whose text is their tokens' text (not a token that is half a UTF-8 character): a choice of
    # that text, or another, allows every one of their tokens.
    clean = [(p, o) for p, o in zip(prompts, free, strict=True) if "\ufffd" not in o.text]
    assert len(clean) >= 2
    for prompt, out in clean:
        spec = StructuredOutput.choice([out.text, "zzz never"])
        [constrained] = llm.generate([prompt], SamplingParams(max_tokens=20, structured=spec))
        assert constrained.token_ids[: len(out.token_ids)] == out.token_ids and constrained.text == out.text


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    free = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, free)]
    spec = StructuredOutput.json_schema(SCHEMA)
    mixed = llm.generate(
        [*PROMPTS, *PROMPTS], [free] * 3 + [SamplingParams(max_tokens=60, structured=spec)] * 3
    )
    assert [o.token_ids for o in mixed[:3]] == alone
    assert all(isinstance(json.loads(o.text), dict) for o in mixed[3:])


def test_a_constraint_that_does_not_compile_is_refused_naming_it(llm: LLM) -> None:
    for spec, what in (
        (StructuredOutput("regex", "(unclosed"), "structured.regex"),
        (StructuredOutput("json_schema", '{"type": "nope"}'), "structured.json_schema"),
        (StructuredOutput("json_schema", "not json"), "structured.json_schema"),
        (StructuredOutput("grammar", "start: undefined_rule"), "structured.grammar"),
    ):
        with pytest.raises(GrammarError, match=re.escape(what)):
            llm.engine.grammars.compile(spec)
        with pytest.raises(ValueError, match=re.escape(what)):
            llm.engine.add_request("bad", "hi", SamplingParams(structured=spec))
    with pytest.raises(ValueError, match=r"structured\.choice"):
        StructuredOutput.choice([])
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids  # and it carries on


def test_compiled_once_per_constraint(llm: LLM) -> None:
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert llm.engine.grammars.compile(spec) is llm.engine.grammars.compile(
        StructuredOutput(spec.kind, spec.spec)
    )


def test_a_constraint_holds_across_a_prefill_decode_split() -> None:
    """The prefill engine samples the first token under the constraint; the decode engine's matcher
    advances over it first: the tokens equal one engine's."""
    spec = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(max_tokens=60, structured=spec)
    prompt = [5, 17, 33, 90, 12, 7, 200, 41, 8]
    local = make_engine("st-local", p2p=False)
    local.add_request("r", prompt, params)
    want = [
        t
        for o in run_until([local], lambda: not local.has_unfinished_requests())["r"]
        for t in o.new_token_ids
    ]
    producer, consumer = make_engine("st-p"), make_engine("st-d")
    try:
        producer.add_request(
            "r", prompt, dataclasses.replace(params, max_tokens=1), kv_transfer_params=RemoteDecode()
        )
        first = run_until([producer], lambda: producer.scheduler.get_request("r") is None)["r"][-1]
        token = first.new_token_ids[0]
        consumer.add_request(
            "r",
            [*prompt, token],
            dataclasses.replace(params, max_tokens=59),
            kv_transfer_params=first.kv_transfer_params,
            prior_output_token_ids=[token],
        )
        outs = run_until(
            [consumer, producer], lambda: not consumer.has_pending_work() and not producer.has_pending_work()
        )
        assert [token, *(t for o in outs["r"] for t in o.new_token_ids)] == want
        assert outs["r"][-1].finish_reason == "stop"
    finally:
        for engine in (local, producer, consumer):
            engine.shutdown()
