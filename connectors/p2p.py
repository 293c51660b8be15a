"""``p2p``: stream a request's prompt KV from a prefill engine (producer) to a decode engine (consumer).

The flow (ARCHITECTURE.md §1; params format in ``engine.connector.params``; wire format in
``connectors.p2p_transfer``)::

    producer engine                                          consumer engine
    request with {"do_remote_decode": true} finishes
    scheduler half: request_finished -> delay_free=True,
      params {kv_endpoint, remote_request_id, block_hashes, num_tokens, ...}
    worker half (next step): lease registered in the
      BlockServer (ROUTER thread)            ── router ──▶   request (prompt + first token, params)
                                                             scheduler half: get_num_new_matched_tokens
                                                               -> (prompt blocks not held locally, async)
                                                             worker half: BlockPuller thread
                        ◀── read [first, n) + hashes ──────    DEALER, window of reads
                        ─── header + n raw frames ────────▶    recv_into the paged cache, checksums
                        ◀── release ───────────────────────    ... then finished_recving
    lease closed; once ZeroMQ sent every frame:
      finished_sending -> the engine frees the blocks

Options (``P2POptions``; a bad value is a ``ConnectorOptionsError`` naming the key): ``bind`` (the
producer's ROUTER address, default ``tcp://127.0.0.1:0``: any free port, reported in the params),
``advertise_host`` (the host put in the params when binding a wildcard address), ``lease_s``,
``pull_timeout_s``, ``recv_timeout_s``, ``max_in_flight`` (concurrent pulls), ``batch_bytes`` (payload
per read), ``window`` (reads outstanding per pull), ``stop_timeout_s`` (how long a stop waits for sends
in flight before resetting the socket).

A *lease* is the producer's side of the engine's hold on a finished request's blocks: what its block
server serves while the engine keeps them.  One owner ends it: the consumer's ``release``, sent after
its pull, or at admission without a pull when it holds every block already (``releases`` in the
metadata; a release that arrives before the lease is registered ends it as it is registered).  The
rest are safety nets, each for a consumer that never comes (invariant 7: every hold has an end):
``lease_s`` passing unread, and the engine asking for the blocks back (``stop_request_ids``: the router
aborted the request because decode failed or the client left, or ``kv_hold_timeout_s`` passed -- keep
it above ``lease_s``).  A pull ends by success, failure (reported as load errors: the engine recomputes
from the first bad block) or a stop (the request ended while pulling).

No block is reused under a transfer (invariant 8), and this connector keeps no books for it: the engine
frees held blocks only after the worker half reported them (two-phase release, ``connectors/base.py``).
A stop is carried out within the step: the server closes the lease and waits for its sends in flight
(ZeroMQ tracks them, ``connectors.p2p_server``), the puller stops writing; both then report the request.

The halves share no state but one: with a port chosen at bind time (``:0``), the worker half publishes
the bound endpoint for the scheduler half of the same engine (``_EndpointBoard``, keyed by the engine's
``ConnectorContext``).  With a fixed port or an ``ipc://`` address the scheduler half derives it from
the options alone.  A cache on a GPU moves through pinned host staging (``connectors/staging.py``): a
lease serves host copies taken when it is registered, a pull receives into host buffers that are copied
into the cache, ordered before the request's next forward, once the pull is done.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.p2p_options import BOARD, P2POptions
from connectors.p2p_transfer import TransferStats
from engine.connector.base import (
    ConnectorContext,
    ConnectorOptionsError,
    ConnectorStats,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.connector.params import KVTransferParams, RemoteDecode, RemotePrefill
from engine.request import Request, RequestId, RequestStatus
from wire.layout import BlockLayout
from wire.p2p_protocol import MAX_READ_BLOCKS

if TYPE_CHECKING:
    import torch

    from connectors.p2p_client import BlockPuller, PullJob
    from connectors.p2p_server import BlockServer
    from connectors.staging import BlockStager, StagedBlocks
    from engine.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    request_id: RequestId
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    lease_s: float


@dataclass
class P2PMetadata(KVConnectorMetadata):
    """One step's instructions to the worker half (stops come in ``stop_request_ids``)."""

    leases: list[LeaseSpec] = field(default_factory=list)  # producer: start serving these
    pulls: list[PullJob] = field(default_factory=list)  # consumer: start pulling these
    # consumer: leases this engine will not read (it held every block already): (endpoint, lease id)
    releases: list[tuple[str, str]] = field(default_factory=list)


# A prefill request is leased when its one token capped it: one that met EOS or a stop token ends there.
_LEASABLE = (RequestStatus.FINISHED_LENGTH_CAPPED,)


class P2PConnector(KVConnectorBase):
    name = "p2p"
    Options = P2POptions

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self.options: P2POptions
        self.block_size = context.block_size
        self.layout = BlockLayout.from_spec(context.spec)
        self.stats = TransferStats()
        # scheduler half
        self._pulled: set[RequestId] = set()  # requests whose remote prefill was pulled (or tried): no second
        self._next = P2PMetadata()
        # worker half
        self._server: BlockServer | None = None
        self._puller: BlockPuller | None = None
        self._pulling: set[RequestId] = set()
        self._stopped: set[RequestId] = set()  # pulls stopped: their result is no load (the request ended)
        self._stager: BlockStager | None = None  # a GPU cache: blocks move through pinned staging
        self._staged_pulls: dict[RequestId, tuple[PullJob, StagedBlocks]] = {}
        self._load_errors: set[int] = set()

    # ================================ scheduler half ================================================

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        """The producer's params of ``request`` when they can be used here; None otherwise."""
        remote = request.kv_transfer_params
        if not isinstance(remote, RemotePrefill) or request.request_id in self._pulled:
            return None
        if remote.namespace_id != self.context.namespace.namespace_id:
            self._reject(request, "namespace", f"namespace {remote.namespace_id} is not this model's")
            return None
        if remote.layout != self.layout:
            self._reject(request, "layout", f"layout {remote.layout.describe()} is not this cache's")
            return None
        return remote

    def _reject(self, request: Request, reason: str, detail: str) -> None:
        """Count and log params this engine cannot use; the request recomputes its prompt."""
        logger.warning(
            "p2p: %s recomputes its prompt: kv_transfer_params unusable: %s", request.request_id, detail
        )
        self.stats.add(f"params_rejected.{reason}")

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        bs = self.block_size
        first = num_computed_tokens // bs
        last = min(len(remote.block_hashes), len(request.block_hashes), (request.num_tokens - 1) // bs)
        if last <= first:
            return 0, False
        if tuple(request.block_hashes[:last]) != remote.block_hashes[:last]:
            self._reject(request, "hash_mismatch", "the producer's block hashes are not this prompt's")
            return 0, False
        return (last - first) * bs, True

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        first = request.num_computed_tokens // self.block_size
        if num_external_tokens <= 0:
            params = request.kv_transfer_params
            if (
                isinstance(params, RemotePrefill)
                and params.block_hashes
                and request.request_id not in self._pulled
            ):
                # Admitted with nothing to pull (its blocks were all here already, or the params were not
                # usable here): the consumer is the one owner that ends a lease it does not read, so the
                # producer frees it now, not at lease_s.  (No blocks: no lease, nothing to release.)
                self._next.releases.append((params.kv_endpoint, params.remote_request_id))
                self._pulled.add(request.request_id)
            return
        remote = self._remote_prefill(request)
        assert remote is not None, "external tokens were only offered for usable params"
        from connectors.p2p_client import PullJob

        n = num_external_tokens // self.block_size
        dest = tuple(block_ids[first : first + n])
        self._next.pulls.append(
            PullJob(
                request.request_id,
                remote.kv_endpoint,
                remote.remote_request_id,
                first,
                dest,
                tuple(request.block_hashes[first : first + n]),
            )
        )
        self._pulled.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._next = self._next, P2PMetadata()
        return meta

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        # A request that ends while pulling is held by the engine until the pull stopped (its stop comes
        # in the metadata with the pull, if the pull has not been sent yet): nothing to do here.
        self._pulled.discard(request.request_id)
        if not isinstance(request.kv_transfer_params, RemoteDecode) or request.status not in _LEASABLE:
            return False, None
        return self._lease(request, block_ids)

    def _lease(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, RemotePrefill | None]:
        bs = self.block_size
        endpoint = self.options.static_endpoint or BOARD.lookup(self.context)
        if endpoint is None:
            logger.warning(
                "p2p: no block server is running for this engine; %s is not leased", request.request_id
            )
            self.stats.add("leases_unavailable")
            return False, None
        n = min(
            request.num_prompt_tokens // bs,
            request.num_computed_tokens // bs,
            len(block_ids),
            len(request.block_hashes),
        )
        lease = LeaseSpec(
            request.request_id, tuple(block_ids[:n]), tuple(request.block_hashes[:n]), self.options.lease_s
        )
        params = RemotePrefill(
            engine_id=self.context.engine_id,
            kv_endpoint=endpoint,
            remote_request_id=request.request_id,
            block_ids=lease.block_ids,
            block_hashes=lease.block_hashes,
            num_tokens=n * bs,
            lease_s=float(self.options.lease_s),
            layout=self.layout,
            namespace_id=self.context.namespace.namespace_id,
        )
        if n == 0:
            return False, params  # a prompt shorter than a block: nothing worth holding
        self._next.leases.append(lease)
        return True, params

    # ================================ worker half ===================================================

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        import zmq

        from connectors.p2p_client import BlockPuller
        from connectors.p2p_server import BlockServer
        from connectors.p2p_transfer import BlockViews
        from connectors.staging import BlockStager, needs_staging
        from wire.codec import store_namespace

        views = BlockViews(kv_cache)
        self._stager = BlockStager.for_cache(kv_cache) if needs_staging(kv_cache) else None
        opts = self.options
        try:
            namespace = store_namespace(self.context.namespace.namespace_id, self.layout)
            self._server = BlockServer(
                views,
                opts.bind,
                stats=self.stats,
                namespace=namespace,
                engine_id=self.context.engine_id,
                max_read_blocks=MAX_READ_BLOCKS,
                stop_timeout_s=opts.stop_timeout_s,
            )
        except zmq.ZMQError as exc:
            raise ConnectorOptionsError(
                f"connector 'p2p': cannot bind option 'bind' {opts.bind!r}: {exc}"
            ) from exc
        BOARD.publish(self.context, opts.advertised(self._server.endpoint))
        self._puller = BlockPuller(
            views,
            stats=self.stats,
            namespace=namespace,
            threads=opts.max_in_flight,
            recv_timeout_s=opts.recv_timeout_s,
            pull_timeout_s=opts.pull_timeout_s,
            batch_blocks=max(1, min(MAX_READ_BLOCKS, opts.batch_bytes // views.block_nbytes)),
            window=opts.window,
        )

    @property
    def endpoint(self) -> str | None:
        """The advertised endpoint of this worker half's block server (None before registration)."""
        return None if self._server is None else self.options.advertised(self._server.endpoint)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, P2PMetadata):
            return
        assert self._server is not None and self._puller is not None, "register_kv_caches was not called"
        stager = self._stager
        for lease in metadata.leases:
            # A GPU cache: the lease serves host copies, taken now (after the forward that wrote them).
            staged = stager.to_host(lease.block_ids) if stager is not None else None
            self._server.add_lease(
                lease.request_id, lease.block_ids, lease.block_hashes, lease.lease_s, staged
            )
        for job in metadata.pulls:
            self._pulling.add(RequestId(job.request_id))
            into = stager.empty(len(job.block_ids)) if stager is not None else None
            if into is not None:
                self._staged_pulls[RequestId(job.request_id)] = (job, into)
            self._puller.submit(job, into)
        for endpoint, lease_id in metadata.releases:
            self._puller.release(endpoint, lease_id)
        # After the leases and pulls: a request may have ended between being handed over and this step.
        for rid in metadata.stop_request_ids:
            if rid in self._pulling:
                self._stopped.add(rid)
                self._puller.stop(rid, self.options.stop_timeout_s + self.options.recv_timeout_s)
            else:
                self._server.stop(rid)

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        if self._server is None or self._puller is None:
            return set(), set()
        sending = {RequestId(rid) for rid in self._server.take_finished()}
        recving: set[RequestId] = set()
        for result in self._puller.take_finished():
            rid = RequestId(result.request_id)
            recving.add(rid)
            self._pulling.discard(rid)
            staged = self._staged_pulls.pop(rid, None)
            if rid in self._stopped:
                self._stopped.discard(rid)  # the request ended: nothing will read these blocks
                continue
            if staged is not None and self._stager is not None:
                # The good leading blocks go into the GPU cache before the request's next forward.
                job, into = staged
                self._stager.to_device(into, job.block_ids, result.num_loaded)
            self._load_errors.update(result.failed_block_ids)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ================================ both ==========================================================

    def get_stats(self) -> ConnectorStats:
        return ConnectorStats(self.transfer_stats(), self.endpoint, self.stats.histograms())

    def transfer_stats(self) -> dict[str, float]:
        """Counters for metrics (see ``TransferStats``); the scheduler half counts rejected params."""
        return self.stats.snapshot()

    def shutdown(self) -> None:
        if self._puller is not None:
            self._puller.close()
            self._puller = None
        if self._server is not None:
            BOARD.retract(self.context)
            self._server.close()
            self._server = None
