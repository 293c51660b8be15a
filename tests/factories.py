"""Small factories shared by the engine-core tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.hashing import AdapterId, HashNamespace
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from engine.scheduler.config import CacheConfig, SchedulerConfig

NS4 = HashNamespace(model_fingerprint="test-model", block_size=4)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 4,
    namespace: HashNamespace = NS4,
    cache_salt: str | None = None,
    adapter: AdapterId | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    **params: object,
) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        namespace=namespace,
        cache_salt=cache_salt,
        adapter=adapter,
        priority=priority,
        arrival_time=arrival_time,
    )


def make_scheduler(
    *,
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    enable_kv_events: bool = False,
    max_passed_over: int = 32,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_passed_over=max_passed_over,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_kv_events=enable_kv_events),
    )


def fake_output(so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A runner that samples ``token`` for every request whose chunk reached its last token."""
    return ModelRunnerOutput(sampled_token_ids={sr.request_id: token for sr in so.scheduled if sr.sample})


def run_to_completion(scheduler: Scheduler, *, token: int = 7, max_steps: int = 10_000) -> int:
    """Drive schedule/update until every request finishes; check integrity after each step."""
    steps = 0
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_output(so, token))
        scheduler.check_integrity()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def store_tier_spec(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The ``offload`` connector's ``kv_store`` for one tier: cpu, disk (under ``tmp_path``), redis (the
    ``redis_server`` fixture) or remote (a ``store_server`` with a CPU tier)."""
    if tier == "cpu":
        return "cpu:64MiB"
    if tier == "disk":
        return f"disk:{tmp_path / 'kv'}:64MiB"
    if tier == "redis":
        return f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    assert tier == "remote", tier
    return f"remote:{request.getfixturevalue('store_server')('cpu:64MiB').endpoint}"
