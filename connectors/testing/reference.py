"""The kit's references: the greedy outputs of an engine with no connector, which every connector run
must reproduce."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from connectors.testing.harness import engine_config
from connectors.testing.target import ConformanceTarget
from connectors.testing.workload import PARAMS
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@functools.cache
def _reference(
    prompts: tuple[tuple[int, ...], ...],
    params: SamplingParams,
    options: tuple[tuple[str, Any], ...],
    adapter: str | None,
) -> tuple[tuple[int, ...], ...]:
    engine = LLMEngine(engine_config(None, "kit-reference", **dict(options)))
    out = []
    for i, prompt in enumerate(prompts):  # one at a time: nothing shared, nothing preempted
        rid = f"ref-{i}"
        engine.add_request(rid, list(prompt), params, adapter=adapter)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        out.append(tuple(tokens))
    return tuple(out)


def reference(
    target: ConformanceTarget,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = PARAMS,
    *,
    adapter: str | None = None,
    **engine_options: Any,
) -> list[list[int]]:
    """Greedy outputs of an engine with no connector: what every connector run must reproduce
    (``engine_options``: another model or dtype, or the adapters to serve; ``adapter``: the requests')."""
    options = tuple(sorted({**_output_options(target.engine_options), **engine_options}.items()))
    ref = _reference(tuple(tuple(p) for p in prompts), params, options, adapter)
    return [list(t) for t in ref]


def _output_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The target's engine options that may change outputs (device, dtype), not just the pool's size."""
    return {
        k: v for k, v in options.items() if k not in ("num_blocks", "kv_hold_timeout_s", "kv_stop_timeout_s")
    }
