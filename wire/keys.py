"""Block keys: which blocks a store call is about.

A call is about a contiguous run of one request's chain of block hashes (block ``start`` onwards).  A
block's identity is ``(namespace, hash)``; the hash already covers the model, the tenant salt and every
token before it (``engine.hashing``).  Tiers that shard by key (Redis Cluster) also need the block's
*anchor*: the hash of the first block of its group of ``ANCHOR_SPAN`` consecutive blocks,

    chain:   b0 b1 ... b63 | b64 b65 ... b127 | b128 ...
    anchor:  b0 ........ b0 | b64 ....... b64 | b128 ...

which is a function of the block alone (a block's position and ancestors are fixed by its hash chain).
Keys of one group share a Redis hash tag, so a lookup of N blocks touches about N / ANCHOR_SPAN slots
spread over the cluster, and stays one round trip per node.  Changing ``ANCHOR_SPAN`` changes every Redis
key: it is part of the key format (``docs/kvstore.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from wire.codec import NAMESPACE_SIZE, check_block_hash

BlockHash = NewType("BlockHash", bytes)  # one block's chained hash (``engine.hashing`` computes them)

ANCHOR_SPAN = 64


@dataclass(frozen=True, slots=True)
class KeyRun:
    """Blocks ``start .. start + len(hashes) - 1`` of one hash chain in one namespace.

    ``anchors[g]`` is the anchor of group ``start // ANCHOR_SPAN + g``; build runs with ``of_chain`` (or
    ``from_wire`` for a run received from a peer, which is checked).
    """

    namespace: bytes
    hashes: Sequence[bytes]
    start: int
    anchors: tuple[bytes, ...]

    @classmethod
    def of_chain(
        cls, namespace: bytes, chain: Sequence[bytes], start: int = 0, stop: int | None = None
    ) -> KeyRun:
        """The run ``chain[start:stop]``; ``chain`` holds the request's block hashes from block 0."""
        stop = len(chain) if stop is None else stop
        if not 0 <= start <= stop <= len(chain):
            raise ValueError(f"block range [{start}, {stop}) is outside a chain of {len(chain)} hashes")
        first_group = start // ANCHOR_SPAN
        last_group = (stop - 1) // ANCHOR_SPAN if stop > start else first_group - 1
        anchors = tuple(chain[g * ANCHOR_SPAN] for g in range(first_group, last_group + 1))
        return cls(namespace, chain[start:stop], start, anchors)

    @classmethod
    def from_wire(
        cls, namespace: bytes, hashes: Sequence[bytes], start: int, anchors: Sequence[bytes]
    ) -> KeyRun:
        """A run a peer sent: every field is checked (``ValueError`` names the bad one)."""
        if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_SIZE:
            raise ValueError(f"namespace must be {NAMESPACE_SIZE} bytes")
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a non-negative int, got {start!r}")
        for h in hashes:
            if not isinstance(h, bytes):
                raise ValueError("hashes must be bytes")
            check_block_hash(h)
        for a in anchors:
            if not isinstance(a, bytes):
                raise ValueError("anchors must be bytes")
            check_block_hash(a)
        groups = (start + len(hashes) - 1) // ANCHOR_SPAN - start // ANCHOR_SPAN + 1 if hashes else 0
        if len(anchors) != groups:
            raise ValueError(
                f"a run of {len(hashes)} blocks from block {start} has {groups} anchors, got {len(anchors)}"
            )
        return cls(namespace, list(hashes), start, tuple(anchors))

    def __len__(self) -> int:
        return len(self.hashes)

    def anchor(self, i: int) -> bytes:
        """The anchor of ``hashes[i]``."""
        return self.anchors[(self.start + i) // ANCHOR_SPAN - self.start // ANCHOR_SPAN]

    def slice(self, begin: int, end: int | None = None) -> KeyRun:
        """The sub-run ``hashes[begin:end]`` (indices relative to this run)."""
        n = len(self.hashes)
        end = n if end is None else min(end, n)
        begin = min(begin, end)
        if begin == 0 and end == n:
            return self
        start = self.start + begin
        if end == begin:
            return KeyRun(self.namespace, [], start, ())
        g0 = start // ANCHOR_SPAN - self.start // ANCHOR_SPAN
        g1 = (self.start + end - 1) // ANCHOR_SPAN - self.start // ANCHOR_SPAN
        return KeyRun(self.namespace, self.hashes[begin:end], start, self.anchors[g0 : g1 + 1])

    def key(self, i: int) -> bytes:
        """The namespace-qualified identity of ``hashes[i]`` (the key of in-process indexes)."""
        return self.namespace + self.hashes[i]
