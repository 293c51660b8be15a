"""Structured outputs on the embedded model: decode throughput under a JSON-schema constraint against the
same batch unconstrained, and the compile time of a 20-field schema; and ``n`` choices against as many
separate requests.

    python -m bench.structured [--quick] [--json PATH] [--batch 8] [--tokens 64] [--fork-prompt 2000]

``structured_decode_fraction`` (target >= 0.9 at batch 8): decode tokens/s with every request of the batch
under a JSON schema over the same batch without one, the two run in turns (the decode time is the wall time
after the batch's last first token).  ``schema_compile_ms``: compiling a 20-field schema the compiler has
not seen (llguidance; the tokenizer's table built beforehand), median of several schemas.

``n_fork_speedup`` (target >= 3): on a colocated cluster (router + one node, ``pdkv.launcher``), total
time of 8 separate concurrent requests for one 2,000-token prompt (``POST /v1/completions``, sampled,
``--fork-tokens`` each), each under a cache salt of its own so that each computes the prompt, over one
request with ``n=8`` for the same.  ``n_vs_shared_separate``: the same 8 requests without salts, which
on one node share the prompt through its prefix cache (the chunk budget serves their prefills one after
another, and each later one finds the earlier one's blocks) -- so about 1.  Each kind's prompt is random
token ids of its own, so nothing of it is cached before; the kinds take turns going first.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
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


def _complete(address: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{address}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


KINDS = ("forked", "separate", "unshared")


def fork_times(prompt_tokens: int, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Per round, seconds of: one request with ``n=8`` (``forked``); 8 separate concurrent requests for
    the same prompt (``separate``: one cache salt, so they may share its blocks through the node's prefix
    cache); the same 8 each under a cache salt of its own (``unshared``: none may use another's blocks,
    so each computes the prompt -- what 8 requests cost where nothing shares the prompt).  Each kind gets
    a prompt of ``prompt_tokens`` random token ids, new each time; the kinds take turns first.  Also the
    prompt tokens each kind of separate requests computed (their usage)."""
    from engine.model.embedded import default_model_path
    from pdkv.launcher import Cluster, Topology

    rng = random.Random(5)
    topology = Topology(model=str(default_model_path()), mode="colocated", num_decode=1, router_port=0)
    out: dict[str, list[float]] = {k: [] for k in (*KINDS, "separate_computed", "unshared_computed")}
    with Cluster.start(topology) as cluster:
        address = cluster.http_address
        assert address is not None
        name = _model_name(address)

        def body(prompt: list[int], seed: int, n: int, salt: str | None) -> dict[str, Any]:
            return {
                "model": name,
                "prompt": prompt,
                "max_tokens": new_tokens,
                "temperature": 0.8,
                "seed": seed,
                "n": n,
                "ignore_eos": True,
                **({"cache_salt": salt} if salt else {}),
            }

        for r in range(rounds + 1):  # round 0 warms up
            for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                prompt = [rng.randrange(1000, 40_000) for _ in range(prompt_tokens)]
                answers: list[dict[str, Any]] = []
                t0 = time.perf_counter()
                if kind == "forked":
                    assert len(_complete(address, body(prompt, 1, 8, None))["choices"]) == 8
                else:
                    salts = [f"r{r}-{i}" if kind == "unshared" else None for i in range(8)]
                    threads = [
                        threading.Thread(
                            target=_append, args=(answers, address, body(prompt, 1 + i, 1, salts[i]))
                        )
                        for i in range(8)
                    ]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    assert len(answers) == 8
                elapsed = time.perf_counter() - t0
                if r:
                    out[kind].append(elapsed)
                    if answers:
                        computed = sum(a["usage"]["pdkv"].get("computed_prompt_tokens", 0) for a in answers)
                        out[f"{kind}_computed"].append(computed)
    return out


def _append(answers: list[dict[str, Any]], address: str, body: dict[str, Any]) -> None:
    answers.append(_complete(address, body))


def _model_name(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=30) as answer:
        return str(json.loads(answer.read())["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "structured outputs benchmark")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default 64, --quick 24)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each, in turns (default 3, --quick 1)")
    p.add_argument("--fork-prompt", type=int, default=None, help="n=8's prompt tokens (2000; --quick 400)")
    p.add_argument("--fork-tokens", type=int, default=16, help="tokens per choice (default 16)")
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
    del llm  # the cluster's node needs the cores
    fork_prompt = args.fork_prompt or (400 if args.quick else 2000)
    fork = fork_times(fork_prompt, args.fork_tokens, 1 if args.quick else 3)
    report.figure("fork_prompt_tokens", fork_prompt)
    report.figure("n8_s", statistics.median(fork["forked"]))
    for kind in ("separate", "unshared"):
        report.figure(f"{kind}_8_s", statistics.median(fork[kind]))
        report.figure(f"{kind}_8_prompt_tokens_computed", statistics.median(fork[f"{kind}_computed"]))

    def over_forked(kind: str) -> float:
        return statistics.median(s / f for s, f in zip(fork[kind], fork["forked"], strict=True))

    # What n saves: the prompt computed once for 8 sequences, against 8 requests that each compute it.
    report.ratio("n_fork_speedup", over_forked("unshared"), ">= 3 (n=8, 2,000-token prompt)")
    # Separate requests of one salt on one node share the prompt too (the prefix cache): n's edge there.
    report.ratio("n_vs_shared_separate", over_forked("separate"), "~1: the prefix cache shares it too")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
