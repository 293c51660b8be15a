"""An engine's figures at one moment, read on its driver thread (``driver.call(snapshot)``): what a node's
``Stats`` call, its ``/metrics`` and the planner's measurements report."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.connector.base import ConnectorStats
from engine.llm_engine import LLMEngine
from engine.metrics import StatsSnapshot
from telemetry.metrics import HistogramSnapshot, merge_histograms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """An engine's figures at one moment (read on the driver thread): its identity, every counter, gauge
    and histogram (``engine/metrics.py``), and its connector's stats (both halves merged)."""

    engine_id: str
    model_fingerprint: str
    block_size: int
    hash_algo: str
    stats: StatsSnapshot
    dtype: str  # the model's compute dtype ("bfloat16", "float32")
    deterministic: bool  # batch-invariant forward passes (engine/determinism.py)
    connector: ConnectorStats
    # None when not checked; "" when the books balance; else why they do not.
    integrity_error: str | None = None

    @property
    def kv_endpoint(self) -> str:
        """Where the connector serves KV to peers ("" when it serves none)."""
        return self.connector.kv_endpoint or ""

    @property
    def histograms(self) -> dict[str, HistogramSnapshot]:
        """The engine's latency histograms and the connector's, by key."""
        return merge_histograms(self.stats.histograms, self.connector.histograms)


def snapshot(engine: LLMEngine, *, check_integrity: bool = False) -> EngineSnapshot:
    """Run on the driver thread (``driver.call(snapshot)``): the engine is not thread-safe."""
    integrity: str | None = None
    if check_integrity:
        try:
            engine.scheduler.check_integrity()
            integrity = ""
        except AssertionError as exc:
            integrity = str(exc) or "integrity check failed"
    connector = connector_stats(engine)  # first: a get_stats that raised counts in this snapshot
    return EngineSnapshot(
        engine_id=engine.config.engine_id,
        model_fingerprint=engine.namespace.model_fingerprint,
        block_size=engine.namespace.block_size,
        hash_algo=engine.namespace.algo,
        stats=engine.stats(),
        dtype=str(engine.model.dtype).removeprefix("torch."),
        deterministic=engine.determinism.on,
        connector=connector,
        integrity_error=integrity,
    )


def connector_stats(engine: LLMEngine) -> ConnectorStats:
    """Both connector halves' stats, merged.  A half whose ``get_stats`` raises reports none (each such
    read counted as ``connector_call_failures.get_stats``; logged once a minute, ``telemetry/logs.py``'s
    throttle, where the node installs it): a plugin's broken stats must not take
    its node out of service -- the node's start and the router's health rounds wait on its Stats (an
    outside probe's plugin kept its node from ever starting)."""
    stats = ConnectorStats()
    for half in (engine.scheduler_connector, engine.worker_connector):
        try:
            stats = stats.merged(half.get_stats())
        except Exception:
            engine.scheduler.counters.add("connector_call_failures.get_stats")
            logger.warning(
                "KV connector %s: get_stats raised; its stats are left out", half.name, exc_info=True
            )
    return stats
