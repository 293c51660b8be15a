"""A lease: the blocks of one finished request a producer's block server serves a remote reader, its
state (serving, then closing while its sends are in flight), and waiting for those sends."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from wire.framing import ErrorCode

if TYPE_CHECKING:
    from connectors.staging import StagedBlocks


class LeaseState(enum.Enum):
    SERVING = "serving"
    CLOSING = "closing"  # no new sends; waiting for the sends in flight


@dataclass(slots=True, eq=False)
class Lease:
    """Blocks of one finished request, held for a remote reader until ``deadline``."""

    request_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    deadline: float
    state: LeaseState = LeaseState.SERVING
    reason: ErrorCode = ErrorCode.RELEASED  # what a reader is told once the lease is closing
    sums: list[int | None] = field(default_factory=list)  # payload checksums (sealing), None until computed
    sealed_upto: int = 0  # sums[:sealed_upto] are computed by the sealer
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    registered_at: float = 0.0
    staged: StagedBlocks | None = None  # host copies of the blocks, when the cache is on a GPU
    served: bool = False  # a read was answered (so its end is a transfer's)

    def pending_trackers(self) -> list[zmq.MessageTracker]:
        self.trackers = [t for t in self.trackers if not t.done]
        return self.trackers


def wait_trackers(trackers: Sequence[zmq.MessageTracker], timeout_s: float) -> bool:
    """True once every tracker is done; False if ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    for tracker in trackers:
        while not tracker.done:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                tracker.wait(min(left, 0.05))
            except zmq.NotDone:
                continue
    return True
