"""Serving through the router over a local cluster, in three modes measured in the same run.

    python -m bench.serve [--quick] [--json PATH]

Workload: concurrent multi-turn chats.  Every conversation opens with the same system prompt; turn k's
prompt is the system prompt, the previous turns (user message + the model's answer) and a new user
message, so consecutive turns share ever longer prefixes.  Requests stream (greedy, EOS ignored, a fixed
number of output tokens) through ``pdkv.v1.Generation``; conversations run concurrently, turns in order.

Modes (real processes started by ``pdkv.launcher``, same model, same workload):

- ``colocated``: two colocated nodes, no KV store -- each node only has its own prefix cache;
- ``colocated_store``: the same plus the shared store (cpu + disk tiers) through the ``offload``
  connector, so a turn that lands on the other node loads its prefix instead of recomputing it;
- ``disaggregated_store``: one prefill + one decode node, store on the prefill side, the prompt's KV
  streamed to the decode node by ``p2p``.

Figures per mode: time to first token and time per output token (p50, p99, client-side), output
throughput, and prompt tokens served by source (local prefix cache, store, remote prefill) as a share of
all prompt tokens.  Ratios compare each mode with plain colocated.  ``transfer_fraction_of_socket``
comes from ``bench.transfer`` (the p2p path against a raw socket).

HTTP against gRPC: on the disaggregated cluster, the same streamed request (a cached prompt, so the
engines' work is the same every time) alternates between ``pdkv.v1.Generation/Generate`` and the
OpenAI-compatible ``POST /v1/completions`` with ``stream: true``; time to the first token message (gRPC)
or the first ``data:`` chunk (HTTP, one per delta), client-side.  ``http_ttft_overhead_ms`` is the p50
difference (goal <= 1 ms).  Until the ``offload`` connector is
registered the "store" modes run without it (``offload_available`` = 0 says so).

``--secure``: the disaggregated cluster again with everything on (``pdkv up --secure``: TLS, mutual TLS
to the nodes, an API key, CURVE on the store and p2p, sealed transfer params) -- the chats
(``disaggregated_secure_*``) and the steady time to first token of one cached prompt, each cluster in
turn, sequential requests.  ``secure_ttft_overhead_ms`` is the p50 difference (goal <= 2 ms).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Report, parser
from connectors.registry import discover
from engine.model.make_model import TinyLlamaSpec, make_model
from engine.sampling_params import SamplingParams
from pdkv.launcher import DEFAULT_STORE, Cluster, Topology
from serving.client import Completion, generate_request

BENCH_SPEC = TinyLlamaSpec(layers=4, hidden=256, heads=8, kv_heads=4, vocab=512, max_position_embeddings=4096)


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    output_tokens: int
    seed: int = 0


QUICK = Workload(conversations=4, turns=3, system_tokens=192, user_tokens=32, output_tokens=16)
FULL = Workload(conversations=8, turns=4, system_tokens=512, user_tokens=64, output_tokens=32)
MODES: dict[str, dict[str, Any]] = {
    "colocated": {"mode": "colocated", "num_prefill": 0, "num_decode": 2, "kv_store": None},
    "colocated_store": {"mode": "colocated", "num_prefill": 0, "num_decode": 2, "kv_store": DEFAULT_STORE},
    "disaggregated_store": {
        "mode": "disaggregated",
        "num_prefill": 1,
        "num_decode": 1,
        "kv_store": DEFAULT_STORE,
    },
}


@dataclass
class ModeResult:
    completions: list[Completion] = field(default_factory=list)
    wall_s: float = 0.0
    # TTFT samples (seconds) of the HTTP-vs-gRPC comparison, by path; measured on one mode only.
    http_vs_grpc: dict[str, list[float]] = field(default_factory=dict)

    def figures(self, prefix: str) -> dict[str, float]:
        ttft = [c.time_to_first_token_s for c in self.completions if c.time_to_first_token_s is not None]
        tpot = [
            (c.token_times_s[-1] - c.token_times_s[0]) / (len(c.token_ids) - 1)
            for c in self.completions
            if len(c.token_ids) > 1 and len(c.token_times_s) > 1
        ]
        usages = [c.usage for c in self.completions if c.usage is not None]
        prompt = sum(u.prompt_tokens for u in usages) or 1
        out_tokens = sum(len(c.token_ids) for c in self.completions)
        return {
            f"{prefix}_ttft_p50_ms": _quantile(ttft, 0.5) * 1e3,
            f"{prefix}_ttft_p99_ms": _quantile(ttft, 0.99) * 1e3,
            f"{prefix}_tpot_p50_ms": _quantile(tpot, 0.5) * 1e3,
            f"{prefix}_tpot_p99_ms": _quantile(tpot, 0.99) * 1e3,
            f"{prefix}_throughput_tok_s": out_tokens / self.wall_s if self.wall_s else 0.0,
            f"{prefix}_hit_local": sum(u.cached.local_prefix for u in usages) / prompt,
            f"{prefix}_hit_store": sum(u.cached.store for u in usages) / prompt,
            f"{prefix}_hit_remote_prefill": sum(u.cached.remote_prefill for u in usages) / prompt,
            f"{prefix}_requests": len(self.completions),
        }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]


def run_chats(cluster: Cluster, workload: Workload) -> ModeResult:
    """Every conversation on its own thread; turns in order.  Same tokens in every mode (seeded)."""
    rng = random.Random(workload.seed)
    vocab = BENCH_SPEC.vocab - 2  # not bos/eos
    system = [rng.randrange(vocab) for _ in range(workload.system_tokens)]
    users = [
        [[rng.randrange(vocab) for _ in range(workload.user_tokens)] for _ in range(workload.turns)]
        for _ in range(workload.conversations)
    ]
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    result = ModeResult()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def chat(i: int) -> None:
        history = list(system)
        with cluster.client() as client:
            for turn in users[i]:
                history += turn
                try:
                    out = client.generate(generate_request(history, params), timeout=300)
                except BaseException as exc:
                    errors.append(exc)
                    return
                history += out.token_ids
                with lock:
                    result.completions.append(out)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(workload.conversations)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]!r}")
    return result


def measure_mode(
    name: str, model: Path, workload: Workload, http_rounds: int = 0, *, secure: bool = False
) -> ModeResult:
    topology = Topology(
        model=str(model), router_port=0, node_args=("--num-blocks", "2048"), secure=secure, **MODES[name]
    )
    with Cluster.start(topology) as cluster:
        run_chats(cluster, Workload(1, 1, 32, 8, 4, seed=99))  # warm-up (first-call costs)
        result = run_chats(cluster, workload)
        if http_rounds:
            result.http_vs_grpc = http_vs_grpc_ttft(cluster, http_rounds)
        return result


def steady_ttft(model: Path, rounds: int, *, secure: bool) -> list[float]:
    """TTFT (seconds, client-side) of one cached prompt, ``rounds`` sequential requests, on a fresh
    disaggregated cluster (plain or secure)."""
    topology = Topology(
        model=str(model),
        router_port=0,
        node_args=("--num-blocks", "2048"),
        secure=secure,
        **MODES["disaggregated_store"],
    )
    prompt = random.Random(11).sample(range(BENCH_SPEC.vocab - 2), 64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    times: list[float] = []
    with Cluster.start(topology) as cluster, cluster.client() as client:
        for i in range(rounds + 3):  # three warm-up rounds: channels, caches
            out = client.generate(generate_request(prompt, params), timeout=60)
            assert out.time_to_first_token_s is not None
            if i >= 3:
                times.append(out.time_to_first_token_s)
    return times


def http_vs_grpc_ttft(cluster: Cluster, rounds: int) -> dict[str, list[float]]:
    """TTFT (seconds) of the same streamed request over gRPC and over HTTP, in turns."""
    import http.client
    import json

    assert cluster.http_address is not None
    prompt = random.Random(7).sample(range(BENCH_SPEC.vocab - 2), 64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    name = Path(cluster.topology.model or "model").name
    body = json.dumps(
        {
            "model": name,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    times: dict[str, list[float]] = {"grpc": [], "http": []}
    with cluster.client() as client:
        for i in range(rounds + 2):  # the first two rounds warm both paths up (and cache the prompt)
            out = client.generate(generate_request(prompt, params), timeout=60)
            assert out.time_to_first_token_s is not None
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            first = None
            while line := resp.readline():
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
                if line.startswith(b"data: [DONE]"):
                    break
            resp.read()
            assert first is not None
            if i >= 2:
                times["grpc"].append(out.time_to_first_token_s)
                times["http"].append(first)
    conn.close()
    return times


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "serving benchmark")
    p.add_argument("--no-transfer", action="store_true", help="skip the bench.transfer figure")
    p.add_argument(
        "--secure", action="store_true", help="also measure the disaggregated cluster with security on"
    )
    args: Any = p.parse_args(argv)
    workload = QUICK if args.quick else FULL
    report = Report("serving through the router: colocated vs store vs disaggregated")
    report.figure("offload_available", float("offload" in discover()))
    report.figure("p2p_available", float("p2p" in discover()))
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-serve-") as tmp:
        model = make_model(Path(tmp) / "model", BENCH_SPEC)
        http_rounds = 15 if args.quick else 60
        results = {
            name: measure_mode(name, model, workload, http_rounds if name == "disaggregated_store" else 0)
            for name in MODES
        }
        if args.secure:
            results["disaggregated_secure"] = measure_mode(
                "disaggregated_store", model, workload, secure=True
            )
            rounds = 30 if args.quick else 100
            plain, secure = [], []
            for _ in range(2):  # alternate the clusters: drift on the machine hits both
                plain += steady_ttft(model, rounds // 2, secure=False)
                secure += steady_ttft(model, rounds // 2, secure=True)
    for name, result in results.items():
        for key, value in result.figures(name).items():
            report.figure(key, value)
    base = report.figures
    for name in ("colocated_store", "disaggregated_store"):
        report.ratio(
            f"{name}_ttft_p50_vs_colocated", base[f"{name}_ttft_p50_ms"] / base["colocated_ttft_p50_ms"]
        )
        report.ratio(
            f"{name}_tpot_p50_vs_colocated", base[f"{name}_tpot_p50_ms"] / base["colocated_tpot_p50_ms"]
        )
        report.ratio(
            f"{name}_throughput_vs_colocated",
            base[f"{name}_throughput_tok_s"] / base["colocated_throughput_tok_s"],
        )
    if args.secure:
        report.figure("plain_steady_ttft_p50_ms", _quantile(plain, 0.5) * 1e3)
        report.figure("secure_steady_ttft_p50_ms", _quantile(secure, 0.5) * 1e3)
        report.ratio(
            "secure_ttft_overhead_ms", (_quantile(secure, 0.5) - _quantile(plain, 0.5)) * 1e3, "<= 2 (ms)"
        )
    ttft = results["disaggregated_store"].http_vs_grpc
    for path in ("grpc", "http"):
        report.figure(f"{path}_ttft_p50_ms", _quantile(ttft[path], 0.5) * 1e3)
        report.figure(f"{path}_ttft_p99_ms", _quantile(ttft[path], 0.99) * 1e3)
    report.ratio(
        "http_ttft_overhead_ms",
        (_quantile(ttft["http"], 0.5) - _quantile(ttft["grpc"], 0.5)) * 1e3,
        "<= 1 (ms)",
    )
    if not args.no_transfer:
        try:
            from bench.transfer import measure_transfer
        except ImportError as exc:  # the p2p benchmark is not there
            print(f"bench.serve: no transfer figure ({exc})")
        else:
            fig = measure_transfer(256 if args.quick else 1024, repeat=2 if args.quick else 3)
            report.figure("transfer_p2p_gbps", fig.p2p_gbps)
            report.ratio("transfer_fraction_of_socket", fig.fraction_of_socket, ">= 0.7")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
