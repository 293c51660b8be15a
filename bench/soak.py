"""A timed load on a disaggregated cluster, with cancels: what the nodes log and leave behind.

    python -m bench.soak [--seconds 60] [--quick] [--json PATH]

One prefill + one decode node, the shared store, the router (real processes through
``pdkv.launcher``).  ``--clients`` threads send streamed requests with shared prefixes for
``--seconds``; every fourth request is cancelled after its first token, which stops its holds on both
nodes.  Afterwards the nodes must be idle (every block free, the books balanced), and their logs are
counted: WARNING and ERROR lines, and the lines of the old one-phase release ("reused while it
transfers", about 58 a minute before two-phase release) -- which must be zero.

Figures: ``requests_completed``, ``requests_cancelled``, ``log_warnings``, ``log_errors``,
``reuse_warnings``, ``hold_stop_timeouts`` (the nodes' ``kv_hold_stop_timeouts`` counters).  Ratio:
``reuse_warnings_per_minute`` (goal 0).
"""

from __future__ import annotations

import random
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench.common import Report, parser
from bench.serve import BENCH_SPEC
from engine.model.make_model import make_model
from engine.sampling_params import SamplingParams
from pdkv.launcher import DEFAULT_STORE, Cluster, Topology
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from serving.client import GenerationClient, generate_request

REUSE_WARNING = "reused while it transfers"


def _load(address: str, seconds: float, clients: int) -> tuple[int, int]:
    rng = random.Random(0)
    vocab = BENCH_SPEC.vocab - 2
    prefixes = [[rng.randrange(vocab) for _ in range(160)] for _ in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    done = [0, 0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        local = random.Random(i)
        n = 0
        with GenerationClient(address) as c:
            while time.monotonic() < stop_at:
                prompt = local.choice(prefixes) + [
                    local.randrange(vocab) for _ in range(local.randrange(8, 64))
                ]
                request = generate_request(prompt, params)
                n += 1
                if n % 4 == 0:  # cancelled after its first token: the prefill node's hold is stopped
                    call = c.stream(request, timeout=60)
                    for _ in call:
                        break
                    call.cancel()  # type: ignore[attr-defined]  # a grpc call is also its iterator
                    with lock:
                        done[1] += 1
                    continue
                c.generate(request, timeout=120)
                with lock:
                    done[0] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0], done[1]


def _node_stats(address: str) -> node_pb2.NodeStats:
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.NodeStub(channel).Stats(node_pb2.StatsRequest(check_integrity=True), timeout=10)


def _wait_idle(address: str, timeout_s: float = 30.0) -> node_pb2.NodeStats:
    deadline = time.monotonic() + timeout_s
    while True:
        s = _node_stats(address)
        g = s.gauges
        busy = g["num_requests_running"] + g["num_requests_waiting"] + g["num_requests_loading"]
        if not busy and not g["num_requests_held"] and g["kv_cache_free_blocks"] == g["kv_cache_blocks"]:
            if not s.integrity_ok:
                raise RuntimeError(f"{address}: the books do not balance: {s.integrity_error}")
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address} is not idle after the load: {g}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "soak")
    p.add_argument("--seconds", type=float, default=None, help="load duration (default 60, --quick 15)")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    args: Any = p.parse_args(argv)
    seconds = args.seconds or (15.0 if args.quick else 60.0)
    with tempfile.TemporaryDirectory(prefix="pdkv-soak-") as tmp:
        model = make_model(Path(tmp) / "model", BENCH_SPEC)
        logs = Path(tmp) / "logs"
        topology = Topology(
            num_prefill=1,
            num_decode=1,
            mode="disaggregated",
            model=str(model),
            kv_store=DEFAULT_STORE,
            log_dir=logs,
        )
        with Cluster.start(topology) as cluster:
            started = time.monotonic()
            completed, cancelled = _load(cluster.router_address, seconds, args.clients)
            elapsed = time.monotonic() - started
            nodes = [*cluster.prefill_nodes, *cluster.decode_nodes]
            stats = [_wait_idle(n.address) for n in nodes]
        text = "\n".join(f.read_text(errors="replace") for f in sorted(logs.glob("*.log")))
    lines = text.splitlines()
    warnings = sum(" WARNING " in line for line in lines)
    errors = sum(" ERROR " in line for line in lines)
    reuse = sum(REUSE_WARNING in line for line in lines)
    timeouts = sum(s.counters["kv_hold_stop_timeouts"] for s in stats)
    r = Report(f"bench.soak: {seconds:.0f} s of streamed requests with cancels on 1 prefill + 1 decode")
    r.figure("seconds", elapsed)
    r.figure("requests_completed", completed)
    r.figure("requests_cancelled", cancelled)
    r.figure("log_warnings", warnings)
    r.figure("log_errors", errors)
    r.figure("reuse_warnings", reuse)
    r.figure("hold_stop_timeouts", timeouts)
    r.ratio("reuse_warnings_per_minute", reuse / (elapsed / 60.0), "== 0")
    r.emit(args.json)
    kinds: dict[str, int] = {}
    for line in lines:
        if " WARNING " in line or " ERROR " in line:
            kind = re.sub(r"req-[0-9a-f]+|tcp://[0-9.:]+|\d+", "#", line.split(": ", 2)[-1])[:110]
            kinds[kind] = kinds.get(kind, 0) + 1
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:>5} x {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
