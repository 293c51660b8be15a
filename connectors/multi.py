"""``multi``: several connectors as one.  Loads from the first child with a hit, saves to all.

Options::

    {"connectors": [{"name": "offload", "options": {...}}, {"name": "shared-dir", "options": {...}}]}

- Lookup: children are asked in order; the first that reports a hit provides the request's external
  tokens.  A child that answers ``None`` (still looking) before any hit makes the whole answer ``None``,
  so a preferred child is never skipped just because it is slow to answer.
- Saves and step hooks go to every child.
- ``request_finished`` is called on every child; the request is held if any child holds it, and it is
  reported in ``finished_sending`` only when every child that held it has finished (a stop reaches every
  child, and each reports it once stopped).
  Which children those are travels to the worker half in the step metadata (the halves share no state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.connector.base import (
    ConnectorContext,
    ConnectorOptionsError,
    ConnectorStats,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from engine.connector.params import KVTransferParams
from engine.request import Request, RequestId
from wire.kv_events import KVCacheEvent

if TYPE_CHECKING:
    import torch

    from engine.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class MultiOptions:
    connectors: Sequence[Mapping[str, Any]] = ()


@dataclass
class MultiMetadata(KVConnectorMetadata):
    children: list[KVConnectorMetadata] = field(default_factory=list)
    # request -> indices of the children that held it (their sends must all finish).
    held_by: dict[RequestId, set[int]] = field(default_factory=dict)


class MultiConnector(KVConnectorBase):
    name = "multi"
    Options = MultiOptions

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        from connectors.registry import KVConnectorConfig, create_connector

        specs = list(self.options.connectors)
        if not specs:
            raise ConnectorOptionsError(
                "connector 'multi': option 'connectors' must list at least one connector"
            )
        self.children: list[KVConnectorBase] = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, Mapping) or "name" not in spec:
                raise ConnectorOptionsError(
                    f"connector 'multi': connectors[{i}] must be a mapping with a 'name' "
                    "(and optional 'options')"
                )
            extra = sorted(set(spec) - {"name", "options"})
            if extra:
                raise ConnectorOptionsError(
                    f"connector 'multi': connectors[{i}] has unknown key {extra[0]!r}"
                )
            cfg = KVConnectorConfig(name=spec["name"], options=spec.get("options") or {})
            self.children.append(create_connector(cfg, role, context))
        # Scheduler half: which child loads each request; which children held each finished request.
        self._loader: dict[RequestId, int] = {}
        self._held_by: dict[RequestId, set[int]] = {}
        # Worker half: holds being waited on, and which children reported each done.
        self._pending_sends: dict[RequestId, set[int]] = {}
        self._sent: dict[RequestId, set[int]] = {}

    def get_stats(self) -> ConnectorStats:
        out = ConnectorStats()
        for child in self.children:
            out = out.merged(child.get_stats())
        return out

    # ---------------------------------------------------------------- scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        for i, child in enumerate(self.children):
            num, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num is None:
                return None, False
            if num > 0:
                self._loader[request.request_id] = i  # overwritten by a repeated lookup: still idempotent
                return num, load_async
        self._loader.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        loader = self._loader.get(request.request_id)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if i == loader else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MultiMetadata(
            children=[c.build_connector_meta(scheduler_output) for c in self.children],
            held_by=self._held_by,
        )
        self._held_by = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving | output.finished_sending:
            self._loader.pop(rid, None)
        for child in self.children:
            child.update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        held: set[int] = set()
        params: KVTransferParams | None = None
        for i, child in enumerate(self.children):
            hold, child_params = child.request_finished(request, block_ids)
            if hold:
                held.add(i)
            if params is None:
                params = child_params  # the first child's answer wins, as for loads
        self._loader.pop(request.request_id, None)
        if held:
            self._held_by[request.request_id] = held
        return bool(held), params

    def take_events(self) -> list[KVCacheEvent]:
        return [e for child in self.children for e in child.take_events()]

    # ---------------------------------------------------------------- worker half

    @staticmethod
    def _child_meta(metadata: KVConnectorMetadata, i: int) -> KVConnectorMetadata:
        """Child ``i``'s metadata, with the engine's own instructions (filled in multi's) handed down."""
        assert isinstance(metadata, MultiMetadata), "multi's worker half needs multi's metadata"
        child = metadata.children[i]
        child.preempted_request_ids = metadata.preempted_request_ids
        child.stop_request_ids = metadata.stop_request_ids
        return child

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        for child in self.children:
            child.register_kv_caches(kv_cache)

    def bind_step_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        super().bind_step_metadata(metadata)
        for i, child in enumerate(self.children):
            child.bind_step_metadata(None if metadata is None else self._child_meta(metadata, i))

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        for i, child in enumerate(self.children):
            child.handle_preemptions(self._child_meta(metadata, i))

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MultiMetadata)
        for rid, children in metadata.held_by.items():
            self._pending_sends[rid] = set(children)
        for i, child in enumerate(self.children):
            child.start_load_kv(self._child_meta(metadata, i))

    def wait_for_layer_load(self, layer: int) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        for child in self.children:
            child.save_kv_layer(layer, kv_cache, attn_metadata)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        sending: set[RequestId] = set()
        recving: set[RequestId] = set()
        for i, child in enumerate(self.children):
            s, r = child.get_finished(finished_req_ids)
            recving |= r  # only the loading child receives a request
            for rid in s:
                # Only requests some child held are tracked: a child may report every finished request.
                if rid in self._pending_sends:
                    self._sent.setdefault(rid, set()).add(i)
        for rid in list(self._sent):
            expected = self._pending_sends.get(rid)
            if expected is not None and expected <= self._sent[rid]:
                sending.add(rid)
                del self._sent[rid]
                del self._pending_sends[rid]
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for child in self.children:
            out |= child.get_block_ids_with_load_errors()
        return out

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
