"""Block frames: how a message carries blocks, and the one way they are received and checked.

A message that carries ``n`` blocks is its header frame, then one *unit headers* frame (the ``n`` blocks'
codec headers, ``HEADER_SIZE`` bytes each, ``wire.codec``), then one raw payload frame per block::

    [header, unit headers (n x 96 bytes), payload 0, ..., payload n-1]

Every block received is checked by its codec header against what the receiver asked for -- the
namespace, the block hash, the layout -- then its payload's length and checksum.  Whatever fails, the
receiver learns it one way: ``BlockFrameError``, with the ``MissReason`` and how many leading blocks
passed (``verified``), and the rest of the message is drained.  The store's ``remote:`` tier and the p2p
puller both receive through here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import zmq

from wire.codec import HEADER_SIZE, HeaderMatcher, check_header, payload_checksum, verify_payload
from wire.framing import drain, more, send_frames
from wire.layout import BlockLayout
from wire.reasons import MissReason


class BlockFrameError(Exception):
    """Blocks of a message that failed their check, or a message that does not carry what it says.
    ``reason`` is the ``MissReason``; the ``verified`` leading blocks passed (and are usable)."""

    def __init__(self, reason: MissReason, verified: int, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.verified = verified
        self.checksums: list[int] = []  # receive_units: the verified blocks' payload checksums
        self.received: list[tuple[bytes, memoryview]] = []  # receive_unit_frames: the verified blocks


def unit_header(frame: Any, i: int) -> memoryview:
    """Block ``i``'s codec header in a unit headers frame."""
    return memoryview(frame)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]


def send_units(
    sock: zmq.Socket[Any],
    head: Sequence[Any],
    unit_headers: bytes,
    payloads: Sequence[Any],
    *,
    track: bool = False,
    nonblocking: bool = False,
) -> zmq.MessageTracker | None:
    """Send ``head`` (a ROUTER's identity, then the header frame), the unit headers and the payloads as
    one message, payloads without copies (``wire.framing.send_frames``: ``track`` and ``nonblocking``)."""
    if len(unit_headers) != HEADER_SIZE * len(payloads):
        raise ValueError(f"{len(unit_headers)} bytes of unit headers for {len(payloads)} payloads")
    return send_frames(sock, [*head, unit_headers, *payloads], track=track, nonblocking=nonblocking)


def _unit_headers(sock: zmq.Socket[Any], n: int) -> bytes:
    if not more(sock):
        raise BlockFrameError(MissReason.TRUNCATED, 0, "a reply without its unit headers")
    headers = sock.recv(zmq.NOBLOCK)
    if len(headers) != HEADER_SIZE * n:
        drain(sock)
        raise BlockFrameError(MissReason.CORRUPT, 0, f"unit headers of {len(headers)} bytes for {n} blocks")
    return headers


def _end(sock: zmq.Socket[Any], n: int) -> None:
    if more(sock):
        drain(sock)
        # A message that does not carry what it says is not used at all, however its blocks checked.
        raise BlockFrameError(MissReason.CORRUPT, 0, "more payload frames than blocks")


def receive_units(
    sock: zmq.Socket[Any],
    n: int,
    hashes: Sequence[bytes],
    matcher: HeaderMatcher,
    into: Callable[[int], Any],
    let_go: Callable[[int], None] | None = None,
) -> list[int]:
    """Receive the ``n`` blocks of the message being received (its header frame already read), payload
    ``i`` straight into ``into(i)`` (``let_go(i)`` once written), each checked against ``hashes[i]`` and
    ``matcher``'s namespace and layout.  Returns the payload checksums; ``BlockFrameError`` on the first
    block that fails (the message is drained)."""
    if n == 0:  # nothing found: the (empty) unit headers frame, if any, carries nothing
        drain(sock)
        return []
    checksums: list[int] = []
    try:
        headers = _unit_headers(sock, n)
        for i in range(n):
            if not more(sock):
                raise BlockFrameError(MissReason.TRUNCATED, i, f"the message ended after {i} of {n} payloads")
            dst = into(i)
            try:
                got = sock.recv_into(dst, flags=zmq.NOBLOCK)
            finally:
                if let_go is not None:
                    let_go(i)
            checksum = matcher.match(unit_header(headers, i), hashes[i])
            if isinstance(checksum, MissReason):
                drain(sock)  # another namespace, layout or block: never this block's KV
                raise BlockFrameError(
                    checksum, i, f"block {i} of {n} is not the block asked for ({checksum.value})"
                )
            reason: MissReason | None = None
            if got != memoryview(dst).nbytes:
                reason = MissReason.TRUNCATED if got < memoryview(dst).nbytes else MissReason.CORRUPT
            elif payload_checksum(dst) != checksum:
                reason = MissReason.CORRUPT
            if reason is not None:
                drain(sock)
                raise BlockFrameError(reason, i, f"block {i} of {n} failed its check ({reason.value})")
            checksums.append(checksum)
        _end(sock, n)
    except BlockFrameError as exc:
        exc.checksums = checksums[: exc.verified]
        raise
    return checksums


def receive_unit_frames(
    sock: zmq.Socket[Any], n: int, hashes: Sequence[bytes], namespace: bytes, layout: BlockLayout
) -> list[tuple[bytes, memoryview]]:
    """As ``receive_units``, keeping each payload in the frame it arrived in instead of copying it into a
    destination: (unit header, payload) per block.  ``BlockFrameError.received`` holds the blocks before
    the one that failed."""
    received: list[tuple[bytes, memoryview]] = []
    if n == 0:
        drain(sock)
        return received
    try:
        headers = _unit_headers(sock, n)
        for i in range(n):
            if not more(sock):
                raise BlockFrameError(MissReason.TRUNCATED, i, f"the message ended after {i} of {n} payloads")
            payload = memoryview(sock.recv(zmq.NOBLOCK, copy=False).buffer)
            raw = bytes(unit_header(headers, i))
            header = check_header(raw, namespace, hashes[i], layout)
            reason = header if isinstance(header, MissReason) else verify_payload(header, payload)
            if reason is not None:
                drain(sock)
                raise BlockFrameError(reason, i, f"block {i} of {n} failed its check ({reason.value})")
            received.append((raw, payload))
        _end(sock, n)
    except BlockFrameError as exc:
        exc.received = received[: exc.verified]
        raise
    return received
