"""The objects the connector contract passes around: roles, the engine's context, the per-step metadata
(scheduler half -> worker half) and output (worker half -> scheduler half), stats and options.  The
contract itself -- when each method is called and what it must keep -- is ``engine/connector/base.py``.
These live apart from it so that the scheduler's typed hand-offs (``engine/scheduler/output.py``) can
name them without importing the base class, which names the scheduler's output in turn."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.hashing import HashNamespace
from engine.kv_cache import KVCacheSpec
from engine.request import RequestId
from telemetry.metrics import HistogramSnapshot, merge_histograms


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class ConnectorContext:
    """What the engine tells a connector about itself when it is built."""

    namespace: HashNamespace
    # The paged cache's geometry and dtype: what a stored or streamed block must match byte for byte.
    spec: KVCacheSpec
    engine_id: str = "engine-0"

    @property
    def block_size(self) -> int:
        return self.namespace.block_size


@dataclass
class KVConnectorMetadata:
    """Per-step instructions from the scheduler half to the worker half.  Connectors subclass it.

    The engine fills the two fields below after ``build_connector_meta`` returns: a connector need not
    copy them (``multi`` hands them to its children)."""

    # Requests preempted this step: their blocks may be overwritten by this step's forward pass.
    preempted_request_ids: list[RequestId] = field(default_factory=list)
    # Held requests the engine wants back (aborted, or past kv_hold_timeout_s): stop their transfers,
    # then report them in finished_sending / finished_recving.  Their blocks stay allocated until then.
    stop_request_ids: list[RequestId] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """Per-step report from the worker half (filled by the runner from the worker's calls)."""

    finished_sending: set[RequestId] = field(default_factory=set)
    finished_recving: set[RequestId] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass(frozen=True)
class ConnectorStats:
    """What one connector half reports to its node (``get_stats``): monotonic counters by name (the
    node sums the two halves', and ``multi`` its children's), latency histograms, and the address it
    serves KV on, if any.

    Counters become ``pdkv_connector_<name>_total`` in ``/metrics`` and ``connector_stats`` in the
    ``Node/Stats`` RPC, unchanged: adding a counter to a connector touches that connector only.
    Histograms are keyed like the engine's (``kv_load_seconds.<source>``, ``kv_transfer_seconds.recv``:
    the names ``engine.metrics.CONNECTOR_METRICS`` declares) and exported under those names."""

    counters: Mapping[str, float] = field(default_factory=dict)
    kv_endpoint: str | None = None
    histograms: Mapping[str, HistogramSnapshot] = field(default_factory=dict)

    def merged(self, other: ConnectorStats) -> ConnectorStats:
        """Counters and histograms summed; the first endpoint found wins."""
        counters = dict(self.counters)
        for key, value in other.counters.items():
            counters[key] = counters.get(key, 0.0) + float(value)
        histograms = merge_histograms(self.histograms, other.histograms)
        return ConnectorStats(counters, self.kv_endpoint or other.kv_endpoint, histograms)


class ConnectorOptionsError(ValueError):
    """A connector's options dict is wrong; the message names the key."""


def parse_options(options_cls: type, options: Mapping[str, Any] | None, *, connector: str) -> Any:
    """Build a connector's frozen options dataclass from a config dict, naming any bad key."""
    options = dict(options or {})
    known = {f.name for f in fields(options_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConnectorOptionsError(
            f"connector {connector!r}: unknown option {unknown[0]!r}; "
            f"known options: {', '.join(sorted(known)) or '(none)'}"
        )
    try:
        return options_cls(**options)
    except TypeError as exc:
        raise ConnectorOptionsError(f"connector {connector!r}: {exc}") from exc
