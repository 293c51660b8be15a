"""The KVConnector contract: what a connector plugin implements, and when the engine calls it.

A connector moves KV blocks between the engine's paged cache and something outside it (a store, another
node).  It has two halves, one object per role per process (``KVConnectorRole``).  They share no state:

- the **scheduler half** decides, from metadata only (never tensors): how many leading tokens of a
  request it can provide, what to load and save each step;
- the **worker half** moves bytes in and out of the paged KV cache inside the forward pass.

The scheduler half sends a ``KVConnectorMetadata`` down with every step (``build_connector_meta``); the
worker half reports back a ``KVConnectorOutput`` with every step's result (``update_connector_output``).
Nothing else passes between them, so a future multi-worker runner changes nothing for plugins.

One request's life through both halves::

    scheduler: request waiting
      local prefix hit: num_computed = k * block_size
      get_num_new_matched_tokens(request, num_computed) -> (n, load_async)
          n is None          -> ask again next step (an async lookup is still running)
          n whole blocks     -> never the request's last token; read only request.block_hashes
      blocks allocated for num_computed + n + the tokens to compute
      update_state_after_alloc(request, block_ids, n)     # remember what to load
      (load_async: request parks in WAITING_FOR_REMOTE_KV until the worker reports it received)
      build_connector_meta(scheduler_output) -> metadata  # once per step, after all decisions
    worker: handle_preemptions(metadata)                  # finish saves of preempted requests' blocks
            start_load_kv(metadata)                       # also: stop the transfers of stop_request_ids
            per layer: wait_for_layer_load(i); attention; save_kv_layer(i, kv_cache, attn_metadata)
            wait_for_save()
            get_finished(finished_req_ids) -> (finished_sending, finished_recving)
            get_block_ids_with_load_errors() -> blocks whose load failed
    scheduler: update_connector_output(output)            # the worker's report
      ... decode steps ...
      request_finished(request, block_ids) -> (hold, kv_transfer_params)   # exactly once
          hold: the blocks stay allocated until the worker lists the request in finished_sending.

Holds are released in two phases: the engine never frees a held block before the worker said it is
done with it.  A hold ends when the worker reports the request in ``finished_sending``.  When the request
is aborted, or ``kv_hold_timeout_s`` passes, the engine lists it in the next step's
``metadata.stop_request_ids``; the worker stops the transfer (it owns its threads and sockets, so it can
within the step) and then reports the request as usual.  A request that ends while its async load runs
is held the same way, without asking the connector: it is in ``stop_request_ids`` at once, and its hold
ends with ``finished_recving``.  Should the worker never confirm, the engine frees the blocks after
``kv_stop_timeout_s`` and logs an error: that is a broken connector, not the protocol.  So a connector
keeps no books of its own about reclaimed or reused blocks: while it has not reported a request, its
blocks are its own.

Rules every connector keeps (the conformance kit in ``connectors.testing`` checks them):

1. Lookups are idempotent and side-effect free: ``get_num_new_matched_tokens`` may be called again for
   the same request (after a failed allocation, after preemption).
2. Hits are whole blocks, contiguous from the first block past ``num_computed_tokens``, and never cover
   the request's last token (it must be computed to produce logits).
3. A backend that does not answer in time counts as zero hits; no call blocks the engine unboundedly.
   The engine holds a lookup to that too: one that raises counts as zero hits, and one still answering
   ``None`` after ``LOOKUP_DEADLINE_S`` is given up (zero hits) -- each logged and counted, never a hang
   or a dead node.
4. Load failures are reported through ``get_block_ids_with_load_errors``, never raised: the engine cuts
   the request back to the first bad block and recomputes from there.
5. No block is reused while a transfer still reads or writes it: a connector whose saves outlive the
   step returns ``hold=True`` from ``request_finished`` and reports the request in ``finished_sending``
   when they are done; ``handle_preemptions`` finishes (or drops) the saves of preempted requests, whose
   blocks the same step may overwrite; every request in ``stop_request_ids`` is reported in
   ``finished_sending`` / ``finished_recving`` (whichever its hold waits for) within the step, or as
   soon as its transfer stopped.
6. A failed save costs the save, never the step: catch it, log it, count it (``get_stats``).  A worker
   call that raises fails every request of the step.
7. Blocks are keyed by the whole namespace: the block hash (model, block size, cache salt, LoRA adapter,
   tokens: ``Request.block_hashes``, never hashes of the connector's own) and the cache's layout
   (``context.spec``: dtype, geometry).  A hit is the prefix up to the first block the backend lacks;
   nothing is kept for a request after it ended (``request_finished``, or its hold's end).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from engine.connector.params import KVTransferParams
from engine.connector.types import (
    ConnectorContext,
    ConnectorOptionsError,
    ConnectorStats,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    parse_options,
)
from engine.request import Request, RequestId
from wire.kv_events import KVCacheEvent

if TYPE_CHECKING:
    import torch

    from engine.scheduler.output import SchedulerOutput


__all__ = [
    "ConnectorContext",
    "ConnectorOptionsError",
    "ConnectorStats",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVTransferParams",
    "parse_options",
]


# How long a lookup may keep answering None ("still looking") before the engine gives up on it: zero hits,
# the prompt computed (rule 3).  The conformance kit's lookup_deadline_s defaults to the same.
LOOKUP_DEADLINE_S = 5.0


class KVConnectorBase:
    """Base class of every connector.  Override the methods of the half (or halves) you need.

    Defaults are those of a connector that never has a hit and never moves a byte, so a minimal
    connector overrides only what it does.  Subclasses set ``name`` and, to take options, an ``Options``
    frozen dataclass (validated by ``parse_options``: an unknown key is an error that names it).
    """

    name: ClassVar[str] = "base"
    Options: ClassVar[type | None] = None

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        self.role = role
        self.context = context
        if self.Options is not None:
            self.options = parse_options(self.Options, options, connector=self.name)
        elif options:
            raise ConnectorOptionsError(f"connector {self.name!r} takes no options, got {sorted(options)}")
        else:
            self.options = None

    # ================================ scheduler half ================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` (the local hit) this connector can provide.

        Returns ``(num_tokens, load_async)``.  ``num_tokens`` is whole blocks, contiguous from block
        ``num_computed_tokens // block_size``, never covering the request's last token; ``None`` means
        "still looking, ask again next step".  ``load_async=True`` loads across steps (the request waits
        in WAITING_FOR_REMOTE_KV); False loads inside the next forward pass.  Reads
        ``request.block_hashes``; never hashes tokens.  Idempotent and side-effect free.
        """
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request`` (``block_ids`` is its whole block table, in order).

        Decide whether to load from ``num_external_tokens`` (may be 0), not from ``block_ids``.  At this
        call ``request.num_computed_tokens`` counts the local hit only, so the external tokens occupy
        blocks ``[num_computed // bs, (num_computed + num_external) // bs)`` of ``block_ids``.
        May be called twice for an async load (allocation, then again when it is scheduled).
        """

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Once per step, after all scheduling decisions: what the worker half must load and save.

        Resets per-step state.  Must not change ``scheduler_output``.  The engine then fills
        ``preempted_request_ids`` and ``stop_request_ids``.
        """
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report for the step (finished sends and receives, failed blocks).  Counters
        are not reported here: ``get_stats`` is read when the node's stats are."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Exactly once per request, before its blocks are freed.

        Returns ``(hold, kv_transfer_params)``.  ``hold=True``: the blocks stay allocated until the worker
        reports the request in ``finished_sending`` (asked by ``stop_request_ids`` on abort or past
        ``kv_hold_timeout_s``).  The params go back to the caller (the router hands them to the decode
        node).  A request that ends while its async load runs is held by the engine whatever this says.
        """
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        """Store/remove events of the connector's own tiers, merged into the engine's event stream."""
        return []

    # ================================ worker half ===================================================

    @property
    def step_metadata(self) -> KVConnectorMetadata | None:
        """This step's metadata (what ``start_load_kv`` got), from ``handle_preemptions`` until
        ``get_finished`` returns; None outside a step.  ``wait_for_save`` and ``save_kv_layer`` read it
        here instead of stashing it."""
        return self.__dict__.get("_step_metadata")

    def bind_step_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """The runner's call, around each step (``multi`` binds each child its own part)."""
        self.__dict__["_step_metadata"] = metadata

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Once at start-up: the paged cache `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`."""

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward pass may overwrite preempted requests' blocks: finish or drop their saves."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: start the loads this step needs; stop the transfers of
        ``metadata.stop_request_ids`` (report each in ``get_finished`` once stopped)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Inside the forward, before layer ``layer`` reads its KV (lets loads overlap compute)."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        """Inside the forward, after layer ``layer`` wrote its KV for this step's tokens."""

    def wait_for_save(self) -> None:
        """After the forward: from here on, saves are safe from block reuse."""

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        """Requests whose async send / receive completed: ``(finished_sending, finished_recving)``."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call.  Report, never raise."""
        return set()

    # ================================ both ==========================================================

    def get_stats(self) -> ConnectorStats:
        """Counters and the KV endpoint for the node's Stats RPC and metrics (read on the engine thread;
        keep it cheap).  The default reports nothing."""
        return ConnectorStats()

    def shutdown(self) -> None:
        """Release threads, sockets and files.  Called once when the engine stops."""
