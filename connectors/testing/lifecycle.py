"""The checks of a request's life around the connector: ``request_finished`` once, no block leaked after
an abort or a preemption, holds that end (by ``finished_sending``, or confirmed when stopped), an
unreachable backend that costs bounded time, and nothing kept for a finished request."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from connectors.testing.harness import KitEngine, engine_config
from connectors.testing.items import (
    ABORT_LEAK,
    FINISHED_ONCE,
    HOLD_ENDS,
    PREEMPT_LEAK,
    RELEASED,
    STOP_CONFIRMED,
    UNREACHABLE,
    ConformanceError,
)
from connectors.testing.reference import reference
from connectors.testing.runner import run_with_deadline
from connectors.testing.steps import (
    LONG_HOLD_S,
    LONG_PARAMS,
    expect_outputs,
    save,
)
from connectors.testing.target import ConformanceTarget
from connectors.testing.workload import (
    LONG_PROMPT,
    PARAMS,
    PROMPTS,
)
from engine.outputs import GenerationOutput


def check_request_finished_exactly_once(target: ConformanceTarget, shared: Path) -> None:
    """Every request, however it ends (length, stop token, abort while waiting or running, an abort after
    it finished), gets one ``request_finished`` returning ``(bool, dict or None)``, and the worker reports
    each delayed free's ``finished_sending`` and each async load's ``finished_recving`` once."""
    item = FINISHED_ONCE
    save(target, shared, item)
    stop_token = reference(target, PROMPTS[2:3])[0][2]
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        waiting = b.add(PROMPTS[0])
        b.abort(waiting)
        stopped = b.add(PROMPTS[2], dataclasses.replace(PARAMS, stop_token_ids=(stop_token,)))
        normal = [b.add(PROMPTS[1]), b.add(PROMPTS[3])]
        running = b.add(LONG_PROMPT, LONG_PARAMS)
        b.step()
        b.abort(running)
        b.abort(running)  # a second abort is a no-op
        b.wait([stopped, *normal])
        for rid in normal:
            b.abort(rid)  # after it finished: a no-op, or the end of a delayed free
        b.drain(target.send_deadline_s, "engine B, after every request ended")
        spy = b.scheduler_spy
        for rid in (waiting, stopped, *normal, running):
            if spy.finished[rid] != 1:
                raise ConformanceError(item, f"request_finished ran {spy.finished[rid]} times for {rid}")
            result = spy.finish_results[rid]
            ok = (
                isinstance(result, tuple)
                and len(result) == 2
                and isinstance(result[0], bool)
                and (result[1] is None or isinstance(result[1], dict))
            )
            if not ok:
                raise ConformanceError(
                    item, f"request_finished returned {result!r}; it must be (hold: bool, dict or None)"
                )
        for what in ("finished_sending", "finished_recving"):  # no request here loads or sends twice
            twice = sorted(r for r, n in getattr(b.worker_spy, what).items() if n > 1)
            if twice:
                raise ConformanceError(item, f"{what} listed {twice} more than once")


def check_no_leak_after_abort(target: ConformanceTarget, shared: Path) -> None:
    """Aborts while waiting, mid-prefill, loading (just admitted with a hit), decoding and after finishing
    leave every block free once the connector's work is done."""
    item = ABORT_LEAK
    save(target, shared, item)
    with KitEngine(
        target, target.config(shared), item=item, engine_id="kit-b", long_prefill_token_threshold=8
    ) as b:
        waiting = b.add(PROMPTS[0])
        b.abort(waiting)
        prefill = b.add(LONG_PROMPT, LONG_PARAMS)  # 40 fresh tokens, 8 per step
        loading = b.add(PROMPTS[1], LONG_PARAMS)
        decoding = b.add(PROMPTS[2], LONG_PARAMS)
        finished = b.add(PROMPTS[3])
        scheduler = b.engine.scheduler
        # Abort each as soon as it is in its state: the long prompt with its first chunk computed, the
        # saved one as soon as it has blocks (loading, if the connector loads asynchronously).
        ready = {
            prefill: lambda: b.request(prefill).num_computed_tokens > 0,
            loading: lambda: loading in scheduler.kv.req_to_blocks,
        }

        def abort_when_ready() -> bool:
            for rid, is_ready in list(ready.items()):
                if is_ready():
                    if rid == prefill:
                        computed = b.request(prefill).num_computed_tokens
                        assert computed < len(LONG_PROMPT), "kit bug: not mid-prefill"
                    b.abort(rid)
                    del ready[rid]
            return not ready

        b.step_until(abort_when_ready, 30.0, "requests were never admitted")
        b.step_until(
            lambda: bool(b.results[decoding].token_ids), 30.0, "the decoding request produced no token"
        )
        b.abort(decoding)
        b.wait([finished])
        b.abort(finished)
        b.drain(target.send_deadline_s, "engine B, after the aborts")
        b.assert_no_leak("aborts in every state")


def check_no_leak_after_preemption(target: ConformanceTarget, shared: Path) -> None:
    """With a pool too small for the batch, requests are preempted (their blocks reused) while the
    connector loads and saves; outputs stay exact and every block comes back."""
    item = PREEMPT_LEAK
    save(target, shared, item)
    ref = reference(target, PROMPTS, LONG_PARAMS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b", num_blocks=12) as b:
        outs = b.generate(PROMPTS, LONG_PARAMS)
        # The outputs first: a request the connector failed (a raising load) is never preempted, and
        # its error is what the author needs to read, not the kit's own precondition.
        expect_outputs(item, outs, ref, "engine B (preempting)")
        assert b.engine.stats().counter("num_preemptions") > 0, "kit bug: nothing was preempted"
        b.drain(target.send_deadline_s, "engine B, after the preemptions")
        b.assert_no_leak("preemptions")


def check_hold_ends_with_finished_sending(target: ConformanceTarget, shared: Path) -> None:
    """A connector that holds a finished request's blocks (``hold=True``) lists the request in
    ``finished_sending`` within ``send_deadline_s``.  The engine's hold timeout is set far above that:
    relying on it fails."""
    item = HOLD_ENDS
    hold_s = max(LONG_HOLD_S, 100 * target.send_deadline_s)
    with KitEngine(
        target, target.config(shared), item=item, engine_id="kit-a", kv_hold_timeout_s=hold_s
    ) as a:
        expect_outputs(item, a.generate(PROMPTS), reference(target, PROMPTS), "engine A")
        a.drain(target.send_deadline_s, "engine A, after generating")
        a.assert_no_leak("the holds")


def check_stopped_holds_are_confirmed(target: ConformanceTarget, shared: Path) -> None:
    """With a hold timeout shorter than any send, the engine asks the worker to stop every hold
    (``metadata.stop_request_ids``) and frees the blocks only once the worker reports the request.  The
    engine's last-resort free (``kv_stop_timeout_s``) is set far above ``send_deadline_s``: a worker that
    does not confirm its stops fails, and so does any leak."""
    item = STOP_CONFIRMED
    stop_s = max(LONG_HOLD_S, 100 * target.send_deadline_s)
    save(target, shared, item, kv_hold_timeout_s=0.001, kv_stop_timeout_s=stop_s)
    ref = reference(target, PROMPTS)
    with KitEngine(
        target,
        target.config(shared),
        item=item,
        engine_id="kit-b",
        kv_hold_timeout_s=0.001,
        kv_stop_timeout_s=stop_s,
    ) as b:
        for run in ("first", "second"):
            expect_outputs(item, b.generate(PROMPTS), ref, f"engine B ({run} run)")
            b.drain(target.send_deadline_s, f"engine B, after the {run} run")
            b.assert_no_leak(f"the {run} run's holds were stopped")


def check_unreachable_backend(target: ConformanceTarget, shared: Path) -> None:
    """With the backend unreachable, an engine starts and generates correct outputs within
    ``unreachable_deadline_s``, with zero external tokens."""
    item = UNREACHABLE
    missing = target.missing_hook("unreachable_factory")
    if missing is not None:
        raise ConformanceError(item, missing)
    config = target.unreachable_config(shared)
    ref = reference(target, PROMPTS)
    engine_config(target, "kit-unreachable")  # the model is written before the clock starts
    deadline = target.unreachable_deadline_s

    def run(engine_id: str, what: str) -> list[GenerationOutput]:
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                with KitEngine(target, config, item=item, engine_id=engine_id) as b:
                    box["outs"] = b.generate(PROMPTS, deadline_s=deadline)
            except BaseException as exc:
                box["error"] = exc

        run_with_deadline(work, deadline, item, f"{what} start + {len(PROMPTS)} short prompts")
        if "error" in box:
            error = box["error"]
            if isinstance(error, ConformanceError):
                raise error
            raise ConformanceError(item, f"raised {error!r}") from error
        outs: list[GenerationOutput] = box["outs"]
        expect_outputs(item, outs, ref, f"{what} with the backend down")
        return outs

    loaded = [o.num_external_tokens for o in run("kit-unreachable", "engine")]
    if any(loaded):
        raise ConformanceError(item, f"an unreachable backend provided {loaded} tokens")
    if target.nothing_to_reach:
        return
    # A config that reaches a backend after all (an outside author passed the connector's own factory)
    # passes the above with an empty store: a second engine from it must not find what the first saved.
    again = [o.num_external_tokens for o in run("kit-unreachable-2", "a second engine")]
    if any(again):
        raise ConformanceError(
            item,
            f"a second engine from unreachable_factory was provided {again} tokens that the first saved "
            "through it: that backend is reachable -- give a config whose backend cannot be reached (a "
            "path under a regular file, a closed port), or nothing_to_reach=True for in-process memory",
        )


def check_nothing_is_kept_for_finished_requests(target: ConformanceTarget, shared: Path) -> None:
    """Once every request ended (finished, stopped, aborted while waiting or running) and the holds are
    over, the scheduler half keeps no state for any of them: a long-running engine serves millions of
    requests.  (``tracked_requests`` asks the target; without it the kit looks for the requests' ids.)"""
    item = RELEASED
    save(target, shared, item)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        waiting = b.add(PROMPTS[0])
        b.abort(waiting)
        running = b.add(LONG_PROMPT, LONG_PARAMS)
        b.step()
        b.abort(running)
        done = [b.add(p) for p in PROMPTS[1:]]
        b.wait(done)
        b.drain(target.send_deadline_s, "engine B, after every request ended")
        ended = {waiting, running, *done}
        if target.tracked_requests is not None:
            n = target.tracked_requests(b.scheduler_spy.inner)
            if n:
                raise ConformanceError(
                    item, f"tracked_requests says the scheduler half still tracks {n} requests, all ended"
                )
            return
        holding = b.scheduler_state_holding(ended)
        if holding:
            raise ConformanceError(
                item,
                "after every request ended, the scheduler half still refers to them: "
                + "; ".join(holding)
                + ".  Drop a request's state in request_finished (or, for a hold, when its "
                "finished_sending arrives in update_connector_output)",
            )
