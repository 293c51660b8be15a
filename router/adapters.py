"""The router's LoRA adapters: which the nodes serve, which nodes may run a request, and run-time loads.

Each health round reads every node's adapters (``NodeStats.adapters``: name, digest, resident).  A
request names an adapter; ``resolve`` turns the name into the identity the nodes serve it under (the
digest most nodes have, should a reload be half done), or NOT_FOUND.  Only nodes serving that exact
identity are candidates (``serves``), resident ones first (``prefer_resident``): the prefill and the
decode node of a request always run the same weights, and the request carries the digest
(``AdapterRef``) so that a node with other weights under the name refuses it rather than mixing KV.

``load`` / ``unload`` (behind ``--allow-runtime-lora``) call every node of every pool, prefill and
decode alike: an adapter is served where all of them can run it.  A node that comes back without an
adapter loaded that way (it restarted) is asked to load it again after the next health round; one that
comes back with an adapter unloaded that way (a ``--lora`` of its command line) is asked to unload it
again, and the name stays unserved meanwhile -- until a load of that name.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine.hashing import AdapterId
from pdkv_proto.pdkv.v1 import types_pb2
from router.nodes import NodeHandle, NodePool
from serving.errors import ServingError, status_for

logger = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 60.0
RETRY_S = 30.0  # a node that refused to load an adapter again is asked again after this long


def serves(node: NodeHandle, adapter: AdapterId | None) -> bool:
    """Whether ``node`` runs a request admitted under ``adapter`` (``NodeHandle.runs``)."""
    return node.runs(adapter)


def prefer_resident(nodes: Sequence[NodeHandle], adapter: AdapterId | None) -> list[NodeHandle]:
    """The nodes that have ``adapter`` in a slot now, when there are any; else all of them."""
    if adapter is None:
        return list(nodes)
    resident = [n for n in nodes if adapter in n.resident_adapters]
    return resident or list(nodes)


def no_node_serves(kind: str, adapter: AdapterId) -> ServingError:
    return ServingError(
        grpc.StatusCode.UNAVAILABLE,
        f"no healthy {kind} node serves adapter {adapter}; retry later",
    )


class RouterAdapters:
    """``pools``: every pool of the router; ``allow_runtime``: take load / unload calls; ``base_name``:
    the served model's name, which no adapter may take (requests naming it run the base model)."""

    def __init__(
        self, pools: Sequence[NodePool], *, allow_runtime: bool = False, base_name: str | None = None
    ) -> None:
        self.pools = tuple(pools)
        self.allow_runtime = allow_runtime
        self.base_name = base_name
        # What was loaded through the router (name -> path, digest): a node that comes back without it
        # (restarted: it serves only its --lora adapters) loads it again (``reconcile``).
        self._runtime: dict[str, tuple[str, bytes]] = {}
        # Names unloaded through the router and not loaded since: never served, whatever a node that
        # restarted with them on its command line says (``served``, ``reconcile``).
        self._unloaded: set[str] = set()
        # (node, name) -> when it may be asked again (in flight: never; after a refusal: a while later)
        self._pending: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def _nodes(self) -> list[NodeHandle]:
        return [n for pool in self.pools for n in pool.nodes()]

    def served(self) -> dict[str, AdapterId]:
        """Each adapter name some healthy node serves, as the identity most of them have."""
        votes: dict[str, Counter[AdapterId]] = {}
        with self._lock:
            unloaded = set(self._unloaded)
        for node in self._nodes():
            if node.healthy:
                for name, aid in node.adapters.items():
                    if name not in unloaded:
                        votes.setdefault(name, Counter())[aid] += 1
        return {name: max(c, key=lambda a: (c[a], a.digest)) for name, c in sorted(votes.items())}

    def info(self) -> list[types_pb2.AdapterInfo]:
        """What ``GetModelInfo`` and ``/v1/models`` list: the served adapters (by their identity)."""
        shapes: dict[AdapterId, types_pb2.AdapterInfo] = {}
        for node in self._nodes():
            shapes.update(node.adapter_infos)
        out = []
        for aid in self.served().values():
            known = shapes.get(aid)
            info = types_pb2.AdapterInfo(name=aid.name, digest=aid.digest)
            if known is not None:
                info.max_rank, info.modules[:] = known.max_rank, list(known.modules)
            out.append(info)
        return out

    def resolve(self, name: str, field: str = "adapter") -> AdapterId:
        """The identity requests for ``name`` run under; NOT_FOUND when no healthy node serves it."""
        served = self.served()
        if name not in served:
            names = ", ".join(served) or "none"
            raise ServingError(
                grpc.StatusCode.NOT_FOUND, f"{field}: adapter {name!r} is not served here (served: {names})"
            )
        return served[name]

    # -- run-time loads -----------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> types_pb2.AdapterInfo:
        """Load ``path`` as ``name`` on every node; the first node's refusal (which names the field) is
        the answer when any refuses.  Nodes that loaded it keep it (a retry replaces it everywhere)."""
        self._check_allowed()
        if name == self.base_name:
            raise ServingError(
                grpc.StatusCode.INVALID_ARGUMENT, f"name: {name!r} is the base model's name: pick another"
            )
        msg = types_pb2.LoadAdapterRequest(name=name, path=path)
        with self._lock:  # before the nodes load it: a health round meanwhile must not unload it again
            was_unloaded = name in self._unloaded
            self._unloaded.discard(name)
        try:
            answers = self._fan_out(lambda n: n.control.LoadAdapter(msg, timeout=ADMIN_TIMEOUT_S))
            _raise_first_error(answers, f"load of adapter {name!r}")
            infos = [info for _, info in answers if isinstance(info, types_pb2.AdapterInfo)]
            if len({i.digest for i in infos}) != 1:
                raise ServingError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"adapter {name!r}: the nodes read different files at {path!r} (digests differ); give "
                    "every node the same folder",
                )
        except ServingError:
            if was_unloaded:  # a failed load serves nothing under the name
                with self._lock:
                    self._unloaded.add(name)
            raise
        for node, info in answers:
            assert isinstance(info, types_pb2.AdapterInfo)
            node.note_adapter(info)
        with self._lock:
            self._runtime[name] = (path, infos[0].digest)
        return infos[0]

    def unload(self, name: str) -> None:
        self._check_allowed()
        msg = types_pb2.UnloadAdapterRequest(name=name)
        served = name in self.served()
        with self._lock:
            self._runtime.pop(name, None)
        answers = self._fan_out(lambda n: n.control.UnloadAdapter(msg, timeout=ADMIN_TIMEOUT_S))
        for node, _ in answers:
            node.forget_adapter(name)
        unloaded = not all(isinstance(answer, Exception) for _, answer in answers)
        if unloaded or served:  # a name no node had (a typo) leaves no mark
            with self._lock:
                self._unloaded.add(name)
        if not unloaded:
            _raise_first_error(answers, f"unload of adapter {name!r}")

    def reconcile(self) -> None:
        """After a health round: each healthy node lacking an adapter loaded through the router (it
        restarted) is asked to load it again, and each one serving an adapter unloaded through the router
        (a ``--lora`` of the command line it restarted with) to unload it again, in the background."""
        with self._lock:
            runtime = dict(self._runtime)
            unloaded = set(self._unloaded)
        for node in self._nodes():
            if not node.healthy:
                continue
            for name, (path, digest) in runtime.items():
                have = node.adapters.get(name)
                if have is None or have.digest != digest:
                    load = types_pb2.LoadAdapterRequest(name=name, path=path)
                    self._again(node, name, "load", node.control.LoadAdapter.future, load)
            for name in unloaded & node.adapters.keys():
                unload = types_pb2.UnloadAdapterRequest(name=name)
                self._again(node, name, "unload", node.control.UnloadAdapter.future, unload)

    def _again(
        self, node: NodeHandle, name: str, verb: str, call: Callable[..., grpc.Future], msg: object
    ) -> None:
        """``call(msg)`` on ``node`` in the background, unless one is in flight or refused lately."""
        key = (node.address, name)
        with self._lock:
            if self._pending.get(key, 0.0) > time.monotonic():
                return
            self._pending[key] = math.inf
        logger.info("adapter %s: asking %s to %s it again (it restarted)", name, node.address, verb)
        future = call(msg, timeout=ADMIN_TIMEOUT_S)
        future.add_done_callback(lambda f: self._done_again(f, node, key, verb))

    def _done_again(self, future: grpc.Future, node: NodeHandle, key: tuple[str, str], verb: str) -> None:
        try:
            answer = future.result()
            if isinstance(answer, types_pb2.AdapterInfo):
                node.note_adapter(answer)
            else:
                node.forget_adapter(key[1])
            with self._lock:
                self._pending.pop(key, None)
        except grpc.RpcError as exc:
            logger.warning("adapter %s: %s did not %s it again: %s", key[1], node.address, verb, exc)
            with self._lock:
                self._pending[key] = time.monotonic() + RETRY_S

    def _fan_out(self, call: Callable[[NodeHandle], object]) -> list[tuple[NodeHandle, object]]:
        """``call`` on every node at once: each node with its answer, or the ``grpc.RpcError`` it got."""
        nodes = self._nodes()
        if not nodes:
            raise ServingError(grpc.StatusCode.UNAVAILABLE, "the router has no nodes")

        def one(node: NodeHandle) -> object:
            try:
                return call(node)
            except grpc.RpcError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
            return list(zip(nodes, pool.map(one, nodes), strict=True))

    def _check_allowed(self) -> None:
        if not self.allow_runtime:
            raise ServingError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "runtime adapter loading is off: start the router (pdkv up) with --allow-runtime-lora",
            )


def _raise_first_error(answers: Iterable[tuple[NodeHandle, object]], what: str) -> None:
    """The first node's failure among ``answers`` as a ``ServingError`` with its status (a refusal
    names the field), if any failed."""
    for node, answer in answers:
        if isinstance(answer, grpc.RpcError):
            code, message = status_for(answer)
            raise ServingError(code, f"{what} on {node.address}: {message}")
