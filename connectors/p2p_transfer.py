"""What the ``p2p`` transfer moves and counts: byte views of the paged cache, and the transfer counters.

The wire format is ``wire.p2p_protocol`` over ``wire.units`` (the block frames the store's also use): the
producer's worker half binds a ROUTER (``connectors.p2p_server``), a consumer connects DEALERs
(``connectors.p2p_client``) and sends ``read``/``release``; a data reply carries each block's codec header
(namespace, hash, layout, checksum) and its raw payload, and the consumer checks every block by that
header before it counts as loaded.

Rules both sides keep:

- Flow control is the consumer's: at most ``window`` reads outstanding per pull, each of at most
  ``batch_blocks`` blocks.  That bounds what the producer's socket queues for one pull -- and so how
  long stopping a lease waits for sends in flight.
- The unit is a *batch of whole blocks*, not a layer: the engine's cache keeps a block contiguous across
  layers (``engine/kv_cache.py``), so one block is one frame and lands with one copy straight into the
  consumer's paged cache (``recv_into``).  The decode engine needs every layer before its first step
  anyway, so layer-by-layer streaming would only multiply the frames.
- A peer that sends anything that is not the protocol gets an ``error`` reply (``malformed``/``version``)
  and the producer keeps serving.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

from engine.metrics import SPECS
from telemetry.metrics import Histogram, HistogramSnapshot
from wire.layout import BlockLayout

if TYPE_CHECKING:
    import torch


# ---- the paged cache as bytes ------------------------------------------------------------------------------


class BlockViews:
    """Byte views of an engine's paged cache, one per block, without copies.

    ``kv_cache`` is ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` (C-contiguous), so block
    ``i`` is the byte range ``[i * block_nbytes, (i + 1) * block_nbytes)`` of the tensor.  On the CPU the
    views are writable: a consumer receives frames straight into them.  A cache on a GPU has no host
    views (``on_host`` is False): its blocks move through pinned staging (``connectors/staging.py``), and
    ``block`` refuses.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        import torch

        if not kv_cache.is_contiguous():
            raise ValueError("the p2p connector needs a contiguous paged cache tensor")
        self.layout = BlockLayout.from_kv_cache(kv_cache)
        self.num_blocks = int(kv_cache.shape[0])
        self.block_nbytes = self.layout.payload_nbytes
        self.on_host = kv_cache.device.type == "cpu"
        self._tensor = kv_cache  # keeps the memory alive for as long as the views exist
        self._flat: memoryview | None = None
        if self.on_host:
            flat = kv_cache.reshape(-1).view(torch.uint8)  # [num_blocks * block_nbytes] uint8, same memory
            self._flat = memoryview(flat.numpy())  # type: ignore[arg-type]

    def block(self, block_id: int) -> memoryview:
        """Block ``block_id``'s bytes, writable.  ``IndexError`` for an id outside the cache."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the cache (0..{self.num_blocks - 1})")
        if self._flat is None:
            raise RuntimeError("a cache on a GPU has no host views: stage its blocks (connectors/staging.py)")
        start = block_id * self.block_nbytes
        return self._flat[start : start + self.block_nbytes]


# ---- counters --------------------------------------------------------------------------------------------


class TransferStats:
    """Counters of one connector half's transfers, safe to bump from any thread.

    Keys (all exported by ``snapshot`` as floats; a key appears once it was bumped):

    - producer: ``leases_registered``, ``leases_released`` (the consumer acknowledged), ``lease_expiries``,
      ``leases_stopped`` (the engine asked for the blocks back), ``leases_unavailable``,
      ``socket_resets``, ``blocks_sent``, ``bytes_sent``, ``requests_refused``, ``replies_dropped``;
    - consumer: ``pulls_started``/``_ok``/``_failed``/``_cancelled``, ``blocks_received``,
      ``bytes_received``, ``late_replies``, ``leases_unused`` (released unread: this engine held every
      block already), ``failures.<reason>`` (timeout, expired, malformed, socket, unknown_lease, released,
      hash_mismatch, and the block checks' ``MissReason``: truncated, corrupt, wrong_namespace,
      wrong_layout, wrong_hash), ``params_rejected.<reason>`` (namespace, layout, hash_mismatch).

    Histograms (``histograms``): every successful pull (``kv_transfer_seconds.recv``, and
    ``kv_load_seconds.p2p``: the consumer's KV load) and every lease its consumer released
    (``kv_transfer_seconds.send``: registered to released).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self.recv_seconds = Histogram(SPECS["kv_transfer_seconds"])
        self.send_seconds = Histogram(SPECS["kv_transfer_seconds"])

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._counts[key] += value  # type: ignore[assignment]

    def failure(self, reason: str) -> None:
        self.add(f"failures.{reason}")

    def observe_pull(self, seconds: float) -> None:
        self.recv_seconds.observe(seconds)

    def observe_lease(self, seconds: float) -> None:
        self.send_seconds.observe(seconds)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        out = {}
        recv, send = self.recv_seconds.snapshot(), self.send_seconds.snapshot()
        if recv.count:
            out["kv_transfer_seconds.recv"] = out["kv_load_seconds.p2p"] = recv
        if send.count:
            out["kv_transfer_seconds.send"] = send
        return out

    def get(self, key: str) -> float:
        with self._lock:
            return float(self._counts.get(key, 0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}
