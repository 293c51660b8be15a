"""Structured outputs (engine/structured.py): every kind of constraint holds, greedy output is the
unconstrained one wherever its tokens are allowed, a constraint holds across a prefill -> decode split,
constrained and free requests share a batch without changing each other, and a constraint that does not
compile is refused naming it."""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.structured import GrammarError, StructuredOutput
from tests.p2p_harness import run_local_and_split
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
        assert list(value) == ["name", "age", "ok", "color"]  # the schema's order (it had been sorted)


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
    params = SamplingParams(max_tokens=120, structured=StructuredOutput.json_schema(SCHEMA))
    run = run_local_and_split("st", [5, 17, 33, 90, 12, 7, 200, 41, 8], params)
    want = [t for o in run.local for t in o.new_token_ids]
    assert [*run.first.new_token_ids, *(t for o in run.decoded for t in o.new_token_ids)] == want
    assert run.decoded[-1].finish_reason == "stop"


def test_ignore_eos_with_a_constraint_adds_no_stray_token_and_min_tokens_is_refused(llm: LLM) -> None:
    """A complete constraint allows only EOS: with ignore_eos the request ends at that EOS, not at a
    second one.  min_tokens could not be kept past a complete constraint (an outside probe: 3 tokens
    served for min_tokens 5, silently): refused by name."""
    choices = ["yes", "no"]
    with pytest.raises(ValueError, match="min_tokens is not served with a structured output"):
        SamplingParams(max_tokens=20, structured=StructuredOutput.choice(choices), min_tokens=5)
    params = SamplingParams(max_tokens=20, structured=StructuredOutput.choice(choices), ignore_eos=True)
    [out] = llm.generate(["Is it?"], params)
    assert out.text in choices and out.finish_reason == "stop"
    assert 0 not in out.token_ids[:-1] and len(out.token_ids) <= 4, out.token_ids
