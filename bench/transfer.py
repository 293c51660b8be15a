"""The p2p connector's block transfer against a raw loopback TCP socket moving the same bytes.

    python -m bench.transfer [--quick] [--json PATH]

A producer *process* holds a paged cache of N blocks (default 2048 blocks of 256 KiB: the bench engine's
layout, 4 layers x K/V x 16 tokens x 8 KV heads x 64 head dim x float32) and serves them two ways:

- p2p: the connector's ``BlockServer`` (ZeroMQ ROUTER, zero-copy frames) holds a lease on all N blocks;
  this process pulls them with the connector's ``BlockPuller`` (DEALER, windowed reads of 8 MiB,
  ``recv_into`` straight into a preallocated destination cache, every block's xxh3 checksum verified)
  -- exactly the production path.  The producer seals a lease (checksums every block) as soon as it is
  registered, while in production the decode request is still travelling through the router; the pull
  is timed from the moment the consumer asks, and the seal is reported on its own (``seal_gbps``);
- socket: one ``sendall`` of the same bytes over a plain TCP connection, received with ``recv_into``
  into the same destination tensor -- the floor (FLOORS.md: 4.5-7.7 GB/s on this machine kind).

Both processes tune malloc as an engine on the CPU does.  Both paths run in the same processes,
interleaved, ``--repeat`` times after a warm-up; each keeps its best time.  Ratio:
``transfer_fraction_of_socket`` = p2p GB/s / socket GB/s (target >= 0.7).

``measure_transfer()`` is the entry point for other benchmarks (``bench.serve``).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.common import Report, parser
from connectors.p2p_client import BlockPuller, PullJob
from connectors.p2p_transfer import BlockViews, TransferStats
from wire.memory import tune_malloc_for_tensors

# [num_layers, 2, block_size, kv_heads, head_dim] of one block: 256 KiB in float32.
BLOCK_SHAPE = (4, 2, 16, 8, 64)
BATCH_BYTES = 8 << 20
WINDOW = 2


@dataclass(frozen=True)
class TransferFigures:
    num_blocks: int
    block_bytes: int
    p2p_s: float  # best wall time of one pull of every block
    socket_s: float  # best wall time of the same bytes over a raw socket
    seal_s: float  # best time the producer took to checksum the leased blocks (before the pull)
    round_fractions: tuple[float, ...] = ()  # p2p / socket GB/s of each round (measured back to back)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def p2p_gbps(self) -> float:
        return self.total_bytes / self.p2p_s / 1e9

    @property
    def socket_gbps(self) -> float:
        return self.total_bytes / self.socket_s / 1e9

    @property
    def seal_gbps(self) -> float:
        return self.total_bytes / self.seal_s / 1e9

    @property
    def fraction_of_socket(self) -> float:
        return self.p2p_gbps / self.socket_gbps

    def figures(self) -> dict[str, float]:
        return {
            "transfer_blocks": self.num_blocks,
            "transfer_block_bytes": self.block_bytes,
            "transfer_p2p_gbps": self.p2p_gbps,
            "transfer_socket_gbps": self.socket_gbps,
            "transfer_p2p_s": self.p2p_s,
            "transfer_socket_s": self.socket_s,
            "transfer_seal_gbps": self.seal_gbps,
            # Less sensitive to load that comes and goes than the ratio of the bests.
            "transfer_fraction_median_round": statistics.median(self.round_fractions or (0.0,)),
        }


NAMESPACE = bytes(16)  # both ends of the benchmark's one model


def _hashes(num_blocks: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(32, "little") for i in range(num_blocks))


def _producer(conn: Connection, num_blocks: int) -> None:
    """The producer process: a cache, a ``BlockServer`` over it, and a raw socket sending the same bytes."""
    from connectors.p2p_server import BlockServer

    tune_malloc_for_tensors()  # as an engine on the CPU does
    torch.set_num_threads(1)
    kv = torch.empty(num_blocks, *BLOCK_SHAPE).uniform_()  # [blocks, L, 2, bs, H, D]
    flat = memoryview(kv.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    server = BlockServer(BlockViews(kv), "tcp://127.0.0.1:0", stats=TransferStats(), namespace=NAMESPACE)
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((server.endpoint, listener.getsockname()[1]))
    raw, _ = listener.accept()
    hashes = _hashes(num_blocks)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "lease":
                start = time.perf_counter()
                server.add_lease(arg, range(num_blocks), hashes, 600.0)
                while not server.is_sealed(arg):  # the seal runs while the decode request travels
                    time.sleep(0.0005)
                conn.send(time.perf_counter() - start)
            elif cmd == "raw":
                raw.sendall(flat)
            else:
                return
    finally:
        raw.close()
        listener.close()
        server.close()


def measure_transfer(num_blocks: int = 2048, *, repeat: int = 3) -> TransferFigures:
    """Best-of-``repeat`` times of the p2p pull and of the raw socket, measured in this call."""
    tune_malloc_for_tensors()  # as an engine on the CPU does: ZeroMQ's 256 KiB receive buffers are recycled
    ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or sockets
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, num_blocks), daemon=True)
    proc.start()
    puller: BlockPuller | None = None
    raw: socket.socket | None = None
    try:
        if not parent.poll(120):
            raise RuntimeError("the producer process did not start within 120s")
        endpoint, port = parent.recv()
        dst = torch.zeros(num_blocks, *BLOCK_SHAPE)  # preallocated, first-touched: the decode engine's cache
        views = BlockViews(dst)
        puller = BlockPuller(
            views,
            stats=TransferStats(),
            namespace=NAMESPACE,
            threads=1,
            recv_timeout_s=30.0,
            pull_timeout_s=300.0,
            batch_blocks=max(1, BATCH_BYTES // views.block_nbytes),
            window=WINDOW,
        )
        raw = socket.create_connection(("127.0.0.1", port))
        dst_bytes = memoryview(dst.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        hashes = _hashes(num_blocks)
        seal_times: list[float] = []
        p2p_times: list[float] = []
        socket_times: list[float] = []
        for i in range(repeat + 1):  # the first round warms up both paths
            rid = f"bench-{i}"
            parent.send(("lease", rid))
            seal_times.append(parent.recv())
            start = time.perf_counter()
            result = puller.submit(PullJob(rid, endpoint, rid, 0, tuple(range(num_blocks)), hashes)).wait(300)
            elapsed = time.perf_counter() - start
            if result is None or not result.ok:
                raise RuntimeError(f"the p2p pull failed: {result}")
            puller.take_finished()
            p2p_times.append(elapsed)
            socket_times.append(_receive_raw(parent, raw, dst_bytes))
        rounds = tuple(s / p for p, s in zip(p2p_times[1:], socket_times[1:], strict=True))
        return TransferFigures(
            num_blocks,
            views.block_nbytes,
            min(p2p_times[1:]),
            min(socket_times[1:]),
            min(seal_times[1:]),
            rounds,
        )
    finally:
        if puller is not None:
            puller.close()
        if raw is not None:
            raw.close()
        parent.send(("stop", None))
        proc.join(30)


def _receive_raw(conn: Connection, raw: socket.socket, dst: memoryview) -> float:
    start = time.perf_counter()
    conn.send(("raw", None))
    got, total = 0, dst.nbytes
    while got < total:
        n = raw.recv_into(dst[got:])
        if n == 0:
            raise RuntimeError("the producer closed the raw socket")
        got += n
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "p2p transfer benchmark")
    p.add_argument("--blocks", type=int, default=None, help="blocks to move (default 2048, --quick 512)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds of each (default 5, --quick 3)")
    args: Any = p.parse_args(argv)
    blocks = args.blocks or (512 if args.quick else 2048)
    repeat = args.repeat or (3 if args.quick else 5)
    fig = measure_transfer(blocks, repeat=repeat)
    report = Report("p2p block transfer vs raw TCP socket")
    for key, value in fig.figures().items():
        report.figure(key, value)
    report.ratio("transfer_fraction_of_socket", fig.fraction_of_socket, ">= 0.7")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
