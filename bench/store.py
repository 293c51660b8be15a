"""Benchmark the KV store tiers against the raw floor of each medium, measured in the same run.

    python -m bench.store [--quick] [--json PATH] [--disk-dir DIR] [--block-kib 256]

Every figure is a ratio against a baseline measured here, now, on the same bytes:

    lookup_speedup_vs_per_key_exists   Redis lookup of a 2048-block prefix (one Lua EVAL) vs one EXISTS
                                       round trip per key, in order             (target >= 50)
    lookup_slowdown_vs_multi_exists    the same lookup vs one bare multi-key EXISTS over the same keys
                                       (the floor: it counts, it cannot say where the prefix ends)
                                                                                (target <= 1.5)
    get_fraction_of_floor_<tier>       tier throughput / raw throughput of its medium (target >= 0.7):
    put_fraction_of_floor_<tier>         cpu     memcpy into a preallocated tensor
                                         disk    raw file write (open, write, close) / read (readinto)
                                         redis   raw pipelined SET / GET of the same bytes, 16 per round trip
                                         remote  raw ZeroMQ DEALER/ROUTER exchange of the same frames
    ttft_speedup_<tier>                time to first token of an 8k-token prompt computed, over the same
                                       prompt with all its KV in that tier (bench model; --quick: 2k)
                                                                (target >= 5 from cpu, >= 3 from redis)

Tier figures include everything a store call costs: header checks, payload checksums, atomic renames.
Redis and the remote store server run as child processes on free ports, started and stopped here.  The
time-to-first-token figures drive a real engine with the ``offload`` connector (``measure_ttft``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from kvstore.config import CpuTierConfig, DiskTierConfig, RedisTierConfig, RemoteTierConfig
from kvstore.deadline import Deadline
from kvstore.results import Unit
from kvstore.tiers.base import Tier, TierPolicy
from wire.codec import BlockCodec
from wire.keys import KeyRun
from wire.layout import BlockLayout
from wire.memory import tune_malloc_for_tensors

NAMESPACE = bytes(range(16))
LOOKUP_BLOCKS = 2048
BATCH = 16
_POLICY = TierPolicy(lookup_timeout_s=10.0, get_timeout_s=60.0, put_timeout_s=60.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def redis_server() -> Iterator[int]:
    """A throwaway redis-server on a free port (no persistence)."""
    import redis

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_for(up, 10.0, "redis-server")
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def make_chain(n: int, salt: int = 0) -> list[bytes]:
    """``n`` block hashes as random-looking as real (sha256) ones."""
    return [hashlib.sha256(b"%d:%d" % (salt, i)).digest() for i in range(n)]


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---- Redis lookup ---------------------------------------------------------------------------------------


def bench_lookup(port: int, reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Figures and ratios of a 2048-block Redis lookup: ours, one bare multi-key EXISTS, EXISTS per key."""
    import redis

    from kvstore.tiers.redis import RedisTier

    tier = RedisTier(RedisTierConfig(f"redis://127.0.0.1:{port}/0"), policy=_POLICY)
    chain = make_chain(LOOKUP_BLOCKS, salt=7)
    run = KeyRun.of_chain(NAMESPACE, chain)
    keys = tier.keys(run)  # the floors ask about exactly the keys the lookup asks about
    client = redis.Redis(port=port)
    for i in range(0, len(keys), 512):
        client.mset({k: b"1" for k in keys[i : i + 512]})
    assert tier.contains_prefix(run) == LOOKUP_BLOCKS

    def ours() -> None:
        assert tier.contains_prefix(run, Deadline.after(10)) == LOOKUP_BLOCKS

    def multi() -> None:
        assert client.exists(*keys) == LOOKUP_BLOCKS

    def per_key() -> None:
        for key in keys:
            if not client.exists(key):
                break

    # ours and the floors in turns, as for the throughput figures
    samples: dict[str, list[float]] = {"ours": [], "multi": [], "per_key": []}
    ours()
    multi()
    for r in range(reps * 10):
        for name, fn in (("ours", ours), ("multi", multi), ("per_key", per_key)):
            if name == "per_key" and r % 10:
                continue  # 2048 round trips: a tenth as many samples
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    half = KeyRun.of_chain(NAMESPACE, chain[: LOOKUP_BLOCKS // 2] + make_chain(LOOKUP_BLOCKS // 2, salt=8))
    ours_half = timed(lambda: tier.contains_prefix(half, Deadline.after(10)), reps * 10)
    tier.close()
    client.close()
    ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    figures = {
        "redis_lookup_2048_full_hit_ms": ms["ours"],
        "redis_lookup_2048_half_hit_ms": ours_half * 1e3,
        "redis_exists_multi_2048_ms": ms["multi"],
        "redis_exists_per_key_2048_ms": ms["per_key"],
    }
    ratios = {
        "lookup_speedup_vs_per_key_exists": ms["per_key"] / ms["ours"],
        "lookup_slowdown_vs_multi_exists": statistics.median(
            o / m for o, m in zip(samples["ours"], samples["multi"], strict=True)
        ),
    }
    return figures, ratios


# ---- tier throughput ------------------------------------------------------------------------------------


class Blocks:
    """``n`` engine blocks of one layout (sources), their destinations, and encoded copies for floors."""

    def __init__(self, layout: BlockLayout, n: int) -> None:
        self.layout = layout
        self.n = n
        self.codec = BlockCodec(NAMESPACE, layout)
        nbytes = layout.payload_nbytes
        self.src = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8)
        self.dst = torch.zeros((n, nbytes), dtype=torch.uint8)
        self.src_views = [memoryview(self.src[i].numpy()) for i in range(n)]  # type: ignore[arg-type]
        self.dst_views = [memoryview(self.dst[i].numpy()) for i in range(n)]  # type: ignore[arg-type]
        self.encoded = torch.empty((n, 96 + nbytes), dtype=torch.uint8)
        chain = make_chain(n)
        for i in range(n):
            self.encoded[i].numpy()[:] = memoryview(self.codec.encode(chain[i], self.src_views[i]))
        self.encoded_views = [memoryview(self.encoded[i].numpy()) for i in range(n)]  # type: ignore[arg-type]

    @property
    def total_bytes(self) -> int:
        return self.n * self.layout.payload_nbytes

    def units(self, chain: list[bytes]) -> list[Unit]:
        return [
            Unit(v.toreadonly(), sealer=self.codec.sealer(h))
            for v, h in zip(self.src_views, chain, strict=True)
        ]

    def check(self) -> None:
        if not torch.equal(self.src, self.dst):
            raise AssertionError("a tier returned different bytes than it was given")
        self.dst.zero_()


Ops = tuple[Callable[[], None], Callable[[], None]]  # (put everything, get everything)
Pair = tuple[float, float]  # (put, get)


def interleaved(ours: Ops, floor: Ops, reps: int, nbytes: int) -> tuple[Pair, Pair, Pair]:
    """Ours (put, get) GB/s, the floor's (put, get) GB/s, and the (put, get) fractions of the floor.

    Each round runs floor put, our put, floor get, our get (a get reads what the put before it wrote), so
    both sides of a ratio are measured seconds apart; figures are medians over ``reps`` rounds after one
    warm-up round, and each fraction is the median of the per-round fractions (robust to load that comes
    and goes on a shared host).
    """
    order = [floor[0], ours[0], floor[1], ours[1]]
    for fn in order:
        fn()
    samples: list[list[float]] = [[], [], [], []]
    for _ in range(reps):
        for k, fn in enumerate(order):
            start = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - start)
    gbps = [nbytes / statistics.median(s) / 1e9 for s in samples]
    put_fraction = statistics.median(f / o for f, o in zip(samples[0], samples[1], strict=True))
    get_fraction = statistics.median(f / o for f, o in zip(samples[2], samples[3], strict=True))
    return (gbps[1], gbps[3]), (gbps[0], gbps[2]), (put_fraction, get_fraction)


def tier_ops(tier: Tier, blocks: Blocks, reps: int) -> Ops:
    """Put ``blocks`` under fresh keys (prepared before the clock starts), get the last ones back."""
    prepared = []
    for salt in range(1000, 1000 + reps + 2):
        chain = make_chain(blocks.n, salt=salt)
        prepared.append((KeyRun.of_chain(NAMESPACE, chain), blocks.units(chain)))
    pending = iter(prepared)
    last: list[KeyRun] = []

    def put() -> None:
        run, units = next(pending)
        result = tier.put(run, units, Deadline.after(60))
        assert result.stored == blocks.n, result
        last[:] = [run]

    def get() -> None:
        result = tier.get_into(last[0], blocks.dst_views, blocks.layout, Deadline.after(60))
        assert result.loaded == blocks.n, result

    return put, get


def cpu_floor_ops(blocks: Blocks) -> Ops:
    """memcpy, one thread, into and out of a preallocated tensor: what a store copy may cost without
    taking the engine's compute threads."""
    medium = torch.empty_like(blocks.src)
    medium.fill_(0)  # touched: no page faults in the timed copies
    views = [memoryview(medium[i].numpy()) for i in range(blocks.n)]  # type: ignore[arg-type]

    def put() -> None:
        for dst, src in zip(views, blocks.src_views, strict=True):
            dst[:] = src

    def get() -> None:
        for dst, src in zip(blocks.dst_views, views, strict=True):
            dst[:] = src

    return put, get


def torch_copy_gbps(blocks: Blocks, reps: int) -> float:
    """torch's parallel ``copy_`` of the same blocks (for reference: fast on an idle host)."""

    def copy() -> None:
        for i in range(blocks.n):
            blocks.dst[i].copy_(blocks.src[i])

    return blocks.total_bytes / timed(copy, reps) / 1e9


def disk_floor_ops(blocks: Blocks, folder: str) -> Ops:
    """Raw files: open, write, close each encoded block; open, readv, close to read it back."""
    os.makedirs(folder, exist_ok=True)
    rounds = iter(range(10_000))
    written: list[list[str]] = []
    head = bytearray(96)

    def put() -> None:
        r = next(rounds)
        paths = [f"{folder}/{r}-{i}" for i in range(blocks.n)]
        for path, view in zip(paths, blocks.encoded_views, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, view)
            finally:
                os.close(fd)
        written[:] = [paths]

    def get() -> None:
        for path, dst in zip(written[0], blocks.dst_views, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.readv(fd, [head, dst])
            finally:
                os.close(fd)

    return put, get


def redis_floor_ops(port: int, blocks: Blocks) -> tuple[Ops, Callable[[], None]]:
    """Raw pipelined SET / GET of the encoded blocks through one redis-py connection, 16 per round trip.

    Every put writes fresh keys, as the tier does (new keys cost Redis more than overwriting old ones).
    """
    import redis

    pool = redis.ConnectionPool(host="127.0.0.1", port=port)
    conn = pool.get_connection()
    rounds = iter(range(10_000))
    keys: list[bytes] = []

    def put() -> None:
        r = next(rounds)
        keys[:] = [b"floor:%d:%d" % (r, i) for i in range(blocks.n)]
        for lo in range(0, blocks.n, BATCH):
            batch = range(lo, min(lo + BATCH, blocks.n))
            conn.send_packed_command(
                conn.pack_commands([("SET", keys[i], blocks.encoded_views[i]) for i in batch])
            )
            for _ in batch:
                conn.read_response()

    def get() -> None:
        for lo in range(0, blocks.n, BATCH):
            batch = range(lo, min(lo + BATCH, blocks.n))
            conn.send_packed_command(conn.pack_commands([("GET", keys[i]) for i in batch]))
            for _ in batch:
                conn.read_response()

    def close() -> None:
        pool.release(conn)
        pool.disconnect()

    return (put, get), close


def _zmq_floor_server(endpoint: str, nbytes: int, n: int) -> None:
    """A ROUTER that acks puts and answers gets with ``n`` preallocated payload frames (no store)."""
    import zmq

    torch.set_num_threads(1)
    tune_malloc_for_tensors()
    payloads = [torch.zeros(nbytes, dtype=torch.uint8).numpy() for _ in range(n)]
    headers = bytes(96 * n)
    sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        kind = frames[1].bytes
        if kind == b"stop":
            return
        if kind == b"get":
            sock.send_multipart([frames[0].bytes, b"ok", headers, *payloads], copy=False)
        else:
            sock.send_multipart([frames[0].bytes, b"ok"])


@contextmanager
def remote_floor_ops(blocks: Blocks) -> Iterator[Ops]:
    """A raw DEALER/ROUTER exchange of the same frames with a server process that stores nothing."""
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_zmq_floor_server, args=(endpoint, blocks.layout.payload_nbytes, blocks.n))
    proc.start()
    sock: Any = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    headers = bytes(96 * blocks.n)

    def put() -> None:
        sock.send_multipart([b"put", headers, *blocks.src_views], copy=False)
        sock.recv_multipart()

    def get() -> None:
        sock.send(b"get")
        sock.recv()
        sock.recv()
        for dst in blocks.dst_views:
            sock.recv_into(dst)

    try:
        yield put, get
    finally:
        sock.send(b"stop")
        proc.join(10)
        sock.close(linger=0)


@contextmanager
def store_server(spec: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--kv-store", spec, "--bind", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("pdkv kvstore: serving on "):
            raise RuntimeError(f"store server did not start: {line!r}")
        yield line.removeprefix("pdkv kvstore: serving on ").split()[0]
    finally:
        proc.terminate()
        proc.wait(10)


def measure_ttft(quick: bool, disk_dir: str | None) -> tuple[dict[str, float], dict[str, float]]:
    """Time to first token of a prompt whose KV is fully held in one tier, against computing it.

    The bench model (bench.engine's: 4 layers, hidden 512, float32) with the ``offload`` connector over a
    store of exactly that tier: a first request computes the prompt and saves it, the engine drains its
    saves and forgets its local prefix cache, then the same prompt is timed again -- its KV now comes from
    the tier.  The baseline is the same prompt computed by an engine without a connector, in the same run.
    """
    from bench.engine import BENCH_SPEC
    from connectors.registry import KVConnectorConfig
    from engine.llm import LLM
    from engine.model.make_model import make_model
    from engine.sampling_params import SamplingParams

    num_tokens = 2048 if quick else 8192
    spec = replace(BENCH_SPEC, max_position_embeddings=num_tokens + 64)
    one = SamplingParams(max_tokens=1)
    figures: dict[str, float] = {"ttft_prompt_tokens": num_tokens}
    ratios: dict[str, float] = {}
    root = tempfile.mkdtemp(prefix="pdkv-bench-ttft-", dir=disk_dir)
    try:
        model = make_model(f"{root}/model", spec)
        prompt = [(i * 7919) % spec.vocab for i in range(num_tokens)]
        options: dict[str, Any] = {"num_blocks": num_tokens // 16 + 8, "max_num_batched_tokens": num_tokens}

        def timed(llm: LLM) -> tuple[float, Any]:
            t0 = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            return time.perf_counter() - t0, out

        cold = LLM(model, **options)
        timed(cold)  # warm-up: first-touch of the cache and the weights
        compute_s = float("inf")
        for _ in range(1 if quick else 2):
            assert cold.engine.reset_prefix_cache()
            compute_s = min(compute_s, timed(cold)[0])
        figures["ttft_compute_ms"] = compute_s * 1e3

        with redis_server() as port, store_server("cpu:4GiB") as endpoint:
            tiers = {
                "cpu": "cpu:4GiB",
                "disk": f"disk:{root}/disk:8GiB",
                "redis": f"redis://127.0.0.1:{port}/0",
                "remote": f"remote:{endpoint}",
            }
            for name, store in tiers.items():
                llm = LLM(model, **options, kv_connector=KVConnectorConfig("offload", {"kv_store": store}))
                timed(llm)  # computes and saves
                assert llm.engine.drain(120.0), f"{name}: saves did not finish"
                best = float("inf")
                for _ in range(1 if quick else 3):
                    # The timed request saves its last block in the background: wait, then forget.
                    assert llm.engine.drain(120.0) and llm.engine.reset_prefix_cache()
                    elapsed, out = timed(llm)
                    assert out.num_external_tokens >= num_tokens - 16, f"{name}: not served from the tier"
                    best = min(best, elapsed)
                llm.engine.drain(120.0)
                llm.engine.shutdown()
                figures[f"ttft_{name}_ms"] = best * 1e3
                ratios[f"ttft_speedup_{name}"] = compute_s / best
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures, ratios


# ---- main -----------------------------------------------------------------------------------------------


def run(quick: bool, disk_dir: str | None, block_kib: int) -> dict[str, Any]:
    from kvstore.tiers.cpu import CpuTier
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.remote import RemoteTier

    reps = 5 if quick else 25
    n = 64 if quick else 256
    # A realistic engine block: block_kib KiB of bf16 KV (e.g. 16 layers x 2 x 16 tokens x 8 heads x 32).
    head_dim = block_kib * 1024 // (16 * 2 * 16 * 8 * 2)
    layout = BlockLayout(16, 8, head_dim, 16, "bfloat16")
    blocks = Blocks(layout, n)
    figures: dict[str, float] = {"block_bytes": layout.payload_nbytes, "blocks_per_call": n}
    ratios: dict[str, float] = {}

    def record(tier: str, measured: tuple[Pair, Pair, Pair]) -> None:
        ours, floor, fractions = measured
        figures[f"{tier}_put_gbps"], figures[f"{tier}_get_gbps"] = ours
        figures[f"{tier}_put_floor_gbps"], figures[f"{tier}_get_floor_gbps"] = floor
        ratios[f"put_fraction_of_floor_{tier}"], ratios[f"get_fraction_of_floor_{tier}"] = fractions

    nbytes = blocks.total_bytes
    cpu = CpuTier(CpuTierConfig(capacity_bytes=n * layout.payload_nbytes), policy=_POLICY)
    record("cpu", interleaved(tier_ops(cpu, blocks, reps), cpu_floor_ops(blocks), reps, nbytes))
    cpu.close()
    blocks.check()
    figures["cpu_torch_copy_gbps"] = torch_copy_gbps(blocks, reps)

    root = tempfile.mkdtemp(prefix="pdkv-bench-", dir=disk_dir)
    try:
        disk = DiskTier(DiskTierConfig(f"{root}/tier", 64 * n * layout.payload_nbytes), policy=_POLICY)
        floor_ops = disk_floor_ops(blocks, f"{root}/floor")
        record("disk", interleaved(tier_ops(disk, blocks, reps), floor_ops, reps, nbytes))
        disk.close()
        blocks.check()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    with redis_server() as port:
        lookup_figures, lookup_ratios = bench_lookup(port, reps)
        figures.update(lookup_figures)
        ratios.update(lookup_ratios)
        tier = RedisTier(RedisTierConfig(f"redis://127.0.0.1:{port}/0"), policy=_POLICY)
        floor_ops, close = redis_floor_ops(port, blocks)
        record("redis", interleaved(tier_ops(tier, blocks, reps), floor_ops, reps, nbytes))
        close()
        tier.close()
        blocks.check()

    with store_server(f"cpu:{n * layout.payload_nbytes}") as endpoint, remote_floor_ops(blocks) as floor_ops:
        remote = RemoteTier(RemoteTierConfig(endpoint, timeout_s=60), policy=_POLICY)
        record("remote", interleaved(tier_ops(remote, blocks, reps), floor_ops, reps, nbytes))
        remote.close()
        blocks.check()

    return {
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {
            "lookup_speedup_vs_per_key_exists": ">= 50",
            "lookup_slowdown_vs_multi_exists": "<= 1.5",
            "get_fraction_of_floor_*": ">= 0.7",
            "put_fraction_of_floor_*": ">= 0.7",
        },
        "quick": quick,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repetitions (under a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    parser.add_argument(
        "--disk-dir", metavar="DIR", help="where the disk tier and floor write (default: tmp)"
    )
    parser.add_argument("--block-kib", type=int, default=256, help="payload size of one block (default 256)")
    parser.add_argument("--no-ttft", action="store_true", help="skip the engine time-to-first-token part")
    args = parser.parse_args(argv)
    results = run(args.quick, args.disk_dir, args.block_kib)
    if not args.no_ttft:
        ttft_figures, ttft_ratios = measure_ttft(args.quick, args.disk_dir)
        results["figures"].update({k: round(v, 3) for k, v in ttft_figures.items()})
        results["ratios"].update({k: round(v, 3) for k, v in ttft_ratios.items()})
        results["targets"].update({"ttft_speedup_cpu": ">= 5", "ttft_speedup_redis": ">= 3"})
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
