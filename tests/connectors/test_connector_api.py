"""What the connector API hands its halves, so authors need not stash or reach into the engine:
``ScheduledRequest.block_hashes`` in ``build_connector_meta``, ``step_metadata`` in the worker half."""

from __future__ import annotations

from typing import Any

from connectors.base import ConnectorContext, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from connectors.testing.harness import engine_config
from connectors.testing.workload import PARAMS, PROMPTS
from engine.llm_engine import LLMEngine
from engine.request import Request


class Recorder(KVConnectorBase):
    name = "recorder"

    def __init__(self, role: KVConnectorRole, context: Any) -> None:
        super().__init__(role, context)
        self.hashes: dict[str, list[bytes]] = {}
        self.seen: list[tuple[str, KVConnectorMetadata | None]] = []

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        for sr in scheduler_output.scheduled:
            self.hashes[sr.request_id] = list(sr.block_hashes)
        return KVConnectorMetadata()

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self.seen.append(("start_load_kv", self.step_metadata))
        assert self.step_metadata is metadata

    def save_kv_layer(self, layer: int, kv_cache: Any, attn_metadata: Any) -> None:
        if layer == 0:
            self.seen.append(("save_kv_layer", self.step_metadata))

    def wait_for_save(self) -> None:
        self.seen.append(("wait_for_save", self.step_metadata))


def test_build_connector_meta_reads_each_request_s_hashes_and_the_worker_its_metadata() -> None:
    config = engine_config(None, "api-test")
    probe = LLMEngine(config)
    context = ConnectorContext(probe.namespace, probe.kv_spec, engine_id="api-test")
    scheduler, worker = (
        Recorder(KVConnectorRole.SCHEDULER, context),
        Recorder(KVConnectorRole.WORKER, context),
    )
    engine = LLMEngine(config, connectors=(scheduler, worker))
    engine.add_request("r0", PROMPTS[0], PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
    want = list(Request("r0", PROMPTS[0], PARAMS, namespace=engine.namespace).block_hashes)
    assert scheduler.hashes["r0"][: len(want)] == want and want
    assert worker.seen and all(meta is not None for _, meta in worker.seen)
    assert {name for name, _ in worker.seen} == {"start_load_kv", "save_kv_layer", "wait_for_save"}
    assert worker.step_metadata is None  # unbound between steps
    engine.shutdown()
