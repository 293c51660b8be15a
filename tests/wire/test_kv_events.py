"""The KV event batch wire format: a round trip, and garbage refused with a reason."""

from __future__ import annotations

import msgpack
import pytest

from engine.hashing import BlockHash
from wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
)

H = [BlockHash(bytes([i]) * 32) for i in range(4)]


def test_a_batch_round_trips() -> None:
    batch = EventBatch(
        "engine-a",
        "e1",
        7,
        123.5,
        (
            BlockStored(H[:2], None, list(range(8)), 4, medium="local"),
            BlockStored([H[2]], H[1], [1, 2, 3, 4], 4, medium="cpu"),
            BlockRemoved([H[0]], medium="local"),
            AllBlocksCleared(medium="disk"),
        ),
        dropped=2,
    )
    assert EventBatch.decode(batch.encode()) == batch


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 9, "pub": "a", "epoch": "e", "seq": 1, "ts": 0.0, "dropped": 0, "events": []}),
        msgpack.packb({"v": 1, "pub": "", "epoch": "e", "seq": 1, "ts": 0.0, "dropped": 0, "events": []}),
        msgpack.packb({"v": 1, "pub": "a", "epoch": "e", "seq": 0, "ts": 0.0, "dropped": 0, "events": []}),
        msgpack.packb(
            {"v": 1, "pub": "a", "epoch": "e", "seq": 1, "ts": 0.0, "dropped": 0, "events": [["x"]]}
        ),
        msgpack.packb(
            {
                "v": 1,
                "pub": "a",
                "epoch": "e",
                "seq": 1,
                "ts": 0.0,
                "dropped": 0,
                "events": [["removed", [b"x"], "l"]],
            }
        ),
        b"\x00" * (17 << 20),
    ],
)
def test_garbage_is_refused_with_a_reason(frame: bytes) -> None:
    with pytest.raises(EventDecodeError):
        EventBatch.decode(frame)
