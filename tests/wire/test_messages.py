"""The wire layer's messages: every one round-trips through its encoding, garbage is refused by name (with
the message's id when one can be read), and blocks are received one way, with one failure type."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from wire.codec import HeaderMatcher, pack_header, payload_checksum
from wire.framing import PROTOCOL_VERSION, ErrorCode, ErrorReply, InfoReply, ProtocolError
from wire.keys import KeyRun
from wire.kv_events import EventDecodeError, ReplayReply, ReplayRequest
from wire.layout import BlockLayout
from wire.p2p_protocol import (
    DataReply,
    PingRequest,
    ReadRequest,
    ReleaseRequest,
    decode_p2p_reply,
    decode_p2p_request,
)
from wire.reasons import MissReason
from wire.store_protocol import (
    CountReply,
    Delete,
    Get,
    Limits,
    Lookup,
    Ping,
    Put,
    Stats,
    decode_store_reply,
    decode_store_request,
)
from wire.units import BlockFrameError, receive_unit_frames, receive_units, send_units

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32")
NS = bytes(range(16))
HASHES = [bytes([i]) * 32 for i in range(1, 5)]
RUN = KeyRun.of_chain(NS, HASHES)


def test_every_store_message_round_trips() -> None:
    for request in (
        Ping(1),
        Stats(2),
        Lookup(3, RUN),
        Delete(4, RUN),
        Get(5, RUN, LAYOUT),
        Put(6, RUN, LAYOUT),
    ):
        assert decode_store_request(request.encode(), Limits()) == request
    for reply in (
        CountReply(7, 3, MissReason.EVICTED),
        CountReply(8, 0),
        InfoReply(9, {"tiers": ["cpu"]}),
        ErrorReply(10, ErrorCode.MALFORMED, "no"),
    ):
        assert decode_store_reply(reply.encode()) == reply


def test_every_p2p_message_round_trips() -> None:
    for request in (ReadRequest(1, "r", 2, tuple(HASHES)), ReleaseRequest(2, "r"), PingRequest(3)):
        assert decode_p2p_request(request.encode()) == request
    for reply in (
        DataReply(4, 2, 3),
        InfoReply(5, {"leases": 1}),
        ErrorReply(6, ErrorCode.UNKNOWN_LEASE, "later"),
    ):
        assert decode_p2p_reply(reply.encode()) == reply


@pytest.mark.parametrize(
    ("body", "code", "request_id"),
    [
        ({"v": PROTOCOL_VERSION, "id": 7, "op": "format_disk"}, ErrorCode.MALFORMED, 7),
        ({"v": PROTOCOL_VERSION - 1, "id": 8, "op": "ping"}, ErrorCode.VERSION, 8),
        ({"v": PROTOCOL_VERSION, "id": 9, "op": "get", "ns": NS, "start": 0}, ErrorCode.MALFORMED, 9),
        ({"v": PROTOCOL_VERSION, "id": -1, "op": "ping"}, ErrorCode.MALFORMED, 0),
    ],
)
def test_a_store_request_refused_names_what_and_keeps_its_id(
    body: dict[str, Any], code: ErrorCode, request_id: int
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_store_request(msgpack.packb(body), Limits())
    assert (info.value.code, info.value.request_id) == (code, request_id)
    refusal = ErrorReply.of(info.value)
    assert decode_store_reply(refusal.encode()) == refusal  # the one error reply, whichever protocol


def test_a_get_without_its_layout_and_an_oversized_run_are_refused() -> None:
    no_layout = {**msgpack.unpackb(Lookup(3, RUN).encode()), "op": "get"}
    with pytest.raises(ProtocolError, match="layout") as info:
        decode_store_request(msgpack.packb(no_layout), Limits())
    assert info.value.request_id == 3
    with pytest.raises(ProtocolError, match="limit"):
        decode_store_request(Lookup(4, RUN).encode(), Limits(max_blocks=2))


def test_replay_messages_round_trip_and_refuse_garbage() -> None:
    assert ReplayRequest.decode(ReplayRequest(3, 5).encode()) == ReplayRequest(3, 5)
    reply = ReplayReply(3, "e", 2, 9, False)
    assert ReplayReply.decode(reply.encode()) == reply
    for frame in (b"\xc1", msgpack.packb({"v": 1, "from": 0}), b"\x00" * 5000):
        with pytest.raises(EventDecodeError):
            ReplayRequest.decode(frame)
    with pytest.raises(EventDecodeError):
        ReplayReply.decode(msgpack.packb({"v": 1, "id": 1, "epoch": "e", "oldest": -1, "last": 0, "gone": 0}))


# ---- block frames ------------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://units")
    b.connect("inproc://units")
    try:
        yield a, b
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _blocks(n: int) -> tuple[bytes, list[bytes]]:
    payloads = [bytes([i + 1]) * LAYOUT.payload_nbytes for i in range(n)]
    headers = b"".join(
        pack_header(NS, HASHES[i], LAYOUT, payload_checksum(p)) for i, p in enumerate(payloads)
    )
    return headers, payloads


def _receive(sock: zmq.Socket[Any], n: int) -> tuple[list[bytearray], list[int]]:
    assert sock.poll(2000)
    sock.recv()  # the header frame
    dst = [bytearray(LAYOUT.payload_nbytes) for _ in range(n)]
    return dst, receive_units(sock, n, HASHES[:n], HeaderMatcher(NS, LAYOUT), lambda i: memoryview(dst[i]))


def test_units_arrive_checked_into_their_destinations(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    a, b = pair
    headers, payloads = _blocks(3)
    send_units(a, [b"head"], headers, payloads)
    dst, checksums = _receive(b, 3)
    assert [bytes(d) for d in dst] == payloads and checksums == [payload_checksum(p) for p in payloads]
    send_units(a, [b"head"], headers, payloads)
    assert b.poll(2000)
    b.recv()
    frames = receive_unit_frames(b, 3, HASHES, NS, LAYOUT)
    assert [bytes(p) for _, p in frames] == payloads


@pytest.mark.parametrize(
    ("mangle", "reason", "verified"),
    [
        (lambda h, p: [h], MissReason.TRUNCATED, 0),  # the payloads never came
        (lambda h, p: [h[:-1], *p], MissReason.CORRUPT, 0),  # a unit headers frame of the wrong size
        (lambda h, p: [h, p[0], p[1][:-1], p[2]], MissReason.TRUNCATED, 1),
        (lambda h, p: [h, p[0], p[1], bytes(len(p[2]))], MissReason.CORRUPT, 2),  # checksum
        (lambda h, p: [h[96:192] + h[96:], *p], MissReason.WRONG_HASH, 0),
        (lambda h, p: [h, *p, b"extra"], MissReason.CORRUPT, 0),  # a message that lies is not used
    ],
)
def test_a_bad_block_frame_fails_one_way(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], mangle: Any, reason: MissReason, verified: int
) -> None:
    a, b = pair
    headers, payloads = _blocks(3)
    a.send_multipart([b"head", *mangle(headers, payloads)])
    with pytest.raises(BlockFrameError) as info:
        _receive(b, 3)
    assert (info.value.reason, info.value.verified, len(info.value.checksums)) == (reason, verified, verified)
    assert not b.getsockopt(zmq.RCVMORE)  # drained: the next message starts clean
    a.send_multipart([b"head", *mangle(headers, payloads)])
    assert b.poll(2000)
    b.recv()
    with pytest.raises(BlockFrameError) as info:
        receive_unit_frames(b, 3, HASHES, NS, LAYOUT)
    assert (info.value.reason, len(info.value.received)) == (reason, verified)
