"""Which nodes one phase of a request may go to: healthy, not tried yet, serving its adapter, and running
the model whose tokens the client already has.

A node's model is its hash namespace (from its Stats): the model fingerprint -- the weights, their
compute format, the KV cache's dtype, the deterministic mode and the kernels' instruction set where that
changes bits -- the block size and the hash algorithm.  Two nodes of one namespace make the same KV bits
(and, in deterministic mode, the same tokens); two of different namespaces never exchange KV.  So a
prefill node's first token and KV are continued only on a decode node of its namespace -- elsewhere the
decode node would recompute the prompt anyway, and the reply would begin with the prefill node's token
(an outside probe: a bf16 prefill node beside quantized decode nodes gave replies that were neither
setup's output) -- and a stream resumed after its node failed goes only to a node of the namespace that
made what the client has.  Where the healthy prefill nodes run none of the healthy decode nodes' models,
the request runs whole on a decode node (``Pipeline``); the router says so, and names each node left
without a partner.  A node is up only once its Stats told its namespace (``NodeHandle.check``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc

from engine.hashing import AdapterId, HashNamespace
from router.adapters import no_node_serves, prefer_resident, serves
from router.admission import AdmittedRequest
from router.nodes import NodeHandle, NodePool
from router.policy import NodeSelector, RoutingInfo
from router.room import RoomWait
from serving.errors import ServingError

logger = logging.getLogger(__name__)


class Unpaired(ServingError):
    """Nodes serve the request, but none runs the model its tokens need."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


def describe(models: Collection[HashNamespace | None]) -> str:
    return "; ".join(
        sorted(
            f"{m.model_fingerprint} (block size {m.block_size}, {m.algo})" for m in models if m is not None
        )
    )


@dataclass(frozen=True)
class PrefillPlan:
    """Where a disaggregated request's prefill may go: a node of one of ``models`` (None: any), or
    nowhere (``whole``: it runs whole on a decode node)."""

    models: frozenset[HashNamespace] | None = None
    whole: bool = False


ANY = PrefillPlan()
WHOLE = PrefillPlan(whole=True)


class Pairing:
    """Which prefill nodes have a decode node of their model; it says when that changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._whole: set[AdapterId | None] = set()  # the adapters (None: the base) whose requests run whole
        # Nodes said to have no partner, until one is seen paired (a request of another adapter, which
        # leaves some nodes out, neither pairs nor strands them: nothing is said again for it).
        self._alone: set[tuple[str, HashNamespace | None]] = set()

    def plan(self, prefill: NodePool, decode: NodePool, request: AdmittedRequest) -> PrefillPlan:
        decoders = [n for n in decode.healthy() if serves(n, request.adapter)]
        prefills = [n for n in prefill.healthy() if serves(n, request.adapter)]
        decode_models = frozenset(n.namespace for n in decoders if n.namespace is not None)
        if not decode_models or not prefills:
            return ANY  # the phase with no node says so (or waits for one stopping to come back)
        prefill_models = {n.namespace for n in prefills}
        whole = not decode_models & prefill_models
        self._say(request.adapter, whole, prefills, decoders, decode_models, prefill_models)
        return WHOLE if whole else PrefillPlan(decode_models)

    def _say(
        self,
        adapter: AdapterId | None,
        whole: bool,
        prefills: Sequence[NodeHandle],
        decoders: Sequence[NodeHandle],
        decode_models: frozenset[HashNamespace],
        prefill_models: set[HashNamespace | None],
    ) -> None:
        alone = {(n.address, n.namespace) for n in prefills if n.namespace not in decode_models}
        alone |= {(n.address, n.namespace) for n in decoders if n.namespace not in prefill_models}
        paired = {(n.address, n.namespace) for n in (*prefills, *decoders)} - alone
        with self._lock:
            was_whole = adapter in self._whole
            if whole:
                self._whole.add(adapter)
            else:
                self._whole.discard(adapter)
            # Running whole, the nodes are not named one by one: they are named once pairing resumes.
            new = set() if whole else alone - self._alone
            self._alone = (self._alone | new) - paired
        what = "requests" if adapter is None else f"requests of adapter {adapter.name}"
        if whole and not was_whole:
            logger.warning(
                "no healthy prefill node runs a model a healthy decode node runs (prefill: %s; decode: %s): "
                "%s run whole on the decode nodes, the prefill nodes idle, until one does",
                describe(prefill_models),
                describe(decode_models),
                what,
            )
        elif was_whole and not whole:
            logger.warning("prefill and decode nodes of one model are up again: %s are disaggregated", what)
        for address, model in sorted(new, key=lambda a: a[0]):
            logger.warning(
                "node %s runs %s, which no node of the other phase runs: it gets no disaggregated request "
                "while so",
                address,
                describe([model]),
            )


def choose(
    selector: NodeSelector,
    pool: NodePool,
    request: AdmittedRequest,
    tried: list[NodeHandle],
    errors: Sequence[str] = (),
    prefer: NodeHandle | None = None,
    room: RoomWait | None = None,
    models: Collection[HashNamespace] | None = None,
    whose: str = "",
) -> NodeHandle:
    """A healthy untried node of ``pool`` serving the request's adapter and running one of ``models``
    (None: any): ``prefer`` where it is one, else the policy's (those with the adapter in a slot first).
    None left but some that were full (``room``): those again, after a pause.  ``Unpaired`` where nodes
    serve the request but none runs one of ``models`` (``whose``: what runs them, for the message)."""

    def candidates() -> tuple[list[NodeHandle], list[NodeHandle]]:
        serving = [n for n in pool.healthy(exclude=tried) if serves(n, request.adapter)]
        return serving, [n for n in serving if models is None or n.namespace in models]

    serving, fit = candidates()
    while not fit and room is not None and room.again(tried, pool):
        serving, fit = candidates()
    if prefer is not None and prefer in fit:
        return prefer
    if not serving and request.adapter is not None and pool.healthy(exclude=tried):
        raise no_node_serves(pool.kind, request.adapter)
    if serving and not fit:
        others = describe({n.namespace for n in serving})
        raise Unpaired(
            f"no healthy {pool.kind} node runs the model of {whose} ({describe(models or ())}); those that "
            f"serve the request run {others}"
        )
    if not fit:
        detail = f"; tried {'; '.join(errors)}" if errors else ""
        down = ", ".join(f"{n.address} ({n.last_error})" for n in pool.nodes() if not n.healthy)
        why = f"no healthy {pool.kind} node{detail}" + (f"; down: {down}" if down else "")
        raise ServingError(grpc.StatusCode.UNAVAILABLE, why + "; retry later")
    info = RoutingInfo(request.request_id, request.prompt_token_ids, request.cache_salt, request.adapter)
    return selector.choose(prefer_resident(fit, request.adapter), info)
