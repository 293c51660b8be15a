"""The contract checks.  Each takes the target and an empty directory, drives real engines, and raises
``ConformanceError("[contract item] what happened")`` on a violation (``NotApplicable`` when it needs a
hook the target does not give).

Most checks start the same way: engine A, with the connector, generates the kit's prompts (saving their
KV), then a fresh engine B with the same backend works from what A left.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from connectors.testing.harness import (
    ABORT_LEAK,
    BLOCK_SIZE,
    BOUNDED_CALLS,
    EXACT_MULTIPLE,
    FILLER_PROMPT,
    FINISHED_ONCE,
    FORKS,
    FREED,
    HOLD_ENDS,
    HOLES,
    LOAD_ERRORS,
    LOADS,
    LONG_PROMPT,
    LOOKUP,
    NAMESPACE,
    NONE_ANSWER,
    PARAMS,
    PREEMPT_LEAK,
    PROMPTS,
    RELEASED,
    STOP_CONFIRMED,
    UNREACHABLE,
    WHOLE_BLOCKS,
    ConformanceError,
    KitEngine,
    NotApplicable,
    engine_config,
    kit_model_dir,
    max_hit_tokens,
    reference,
)
from connectors.testing.spy import CLOCK
from connectors.testing.target import ConformanceTarget
from engine.outputs import GenerationOutput
from engine.sampling_params import SamplingParams

LONG_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# The engine's hold (and stop) timeout when the kit checks that the connector itself ends its holds.
LONG_HOLD_S = 600.0


# The longest a whole check may run (a correct connector's checks take well under a second each).
CHECK_DEADLINE_S = 300.0


def run_check(
    check: Callable[[ConformanceTarget, Path], None], target: ConformanceTarget, shared: Path
) -> None:
    """Run ``check`` under the kit's watchdog: a connector call that blocks past the target's
    ``call_deadline_s`` fails the check with the call's name (the blocked thread is abandoned: the run
    goes on).  The suite runs every check this way."""
    box: dict[str, BaseException] = {}

    def work() -> None:
        try:
            check(target, shared)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, name=f"pdkv-conformance-{check.__name__}", daemon=True)
    run = CLOCK.new_run()
    started = last = time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(0.02)
        now = time.monotonic()
        if now - last > 1.0:  # the watcher was not scheduled for a while: nor was the call
            CLOCK.pardon(now - last - 0.02)
        last = now
        running = CLOCK.longest(run)
        if running is not None and running[1] > target.call_deadline_s:
            name, seconds, blocked = running
            where = _stack_of(blocked)
            CLOCK.forget(blocked)
            raise ConformanceError(
                BOUNDED_CALLS,
                f"{name} has not returned after {seconds:.1f}s (call_deadline_s is "
                f"{target.call_deadline_s:g}s): connector calls run inside the engine's step, so one that "
                "waits on its backend stalls every request; bound it (a timeout) or do the work on a "
                f"thread of your own and report it later.  Where it waits:\n{where}",
            )
        if time.monotonic() - started > CHECK_DEADLINE_S:
            raise ConformanceError(BOUNDED_CALLS, f"the check did not end within {CHECK_DEADLINE_S:g}s")
    if "error" in box:
        raise box["error"]


def _stack_of(thread_id: int) -> str:
    """The innermost frames of a thread, for the message of a call that blocks."""
    import sys
    import traceback

    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "  (the thread has ended)"
    return "".join(traceback.format_stack(frame)[-6:])


# -- shared steps -----------------------------------------------------------------------------------------


def _expect_outputs(
    item: str, outs: Sequence[GenerationOutput], ref: Sequence[Sequence[int]], who: str
) -> None:
    for i, (out, want) in enumerate(zip(outs, ref, strict=True)):
        if out.finish_reason == "error":
            raise ConformanceError(item, f"{who}: prompt {i} ended with an error: {out.error}")
        if out.token_ids != list(want):
            raise ConformanceError(
                item,
                f"{who}: prompt {i} ({len(out.prompt_token_ids)} tokens, {out.num_external_tokens} of them "
                f"from the connector) generated {out.token_ids}; without a connector the engine generates "
                f"{list(want)}, so the KV the connector provided is not the prompt's",
            )


def _save(
    target: ConformanceTarget, shared: Path, item: str, *, snapshot: bool = False, **options: Any
) -> dict[bytes, Any]:
    """Engine A generates the kit's prompts with the connector; returns A's prompt blocks if asked."""
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-a", **options) as a:
        _expect_outputs(item, a.generate(PROMPTS), reference(target, PROMPTS), "engine A (saving)")
        a.drain(target.send_deadline_s, "engine A, after generating")
        blocks: dict[bytes, Any] = {}
        if snapshot:
            for prompt in PROMPTS:
                hashes = a.block_hashes(prompt)
                for h in hashes[: max_hit_tokens(len(prompt), len(hashes), a.block_size) // a.block_size]:
                    blocks[h] = a.cached_block_bytes(h)
        return blocks


def _check_answers(item: str, kit: KitEngine) -> None:
    """Every lookup the spy saw answered whole blocks within the request's hashed prefix, or None."""
    bs = kit.block_size
    for lk in kit.scheduler_spy.lookups:
        answer = lk.answer
        if answer is None:
            continue
        call = (
            f"get_num_new_matched_tokens(request of {lk.num_tokens} tokens, num_computed_tokens="
            f"{lk.num_computed_tokens}) answered {answer!r}"
        )
        if not isinstance(answer, int) or isinstance(answer, bool) or answer < 0:
            raise ConformanceError(item, f"{call}: the answer must be a non-negative int, or None")
        if not isinstance(lk.load_async, bool):
            raise ConformanceError(item, f"{call} with load_async={lk.load_async!r}: it must be a bool")
        if answer % bs:
            raise ConformanceError(item, f"{call}: not a whole number of {bs}-token blocks")
        limit = max_hit_tokens(lk.num_tokens, lk.num_block_hashes, bs) - lk.num_computed_tokens
        if answer > limit:
            why = (
                "it covers the request's last token, which must be computed to produce the logits"
                if lk.num_computed_tokens + answer >= lk.num_tokens
                else "it reaches past the request's hashed blocks"
            )
            raise ConformanceError(item, f"{call}: {why}; at most {max(0, limit)} tokens may come from it")


# -- the checks -------------------------------------------------------------------------------------------


def check_lookups_are_idempotent(target: ConformanceTarget, shared: Path) -> None:
    """Asking again gives the same answer, and asking changes nothing: not what the engine later loads,
    not what another engine is told."""
    item = LOOKUP
    _save(target, shared, item)
    ref = reference(target, PROMPTS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        rids = [b.add(p) for p in PROMPTS]
        baseline = []
        for i, rid in enumerate(rids):
            first = b.lookup_answer(rid, 0)
            again = [b.lookup_answer(rid, 0) for _ in range(3)]
            if any(a != first for a in again):
                raise ConformanceError(
                    item,
                    f"prompt {i}: get_num_new_matched_tokens(request, 0) answered {first}, then {again} for "
                    "the same request: it may be asked again (after a failed allocation, after preemption) "
                    "and must give the same answer",
                )
            baseline.append(first)
        ghost = b.add(PROMPTS[0])  # asked about, then aborted before it was ever scheduled
        b.lookup_answer(ghost, 0)
        b.abort(ghost)
        outs = b.wait(rids)
        _expect_outputs(item, outs, ref, "engine B (after repeated lookups)")
        for i, (out, asked) in enumerate(zip(outs, baseline, strict=True)):
            limit = max_hit_tokens(len(PROMPTS[i]), len(b.block_hashes(PROMPTS[i])), b.block_size)
            offered = min(asked - asked % b.block_size, limit)
            if out.num_external_tokens != offered:
                raise ConformanceError(
                    item,
                    f"prompt {i}: lookups answered {asked} before the request was scheduled, then the engine "
                    f"got {out.num_external_tokens} external tokens for it: the earlier lookups changed what "
                    "the connector provides",
                )
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-c") as c:
        for i, prompt in enumerate(PROMPTS):
            rid = c.add(prompt)
            now = c.lookup_answer(rid, 0)
            if now < baseline[i]:
                raise ConformanceError(
                    item,
                    f"prompt {i}: a fresh engine is now offered {now} tokens where engine B was offered "
                    f"{baseline[i]}: looking up (or loading) consumed what the backend holds",
                )
            c.abort(rid)


def check_whole_block_hits(target: ConformanceTarget, shared: Path) -> None:
    """Answers are whole blocks, contiguous from the first block past ``num_computed_tokens``, and leave
    the last prompt token to be computed, even when every block of the prompt was saved."""
    item = WHOLE_BLOCKS
    _save(target, shared, item)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        bs = b.block_size
        rids = [b.add(p) for p in PROMPTS]
        answers = {(rid, nc): b.lookup_answer(rid, nc) for rid in rids for nc in (0, bs, 2 * bs)}
        _check_answers(item, b)
        for i, rid in enumerate(rids):
            whole, after_one = answers[(rid, 0)], answers[(rid, bs)]
            if whole >= bs and after_one != whole - bs:
                raise ConformanceError(
                    item,
                    f"prompt {i}: {whole} tokens are offered from block 0 but {after_one} from block 1; hits "
                    "are contiguous from the first block past num_computed_tokens",
                )
        exact = PROMPTS[EXACT_MULTIPLE]
        full = answers[(rids[EXACT_MULTIPLE], 0)]
        if target.provides_hits and full != len(exact) - bs:
            raise ConformanceError(
                item,
                f"a {len(exact)}-token prompt ({len(exact) // bs} full blocks, all saved by engine A) is "
                f"offered {full} tokens; expected {len(exact) - bs}: every block but the one holding the "
                "last token",
            )
        b.wait(rids)
        _check_answers(item, b)  # the engine's own lookups, too


def check_none_is_followed_by_an_answer(target: ConformanceTarget, shared: Path) -> None:
    """A lookup may answer None ("still looking") while its backend works; a number must follow within
    ``lookup_deadline_s``, and the request then runs normally."""
    item = NONE_ANSWER
    _save(target, shared, item)
    ref = reference(target, PROMPTS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        # Every step loop of the kit fails a request told None for longer than lookup_deadline_s.
        rids = [b.add(p) for p in PROMPTS]
        b.wait(rids, deadline_s=target.lookup_deadline_s + 60)
        _expect_outputs(item, [b.results[r] for r in rids], ref, "engine B")


def check_loads_reproduce_saved_kv(target: ConformanceTarget, shared: Path) -> None:
    """Engine B loads every block but the tail's from the connector, byte for byte what engine A computed,
    computes only the tail, and generates what an engine without a connector generates.  Engine C first
    caches a prompt's first blocks itself (a fork): the connector then provides the blocks after that
    local hit, into the blocks after it."""
    item = LOADS
    saved = _save(target, shared, item, snapshot=True)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        bs = b.block_size
        rids = [b.add(p) for p in PROMPTS]
        outs = b.wait(rids)
        _expect_outputs(item, outs, reference(target, PROMPTS), "engine B (loading)")
        if not target.provides_hits:
            loaded = [o.num_external_tokens for o in outs]
            if any(loaded):
                raise ConformanceError(item, f"provides_hits=False, yet engine B loaded {loaded} tokens")
            return
        failures = b.engine.stats().counter("kv_load_failures")
        if failures:
            raise ConformanceError(item, f"{failures} loads failed although nothing was damaged")
        for i, (rid, out) in enumerate(zip(rids, outs, strict=True)):
            n = len(PROMPTS[i])
            hashes = b.block_hashes(PROMPTS[i])
            want = max_hit_tokens(n, len(hashes), bs)
            if (out.num_cached_tokens, out.num_external_tokens) != (0, want):
                raise ConformanceError(
                    item,
                    f"prompt {i} ({n} tokens, every full block saved by engine A): engine B took "
                    f"{out.num_external_tokens} tokens from the connector and computed "
                    f"{out.num_computed_prompt_tokens}; expected {want} from the connector and only the "
                    f"{n - want}-token tail computed",
                )
            _expect_loaded_bytes(item, b, rid, hashes, saved, f"prompt {i}")
    # A local hit first: a fork of the longest prompt puts its first two blocks in engine C's own cache,
    # then the prompt itself must take those two locally and the rest -- only the rest -- from the
    # connector, into the blocks after the local hit.
    longest = max(range(len(PROMPTS)), key=lambda k: len(PROMPTS[k]))
    prompt = PROMPTS[longest]
    fork = FORKS[[p for p in PROMPTS if len(p) > 2 * BLOCK_SIZE].index(prompt)]
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-c") as c:
        _expect_outputs(item, c.generate([fork]), reference(target, [fork]), "engine C (a fork)")
        rid = c.add(prompt)
        (out,) = c.wait([rid])
        hashes = c.block_hashes(prompt)
        want = max_hit_tokens(len(prompt), len(hashes), c.block_size)
        local = 2 * c.block_size
        if (out.num_cached_tokens, out.num_external_tokens) != (local, want - local):
            raise ConformanceError(
                item,
                f"prompt {longest} after a fork cached its first two blocks: {out.num_cached_tokens} tokens "
                f"came from the local cache and {out.num_external_tokens} from the connector; expected "
                f"{local} local and {want - local} from the connector (the lookup starts at "
                "num_computed_tokens, the local hit)",
            )
        _expect_loaded_bytes(item, c, rid, hashes, saved, f"prompt {longest} after a local hit")
        _expect_outputs(item, [out], reference(target, [prompt]), "engine C (after a local hit)")


def _expect_loaded_bytes(
    item: str, kit: KitEngine, rid: str, hashes: Sequence[bytes], saved: dict[bytes, Any], what: str
) -> None:
    """The blocks the connector loaded for ``rid`` hold, byte for byte, what engine A saved for them."""
    import torch

    bs = kit.block_size
    out = kit.results[rid]
    alloc = kit.scheduler_spy.first_load(rid)
    assert alloc is not None, "kit bug: a load without update_state_after_alloc"
    first = alloc.num_computed_tokens // bs
    for j in range(first, first + out.num_external_tokens // bs):
        got, expected = kit.block_bytes(alloc.block_ids[j]), saved[hashes[j]]
        if torch.equal(got, expected):
            continue
        ndiff = int((got != expected).sum())
        shifted = next((k for k in range(j) if torch.equal(got, saved[hashes[k]])), None)
        hint = (
            f"; it holds block {shifted}'s KV: the connector's blocks start at the local hit "
            f"(request.num_computed_tokens = {alloc.num_computed_tokens} in update_state_after_alloc), "
            "not at block 0"
            if shifted is not None
            else ""
        )
        raise ConformanceError(
            item,
            f"{what}, block {j}: {ndiff} of {expected.numel()} bytes loaded differ from the block engine A "
            f"computed and saved{hint}",
        )


def check_load_errors_are_reported(target: ConformanceTarget, shared: Path) -> None:
    """After ``corrupt(shared)``, damaged blocks are load errors (the engine recomputes) or misses: no
    exception, no failed request, correct outputs, and nothing damaged left in the local cache."""
    if target.corrupt is None:
        raise NotApplicable("the target gives no corrupt(shared) hook")
    item = LOAD_ERRORS
    _save(target, shared, item)
    target.corrupt(shared)
    ref = reference(target, PROMPTS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        # First, forks of the damaged prompts: their shared blocks fail to load, and the blocks computed
        # in that step attended to damaged KV -- a connector must not save them (engine C checks).
        _expect_outputs(item, b.generate(FORKS), reference(target, FORKS), "engine B, forks of the prompts")
        outs = b.generate(PROMPTS)
        for i, out in enumerate(outs):
            if out.finish_reason == "error":
                raise ConformanceError(
                    item,
                    f"prompt {i} failed ({out.error}): a damaged block must be reported through "
                    "get_block_ids_with_load_errors (the engine then recomputes from it), not raised",
                )
        _expect_outputs(item, outs, ref, "engine B (damaged backend)")
        loaded = sum(o.num_external_tokens for o in outs)
        if loaded and not b.engine.stats().counter("kv_load_failures"):
            raise ConformanceError(
                item,
                f"after corrupt(), engine B loaded {loaded} tokens and reported no load error: a damaged "
                "block must be detected (a checksum) and reported, or be a miss",
            )
        _expect_outputs(item, b.generate(PROMPTS), ref, "engine B, second run (from its local cache)")
        b.drain(target.send_deadline_s, "engine B, after the failed loads")
        b.assert_no_leak("failed loads")
    # Whatever engine B saved or replaced after its failed loads must be right.
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-c") as c:
        _expect_outputs(
            item,
            c.generate([*PROMPTS, *FORKS]),
            reference(target, [*PROMPTS, *FORKS]),
            "engine C, after engine B recovered (were blocks computed over a failed load saved?)",
        )


def check_request_finished_exactly_once(target: ConformanceTarget, shared: Path) -> None:
    """Every request, however it ends (length, stop token, abort while waiting or running, an abort after
    it finished), gets one ``request_finished`` returning ``(bool, dict or None)``, and the worker reports
    each delayed free's ``finished_sending`` once."""
    item = FINISHED_ONCE
    _save(target, shared, item)
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
        twice = sorted(r for r, n in b.worker_spy.finished_sending.items() if n > 1)
        if twice:
            raise ConformanceError(item, f"finished_sending listed {twice} more than once")


def check_no_leak_after_abort(target: ConformanceTarget, shared: Path) -> None:
    """Aborts while waiting, mid-prefill, loading (just admitted with a hit), decoding and after finishing
    leave every block free once the connector's work is done."""
    item = ABORT_LEAK
    _save(target, shared, item)
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
    _save(target, shared, item)
    ref = reference(target, PROMPTS, LONG_PARAMS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b", num_blocks=12) as b:
        outs = b.generate(PROMPTS, LONG_PARAMS)
        assert b.engine.stats().counter("num_preemptions") > 0, "kit bug: nothing was preempted"
        _expect_outputs(item, outs, ref, "engine B (preempting)")
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
        _expect_outputs(item, a.generate(PROMPTS), reference(target, PROMPTS), "engine A")
        a.drain(target.send_deadline_s, "engine A, after generating")
        a.assert_no_leak("the holds")


def check_stopped_holds_are_confirmed(target: ConformanceTarget, shared: Path) -> None:
    """With a hold timeout shorter than any send, the engine asks the worker to stop every hold
    (``metadata.stop_request_ids``) and frees the blocks only once the worker reports the request.  The
    engine's last-resort free (``kv_stop_timeout_s``) is set far above ``send_deadline_s``: a worker that
    does not confirm its stops fails, and so does any leak."""
    item = STOP_CONFIRMED
    stop_s = max(LONG_HOLD_S, 100 * target.send_deadline_s)
    _save(target, shared, item, kv_hold_timeout_s=0.001, kv_stop_timeout_s=stop_s)
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
            _expect_outputs(item, b.generate(PROMPTS), ref, f"engine B ({run} run)")
            b.drain(target.send_deadline_s, f"engine B, after the {run} run")
            b.assert_no_leak(f"the {run} run's holds were stopped")


def check_unreachable_backend(target: ConformanceTarget, shared: Path) -> None:
    """With the backend unreachable, an engine starts and generates correct outputs within
    ``unreachable_deadline_s``, with zero external tokens."""
    if target.unreachable_factory is None:
        raise NotApplicable("the target gives no unreachable_factory(shared) hook")
    item = UNREACHABLE
    config = target.unreachable_config(shared)
    ref = reference(target, PROMPTS)
    engine_config(target, "kit-unreachable")  # the model is written before the clock starts
    deadline = target.unreachable_deadline_s
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            with KitEngine(target, config, item=item, engine_id="kit-unreachable") as b:
                box["outs"] = b.generate(PROMPTS, deadline_s=deadline)
        except BaseException as exc:
            box["error"] = exc

    _run_with_deadline(work, deadline, item, f"engine start + {len(PROMPTS)} short prompts")
    if "error" in box:
        error = box["error"]
        if isinstance(error, ConformanceError):
            raise error
        raise ConformanceError(item, f"raised {error!r}") from error
    outs = box["outs"]
    _expect_outputs(item, outs, ref, "engine with the backend down")
    loaded = [o.num_external_tokens for o in outs]
    if any(loaded):
        raise ConformanceError(item, f"an unreachable backend provided {loaded} tokens")


def _expect_no_hits(item: str, outs: Sequence[GenerationOutput], who: str, why: str) -> None:
    loaded = [o.num_external_tokens for o in outs]
    if any(loaded):
        raise ConformanceError(
            item,
            f"{who}: the connector provided {loaded} tokens of what engine A saved, although {why}; the "
            "block hashes carry the namespace (model, block size) and the cache salt, and the layout "
            "(ConnectorContext.spec: dtype, geometry) is the connector's to key by -- a block is only "
            "ever offered to an engine with the same namespace, salt and layout",
        )


def check_blocks_are_keyed_by_the_namespace(target: ConformanceTarget, shared: Path) -> None:
    """What engine A saved is never offered to another tenant (another cache salt), another model of the
    same geometry (other weights), or the same model in another dtype, all on one shared backend."""
    item = NAMESPACE
    _save(target, shared, item)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-salt") as b:
        outs = b.wait([b.add(p, cache_salt="kit-another-tenant") for p in PROMPTS])
        _expect_outputs(item, outs, reference(target, PROMPTS), "engine B (another cache salt)")
        _expect_no_hits(item, outs, "engine B", "its requests carry another tenant's cache salt")
    other = kit_model_dir("other")
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-model", model=other) as c:
        outs = c.generate(PROMPTS)
        _expect_outputs(item, outs, reference(target, PROMPTS, model=other), "engine C (another model)")
        _expect_no_hits(item, outs, "engine C", "it runs another model (same geometry, other weights)")
    dtype = "bfloat16" if target.engine_options.get("dtype", "float32") != "bfloat16" else "float32"
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-dtype", dtype=dtype) as d:
        outs = d.generate(PROMPTS)
        _expect_outputs(item, outs, reference(target, PROMPTS, dtype=dtype), f"engine D ({dtype})")
        _expect_no_hits(item, outs, "engine D", f"its KV cache is {dtype}, engine A's another dtype")


def check_a_hit_ends_at_the_first_missing_block(target: ConformanceTarget, shared: Path) -> None:
    """With one block of a saved prompt evicted from the backend (``evict``), a lookup offers the blocks
    before it and none after: KV past a missing block is not the prompt's prefix."""
    if target.evict is None:
        raise NotApplicable("the target gives no evict(shared, block_hash) hook")
    item = HOLES
    _save(target, shared, item)
    longest = max(range(len(PROMPTS)), key=lambda k: len(PROMPTS[k]))
    prompt = PROMPTS[longest]
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        hashes = b.block_hashes(prompt)
        target.evict(shared, hashes[1])
        rid = b.add(prompt)
        answer = b.lookup_answer(rid)
        (out,) = b.wait([rid])
        _expect_outputs(item, [out], reference(target, [prompt]), "engine B (block 1 evicted)")
        bs = b.block_size
        if not target.provides_hits:
            return
        for got, what in (
            (answer, "get_num_new_matched_tokens answered"),
            (out.num_external_tokens, "loaded"),
        ):
            if got > bs:
                raise ConformanceError(
                    item,
                    f"prompt {longest}: block 1 of {len(hashes)} was evicted, and the connector {what} {got} "
                    f"tokens; a hit is the prefix up to the first missing block: {bs} tokens (block 0) here",
                )


def check_freed_blocks_are_not_read(target: ConformanceTarget, shared: Path) -> None:
    """Engine A overwrites every block with NaN the moment the engine frees it (after request_finished
    returned ``hold=False``, or after the hold ended): a save that still reads a block then saves NaN,
    which engine B's loads show.  A connector that reads after the free must hold the blocks instead."""
    if not target.provides_hits:
        raise NotApplicable("provides_hits=False: nothing is loaded back to compare")
    import torch

    item = FREED
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-a", poison_freed=True) as a:
        _expect_outputs(item, a.generate(PROMPTS), reference(target, PROMPTS), "engine A (poisoning)")
        # The engine goes on serving (its freed blocks are reused), as engines do.
        a.generate([FILLER_PROMPT], LONG_PARAMS)
        a.drain(target.send_deadline_s, "engine A, after generating")
        computed = dict(a.freed_kv)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        rids = [b.add(p) for p in PROMPTS]
        outs = b.wait(rids)
        for i, (rid, out) in enumerate(zip(rids, outs, strict=True)):
            alloc = b.scheduler_spy.first_load(rid)
            if alloc is None:
                continue
            hashes = b.block_hashes(PROMPTS[i])
            first = alloc.num_computed_tokens // b.block_size
            for j in range(first, first + out.num_external_tokens // b.block_size):
                got = b.block_bytes(alloc.block_ids[j])
                want = computed.get(hashes[j])
                if want is None:
                    continue
                if not torch.equal(got, want):
                    nan = bool(torch.isnan(got.view(b.engine.runner.kv_cache.dtype)).any())
                    raise ConformanceError(
                        item,
                        f"prompt {i}, block {j}: engine B loaded "
                        + ("NaN" if nan else "bytes other than engine A computed")
                        + ", which engine A wrote into the block when the engine freed it: the connector "
                        "read the block after request_finished returned hold=False (an asynchronous save, "
                        "or one flushed at shutdown).  Return hold=True until the save has read the "
                        "block, and list the request in finished_sending then",
                    )
        _expect_outputs(item, outs, reference(target, PROMPTS), "engine B (loading what A saved)")


def check_nothing_is_kept_for_finished_requests(target: ConformanceTarget, shared: Path) -> None:
    """Once every request ended (finished, stopped, aborted while waiting or running) and the holds are
    over, the scheduler half keeps no state for any of them: a long-running engine serves millions of
    requests.  (``tracked_requests`` asks the target; without it the kit looks for the requests' ids.)"""
    item = RELEASED
    _save(target, shared, item)
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


def _run_with_deadline(work: Callable[[], None], deadline_s: float, item: str, what: str) -> None:
    # A daemon thread: if a call hangs on the backend, the check still ends (the thread is abandoned).
    thread = threading.Thread(target=work, name="pdkv-conformance-unreachable", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise ConformanceError(
            item,
            f"with the backend unreachable, {what} did not finish within {deadline_s:g}s: some call waited "
            "on the backend without a bound (a backend that does not answer in time counts as zero hits)",
        )
