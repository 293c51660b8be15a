"""An engine's figures at one moment, read on its driver thread (``driver.call(snapshot)``): what a node's
``Stats`` call, its ``/metrics`` and the planner's measurements report."""

from __future__ import annotations

from dataclasses import dataclass

from engine.connector.base import ConnectorStats
from engine.llm_engine import LLMEngine
from engine.metrics import StatsSnapshot
from telemetry.metrics import HistogramSnapshot, merge_histograms


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
    return EngineSnapshot(
        engine_id=engine.config.engine_id,
        model_fingerprint=engine.namespace.model_fingerprint,
        block_size=engine.namespace.block_size,
        hash_algo=engine.namespace.algo,
        stats=engine.stats(),
        dtype=str(engine.model.dtype).removeprefix("torch."),
        deterministic=engine.determinism.on,
        connector=engine.scheduler_connector.get_stats().merged(engine.worker_connector.get_stats()),
        integrity_error=integrity,
    )
