"""Grammar engines for structured outputs, measured against each other on the CPU: llguidance and xgrammar
with the embedded model's tokenizer (SmolLM2-135M-Instruct, vocabulary 49152, EOS ``<|im_end|>``).

    python -m bench.grammar_engines [--quick] [--json PATH] [--runs N]

Each engine runs the same cases, in turns (a load spike from elsewhere on the shared host hits both):

    json    the 20-field schema of ``bench.structured`` (strings, integers, numbers, booleans, enums, nested
            objects, arrays; all required, ``additionalProperties: false``), written as OpenAI's strict mode
            writes JSON (``", "`` and ``": "``, no other whitespace); the instance is 209 tokens
    date    the regex ``\\d{4}-\\d{2}-\\d{2}``             email   an email-like regex
    choice  one of 5 strings                              lark    a small arithmetic Lark grammar

Figures, per engine (``llguidance_*``, ``xgrammar_*``), medians over ``--runs`` runs:

    tokenizer_ms               building the engine's token table from the tokenizer (once per process)
    <case>_compile_ms          compiling a constraint the engine has not seen (json: a new schema each run)
    json_compile_cached_ms     a ready matcher for a schema compiled before: llguidance has no cache of its
                               own (engine/structured.py keeps templates), so a ``deep_copy`` of the
                               template; xgrammar's compiler cache hit plus a ``GrammarMatcher``
    <case>_mask_us_mean/_p99   one token's mask (bitmask into a preallocated int32 row: llguidance.numpy's
                               fill, xgrammar's torch tensor), over the instance tokenized by the model's
                               tokenizer, then EOS; a fresh matcher from a grammar compiled before
    <case>_advance_us_mean     consuming one token
    <case>_total_us            every mask and advance of the instance
    json_first_walk_us         the same total on a freshly compiled schema (lazy work lands here)
    json_steps_masks_differ    steps of the json instance where the two masks differ (special tokens left
                               out; json_tokens_masks_differ_max: the most tokens in one step's difference)
    import_ms                  ``import <engine>`` in a fresh interpreter
    installed_mib              the engine's own installed files (its dependencies are listed, not counted)

Ratios ``xgrammar_over_llguidance_*``: above 1, llguidance is faster.  After the figures, the features each
engine has (checked here, not taken from its documentation) and what it does on invalid input.

The engines are imported lazily; one that is not installed is named, and the other is measured alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import Report, parser
from bench.structured import twenty_fields

ENGINES = ("llguidance", "xgrammar")
# What engine/structured.py asks llguidance for: JSON as OpenAI's strict mode writes it.
JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DATE = r"\d{4}-\d{2}-\d{2}"
EMAIL = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


def instance(schema: dict[str, Any]) -> dict[str, Any]:
    """A valid instance of a ``twenty_fields`` schema."""
    out: dict[str, Any] = {}
    for key, prop in schema["properties"].items():
        kind = prop.get("type")
        if "enum" in prop:
            out[key] = prop["enum"][1]
        elif kind == "string":
            out[key] = f"value of {key}"
        elif kind == "integer":
            out[key] = 1234
        elif kind == "number":
            out[key] = 3.25
        elif kind == "boolean":
            out[key] = True
        elif kind == "object":
            out[key] = {"x": 7, "y": "why"}
        else:
            out[key] = ["red", "green"]
    return out


# Constraints as (kind, spec): kind is json_schema, regex, choice or lark; spec is text.
Spec = tuple[str, str]


class Engine:
    """One engine behind the calls the benchmark makes."""

    name = ""
    modules: tuple[str, ...] = ()  # imported before the token table's build is timed

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        raise NotImplementedError

    def compile(self, spec: Spec) -> Any:
        """A template matcher (llguidance) or compiled grammar (xgrammar); raises on invalid input."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def new_mask(self) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, mask: Any) -> None:
        raise NotImplementedError

    def advance(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def allowed(self, mask: Any, token: int) -> bool:
        row = mask.numpy() if hasattr(mask, "numpy") else mask
        return bool((int(row[0, token >> 5]) >> (token & 31)) & 1)

    def allowed_ids(self, mask: Any, ids: Sequence[int]) -> list[int]:
        return [t for t in ids if self.allowed(mask, t)]

    def complete(self, matcher: Any) -> bool:
        raise NotImplementedError

    def rollback(self, matcher: Any, n: int) -> None:
        raise NotImplementedError

    def fast_forward(self, matcher: Any) -> list[int]:
        raise NotImplementedError


class ErrorState(ValueError):
    """llguidance's way to refuse: no exception, a matcher in an error state (``get_error()``)."""


class LLGuidance(Engine):
    name = "llguidance"
    modules = ("llguidance", "llguidance.numpy")

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.numpy

        self._llg = llguidance
        self._np = llguidance.numpy
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(hf_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)

    def grammar(self, spec: Spec) -> str:
        kind, text = spec
        m = self._llg.LLMatcher
        if kind == "json_schema":
            return str(m.grammar_from_json_schema(text, defaults=JSON_STYLE))
        if kind == "regex":
            return str(m.grammar_from_regex(text))
        if kind == "choice":
            return str(m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text))))
        return str(m.grammar_from_lark(text))

    def compile(self, spec: Spec) -> Any:
        template = self._llg.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if template.is_error():  # the constructor never raises: the matcher is left in an error state
            raise ErrorState(template.get_error())
        return template

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def new_mask(self) -> Any:
        return self._np.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, mask: Any) -> None:
        self._np.fill_next_token_bitmask(matcher, mask, 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def complete(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())

    def rollback(self, matcher: Any, n: int) -> None:
        if not matcher.rollback(n):
            raise RuntimeError(matcher.get_error())

    def fast_forward(self, matcher: Any) -> list[int]:
        return list(matcher.compute_ff_tokens())


class XGrammar(Engine):
    name = "xgrammar"
    modules = ("xgrammar", "transformers")

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        # The documented route: a transformers tokenizer (xgrammar requires transformers anyway).
        wrapped = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: Spec) -> Any:
        kind, text = spec
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(text)))
        return c.compile_lark(text)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def new_mask(self) -> Any:
        return self._xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, mask: Any) -> None:
        matcher.fill_next_token_bitmask(mask, 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def complete(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)

    def fast_forward(self, matcher: Any) -> list[int]:
        return list(matcher.find_jump_forward_tokens())


CLASSES: dict[str, type[Engine]] = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def walk(engine: Engine, matcher: Any, tokens: Sequence[int]) -> tuple[list[float], list[float]]:
    """Mask then advance at every token (µs each); raises if the engine refuses a token of the instance."""
    mask = engine.new_mask()
    masks, advances = [], []
    clock = time.perf_counter_ns
    for i, token in enumerate(tokens):
        t0 = clock()
        engine.fill(matcher, mask)
        t1 = clock()
        ok = engine.advance(matcher, token)
        t2 = clock()
        if not ok or not engine.allowed(mask, token):
            raise RuntimeError(f"{engine.name} refused token {i} ({token}) of a valid instance")
        masks.append((t1 - t0) / 1000)
        advances.append((t2 - t1) / 1000)
    return masks, advances


def p99(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def timed_ms(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t0) * 1000, out


def import_ms(module: str, repeat: int) -> float:
    """``import module`` in a fresh interpreter (same sys.path), minus a bare interpreter's start."""
    code = "import time; t = time.perf_counter(); import {}; print((time.perf_counter() - t) * 1000)"
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", code.format(module)], capture_output=True, text=True, check=True
        )
        runs.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(runs)


def footprint(name: str) -> tuple[float, list[str]]:
    """MiB of the distribution's own files, and its required dependencies (extras left out)."""
    dist = importlib.metadata.distribution(name)
    size = sum(f.size or 0 for f in dist.files or ())
    requires = [r.split(";")[0].strip() for r in dist.requires or () if "extra ==" not in r]
    return size / 2**20, requires


def measure(
    engines: dict[str, Engine], cases: dict[str, tuple[Spec, list[int]]], runs: int, report: Report
) -> None:
    """Compile and walk every case with every engine, the engines in turns within each run."""
    for case, (spec, tokens) in cases.items():
        compile_ms: dict[str, list[float]] = {n: [] for n in engines}
        stats: dict[str, dict[str, list[float]]] = {
            n: {"mean": [], "p99": [], "adv": [], "total": []} for n in engines
        }
        compiled: dict[str, Any] = {}
        for run in range(runs):
            for name, engine in engines.items():
                run_spec = spec
                if case == "json":  # a schema new to the compiler every run
                    run_spec = ("json_schema", json.dumps(twenty_fields(1000 + run)))
                ms, compiled[name] = timed_ms(engine.compile, run_spec)
                compile_ms[name].append(ms)
                if case == "json" and run == 0:  # the first walk of a fresh grammar
                    m, a = walk(engine, engine.matcher(compiled[name]), tokens)
                    report.figure(f"{name}_json_first_walk_us", sum(m) + sum(a))
                # the steady state: a fresh matcher from a grammar compiled (and walked) before
                m, a = walk(engine, engine.matcher(compiled[name]), tokens)
                m, a = walk(engine, engine.matcher(compiled[name]), tokens)
                s = stats[name]
                s["mean"].append(statistics.fmean(m))
                s["p99"].append(p99(m))
                s["adv"].append(statistics.fmean(a))
                s["total"].append(sum(m) + sum(a))
        for name in engines:
            med = {k: statistics.median(v) for k, v in stats[name].items()}
            report.figure(f"{name}_{case}_compile_ms", statistics.median(compile_ms[name]))
            report.figure(f"{name}_{case}_mask_us_mean", med["mean"])
            report.figure(f"{name}_{case}_mask_us_p99", med["p99"])
            report.figure(f"{name}_{case}_advance_us_mean", med["adv"])
            report.figure(f"{name}_{case}_total_us", med["total"])
        if case == "json":
            report.figure("json_instance_tokens", len(tokens))
            for name, engine in engines.items():
                engine.compile(spec)  # compiled before (xgrammar caches it by its text)
                template = engine.compile(spec)
                cached = []
                for _ in range(runs):
                    if name == "xgrammar":  # its compiler's cache, then a matcher
                        ms, _ = timed_ms(lambda e=engine, s=spec: e.matcher(e.compile(s)))
                    else:  # a template kept by the caller (engine/structured.py), copied
                        ms, _ = timed_ms(engine.matcher, template)
                    cached.append(ms)
                report.figure(f"{name}_json_compile_cached_ms", statistics.median(cached))


def mask_differences(
    engines: dict[str, Engine], tokens: Sequence[int], spec: Spec, skip: set[int]
) -> list[int]:
    """At each step of the instance, how many tokens one engine allows and the other does not (the ids
    in ``skip`` left out)."""
    import numpy as np

    pairs = [(e, e.matcher(e.compile(spec)), e.new_mask()) for e in engines.values()]
    keep = np.ones(32 * pairs[0][2].shape[1], dtype=bool)
    keep[list(skip)] = False
    out = []
    for token in tokens:
        bits = []
        for engine, matcher, mask in pairs:
            engine.fill(matcher, mask)
            row = np.asarray(mask.numpy() if hasattr(mask, "numpy") else mask)[0]
            bits.append(np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool) & keep)
            engine.advance(matcher, token)
        out.append(int((bits[0] != bits[1]).sum()))
    return out


def accepts(engine: Engine, spec: Spec, tokens: Sequence[int]) -> bool:
    matcher = engine.matcher(engine.compile(spec))
    return all(engine.advance(matcher, t) for t in tokens) and engine.complete(matcher)


def schema_keyword(engine: Engine, encode: Callable[[str], list[int]], probe: tuple[Any, str, str]) -> str:
    """What the engine does with a schema keyword: refused, enforced (an instance breaking it is
    refused), ignored (accepted), or wrong (a valid instance is refused)."""
    schema, good, bad = probe
    spec = ("json_schema", json.dumps(schema))
    try:
        engine.compile(spec)
    except Exception as exc:
        return f"refused ({first_line(exc)})"
    if not accepts(engine, spec, encode(good)):
        return "wrong (refuses a valid instance)"
    return "ignored" if accepts(engine, spec, encode(bad)) else "enforced"


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:110]
    return (
        f"error state, no exception: {text}"
        if isinstance(exc, ErrorState)
        else f"raises {type(exc).__name__}: {text}"
    )


ABSENT = "additionalProperties absent: an extra key"
SCHEMA_PROBES: dict[str, tuple[Any, str, str]] = {
    "additionalProperties false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"a": 1}',
        '{"a": 1, "b": 2}',
    ),
    ABSENT: (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a": 1}',
        '{"a": 1, "b": 2}',
    ),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a": 1}',
        "{}",
    ),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{3}$"}, '"ABC"', '"abc"'),
    "format: email": ({"type": "string", "format": "email"}, '"a@b.org"', '"not an email"'),
    "format: date-time": (
        {"type": "string", "format": "date-time"},
        '"2024-05-17T10:00:00Z"',
        '"yesterday"',
    ),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    "maxLength string: an escape (valid JSON)": (
        {"type": "string", "maxLength": 10},
        '"a\\nb"',
        '"a\\qb"',
    ),
    "maxLength string: a raw control character (invalid JSON)": (
        {"type": "string", "maxLength": 10},
        '"ab"',
        '"a\x01b"',
    ),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, "5", "12"),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "10", "7"),
    "minItems/maxItems": (
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        "[1, 2]",
        "[1, 2, 3]",
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "3", "true"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "5", "1"),
    "$ref (recursive)": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    "required": ["next"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"next": {"next": null}}',
        '{"next": 1}',
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        '[1, "a"]',
        '["a", 1]',
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        '{"x1": 1}',
        '{"y": 1}',
    ),
    "not": ({"not": {"type": "string"}}, "1", '"s"'),
    "if/then": (
        {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 5}},
        "10",
        "7",
    ),
}

INVALID: dict[str, Spec] = {
    "schema with an unknown type": ("json_schema", '{"type": "strin"}'),
    "schema that is not JSON": ("json_schema", '{"type": '),
    "regex with an open group": ("regex", "(ab"),
    "Lark with an undefined rule": ("lark", "start: undefined_rule"),
}


def features(
    engine: Engine,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    eos: int,
    json_spec: Spec,
    special: Sequence[int],
) -> dict[str, str]:
    """Each feature as this engine has it, found by trying it."""
    out: dict[str, str] = {}
    for key, probe in SCHEMA_PROBES.items():
        found = schema_keyword(engine, encode, probe)
        if key == ABSENT:  # no keyword to enforce: which default the engine takes
            found = {"ignored": "allowed (JSON Schema's rule)", "enforced": "refused (strict)"}.get(
                found, found
            )
        out[f"json schema: {key}"] = found
    for key, spec, good, bad in (
        ("regex", ("regex", DATE), "2024-05-17", "2024-5-17"),
        ("choice", ("choice", json.dumps(CHOICES)), "neutral", "neutrality"),
        ("Lark grammar", ("lark", LARK), "(12+3)*45", "(12+3"),
    ):
        try:
            ok = accepts(engine, spec, encode(good)) and not accepts(engine, spec, encode(bad))
            out[key] = "yes" if ok else "wrong"
        except Exception as exc:
            out[key] = f"refused ({first_line(exc)})"
    out["GBNF/EBNF grammar"] = (
        "via llguidance.gbnf_to_lark (GBNF -> Lark)" if engine.name == "llguidance" else "yes (native)"
    )
    # Rollback: advance 8 tokens, roll 5 back, the same 5 again, then the rest of the instance.
    tokens = [*encode(json.dumps(instance(json.loads(json_spec[1])))), eos]
    matcher = engine.matcher(engine.compile(json_spec))
    try:
        assert all(engine.advance(matcher, t) for t in tokens[:8])
        engine.rollback(matcher, 5)
        assert all(engine.advance(matcher, t) for t in tokens[3:])
        out["rollback"] = "yes"
    except Exception as exc:
        out["rollback"] = f"no ({first_line(exc)})"
    ff = engine.fast_forward(engine.matcher(engine.compile(json_spec)))
    out["fast-forward at the schema's start"] = f"{len(ff)} tokens, {decode(ff)!r}" if ff else "none"
    # Special tokens (<|im_start|>, <|endoftext|>, ...) where the schema wants a string's characters.
    matcher = engine.matcher(engine.compile(("json_schema", '{"type": "string"}')))
    engine.advance(matcher, encode('"')[0])
    mask = engine.new_mask()
    engine.fill(matcher, mask)
    leaked = engine.allowed_ids(mask, special)
    out["special tokens allowed inside a JSON string"] = f"{len(leaked)} of {len(special)}"
    for key, spec in INVALID.items():
        try:
            engine.compile(spec)
            out[f"invalid: {key}"] = "accepted"
        except Exception as exc:
            out[f"invalid: {key}"] = first_line(exc)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("grammar engines for structured outputs: llguidance against xgrammar")
    p.add_argument("--runs", type=int, default=None, help="runs per figure (default 7, --quick 3)")
    args: Any = p.parse_args(argv)
    runs = args.runs or (3 if args.quick else 7)

    missing = [n for n in ENGINES if not installed(n)]
    for name in missing:
        print(
            f"bench.grammar_engines: {name} is not installed (pip install {name}); not measured",
            file=sys.stderr,
        )
    if len(missing) == len(ENGINES):
        return 2

    from engine.model.embedded import default_model_path
    from router.tokenizer import load_model

    model = load_model(default_model_path())
    tok = model.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else model.eos_token_ids[0]
    hf = tok._tok  # the tokenizers.Tokenizer pdkv's Tokenizer wraps

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    report = Report(f"grammar engines: {model.name} tokenizer (vocab {model.vocab_size}), {runs} runs")
    engines: dict[str, Engine] = {}
    for name in ENGINES:
        if name in missing:
            continue
        for module in CLASSES[name].modules:
            importlib.import_module(module)
        ms, engines[name] = timed_ms(CLASSES[name], hf, model.vocab_size, eos)
        report.figure(f"{name}_tokenizer_ms", ms)

    schema = twenty_fields(0)
    json_spec = ("json_schema", json.dumps(schema))
    cases = {
        "json": (json_spec, [*encode(json.dumps(instance(schema))), eos]),
        "date": (("regex", DATE), [*encode("2024-05-17"), eos]),
        "email": (("regex", EMAIL), [*encode("ada.lovelace@example.org"), eos]),
        "choice": (("choice", json.dumps(CHOICES)), [*encode("neutral"), eos]),
        "lark": (("lark", LARK), [*encode("(12+3)*45-6/7"), eos]),
    }
    measure(engines, cases, runs, report)

    deps: dict[str, list[str]] = {}
    for name in engines:
        report.figure(f"{name}_import_ms", import_ms(name, 1 if args.quick else 3))
        mib, deps[name] = footprint(name)
        report.figure(f"{name}_installed_mib", mib)

    if len(engines) == len(ENGINES):
        f = report.figures
        for key in (
            "json_mask_us_mean",
            "json_mask_us_p99",
            "json_total_us",
            "json_compile_ms",
            "json_compile_cached_ms",
            "json_first_walk_us",
            "date_mask_us_mean",
            "email_mask_us_mean",
            "choice_mask_us_mean",
            "lark_mask_us_mean",
        ):
            report.ratio(f"xgrammar_over_llguidance_{key}", f[f"xgrammar_{key}"] / f[f"llguidance_{key}"])
    special = [t for t in range(model.vocab_size) if t != eos and tok.decode([t]) == ""][:64]
    if len(engines) == len(ENGINES):
        # xgrammar lets the special tokens through where a string's characters go: counted apart
        differ = mask_differences(engines, cases["json"][1], json_spec, set(special))
        report.figure("json_steps_masks_differ", sum(1 for d in differ if d))
        report.figure("json_tokens_masks_differ_max", max(differ))
    report.emit(args.json)

    found = {name: features(e, encode, tok.decode, eos, json_spec, special) for name, e in engines.items()}
    print("== features (tried here)")
    for key in next(iter(found.values())):
        print(f"  {key}")
        for name in found:
            print(f"    {name:<11} {found[name][key]}")
    print("== dependencies (required, extras left out)")
    for name, reqs in deps.items():
        print(f"  {name:<11} {', '.join(reqs) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
