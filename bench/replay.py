"""Replaying a Mooncake-format request trace through the router, per routing policy, against its ceiling.

    python -m bench.replay [--trace PATH] [--start N] [--requests N] [--sample F] [--tokens-per-block T]
                           [--time-scale S] [--max-input N] [--max-output M] [--workload trace|qa]
                           [--model smollm2|tiny] [--nodes N] [--node-blocks N] [--node-threads N]
                           [--store TIERS] [--modes A,B] [--qa-users N] [--qa-gap-ms MS] [--quick]
                           [--json PATH]

The trace (``../shared/data/traces/conversation_trace.jsonl`` by default; README there): one JSON object a
line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (512-token prefix
blocks: equal ids, the same block).  The replay scales it to this machine -- ``--tokens-per-block`` tokens
stand for each 512-token block (input lengths scale alike, capped at ``--max-input``), arrival times are
multiplied by ``--time-scale``, outputs are capped at ``--max-output``, and with ``--sample F`` only the
requests of a fraction F of the conversations are replayed (every turn of each, so a window spans more of
the trace, and more of its reuse, at a rate the machine keeps) -- and makes token ids from hash ids
deterministically (the same id always gives the same block of tokens; the last block is cut to the scaled
input length).  Every figure is printed with those factors.

The **ceiling** is the window's infinite-cache hit rate: a request's leading blocks whose ids an earlier
request of the window already had, over all its input tokens (never the last token).  Each mode reports
prompt-token hit rates by source (local prefix cache, store, remote prefill) next to it, TTFT / TPOT / ITL at
p50/p90/p99 (client-side, streamed), goodput (requests/s meeting the SLO: TTFT <= ``--slo-ttft-ms`` and
TPOT <= ``--slo-tpot-ms``) and output throughput.

Modes (real processes through ``pdkv.launcher``; node caches small enough that the window overflows
them): round-robin, least-loaded and kv-aware over 4 colocated nodes (``--nodes``), each without and with
the shared store (cpu tier), and kv-aware with the store on 2 prefill + 2 decode.  ``--quick`` runs the
three modes the ratios need with the tiny model, 2 nodes and 120 requests: a check of the pipeline that
fits in a minute, not a measurement.

The nodes run ``--model smollm2`` by default: the embedded SmolLM2-135M (its GGUF converted once to a bf16
folder), so a token computed costs what a real model's does against a token loaded (23 KiB of KV).  Its
window and rates are sized for this 2-core machine: 300 requests of 4 % of the conversations (lines 0-7299,
a ceiling of 43 %, where 300 consecutive lines have 11 %), 32 tokens for each 512-token block, inputs
capped at 1024 tokens, outputs at 8, time x0.065 (the window spans 146 s);
``--model tiny`` runs the 4-layer random bench model (600 requests at x0.15), on which computing a block
costs about what loading it does, so reuse barely shows.

Ratios: ``hit_rate_fraction_of_ceiling`` (kv-aware + store: local + store hits over the ceiling),
``kv_aware_ttft_p90_gain_vs_round_robin`` (4 colocated, no store: round-robin's TTFT p90 over kv-aware's),
``store_throughput_gain_when_local_overflows`` (kv-aware with the store over without).  The last one needs
local caches that overflow, as the QA defaults' do (histories outgrow 2048-token node caches); on the
trace, whose reuse kv-aware mostly keeps locally, it is bounded near 1.1 whatever the machine
(docs/BENCHMARKS.md).

``--workload qa``: the synthetic multi-round QA workload instead (LMCache's: users x rounds, a shared system
prompt, each round's prompt is the history so far plus a new question; a user asks the next question once
the answer is in, never before), through the same code.
"""

from __future__ import annotations

import itertools
import math
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import Report, parser
from engine.model.convert_gguf import convert_gguf
from engine.model.embedded import ensure_default_model
from engine.model.make_model import TinyLlamaSpec, make_model
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster, Topology
from planner.trace import DEFAULT_TRACE, Scale, TraceError, ceiling, read_trace
from planner.workload import TraceRequest, as_arrivals, qa_workload, scale_trace
from serving.client import Completion, GenerationClient, generate_request

SPEC = TinyLlamaSpec(layers=4, hidden=256, heads=8, kv_heads=4, vocab=512, max_position_embeddings=16384)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Sizes:
    """One workload's defaults for one model: the window, the scale and the node caches (per node, below
    the window's working set, so that local caches overflow)."""

    requests: int
    tokens_per_block: int  # also the nodes' block size
    max_output: int
    node_blocks: int
    # The trace's: the share of its conversations replayed, the time factor, the input cap.
    sample: float = 1.0
    time_scale: float = 1.0
    max_input: int = 1 << 30
    # The QA workload's: users, and the ms between two rounds' slots.
    users: int = 16
    gap_ms: float = 250.0


@dataclass(frozen=True)
class ModelChoice:
    """What the nodes run, and the sizes that go with its cost: ``tiny`` is the 4-layer random bench
    model (compute nearly free, so reuse barely shows); ``smollm2`` is the embedded SmolLM2-135M-Instruct,
    whose prefill costs what a real model's does against what loading its KV costs."""

    vocab: int
    low_id: int  # prompt ids start here (special tokens below)
    store: str
    trace: Sizes
    qa: Sizes


MODELS = {
    "tiny": ModelChoice(
        vocab=SPEC.vocab,
        low_id=2,
        store="cpu:1GiB",
        trace=Sizes(600, 16, 16, 160, time_scale=0.15, max_input=1024),
        qa=Sizes(600, 16, 16, 160, gap_ms=50.0),
    ),
    # 23 KiB of KV a token (30 layers x 3 KV heads x 64 x K,V in bf16): 4 GiB hold ~180k tokens.
    # The trace: 300 requests of 4 % of the conversations (lines 0-7299, a ceiling of 43 %), 146 s.
    # QA: 32 users x 12 rounds whose histories (up to ~1070 tokens) outgrow 2048-token node caches,
    # with 4-token answers, so that prefill (what the store saves) is most of the work.
    "smollm2": ModelChoice(
        vocab=49152,
        low_id=20,
        store="cpu:4GiB",
        trace=Sizes(300, 32, 8, 640, sample=0.04, time_scale=0.065, max_input=1024),
        qa=Sizes(384, 32, 4, 64, users=32, gap_ms=50.0),
    ),
}


def prepare_model(name: str, folder: Path) -> Path:
    if name == "tiny":
        return make_model(folder, SPEC)
    # The GGUF converted once to a bf16 folder: the four nodes load it in half the time.
    return convert_gguf(ensure_default_model(progress=True), folder, dtype="bfloat16")


@dataclass
class ModeResult:
    completions: list[Completion] = field(default_factory=list)
    wall_s: float = 0.0
    error_kinds: Counter[str] = field(default_factory=Counter)  # failed requests by status and message

    @property
    def errors(self) -> int:
        return self.error_kinds.total()


# Each request its own connection, as separate clients have: gRPC would otherwise share one between the
# bench's channels, and the router's per-connection limit would see one client sending them all.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def replay(address: str, requests: list[TraceRequest]) -> ModeResult:
    """Every request at its (scaled) arrival time, on its own thread, streamed; one that comes ``after``
    another is sent at its arrival time or when that one has finished, whichever is later (a QA user
    asks the next question once the answer is in, as LMCache's users do)."""
    result = ModeResult()
    lock = threading.Lock()
    finished = [threading.Event() for _ in requests]
    start = time.perf_counter()

    def one(i: int, r: TraceRequest) -> None:
        try:
            if r.after is not None:
                finished[r.after].wait()
            delay = r.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            try:
                with GenerationClient(address, options=OWN_CONNECTION) as client:
                    out = client.generate(generate_request(r.prompt, params), timeout=600)
            except Exception as exc:
                with lock:
                    result.error_kinds[_error_kind(exc)] += 1
                return
            with lock:
                result.completions.append(out)
        finally:
            finished[i].set()  # failed or not: the user goes on

    threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    return result


def _error_kind(exc: Exception) -> str:
    """A gRPC error's status and details, else the exception's type and text (cut to a line)."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return f"{exc.code().name}: {(exc.details() or '')[:120]}"
    return f"{type(exc).__name__}: {str(exc)[:120]}"


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


def _mode(policy: str, store: bool, disaggregated: bool = False) -> dict[str, Any]:
    """The nodes colocated, or half of them prefill-only (disaggregated)."""
    return {"policy": policy, "kv_store": store, "disaggregated": disaggregated}


MODES: dict[str, dict[str, Any]] = {
    "rr": _mode("round-robin", False),
    "ll": _mode("least-loaded", False),
    "kv": _mode("kv-aware", False),
    "rr_store": _mode("round-robin", True),
    "ll_store": _mode("least-loaded", True),
    "kv_store": _mode("kv-aware", True),
    "kv_store_2p2d": _mode("kv-aware", True, disaggregated=True),
}
QUICK_MODES = ("rr", "kv", "kv_store")


def run_mode(
    name: str,
    model: Path,
    requests: list[TraceRequest],
    warm_s: float,
    node_blocks: int,
    store: str,
    nodes: int = 4,
    block_size: int = BLOCK_SIZE,
    threads: int | None = None,
) -> ModeResult:
    mode = MODES[name]
    prefill = nodes // 2 if mode["disaggregated"] else 0
    topology = Topology(
        model=str(model),
        mode="disaggregated" if prefill else "colocated",
        num_prefill=prefill,
        num_decode=nodes - prefill,
        policy=mode["policy"],
        kv_store=store if mode["kv_store"] else None,
        node_args=("--num-blocks", str(node_blocks), "--block-size", str(block_size), "--device", "cpu"),
        node_threads=threads,
        router_args=("--health-interval-s", "0.5"),
        grace_s=1.0,  # every request has ended when the cluster stops
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
        "--requests",
        type=int,
        default=None,
        help="requests in the window (default: the model's; --quick 120)",
    )
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=None,
        help="tokens standing for 512, also the nodes' block size (default: the model's)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="arrival times are multiplied by this (default: the model's)",
    )
    p.add_argument(
        "--max-input", type=int, default=None, help="scaled input tokens at most (default: the model's)"
    )
    p.add_argument(
        "--sample",
        type=float,
        default=None,
        help="replay only this fraction of the conversations (every turn of each; default: the model's)",
    )
    p.add_argument(
        "--max-output", type=int, default=None, help="output tokens at most (default: the model's)"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--modes", default="", help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument(
        "--model",
        choices=tuple(MODELS),
        default=None,
        help="what the nodes run: the 4-layer random bench model or the embedded SmolLM2-135M "
        "(default smollm2; --quick: tiny)",
    )
    p.add_argument(
        "--nodes", type=int, default=None, help="nodes in every mode (default 4; --quick 2, to fit a minute)"
    )
    p.add_argument("--node-blocks", type=int, default=None, help="KV blocks per node (default: the model's)")
    p.add_argument("--store", default=None, help="the shared store's tiers (default: the model's)")
    p.add_argument(
        "--qa-users", type=int, default=None, help="--workload qa: users (default: the model's; --quick 8)"
    )
    p.add_argument(
        "--qa-gap-ms",
        type=float,
        default=None,
        help="--workload qa: ms between requests (default: the model's)",
    )
    p.add_argument(
        "--node-threads",
        type=int,
        default=None,
        help="compute threads a node (default: one per core)",
    )
    args: Any = p.parse_args(argv)

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    model_name = pick(args.model, "tiny" if args.quick else "smollm2")
    choice = MODELS[model_name]
    qa = args.workload == "qa"
    nodes = pick(args.nodes, 2 if args.quick else 4)
    sizes = choice.qa if qa else choice.trace
    node_blocks = pick(args.node_blocks, sizes.node_blocks)
    store = pick(args.store, choice.store)
    count = pick(args.requests, 120 if args.quick else sizes.requests)
    tokens_per_block = pick(args.tokens_per_block, sizes.tokens_per_block)
    max_output = pick(args.max_output, sizes.max_output)
    for flag, value, least in (
        ("--nodes", nodes, 2),  # a policy needs a choice
        ("--node-blocks", node_blocks, 1),
        ("--requests", count, 1),
        ("--tokens-per-block", tokens_per_block, 1),
        ("--max-output", max_output, 1),
        ("--node-threads", pick(args.node_threads, 1), 1),
        ("--start", args.start, 0),
        ("--max-input", pick(args.max_input, 1), 1),
    ):
        if value < least:
            raise SystemExit(f"bench.replay: {flag} must be at least {least}, got {value}")
    for flag, number in (
        ("--time-scale", args.time_scale),
        ("--slo-ttft-ms", args.slo_ttft_ms),
        ("--slo-tpot-ms", args.slo_tpot_ms),
    ):  # (an outside probe: a time scale of -1 or nan, a negative target, all taken)
        if number is not None and not 0 < number < math.inf:
            raise SystemExit(f"bench.replay: {flag} must be a positive number, got {number}")
    if qa and (args.time_scale is not None or args.max_input is not None or args.sample is not None):
        raise SystemExit(
            "bench.replay: --time-scale, --max-input and --sample scale the trace; "
            "--workload qa takes --qa-gap-ms"
        )
    sample = pick(args.sample, sizes.sample)
    if not 0 < sample <= 1:
        raise SystemExit(f"bench.replay: --sample must be in (0, 1], got {sample:g}")
    scale = Scale(
        tokens_per_block,
        pick(args.time_scale, sizes.time_scale),
        max_output,
        pick(args.max_input, sizes.max_input),
    )
    if args.workload == "trace":
        try:
            rows = read_trace(args.trace, args.start, count, sample)
        except TraceError as exc:
            raise SystemExit(f"bench.replay: {exc}") from None
        if not rows:
            raise SystemExit(f"bench.replay: no requests in {args.trace} from line {args.start} on")
        requests = scale_trace(rows, scale, choice.vocab, choice.low_id)
        last = rows[-1]["line"] - 1
        what = f"{args.trace.name} lines {args.start}..{last}"
        if sample < 1:
            what += f", the requests of {sample:g} of its conversations"
    else:
        users = pick(args.qa_users, 8 if args.quick else sizes.users)
        gap_s = pick(args.qa_gap_ms, sizes.gap_ms) / 1e3
        if users < 1 or gap_s < 0:
            raise SystemExit("bench.replay: --qa-users must be at least 1 and --qa-gap-ms not negative")
        rounds = max(2, count // users)
        requests = qa_workload(users, rounds, scale, choice.vocab, gap_s, choice.low_id)
        what = (
            f"multi-round QA, {users} users x {rounds} rounds, one every {gap_s * 1e3:g} ms "
            "(a user's next once its answer is in)"
        )
    modes = [m for m in args.modes.split(",") if m] or list(QUICK_MODES if args.quick else MODES)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"bench.replay: unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
    # The engine's blocks are the trace's scaled blocks: a hit is whole blocks, as the ceiling counts.
    block_size = scale.tokens_per_block
    threads = f", {args.node_threads} threads a node" if args.node_threads else ""
    r = Report(
        f"bench.replay: {what}; {scale.describe(not qa)}; model {model_name}, {nodes} nodes of "
        f"{node_blocks} blocks of {block_size}{threads}, store {store}"
    )
    r.figure("window_requests", len(requests))
    r.figure("window_prompt_tokens", sum(len(q.prompt) for q in requests))
    r.figure("window_span_s", requests[-1].arrival_s if requests else 0.0)
    ceil = ceiling(as_arrivals(requests, scale.tokens_per_block), scale.tokens_per_block)
    r.figure("ceiling_hit_rate", ceil)
    r.figure("tokens_per_block", scale.tokens_per_block)
    if not qa:
        r.figure("time_scale", scale.time_scale)
    r.figure("max_output", scale.max_output)
    r.figure("node_cache_tokens", node_blocks * block_size)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="pdkv-replay-") as tmp:
        model = prepare_model(model_name, Path(tmp) / "model")
        for name in modes:
            res = run_mode(
                name, model, requests, 1.5, node_blocks, store, nodes, block_size, args.node_threads
            )
            results[name] = figures(name, res, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
            for key, value in results[name].items():
                r.figure(key, value)
            for kind, n in res.error_kinds.most_common(3):
                print(f"  {name}: {n} requests failed: {kind}")
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
