"""Replaying a Mooncake-format request trace through the router, per routing policy, against its ceiling.

    python -m bench.replay [--trace PATH] [--start N] [--requests N] [--tokens-per-block T]
                           [--time-scale S] [--max-output M] [--workload trace|qa] [--quick] [--json PATH]

The trace (``../shared/data/traces/conversation_trace.jsonl`` by default; README there): one JSON object a
line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (512-token prefix
blocks: equal ids, the same block).  The replay scales it to this machine -- ``--tokens-per-block`` tokens
stand for each 512-token block (input lengths scale alike, capped at ``--max-input``), arrival times are
multiplied by ``--time-scale``, outputs are capped at ``--max-output`` -- and makes token ids from hash ids
deterministically (the same id always gives the same block of tokens; the last block is cut to the scaled
input length).  Every figure is printed with those factors.

The **ceiling** is the window's infinite-cache hit rate: a request's leading blocks whose ids an earlier
request of the window already had, over all its input tokens (never the last token).  Each mode reports
prompt-token hit rates by source (local prefix cache, store, remote prefill) next to it, TTFT / TPOT / ITL at
p50/p90/p99 (client-side, streamed), goodput (requests/s meeting the SLO: TTFT <= ``--slo-ttft-ms`` and
TPOT <= ``--slo-tpot-ms``) and output throughput.

Modes (real processes through ``serving.launcher``; node caches small enough that the window overflows
them): round-robin, least-loaded and kv-aware over 4 colocated nodes, each without and with the shared
store (cpu tier), and kv-aware with the store on 2 prefill + 2 decode.  ``--quick`` runs the three modes the
ratios need, on a shorter window.

Ratios: ``hit_rate_fraction_of_ceiling`` (kv-aware + store: local + store hits over the ceiling),
``kv_aware_ttft_p90_gain_vs_round_robin`` (4 colocated, no store: round-robin's TTFT p90 over kv-aware's),
``store_throughput_gain_when_local_overflows`` (kv-aware with the store over without).

``--workload qa``: the synthetic multi-round QA workload instead (LMCache's: users x rounds, a shared system
prompt, each round's prompt is the history so far plus a new question), through the same code.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Report, parser
from engine.model.make_model import TinyLlamaSpec, make_model
from engine.sampling_params import SamplingParams
from serving.client import Completion, GenerationClient, generate_request
from serving.launcher import Cluster, Topology

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
)
TRACE_BLOCK_TOKENS = 512
SPEC = TinyLlamaSpec(layers=4, hidden=256, heads=8, kv_heads=4, vocab=512, max_position_embeddings=16384)
BLOCK_SIZE = 16
NODE_BLOCKS = 160  # per node (2560 tokens): far below the window's working set, so local caches overflow
STORE = "cpu:1GiB"


class TraceError(ValueError):
    """A trace line that is not what the format says; the text names the line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # scaled
    prompt: list[int]
    max_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Scale:
    tokens_per_block: int
    time_scale: float
    max_output: int
    max_input: int = 1 << 30

    def describe(self) -> str:
        return (
            f"{self.tokens_per_block} tokens per 512-token block, time x{self.time_scale:g}, "
            f"inputs capped at {self.max_input} tokens, outputs at {self.max_output}"
        )


def read_trace(path: Path, start: int, count: int) -> list[dict[str, Any]]:
    """Lines ``start .. start + count`` of the trace, each checked; a bad line stops with its number."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if number <= start:
                continue
            if len(rows) == count:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{number}: a line must be a JSON object")
            for key, kind in (("timestamp", (int, float)), ("input_length", int), ("output_length", int)):
                if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool) or row[key] < 0:
                    raise TraceError(
                        f"{path}:{number}: field {key!r} is missing or not a non-negative number"
                    )
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise TraceError(f"{path}:{number}: field 'hash_ids' is missing or not a list of ints")
            rows.append(row)
    return rows


def block_tokens(block_id: int, n: int, vocab: int) -> list[int]:
    """The tokens that stand for one trace block: the same id, the same tokens (bos/eos avoided)."""
    rng = random.Random(block_id * 1_000_003 + 17)
    return [2 + rng.randrange(vocab - 2) for _ in range(n)]


def scale_trace(rows: list[dict[str, Any]], scale: Scale, vocab: int) -> list[TraceRequest]:
    t0 = rows[0]["timestamp"] if rows else 0
    out: list[TraceRequest] = []
    for row in rows:
        scaled = round(row["input_length"] * scale.tokens_per_block / TRACE_BLOCK_TOKENS)
        n = max(1, min(scale.max_input, scaled))
        ids = tuple(row["hash_ids"])
        tokens: list[int] = []
        for block_id in ids:
            tokens += block_tokens(block_id, scale.tokens_per_block, vocab)
            if len(tokens) >= n:
                break
        if len(tokens) < n:  # the ids cover less than the input: the rest is unique to the request
            tokens += block_tokens(-len(out) - 1, n - len(tokens), vocab)
        out.append(
            TraceRequest(
                (row["timestamp"] - t0) / 1000.0 * scale.time_scale,
                tokens[:n],
                max(1, min(row["output_length"], scale.max_output)),
                ids,
            )
        )
    return out


def ceiling(requests: list[TraceRequest], tokens_per_block: int) -> float:
    """The window's infinite-cache prompt hit rate: whole leading blocks seen before, never the last
    token."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        n = len(r.prompt)
        blocks = n // tokens_per_block
        ids = r.block_ids[:blocks]
        k = 0
        while k < len(ids) and ids[: k + 1] in seen:
            k += 1
        hit += min(k * tokens_per_block, n - 1)
        total += n
        for j in range(1, len(ids) + 1):
            seen.add(ids[:j])
    return hit / total if total else 0.0


def qa_workload(users: int, rounds: int, scale: Scale, vocab: int, gap_s: float) -> list[TraceRequest]:
    """Multi-round QA: a shared system prompt; user u's round k asks its history plus a new question."""
    rng = random.Random(7)
    system = [2 + rng.randrange(vocab - 2) for _ in range(8 * scale.tokens_per_block)]
    out: list[TraceRequest] = []
    histories = {u: list(system) for u in range(users)}
    tpb = scale.tokens_per_block
    for k in range(rounds):
        order = list(range(users))
        rng.shuffle(order)  # users answer at their own pace: no fixed order a round-robin could align with
        for slot, u in enumerate(order):
            question = [2 + rng.randrange(vocab - 2) for _ in range(2 * scale.tokens_per_block)]
            prompt = histories[u] + question
            answer = [2 + rng.randrange(vocab - 2) for _ in range(scale.max_output)]
            histories[u] = prompt + answer
            arrival = (k * users + slot) * gap_s
            out.append(TraceRequest(arrival, prompt, scale.max_output, _chain_ids(prompt, tpb)))
    return out


def _chain_ids(prompt: list[int], block: int) -> tuple[int, ...]:
    """Prefix block ids of a prompt, as the trace's are: equal ids, equal prefixes up to that block."""
    ids: list[int] = []
    parent = 0
    for k in range(len(prompt) // block):
        parent = hash((parent, tuple(prompt[k * block : (k + 1) * block])))
        ids.append(parent)
    return tuple(ids)


@dataclass
class ModeResult:
    completions: list[Completion] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0


def replay(address: str, requests: list[TraceRequest]) -> ModeResult:
    """Every request at its (scaled) arrival time, on its own thread, streamed."""
    result = ModeResult()
    lock = threading.Lock()
    start = time.perf_counter()

    def one(r: TraceRequest) -> None:
        delay = r.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        try:
            with GenerationClient(address) as client:
                out = client.generate(generate_request(r.prompt, params), timeout=600)
        except Exception:
            with lock:
                result.errors += 1
            return
        with lock:
            result.completions.append(out)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    return result


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]


def figures(prefix: str, res: ModeResult, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, float]:
    done = res.completions
    ttft = [c.time_to_first_token_s for c in done if c.time_to_first_token_s is not None]
    tpot, itl, good = [], [], 0
    for c in done:
        times = c.token_times_s
        per = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        if len(times) > 1:
            tpot.append(per)
            itl += [b - a for a, b in itertools.pairwise(times)]
        if (
            c.time_to_first_token_s is not None
            and c.time_to_first_token_s <= slo_ttft_s
            and per <= slo_tpot_s
        ):
            good += 1
    usages = [c.usage for c in done if c.usage is not None]
    prompt = sum(u.prompt_tokens for u in usages) or 1
    out = {
        f"{prefix}_requests": len(done),
        f"{prefix}_errors": res.errors,
        f"{prefix}_hit_local": sum(u.cached.local_prefix for u in usages) / prompt,
        f"{prefix}_hit_store": sum(u.cached.store for u in usages) / prompt,
        f"{prefix}_hit_remote_prefill": sum(u.cached.remote_prefill for u in usages) / prompt,
        f"{prefix}_throughput_tok_s": sum(len(c.token_ids) for c in done) / res.wall_s if res.wall_s else 0.0,
        f"{prefix}_goodput_req_s": good / res.wall_s if res.wall_s else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (0.5, 0.9, 0.99):
            out[f"{prefix}_{name}_p{round(q * 100)}_ms"] = _q(values, q) * 1e3
    return out


MODES: dict[str, dict[str, Any]] = {
    "rr": {"mode": "colocated", "num_prefill": 0, "num_decode": 4, "policy": "round-robin", "kv_store": None},
    "ll": {
        "mode": "colocated",
        "num_prefill": 0,
        "num_decode": 4,
        "policy": "least-loaded",
        "kv_store": None,
    },
    "kv": {"mode": "colocated", "num_prefill": 0, "num_decode": 4, "policy": "kv-aware", "kv_store": None},
    "rr_store": {
        "mode": "colocated",
        "num_prefill": 0,
        "num_decode": 4,
        "policy": "round-robin",
        "kv_store": STORE,
    },
    "ll_store": {
        "mode": "colocated",
        "num_prefill": 0,
        "num_decode": 4,
        "policy": "least-loaded",
        "kv_store": STORE,
    },
    "kv_store": {
        "mode": "colocated",
        "num_prefill": 0,
        "num_decode": 4,
        "policy": "kv-aware",
        "kv_store": STORE,
    },
    "kv_store_2p2d": {
        "mode": "disaggregated",
        "num_prefill": 2,
        "num_decode": 2,
        "policy": "kv-aware",
        "kv_store": STORE,
    },
}
QUICK_MODES = ("rr", "kv", "kv_store")


def run_mode(name: str, model: Path, requests: list[TraceRequest], warm_s: float) -> ModeResult:
    topology = Topology(
        model=str(model),
        node_args=("--num-blocks", str(NODE_BLOCKS), "--block-size", str(BLOCK_SIZE), "--device", "cpu"),
        router_args=("--health-interval-s", "0.5"),
        **MODES[name],
    )
    with Cluster.start(topology) as cluster:
        time.sleep(warm_s)  # a health round: the router has the nodes' namespaces, costs and events
        return replay(cluster.router_address, requests)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "replay")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--workload", choices=("trace", "qa"), default="trace")
    p.add_argument("--start", type=int, default=0, help="first trace line of the window (0-based)")
    p.add_argument(
        "--requests", type=int, default=None, help="requests in the window (default 600, --quick 240)"
    )
    p.add_argument(
        "--tokens-per-block", type=int, default=BLOCK_SIZE, help="tokens standing for 512 (default 16)"
    )
    p.add_argument("--time-scale", type=float, default=0.15, help="arrival times are multiplied by this")
    p.add_argument("--max-input", type=int, default=1024, help="scaled input tokens at most (default 1024)")
    p.add_argument("--max-output", type=int, default=16, help="output tokens at most")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--modes", default="", help=f"comma-separated subset of {', '.join(MODES)}")
    args: Any = p.parse_args(argv)
    count = args.requests or (240 if args.quick else 600)
    scale = Scale(args.tokens_per_block, args.time_scale, args.max_output, args.max_input)
    if args.workload == "trace":
        try:
            rows = read_trace(args.trace, args.start, count)
        except TraceError as exc:
            raise SystemExit(f"bench.replay: {exc}") from None
        requests = scale_trace(rows, scale, SPEC.vocab)
        what = f"{args.trace.name} lines {args.start}..{args.start + len(rows) - 1}"
    else:
        users = 8 if args.quick else 16
        requests = qa_workload(users, max(2, count // users), scale, SPEC.vocab, gap_s=0.05)
        what = f"multi-round QA, {users} users x {max(2, count // users)} rounds"
    modes = [m for m in args.modes.split(",") if m] or list(QUICK_MODES if args.quick else MODES)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"bench.replay: unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
    r = Report(f"bench.replay: {what}; {scale.describe()}")
    r.figure("window_requests", len(requests))
    r.figure("window_prompt_tokens", sum(len(q.prompt) for q in requests))
    r.figure("window_span_s", requests[-1].arrival_s if requests else 0.0)
    ceil = ceiling(requests, scale.tokens_per_block)
    r.figure("ceiling_hit_rate", ceil)
    r.figure("tokens_per_block", scale.tokens_per_block)
    r.figure("time_scale", scale.time_scale)
    r.figure("max_output", scale.max_output)
    r.figure("node_cache_tokens", NODE_BLOCKS * BLOCK_SIZE)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="pdkv-replay-") as tmp:
        model = make_model(Path(tmp) / "model", SPEC)
        for name in modes:
            res = run_mode(name, model, requests, warm_s=1.5)
            results[name] = figures(name, res, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
            for key, value in results[name].items():
                r.figure(key, value)
    if "kv_store" in results and ceil:
        hits = results["kv_store"]["kv_store_hit_local"] + results["kv_store"]["kv_store_hit_store"]
        r.ratio("hit_rate_fraction_of_ceiling", hits / ceil, ">= 0.9")
    if "rr" in results and "kv" in results:
        r.ratio(
            "kv_aware_ttft_p90_gain_vs_round_robin",
            results["rr"]["rr_ttft_p90_ms"] / results["kv"]["kv_ttft_p90_ms"],
            ">= 3",
        )
    if "kv" in results and "kv_store" in results and results["kv"]["kv_throughput_tok_s"]:
        r.ratio(
            "store_throughput_gain_when_local_overflows",
            results["kv_store"]["kv_store_throughput_tok_s"] / results["kv"]["kv_throughput_tok_s"],
            ">= 2",
        )
    r.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
