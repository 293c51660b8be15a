"""The store server as a real process, reached through the ``remote:`` tier: round trips, garbage frames,
a server that dies or stalls mid-run, restarts, and the ``pdkv kvstore`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from kvtest import (
    BLOCK,
    LAYOUT,
    NAMESPACE,
    OTHER_NAMESPACE,
    Blocks,
    RedisProcess,
    StoreServerProcess,
    free_port,
    requires_redis,
    wait_until,
)

from kvstore.breaker import BreakerConfig
from kvstore.config import RemoteTierConfig
from kvstore.deadline import Deadline
from kvstore.engine_view import KVStore
from kvstore.results import MissReason, Unit
from kvstore.tiers.base import TierPolicy
from kvstore.tiers.remote import CONNECT_WAIT_S, PUT_CHUNK, RemoteTier
from wire.codec import BlockCodec
from wire.framing import PROTOCOL_VERSION, ErrorReply, send_frames
from wire.layout import BlockLayout
from wire.store_protocol import CountReply, Lookup, Put, decode_store_reply

POLICY = TierPolicy(
    lookup_timeout_s=0.5, get_timeout_s=1.0, put_timeout_s=1.0, breaker=BreakerConfig(cooldown_s=0.1)
)

StartServer = Callable[..., StoreServerProcess]


@pytest.fixture
def remote() -> Iterator[Callable[[str], RemoteTier]]:
    tiers: list[RemoteTier] = []

    def connect(endpoint: str) -> RemoteTier:
        tier = RemoteTier(RemoteTierConfig(endpoint, timeout_s=1.0), policy=POLICY)
        tiers.append(tier)
        return tier

    yield connect
    for tier in tiers:
        tier.close()


def raw_request(endpoint: str, frames: list[bytes], timeout_ms: int = 2000) -> list[bytes]:
    """Send frames on a fresh DEALER and return the reply frames."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "the server did not answer"
        return sock.recv_multipart()
    finally:
        sock.close()


def test_put_get_lookup_through_the_remote_tier(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    server = store_server("cpu:1MiB")
    tier = remote(server.endpoint)
    n = PUT_CHUNK + 6  # two put requests on the wire, three get requests
    b = make_blocks(n + 10)
    assert tier.ping()["server"] == "pdkv-kvstore"
    assert tier.contains_prefix(b.run()) == 0
    assert tier.put(b.run(0, n), b.units(0, n)).stored == n
    assert tier.contains_prefix(b.run()) == n
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (n, MissReason.ABSENT) and b.loaded(n)
    read = tier.read(b.run(n - 2), layout=LAYOUT)
    assert [bytes(u.payload) for u in read.units] == [bytes(v) for v in b.views[n - 2 : n]]
    assert tier.delete(b.run(10, 12)) == 2 and tier.contains_prefix(b.run()) == 10
    requests = tier.server_stats()["requests"]
    assert requests["put"] == 2 and requests["lookup"] == 3


def test_over_ipc_with_a_disk_tier(
    store_server: StartServer,
    remote: Callable[[str], RemoteTier],
    make_blocks: Callable[..., Blocks],
    tmp_path: Path,
) -> None:
    server = store_server(
        f"cpu:{2 * BLOCK},disk:{tmp_path / 'disk'}:1MiB", bind=f"ipc://{tmp_path / 'kv.sock'}"
    )
    tier = remote(server.endpoint)
    b = make_blocks(6)
    assert tier.put(b.run(), b.units()).stored == 6
    wait_until(lambda: len(list((tmp_path / "disk").rglob("*"))) >= 6 + 2, 5.0, "the write-down to disk")
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 6 and b.loaded(
        6
    )  # most from the server's disk


def test_engines_with_different_layouts_share_one_server(store_server: StartServer) -> None:
    server = store_server("cpu:1MiB")
    bf16 = BlockLayout(2, 2, 8, 4, "bfloat16")
    namespace = "ab" * 16
    one = KVStore.open(f"remote:{server.endpoint}", namespace_id=namespace, layout=LAYOUT)
    two = KVStore.open(f"remote:{server.endpoint}", namespace_id=namespace, layout=bf16)
    try:
        hashes = [bytes([i]) * 32 for i in range(3)]
        assert one.put(hashes, [bytes([1]) * BLOCK] * 3).stored == 3
        assert one.contains_prefix(hashes) == 3 and two.contains_prefix(hashes) == 0
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize(
    "frames",
    [
        [b"not msgpack \xc1"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": PROTOCOL_VERSION, "id": 7, "op": "format_disk"})],
        [msgpack.packb({"v": 99, "id": 7, "op": "ping"})],
        [
            msgpack.packb(
                {
                    "v": PROTOCOL_VERSION,
                    "id": 7,
                    "op": "lookup",
                    "ns": b"x",
                    "start": 0,
                    "hashes": [],
                    "anchors": [],
                }
            )
        ],
        [b"x" * (2 << 20)],  # an oversized header frame
        [msgpack.packb({"v": PROTOCOL_VERSION, "id": 7, "op": "ping"}), b"extra"],
    ],
)
def test_garbage_gets_an_error_reply_and_the_server_keeps_serving(
    store_server: StartServer, remote: Callable[[str], RemoteTier], frames: list[bytes]
) -> None:
    server = store_server()
    reply = decode_store_reply(raw_request(server.endpoint, frames)[0])
    assert isinstance(reply, ErrorReply) and reply.msg
    assert remote(server.endpoint).ping()["protocol"] == PROTOCOL_VERSION


def test_bad_puts_are_refused_block_by_block(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    server = store_server("cpu:1MiB", extra=("--max-blocks", "8"))
    b = make_blocks(3)
    codec = BlockCodec(NAMESPACE, LAYOUT)
    run = b.run()
    headers = [codec.header_of(h, v) for h, v in zip(b.hashes, b.views, strict=True)]
    header_frame = Put(5, run, LAYOUT).encode()
    # block 1 carries block 2's header: blocks 0 is stored, the rest refused
    frames = [header_frame, headers[0] + headers[2] + headers[2], *(bytes(v) for v in b.views)]
    reply = decode_store_reply(raw_request(server.endpoint, frames)[0])
    assert reply == CountReply(5, 1, MissReason.WRONG_HASH)
    # a frame count that does not match the run: refused, by name, matched to its request
    reply = decode_store_reply(raw_request(server.endpoint, [header_frame, b"".join(headers)])[0])
    assert isinstance(reply, ErrorReply) and reply.id == 5 and "frames" in reply.msg
    # more blocks than the server accepts
    big = make_blocks(9, salt=1)
    reply = decode_store_reply(raw_request(server.endpoint, [Lookup(6, big.run()).encode()])[0])
    assert isinstance(reply, ErrorReply) and reply.id == 6 and "limit" in reply.msg
    tier = remote(server.endpoint)
    assert tier.contains_prefix(run) == 1


def test_corrupt_payloads_are_caught_by_readers_and_by_a_verifying_server(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(2)
    codec = BlockCodec(NAMESPACE, LAYOUT)
    header = codec.header_of(b.hashes[0], b.views[0])
    flipped = bytearray(b.views[0])
    flipped[7] ^= 1
    for extra, stored in (((), 1), (("--verify-puts",), 0)):
        server = store_server("cpu:1MiB", extra=extra)
        tier = remote(server.endpoint)
        result = tier.put(b.run(0, 1), [Unit(memoryview(bytes(flipped)), header)])
        assert result.stored == stored
        got = tier.get_into(b.run(0, 1), b.out_views[:1], LAYOUT)
        assert got.loaded == 0 and got.reason in (MissReason.CORRUPT, MissReason.ABSENT)


def test_a_killed_server_is_a_bounded_miss_and_is_reconnected_after_restart(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    server = store_server()
    tier = remote(server.endpoint)
    b = make_blocks(4)
    tier.put(b.run(), b.units())
    server.kill()
    start = time.monotonic()
    assert tier.contains_prefix(b.run(), Deadline.after(0.3)) == 0
    assert tier.get_into(b.run(), b.out_views, LAYOUT, Deadline.after(0.3)).loaded == 0
    assert tier.put(b.run(), b.units(), Deadline.after(0.3)).stored == 0
    assert time.monotonic() - start < 2.5  # three calls of 0.3 s each, plus slack for a busy host
    assert tier.stats().breakers["read"] != "closed"
    server.start()  # the same endpoint, an empty store
    wait_until(lambda: tier.put(b.run(), b.units()).stored == 4, 10.0, "the client to reconnect")
    wait_until(lambda: tier.contains_prefix(b.run()) == 4, 10.0, "lookups to work again")
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)


def test_a_server_that_is_down_fails_each_call_at_once_not_at_its_deadline(
    make_blocks: Callable[..., Blocks],
) -> None:
    """An outside probe's find: with no server listening every put waited out its whole deadline (2 s of
    a write lane each) and every lookup its 50 ms, where the docs promise "a server that is down is an
    immediate error".  Only a new socket's first send waits for its connection (CONNECT_WAIT_S); each
    later call -- the breaker's half-open tries, here after its cooldown -- fails at once."""
    policy = TierPolicy(
        lookup_timeout_s=20, get_timeout_s=20, put_timeout_s=20, breaker=BreakerConfig(cooldown_s=0.05)
    )
    tier = RemoteTier(RemoteTierConfig(f"tcp://127.0.0.1:{free_port()}", timeout_s=20), policy=policy)
    b = make_blocks(4)
    try:
        start = time.monotonic()
        for _ in range(3):
            time.sleep(0.1)  # past the breaker's cooldown: the next call reaches the socket
            assert tier.put(b.run(), b.units()).stored == 0
            time.sleep(0.1)
            assert tier.contains_prefix(b.run()) == 0
        # Six deadlines would be 120 s; a connection wait each, 0.6 s of sleeps + 1.5 s.
        assert time.monotonic() - start < 0.6 + CONNECT_WAIT_S + 1.0
        stats = tier.stats()
        assert set(stats.put_failures) == {"error"} and set(stats.misses) == {"error"}  # never "timeout"
    finally:
        tier.close()


def test_a_late_reply_is_recognised_and_dropped(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    server = store_server()
    tier = remote(server.endpoint)
    b = make_blocks(2)
    tier.put(b.run(), b.units())
    assert tier.contains_prefix(b.run()) == 2  # the lookup lane's socket is connected
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # the request is delivered, the answer comes late
    try:
        assert tier.contains_prefix(b.run(), Deadline.after(0.2)) == 0
        # the abandoned call gives up too before the server answers: its reply is late for certain
        wait_until(lambda: not tier._lanes["lookup"].stuck(), 5.0, "the abandoned lookup to return")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    tier.read_breaker.record_success()  # skip the cooldown
    assert tier.contains_prefix(b.run()) == 2
    assert tier.stats().backend["late_replies"] == 1


def test_sigterm_stops_the_server_cleanly(store_server: StartServer) -> None:
    server = store_server()
    assert server.terminate() == 0


@pytest.mark.parametrize("interval", ["0", "-5"])
def test_a_health_interval_that_is_not_positive_is_refused_before_serving(interval: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.server", "--kv-store", "cpu:1MiB", "--health-interval-ms", interval],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "pdkv kvstore: serving on" not in done.stdout
    assert f"--health-interval-ms must be positive, got {interval}" in done.stderr


def test_pdkv_kvstore_command_line(store_server: StartServer, capsys: pytest.CaptureFixture[str]) -> None:
    from pdkv.commands import kvstore as command

    parser = argparse.ArgumentParser(prog="pdkv")
    command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kvstore", "serve", "--kv-store", "cpu:1MiB", "--bind", "tcp://127.0.0.1:0"])
    assert args.kv_store == "cpu:1MiB" and args.func.__name__ == "_serve"
    server = store_server()
    args = parser.parse_args(["kvstore", "ping", "--connect", server.endpoint, "--stats"])
    assert args.func(args) == 0
    assert '"pdkv-kvstore"' in capsys.readouterr().out
    server.kill()
    args = parser.parse_args(["kvstore", "ping", "--connect", server.endpoint, "--timeout-ms", "200"])
    assert args.func(args) == 1


def test_pdkv_kvstore_serve_takes_a_toml_file_as_its_help_says(
    store_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe: ``--kv-store @store.toml`` (the help's and docs/kvstore.md's way to the store-wide
    options) was refused by the command's check before the server, which reads it, could start."""
    from pdkv.commands import kvstore as command

    parser = argparse.ArgumentParser(prog="pdkv")
    command.register(parser.add_subparsers(dest="command", required=True))
    good, bad = tmp_path / "Store.toml", tmp_path / "bad.toml"
    good.write_text(
        '[kv_store]\nwrite_policy = "back"\n[[kv_store.tiers]]\nkind = "cpu"\ncapacity = "1MiB"\n'
    )
    bad.write_text('[[kv_store.tiers]]\nkind = "tape"\n')
    for spec, refused in (
        (f"@{good}", None),
        (f"@{bad}", "tape"),
        (f"@{tmp_path / 'none.toml'}", "none.toml"),
    ):
        args = parser.parse_args(["kvstore", "serve", "--kv-store", spec, "--bind", "tcp://127.0.0.1:0"])
        if refused is None:
            args.check(args)
        else:
            with pytest.raises((ValueError, FileNotFoundError), match=refused):
                args.check(args)
    server = store_server(f"@{good}")
    args = parser.parse_args(["kvstore", "ping", "--connect", server.endpoint])
    assert args.func(args) == 0


@requires_redis
def test_ping_is_not_green_while_a_tier_cannot_serve(
    store_server: StartServer, redis_server: RedisProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault drill: the Redis behind the store hangs, then stops; then its disk folder goes away.  The
    store keeps serving, its health check names each tier that cannot serve and why, and it answers at
    once whatever the backends do (the probes run off the serving loop)."""
    from pdkv.commands import kvstore as command

    parser = argparse.ArgumentParser(prog="pdkv")
    command.register(parser.add_subparsers(dest="command", required=True))
    disk = tmp_path / "disk"
    server = store_server(
        f"cpu:1MiB,disk:{disk}:1MiB,{redis_server.url}", extra=("--health-interval-ms", "100")
    )

    def ping(*extra: str) -> tuple[int, str]:
        args = parser.parse_args(
            ["kvstore", "ping", "--connect", server.endpoint, "--timeout-ms", "500", *extra]
        )
        code = args.func(args)
        return code, capsys.readouterr().out

    code, out = ping()
    assert code == 0 and '"degraded": {}' in out
    redis_server.pause()  # it keeps its socket: the probe waits for its whole deadline
    wait_until(lambda: ping()[0] == 1, 10.0, "the hung Redis reported")
    started = time.monotonic()
    code, out = ping()
    assert time.monotonic() - started < 0.3, "a ping does not wait on the hung backend"
    assert code == 1 and "tier redis cannot serve: probe failed: TierTimeout" in out, out
    assert ping("--liveness")[0] == 0, "the server answers: alive, if degraded"
    redis_server.resume()
    redis_server.stop()
    wait_until(lambda: "connecting to" in ping()[1], 10.0, "the stopped Redis reported")
    disk.rename(tmp_path / "gone")
    wait_until(lambda: "tier disk cannot serve" in ping()[1], 10.0, "the missing folder reported")
    assert f"probe failed: TierError: {disk} is not a writable folder" in ping()[1]
    redis_server.start()
    (tmp_path / "gone").rename(disk)
    wait_until(lambda: ping()[0] == 0, 10.0, "the tiers back in service")


def test_a_failed_probe_leaves_the_data_path_alone(
    tmp_path: Path, make_blocks: Callable[..., Blocks]
) -> None:
    """A full disk cannot take writes, but its blocks still read: the health check says so without
    opening a breaker that would cut the reads off."""
    from kvstore.store import TieredStore

    store = TieredStore.from_config(f"disk:{tmp_path}:1MiB")
    try:
        b = make_blocks(3)
        assert store.put(b.run(), b.units()).stored == 3
        real_statvfs = os.statvfs
        full = real_statvfs(tmp_path)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "statvfs", lambda _path: type(full)((*full[:4], 0, *full[5:])))  # f_bavail = 0
            assert "file system of" in store.health()["disk"]
            assert store.health()  # asked again: still the probe's answer, not a breaker's
        disk = store.tiers[0]
        assert disk.read_breaker.state.value == "closed" and disk.write_breaker.state.value == "closed"
        assert store.contains_prefix(b.run()) == 3
        assert store.health() == {}
    finally:
        store.close()


def test_two_engines_share_blocks_through_the_server(store_server: StartServer) -> None:
    # The deployment the server exists for: each engine's stack is cpu,remote:...; what one engine
    # saves, the other finds, loads and promotes into its own memory.
    server = store_server("cpu:1MiB")
    spec = f"cpu:{4 * BLOCK},remote:{server.endpoint}"
    namespace = "cd" * 16
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    payloads = [bytes([i + 7]) * BLOCK for i in range(4)]
    first = KVStore.open(spec, namespace_id=namespace, layout=LAYOUT)
    second = KVStore.open(spec, namespace_id=namespace, layout=LAYOUT)
    try:
        assert first.put(hashes, payloads).stored == 4
        assert first.drain(5.0)  # written down to the server in the background
        assert second.contains_prefix(hashes) == 4
        out = [bytearray(BLOCK) for _ in range(4)]
        assert second.get_into(hashes, out).loaded == 4 and [bytes(o) for o in out] == payloads
        assert second.stats().tier("cpu").counter("promotions") == 4
        assert second.store.tiers[0].contains_prefix(second._run(hashes, 0)) == 4  # now in its memory
    finally:
        first.close()
        second.close()


def test_send_frames_tracks_the_last_frame_zeromq_did_not_copy() -> None:
    """A message of a large block and a small trailer: the tracker follows the block (pyzmq copies the
    small frame, so tracking it would say "done" while ZeroMQ still reads the block)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://send-frames")
        b.connect("inproc://send-frames")
        block = bytearray(1 << 20)
        tracker = send_frames(a, [b"header", memoryview(block), b"trailer"], track=True)
        assert tracker is not None and not tracker.done  # the message waits, unread, holding the block
        frames = b.recv_multipart(copy=False)
        assert [len(f) for f in frames] == [6, 1 << 20, 7]
        del frames
        tracker.wait(5)
        small = send_frames(a, [b"x", memoryview(bytearray(16))], track=True)
        assert small is not None and small.done  # nothing sent without a copy: nothing to wait for
        b.recv_multipart()
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_metrics_parse_with_prometheus_client(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    server = store_server("cpu:1MiB", extra=("--metrics-address", "127.0.0.1:0"))
    assert server.metrics, "the ready line names the metrics address"
    # Before any request, every op's and every tier counter's series is there, at 0: an outside probe
    # found the dashboard's store panels empty after a store restart (the series appeared at first use).
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as response:
        fresh = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    ops = {s.labels["op"]: s.value for s in fresh["pdkv_kvstore_requests"].samples}
    assert {"lookup", "get", "put", "delete", "refused", "failed"} <= set(ops) and not any(ops.values())
    for name in ("lookup_blocks", "lookup_hits", "read_blocks", "stored_blocks"):
        assert [s.value for s in fresh[f"pdkv_kvstore_tier_{name}"].samples] == [0.0], name
    tier = remote(server.endpoint)
    b = make_blocks(4)
    assert tier.put(b.run(), b.units()).stored == 4
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 4
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as response:
        body = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    requests = {s.labels["op"]: s.value for s in families["pdkv_kvstore_requests"].samples}
    assert requests["put"] == 1 and requests["get"] == 1
    assert families["pdkv_kvstore_tier_stored_blocks"].type == "counter"
    # Jobs queued now (a single tier writes nothing down), not the queue's capacity.
    assert families["pdkv_kvstore_write_queue_depth"].samples[0].value == 0
    latency = families["pdkv_kvstore_tier_op_seconds"]
    assert latency.type == "histogram"
    # The server serves a get by reading units from its tiers as stored.
    reads = [s for s in latency.samples if s.name.endswith("_count") and s.labels["op"] == "read"]
    assert reads and reads[0].labels["tier"] == "cpu" and reads[0].value >= 1


@pytest.mark.parametrize("backend", ["disk", "redis"])
@pytest.mark.parametrize("wrong", ["layout", "namespace"])
def test_a_wrong_block_in_a_tier_is_never_served_or_promoted_and_is_dropped(
    store_server: StartServer,
    remote: Callable[[str], RemoteTier],
    make_blocks: Callable[..., Blocks],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    backend: str,
    wrong: str,
) -> None:
    """The defect the redesign found: a block with another layout that reached Redis was returned as ok,
    promoted into the server's memory, and made every later request for its prefix miss -- forever.
    Now the server checks every block it returns against the run's namespace and the layout the client
    asked for, and drops a block that fails from the tier it found it in."""
    from kvstore.store import TieredStore
    from wire.codec import pack_header, payload_checksum

    if backend == "redis":
        lower = request.getfixturevalue("redis_server").url
    else:
        lower = f"disk:{tmp_path / 'disk'}:1MiB"
    b = make_blocks(4)
    units = b.units()
    for unit in units:
        unit.seal()
    # Block 2 is planted straight into the backend under its right key, with a header for another
    # layout (same payload size) or another model.
    other_layout = BlockLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, dtype="float16")
    assert other_layout.payload_nbytes == LAYOUT.payload_nbytes
    bad_ns, bad_layout = (OTHER_NAMESPACE, LAYOUT) if wrong == "namespace" else (NAMESPACE, other_layout)
    view = b.views[2]
    units[2] = Unit(view.toreadonly(), pack_header(bad_ns, b.hashes[2], bad_layout, payload_checksum(view)))
    planter = TieredStore.from_config(lower)
    try:
        assert planter.tiers[0].put(b.run(), units).stored == 4
    finally:
        planter.close()

    server = store_server(f"cpu:1MiB,{lower}")
    tier = remote(server.endpoint)
    # Present under its key (a disk tier that checks its files at start may have dropped it already) ...
    assert tier.contains_prefix(b.run()) in (2, 4)
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    expected = MissReason.WRONG_NAMESPACE if wrong == "namespace" else MissReason.WRONG_LAYOUT
    # ... never served (the reason is the tier's, or "absent" once the server has dropped it and asked
    # the tiers below again)
    assert result.loaded == 2 and result.reason in (expected, MissReason.ABSENT) and b.loaded(2)
    assert tier.contains_prefix(b.run()) == 2  # dropped from the backend, and never promoted to memory
    # The server caught it: the client never received the bad block (it would have dropped it itself).
    assert tier.stats().counter("dropped_blocks") == 0
    again = TieredStore.from_config(lower)
    try:
        assert again.tiers[0].contains_prefix(b.run()) == 2, "the bad block is still in the backend"
    finally:
        again.close()
    # The prefix is not lost for good: the recomputed blocks are stored (the bad one dropped with the
    # run's blocks after it: one put heals the run) and served.
    assert tier.put(b.run(2), b.units(2)).stored == 2
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)


def test_the_server_publishes_its_tiers_kv_events(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    """What a kv-aware router learns of the shared store: blocks stored and removed, by tier."""
    from router.kv_index import KVEventSubscriber, KVIndex, Publisher

    server = store_server("cpu:1MiB", extra=("--kv-events", "tcp://127.0.0.1:0"))
    pub, replay = server.kv_events.split(",")
    index = KVIndex()
    subscriber = KVEventSubscriber(index, lambda: [Publisher("store", "store", pub, replay)], refresh_s=0.05)
    subscriber.start()
    try:
        time.sleep(0.3)
        tier = remote(server.endpoint)
        b = make_blocks(6)
        assert tier.put(b.run(), b.units()).stored == 6
        wait_until(lambda: index.prefix_blocks("store", b.hashes) == 6, 5.0, "the stored blocks' events")
        assert tier.delete(b.run(3, 4)) == 1
        wait_until(lambda: index.prefix_blocks("store", b.hashes) == 3, 5.0, "the removed block's event")
    finally:
        subscriber.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_frame_is_refused_as_it_arrives_without_the_server_buffering_it(
    store_server: StartServer, remote: Callable[[str], RemoteTier], make_blocks: Callable[..., Blocks]
) -> None:
    """A frame larger than the largest block the server accepts disconnects the peer when its length
    arrives: the server never holds it (RSS does not grow by its size) and keeps serving."""
    server = store_server("cpu:1MiB", extra=("--max-block-bytes", str(1 << 20)))
    assert server.proc is not None
    before = _rss_bytes(server.proc.pid)
    huge = bytes(256 << 20)  # 256 MiB in one frame
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([Put(1, make_blocks(1).run(), LAYOUT).encode(), b"x" * 96, huge])
        assert sock.poll(2000) == 0  # no reply: the peer was dropped
    finally:
        sock.close(0)
        ctx.term()
    del huge
    assert _rss_bytes(server.proc.pid) - before < 32 << 20
    assert remote(server.endpoint).ping()["server"] == "pdkv-kvstore"
