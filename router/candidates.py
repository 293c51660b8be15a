"""Which nodes one phase of a request may go to: healthy, not tried yet, serving its adapter, and running
the model whose tokens the client already has.

A node's model is its hash namespace (from its Stats): the model fingerprint -- the weights, their
compute format, the KV cache's dtype, the deterministic mode -- the block size and the hash algorithm.
Two nodes of one namespace make the same KV bits and the same tokens; two of different namespaces need
not.  So a prefill node's first token and KV are continued only on a decode node of its namespace, and a
stream resumed after its node failed only on a node of the namespace that made what the client has:
else the reply is neither node's output (an outside probe: a bf16 prefill node beside quantized decode
nodes -- every decode node refused the prefill's KV and recomputed it, but every reply began with the
prefill node's token).  Where no healthy prefill node runs a model a decode node runs, the request runs
whole on a decode node (``Pipeline``), and the router says so once per such set of nodes.

A node whose namespace is not known yet (no Stats read) matches any: its engine refuses foreign KV
itself, by namespace, as it always did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence

import grpc

from engine.hashing import HashNamespace
from router.adapters import no_node_serves, prefer_resident, serves
from router.admission import AdmittedRequest
from router.nodes import NodeHandle, NodePool
from router.policy import NodeSelector, RoutingInfo
from router.room import RoomWait
from serving.errors import ServingError

logger = logging.getLogger(__name__)

# The models a node may run for a phase: None, any; else one of these namespaces.
Models = Collection[HashNamespace] | None


def runs_one_of(node: NodeHandle, models: Models) -> bool:
    return models is None or node.namespace is None or node.namespace in models


def describe(models: Collection[HashNamespace]) -> str:
    return ", ".join(sorted(m.model_fingerprint for m in models))


class Pairing:
    """Which prefill nodes have a decode node of their model to hand their requests to."""

    def __init__(self) -> None:
        self._said: set[frozenset[str]] = set()  # sets of nodes already logged as unpaired
        self._lock = threading.Lock()

    def prefill_models(self, prefill: NodePool, decode: NodePool, request: AdmittedRequest) -> Models:
        """The models a prefill node may run for ``request`` (None: any), or an empty set where healthy
        prefill nodes and healthy decode nodes serving the request's adapter share no model: the
        request then runs whole on a decode node."""
        decoders = [n for n in decode.healthy() if serves(n, request.adapter)]
        models = {n.namespace for n in decoders}
        if not decoders or None in models:
            return None  # nothing to pair with yet (the decode phase will say so), or not known yet
        prefills = prefill.healthy()
        known = {n.namespace for n in prefills}
        if not prefills or None in known or known & models:
            return {m for m in models if m is not None}
        with self._lock:
            said, key = self._said, frozenset(n.address for n in (*prefills, *decoders))
            first = key not in said
            said.add(key)
        if first:
            logger.warning(
                "no prefill node runs a model a decode node runs (prefill: %s; decode: %s): requests run "
                "whole on the decode nodes until one does",
                describe({m for m in known if m is not None}),
                describe({m for m in models if m is not None}),
            )
        return set()


def choose(
    selector: NodeSelector,
    pool: NodePool,
    request: AdmittedRequest,
    tried: list[NodeHandle],
    errors: Sequence[str] = (),
    prefer: NodeHandle | None = None,
    room: RoomWait | None = None,
    models: Models = None,
    whose: Callable[[], str] = lambda: "",
) -> NodeHandle:
    """A healthy untried node of ``pool`` serving the request's adapter and running one of ``models``:
    ``prefer`` where it is one, else the policy's (those with the adapter in a slot first).  None left
    but some that were full (``room``): those again, after a pause.  ``whose`` names, for the error,
    what made the tokens that fix ``models``."""

    def candidates() -> tuple[list[NodeHandle], list[NodeHandle]]:
        healthy = pool.healthy(exclude=tried)
        serving = [n for n in healthy if serves(n, request.adapter)]
        return healthy, [n for n in serving if runs_one_of(n, models)]

    healthy, fit = candidates()
    while not fit and room is not None and room.again(tried, pool):
        healthy, fit = candidates()
    if prefer is not None and prefer in fit:
        return prefer
    serving = [n for n in healthy if serves(n, request.adapter)]
    if healthy and not serving and request.adapter is not None:
        raise no_node_serves(pool.kind, request.adapter)
    if serving and not fit and models is not None:
        raise ServingError(
            grpc.StatusCode.UNAVAILABLE,
            f"no healthy {pool.kind} node runs the model {whose()} ran ({describe(models)}); its other "
            f"nodes run {describe({n.namespace for n in serving if n.namespace is not None})}: "
            "retry the request",
        )
    if not fit:
        detail = f"; tried {'; '.join(errors)}" if errors else ""
        down = ", ".join(f"{n.address} ({n.last_error})" for n in pool.nodes() if not n.healthy)
        why = f"no healthy {pool.kind} node{detail}" + (f"; down: {down}" if down else "")
        raise ServingError(grpc.StatusCode.UNAVAILABLE, why + "; retry later")
    info = RoutingInfo(request.request_id, request.prompt_token_ids, request.cache_salt, request.adapter)
    return selector.choose(prefer_resident(fit, request.adapter), info)
