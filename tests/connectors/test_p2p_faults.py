"""The ``p2p`` connector when things go wrong: every failure ends in a recompute or a free, never a hang.

Engine-level faults use two in-process engines (``tests/p2p_harness.py``); wire-level faults use the
block server and the puller directly against sockets the test controls.  Every wait has a deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

import connectors.p2p_server as p2p_server
from connectors.p2p_client import BlockPuller, PullJob
from connectors.p2p_server import BlockServer
from connectors.p2p_transfer import BlockViews, TransferStats
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.p2p_harness import (
    BLOCK_SIZE,
    assert_idle,
    decode,
    local_reference,
    make_engine,
    prefill,
    run_until,
    stats,
    tokens,
    worker,
)
from tests.tiny_models import random_prompts
from wire.codec import pack_header, payload_checksum
from wire.framing import ErrorCode, ErrorReply, InfoReply, ProtocolError
from wire.layout import BlockLayout
from wire.p2p_protocol import DataReply, PingRequest, ReadRequest, ReleaseRequest
from wire.p2p_protocol import decode_p2p_reply as decode_reply
from wire.p2p_protocol import decode_p2p_request as decode_request

PROMPT = random_prompts([23], seed=3)[0]  # 5 full blocks of 4 tokens, then 3 tokens
MAX_TOKENS = 6
DEADLINE_S = 10.0


@pytest.fixture
def producer() -> Iterator[LLMEngine]:
    engine = make_engine("prefill-0")
    yield engine
    engine.shutdown()


def make_consumer(**options: Any) -> LLMEngine:
    return make_engine("decode-0", recv_timeout_s=0.5, **options)


@pytest.fixture
def consumer() -> Iterator[LLMEngine]:
    engine = make_consumer()
    yield engine
    engine.shutdown()


def server_of(engine: LLMEngine) -> BlockServer:
    server = worker(engine)._server
    assert server is not None
    return server


def wait_for(condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s}s"
        pause.wait(0.002)


class ReadGate:
    """Replaces a server's read handler: the first ``serve`` reads are answered, later ones are dropped
    (the producer looks dead to the reader) and counted in ``dropped``."""

    def __init__(self, server: BlockServer, monkeypatch: pytest.MonkeyPatch, serve: int = 0) -> None:
        self.serve = serve
        self.dropped = threading.Event()
        original = server._serve_read

        def gated(identity: bytes, request: ReadRequest) -> None:
            if self.serve > 0:
                self.serve -= 1
                original(identity, request)
            else:
                self.dropped.set()

        monkeypatch.setattr(server, "_serve_read", gated)


# ---- engine-level faults -----------------------------------------------------------------------------------


def test_producer_stopped_mid_transfer_consumer_recomputes(
    producer: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One block per read, one read at a time: the transfer is mid-way after the first reply.
    consumer = make_consumer(batch_bytes=producer.kv_spec.bytes_per_block, window=1)
    try:
        pre = prefill(producer, "r", PROMPT)
        gate = ReadGate(server_of(producer), monkeypatch, serve=1)
        consumer.add_request("r", [*PROMPT, pre.first_token], None, kv_transfer_params=pre.params)
        run_until([consumer, producer], gate.dropped.is_set, timeout_s=DEADLINE_S)
        producer.shutdown()  # the producer is gone: its socket closed, nothing more will answer
        started = time.monotonic()
        outs = run_until([consumer], lambda: not consumer.has_pending_work(), timeout_s=DEADLINE_S)["r"]
        assert time.monotonic() - started < 3.0  # recv_timeout_s=0.5, then the recompute
        got = [pre.first_token, *tokens(outs)]
        assert got == local_reference(tuple(PROMPT), len(got))
        s = stats(consumer)
        assert s["pulls_failed"] == 1 and s["failures.timeout"] == 1
        assert s["blocks_received"] == 1
        assert consumer.stats().counter("kv_load_failures") == 1
        assert_idle(consumer)
    finally:
        consumer.shutdown()


def test_lease_expiry_frees_the_blocks_when_no_consumer_comes(consumer: LLMEngine) -> None:
    producer = make_engine("prefill-0", lease_s=0.3)
    try:
        pre = prefill(producer, "r", PROMPT)
        assert producer.has_pending_work()
        run_until([producer], lambda: not producer.has_pending_work(), timeout_s=DEADLINE_S)
        assert stats(producer)["lease_expiries"] == 1
        assert_idle(producer)
        # A consumer that comes too late is told so, and recomputes.
        outs = decode(producer, consumer, "r", PROMPT, pre, MAX_TOKENS)
        assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
        assert stats(consumer)["failures.expired"] == 1
        assert consumer.stats().counter("kv_load_failures") == 1
        assert_idle(consumer)
    finally:
        producer.shutdown()


def test_consumer_abort_while_pulling_frees_both_sides(
    producer: LLMEngine, consumer: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pre = prefill(producer, "r", PROMPT)
    gate = ReadGate(server_of(producer), monkeypatch)  # reads go unanswered: the pull stays in flight
    consumer.add_request("r", [*PROMPT, pre.first_token], None, kv_transfer_params=pre.params)
    run_until([consumer, producer], gate.dropped.is_set, timeout_s=DEADLINE_S)
    assert "r" in consumer.scheduler.loading
    aborted = consumer.abort_request("r")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert consumer.has_pending_work()  # blocks held until the pull stopped writing into them
    run_until(
        [consumer, producer],
        lambda: not consumer.has_pending_work() and not producer.has_pending_work(),
        timeout_s=DEADLINE_S,
    )
    assert stats(consumer)["pulls_cancelled"] == 1
    assert stats(producer)["leases_released"] == 1  # the consumer told the producer it is done
    assert_idle(consumer)
    assert_idle(producer)


def test_checksum_mismatch_is_a_load_error_and_the_engine_recomputes(
    producer: LLMEngine, consumer: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def corrupt_third(payload: Any) -> int:
        calls.append(1)
        value = payload_checksum(payload)
        return value ^ 1 if len(calls) == 3 else value  # the producer's checksum of block 2 is wrong

    monkeypatch.setattr(p2p_server, "payload_checksum", corrupt_third)
    pre = prefill(producer, "r", PROMPT)
    outs = decode(producer, consumer, "r", PROMPT, pre, MAX_TOKENS)
    assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
    s = stats(consumer)
    assert s["failures.corrupt"] == 1 and s["pulls_failed"] == 1
    assert consumer.stats().counter("kv_load_failures") == 1
    # Blocks 0 and 1 were good; the engine recomputed from block 2 on, and says so: 8 tokens loaded (not
    # the 20 offered), the rest computed -- the usage a client sees counts what really was loaded.
    assert consumer.stats().counter("prompt_tokens.external_kv_transfer") == 2 * BLOCK_SIZE
    assert outs[-1].num_external_tokens == 2 * BLOCK_SIZE
    assert outs[-1].num_computed_prompt_tokens == len(PROMPT) + 1 - 2 * BLOCK_SIZE
    assert_idle(consumer)
    assert_idle(producer)


@pytest.mark.parametrize("registered", [True, False])
def test_an_aborted_lease_is_stopped_before_its_blocks_are_reused(registered: bool) -> None:
    # 8 blocks: the held request keeps 6, so the next request must reuse some of them once freed.
    producer = make_engine("prefill-0", num_blocks=8)
    try:
        prefill(producer, "held", PROMPT)
        if registered:
            producer.step()  # the worker half registers the lease in the step after the request finished
        assert server_of(producer).num_leases() == int(registered)
        free = producer.scheduler.kv.num_free_blocks
        producer.abort_request("held")  # the router cancelled
        assert producer.scheduler.kv.num_free_blocks == free, "freed before the worker stopped the lease"
        producer.add_request("next", random_prompts([27], seed=5)[0], SamplingParams(max_tokens=2))
        run_until([producer], lambda: not producer.has_pending_work(), timeout_s=DEADLINE_S)
        # Either way the worker stopped the lease (registered in the same step if it was not yet) and
        # confirmed within that step; only then did the engine free the blocks.
        assert stats(producer)["leases_stopped"] == 1
        assert producer.stats().counter("kv_hold_stop_timeouts") == 0
        assert server_of(producer).num_leases() == 0
        assert_idle(producer)
    finally:
        producer.shutdown()


def test_a_lease_withdrawn_before_it_was_served_fails_the_puller_at_once() -> None:
    """The 30 s stall an outside soak found: the prefill request finished, its RPC's end aborted it before
    the worker half registered the lease, and the decode node's pulls got "unknown lease" -- which it
    retries, since a lease may be registered a step late -- until its deadline.  A lease stopped before
    it was served still reaches the server, which answers "released": the consumer recomputes at once."""
    producer = make_engine("prefill-0")
    consumer = make_consumer(pull_timeout_s=30.0)
    try:
        pre = prefill(producer, "gone", PROMPT)
        assert server_of(producer).num_leases() == 0  # queued for the worker half, not registered yet
        producer.abort_request("gone")
        producer.step()  # the lease and its stop reach the worker half together
        start = time.monotonic()
        outs = decode(producer, consumer, "gone", PROMPT, pre, MAX_TOKENS, timeout_s=DEADLINE_S)
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"the pull waited {elapsed:.1f}s for a lease that was withdrawn"
        assert tokens(outs) == local_reference(tuple(PROMPT), MAX_TOKENS)[1:]
        assert consumer.stats().counter("kv_load_failures") == 1
        assert stats(producer)["leases_stopped"] == 1
        assert_idle(consumer)
        assert_idle(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_garbage_to_the_endpoint_is_refused_and_serving_continues(
    producer: LLMEngine, consumer: LLMEngine
) -> None:
    endpoint = worker(producer).endpoint
    assert endpoint is not None
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    garbage: list[list[bytes]] = [
        [b"\xc1\xff not msgpack"],
        [b""],
        [b"\x93\x01\x02\x03"],  # a msgpack array, not a map
        [b"\x81\xa1v\x07"],  # {"v": 7}: another version
        [ReadRequest(5, "nope", 0, (b"x" * 32,)).encode()],  # unknown lease
        [ReadRequest(6, "r", -1, (b"x" * 32,)).encode()[:-3]],  # truncated msgpack
        [ReleaseRequest(7, "nope").encode(), b"extra frame"],
        [PingRequest(8).encode()],
    ]
    for frames in garbage:
        dealer.send_multipart(frames)
    replies = []
    for _ in garbage:  # every message gets an answer: seven errors and the pong
        assert dealer.poll(int(DEADLINE_S * 1000))
        replies.append(decode_reply(dealer.recv()))
    errors = [r for r in replies if isinstance(r, ErrorReply)]
    assert len(errors) == 7 and any(isinstance(r, InfoReply) for r in replies)
    assert {r.code for r in errors} >= {ErrorCode.MALFORMED, ErrorCode.VERSION, ErrorCode.UNKNOWN_LEASE}
    # Bytes that are not even ZeroMQ, and a frame beyond the size limit: the peer is dropped.
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
    dealer.send(b"\x00" * (2 << 20))
    dealer.close()
    ctx.term()
    # ... and a real transfer still works.
    pre = prefill(producer, "r", PROMPT)
    outs = decode(producer, consumer, "r", PROMPT, pre, MAX_TOKENS)
    assert [pre.first_token, *tokens(outs)] == local_reference(tuple(PROMPT), MAX_TOKENS)
    assert outs[-1].num_external_tokens == len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert stats(producer)["requests_refused"] >= 7
    assert_idle(producer)
    assert_idle(consumer)


def test_shutdown_with_a_pull_in_flight_returns(producer: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    consumer = make_engine("decode-0", recv_timeout_s=30.0)
    pre = prefill(producer, "r", PROMPT)
    gate = ReadGate(server_of(producer), monkeypatch)
    consumer.add_request("r", [*PROMPT, pre.first_token], None, kv_transfer_params=pre.params)
    run_until([consumer, producer], gate.dropped.is_set, timeout_s=DEADLINE_S)
    started = time.monotonic()
    consumer.shutdown()
    assert time.monotonic() - started < 2.0


# ---- wire-level faults -------------------------------------------------------------------------------------

BLOCK_NBYTES = 4 * 2 * 16 * 8 * 64 * 4  # 256 KiB: a realistic engine block
OTHER_LAYOUT = BlockLayout(4, 8, 64, 16, "bfloat16")  # the same model, another dtype


def cache(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    kv = torch.zeros(num_blocks, 4, 2, 16, 8, 64)
    if fill is None:
        torch.manual_seed(0)
        kv.normal_()
    else:
        kv.fill_(fill)
    return kv


HASHES = [bytes([i]) * 32 for i in range(64)]
NS = bytes(range(16))  # the namespace both ends of these tests name


def test_stop_waits_for_sends_still_in_flight_and_resets_a_stuck_socket() -> None:
    views = BlockViews(cache(64))
    st = TransferStats()
    server = BlockServer(views, "tcp://127.0.0.1:0", stats=st, namespace=NS, stop_timeout_s=0.3)
    ctx = zmq.Context()
    try:
        server.add_lease("r", range(64), HASHES, 30.0)
        # A reader that asks for 16 MiB and never reads: ZeroMQ still holds frames over the engine's blocks.
        stuck = ctx.socket(zmq.DEALER)
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.connect(server.endpoint)
        for k in range(8):
            stuck.send(ReadRequest(k + 1, "r", k * 8, tuple(HASHES[k * 8 : k * 8 + 8])).encode())
        wait_for(lambda: st.get("blocks_sent") == 64)
        with server._lock:
            in_flight = len(server._leases["r"].pending_trackers())
        assert in_flight > 0
        assert server.stop("r")  # the engine wants the blocks back: waits, then resets the socket
        assert st.get("socket_resets") == 1
        with server._lock:
            assert not server._leases["r"].pending_trackers()
        assert server.take_finished() == ["r"]
        # The server serves again at the same endpoint after the reset.
        server.add_lease("s", [0, 1], HASHES[:2], 30.0)
        fresh = ctx.socket(zmq.DEALER)
        fresh.setsockopt(zmq.LINGER, 0)
        fresh.connect(server.endpoint)
        fresh.send(ReadRequest(99, "s", 0, tuple(HASHES[:2])).encode())
        assert fresh.poll(int(DEADLINE_S * 1000))
        frames = fresh.recv_multipart()
        reply = decode_reply(frames[0])
        assert isinstance(reply, DataReply) and reply.id == 99 and reply.n == 2 and len(frames) == 4
        assert bytes(frames[2]) == bytes(views.block(0))  # after the header and the unit headers
        stuck.close()
        fresh.close()
    finally:
        server.close()
        ctx.term()


def test_a_stop_for_a_lease_that_never_arrived_is_confirmed() -> None:
    """The engine may hold blocks for a lease the server never registered: the stop still ends the hold."""
    server = BlockServer(BlockViews(cache(4)), "tcp://127.0.0.1:0", stats=TransferStats(), namespace=NS)
    try:
        assert server.stop("never-registered")
        assert server.take_finished() == ["never-registered"]
    finally:
        server.close()


def test_a_release_that_beats_its_lease_ends_the_lease_at_registration() -> None:
    """A consumer that holds every block releases at admission, which can arrive before the producer
    registers the lease (a step after the request finished): the lease then ends as it is registered."""
    st = TransferStats()
    server = BlockServer(BlockViews(cache(4)), "tcp://127.0.0.1:0", stats=st, namespace=NS)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(server.endpoint)
        dealer.send(ReleaseRequest(1, "early").encode())
        dealer.send(PingRequest(2).encode())  # answered after the release was handled (one thread, in order)
        assert dealer.poll(int(DEADLINE_S * 1000)) and isinstance(decode_reply(dealer.recv()), InfoReply)
        server.add_lease("early", range(4), HASHES[:4], 30.0)
        finished: list[str] = []
        wait_for(lambda: bool(finished.extend(server.take_finished())) or finished == ["early"])
        assert (st.get("leases_registered"), st.get("leases_released"), st.get("lease_expiries")) == (1, 1, 0)
        assert server.num_leases() == 0
    finally:
        dealer.close(0)
        ctx.term()
        server.close()


class FakeProducer:
    """A ROUTER the test scripts: ``answer(request, frames_out)`` decides what each read gets."""

    def __init__(self, views: BlockViews, answer: Callable[[ReadRequest, Callable[..., None]], None]) -> None:
        self.views = views
        self.answer = answer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.reads: list[ReadRequest] = []
        self.releases = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def data(
        self,
        request: ReadRequest,
        *,
        reply_id: int | None = None,
        namespace: bytes = NS,
        layout: BlockLayout | None = None,
        hashes: list[bytes] | None = None,
    ) -> list[Any]:
        """A data reply as the producer sends it: each block's codec header, then its payload."""
        blocks = [self.views.block(request.first + j) for j in range(len(request.hashes))]
        layout = layout or self.views.layout
        hashes = hashes or list(request.hashes)
        headers = b"".join(
            pack_header(namespace, h, layout, payload_checksum(b))
            for h, b in zip(hashes, blocks, strict=True)
        )
        rid = request.id if reply_id is None else reply_id
        return [DataReply(rid, request.first, len(blocks)).encode(), headers, *(bytes(b) for b in blocks)]

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(10):
                continue
            identity, *body = self.sock.recv_multipart()
            request = decode_request(body[0])
            if isinstance(request, ReadRequest):
                self.reads.append(request)
                self.answer(
                    request, lambda frames, ident=identity: self.sock.send_multipart([ident, *frames])
                )
            else:
                self.releases += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def puller_setup() -> Iterator[tuple[BlockViews, BlockViews, TransferStats]]:
    src = BlockViews(cache(8))
    dst = BlockViews(cache(8, fill=0.0))
    yield src, dst, TransferStats()


def test_a_late_reply_with_a_stale_id_is_dropped(
    puller_setup: tuple[BlockViews, BlockViews, TransferStats],
) -> None:
    src, dst, st = puller_setup
    fake = FakeProducer(src, lambda req, send: None)

    def stale_then_real(request: ReadRequest, send: Callable[..., None]) -> None:
        stale = fake.data(request, reply_id=request.id + 1000)
        stale[2] = b"\xff" * BLOCK_NBYTES  # garbage that must not land anywhere
        send(stale)
        send(fake.data(request))

    fake.answer = stale_then_real
    puller = BlockPuller(dst, stats=st, namespace=NS, threads=1, recv_timeout_s=2.0, batch_blocks=2)
    try:
        job = PullJob("r", fake.endpoint, "remote-r", 0, (4, 5, 6, 7), tuple(HASHES[:4]))
        result = puller.submit(job).wait(DEADLINE_S)
        assert result is not None and result.ok and result.num_loaded == 4
        for j in range(4):
            assert bytes(dst.block(4 + j)) == bytes(src.block(j))
        assert st.get("late_replies") == 2
        assert [bytes(dst.block(b)) == bytes(BLOCK_NBYTES) for b in range(4)] == [True] * 4
        wait_for(lambda: fake.releases == 1)  # the pull acknowledged
    finally:
        puller.close()
        fake.close()


def test_a_silent_producer_times_out_and_the_next_pull_reconnects(
    puller_setup: tuple[BlockViews, BlockViews, TransferStats],
) -> None:
    src, dst, st = puller_setup
    silent = {"on": True}
    fake = FakeProducer(src, lambda req, send: None)
    fake.answer = lambda req, send: None if silent["on"] else send(fake.data(req))
    puller = BlockPuller(dst, stats=st, namespace=NS, threads=1, recv_timeout_s=0.3, batch_blocks=4)
    try:
        job = PullJob("a", fake.endpoint, "remote-a", 0, (0, 1, 2), tuple(HASHES[:3]))
        started = time.monotonic()
        failed = puller.submit(job).wait(DEADLINE_S)
        assert failed is not None and failed.reason == "timeout"
        assert failed.failed_block_ids == (0, 1, 2) and time.monotonic() - started < 2.0
        silent["on"] = False
        job = PullJob("b", fake.endpoint, "remote-b", 1, (5, 6), tuple(HASHES[1:3]))
        ok = puller.submit(job).wait(DEADLINE_S)
        assert ok is not None and ok.ok
        assert bytes(dst.block(5)) == bytes(src.block(1)) and bytes(dst.block(6)) == bytes(src.block(2))
        assert [r.first for r in fake.reads] == [0, 1]
        assert {r.request_id for r in puller.take_finished()} == {"a", "b"}
    finally:
        puller.close()
        fake.close()


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (lambda fake, req: [DataReply(req.id, req.first, 1).encode()], "truncated"),  # no headers, no frames
        (lambda fake, req: [*fake.data(req)[:2], b"short"], "truncated"),
        (lambda fake, req: [*fake.data(req)[:1], b"\x00" * 95, *fake.data(req)[2:]], "corrupt"),
        # A block whose header names another model, layout or block is never this block's KV.
        (lambda fake, req: fake.data(req, namespace=bytes(16)), "wrong_namespace"),
        (lambda fake, req: fake.data(req, layout=OTHER_LAYOUT), "wrong_layout"),
        (lambda fake, req: fake.data(req, hashes=[HASHES[9]]), "wrong_hash"),
        (lambda fake, req: [b"\x92\x01\x02"], "malformed"),
        (lambda fake, req: [*fake.data(req), b"extra"], "corrupt"),
    ],
)
def test_a_malformed_reply_fails_the_pull_without_using_it(
    puller_setup: tuple[BlockViews, BlockViews, TransferStats],
    reply: Callable[[FakeProducer, ReadRequest], list[Any]],
    reason: str,
) -> None:
    src, dst, st = puller_setup
    fake = FakeProducer(src, lambda req, send: None)
    fake.answer = lambda req, send: send(reply(fake, req))
    puller = BlockPuller(dst, stats=st, namespace=NS, threads=1, recv_timeout_s=2.0, batch_blocks=1)
    try:
        result = puller.submit(PullJob("r", fake.endpoint, "x", 0, (3,), (HASHES[0],))).wait(DEADLINE_S)
        assert result is not None and result.reason == reason and result.failed_block_ids == (3,)
        assert st.get(f"failures.{reason}") == 1
    finally:
        puller.close()
        fake.close()


def test_refused_requests_carry_their_id_and_a_code() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(msgpack.packb({"v": 1, "op": "read", "id": 41}))
    assert (info.value.code, info.value.request_id) == (ErrorCode.VERSION, 41)
    with pytest.raises(ProtocolError) as info:
        decode_request(ReadRequest(42, "r", 0, (b"short",)).encode())
    assert (info.value.code, info.value.request_id) == (ErrorCode.MALFORMED, 42)
    assert decode_request(ReadRequest(3, "r", 2, (HASHES[0],)).encode()) == ReadRequest(
        3, "r", 2, (HASHES[0],)
    )
