"""Structured outputs on the embedded model: decode throughput under a JSON-schema constraint against the
same batch unconstrained, and the compile time of a 20-field schema.

    python -m bench.structured [--quick] [--json PATH] [--batch 8] [--tokens 64]

``structured_decode_fraction`` (target >= 0.9 at batch 8): decode tokens/s with every request of the batch
under a JSON schema over the same batch without one, the two run in turns (the decode time is the wall time
after the batch's last first token).  ``schema_compile_ms``: compiling a 20-field schema the compiler has
not seen (llguidance; the tokenizer's table built beforehand), median of several schemas.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import Report, parser

# A long free string keeps a constrained request decoding as long as a free one.
LONG = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def twenty_fields(tag: int) -> dict[str, Any]:
    """A 20-field schema (strings, integers, numbers, booleans, enums, a nested object, an array); ``tag``
    makes each one new to the compiler's cache."""
    props: dict[str, Any] = {}
    for i in range(20):
        kind = i % 7
        if kind == 0:
            props[f"s{i}"] = {"type": "string", "maxLength": 40, "description": f"field {i} of {tag}"}
        elif kind == 1:
            props[f"i{i}"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        elif kind == 2:
            props[f"n{i}"] = {"type": "number"}
        elif kind == 3:
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == 4:
            props[f"e{i}"] = {"enum": ["alpha", "beta", "gamma", f"tag{tag}"]}
        elif kind == 5:
            props[f"o{i}"] = {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "string"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        else:
            props[f"a{i}"] = {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def decode_rate(llm: Any, prompts: list[str], params: Any) -> tuple[float, int]:
    """Decode tokens/s of one batch (tokens after each request's first, over the time after the last
    first token) and the tokens generated."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    first = max(o.time_to_first_token or 0.0 for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return (tokens - len(outs)) / max(elapsed - first, 1e-9), tokens


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "structured outputs benchmark")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default 64, --quick 24)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each, in turns (default 3, --quick 1)")
    args: Any = p.parse_args(argv)
    tokens = args.tokens or (24 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)

    from engine import LLM, SamplingParams
    from engine.model.embedded import default_model_path
    from engine.structured import GrammarCompiler, StructuredOutput

    llm = LLM(default_model_path(), device="cpu")
    prompts = [f"Write a short note number {i} about the sea, in JSON." for i in range(args.batch)]
    free = SamplingParams(max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=tokens, ignore_eos=True, structured=StructuredOutput.json_schema(LONG)
    )
    decode_rate(llm, prompts, constrained)  # warm-up: compiles the schema, touches every path
    free_rates, constrained_rates, constrained_tokens = [], [], 0
    for _ in range(rounds):
        free_rates.append(decode_rate(llm, prompts, free)[0])
        rate, n = decode_rate(llm, prompts, constrained)
        constrained_rates.append(rate)
        constrained_tokens += n

    compiler = GrammarCompiler(
        llm.tokenizer.to_json(), llm.engine.model.config.vocab_size, llm.engine.eos_token_ids
    )
    compiler.compile(StructuredOutput("json_object"))  # builds the tokenizer's table once
    compile_ms = []
    for tag in range(3 if args.quick else 9):
        spec = StructuredOutput.json_schema(twenty_fields(tag))
        t0 = time.perf_counter()
        compiler.compile(spec)
        compile_ms.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    compiler.compile(spec)
    cached_ms = (time.perf_counter() - t0) * 1000

    report = Report(f"structured outputs: batch {args.batch}, {tokens} tokens each")
    report.figure("free_decode_tok_s", statistics.median(free_rates))
    report.figure("structured_decode_tok_s", statistics.median(constrained_rates))
    report.figure("structured_tokens_generated", constrained_tokens / rounds)
    report.figure("schema_compile_ms", statistics.median(compile_ms))
    report.figure("schema_compile_cached_ms", cached_ms)
    fraction = statistics.median(c / f for c, f in zip(constrained_rates, free_rates, strict=True))
    report.ratio("structured_decode_fraction", fraction, ">= 0.9 at batch 8")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
