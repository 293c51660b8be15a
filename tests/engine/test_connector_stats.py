"""A connector whose ``get_stats`` raises: the node's figures leave its stats out (counted, logged) and
the engine serves on.  An outside probe's plugin kept its node from ever starting: the node's start and the
router's health rounds read the engine's snapshot, which called get_stats unguarded."""

from __future__ import annotations

import logging

import pytest

from connectors.registry import KVConnectorConfig
from engine.connector.base import ConnectorStats
from engine.connector.null import NullConnector
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.snapshot import snapshot
from tests.tiny_models import random_prompts, tiny_model_dir


class StatsRaising(NullConnector):
    """The worker half's get_stats raises; the scheduler half's reports a counter."""

    name = "stats-raising"

    def get_stats(self) -> ConnectorStats:
        if self.role.name == "WORKER":
            raise RuntimeError("boom from get_stats")
        return ConnectorStats({"scheduler_half": 1.0})


def test_a_get_stats_that_raises_leaves_that_half_out_and_the_engine_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = KVConnectorConfig(f"{__name__}:StatsRaising")
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64, kv_connector=config)
    plain = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64)
    prompts = random_prompts([12, 30], seed=4)
    params = SamplingParams(max_tokens=4)
    with caplog.at_level(logging.WARNING, logger="engine.snapshot"):
        first = snapshot(llm.engine)
    assert dict(first.connector.counters) == {"scheduler_half": 1.0}
    assert "get_stats raised" in caplog.text
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    assert snapshot(llm.engine).stats.counter("connector_call_failures.get_stats") == 2
