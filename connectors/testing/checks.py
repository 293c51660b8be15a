"""The contract checks.  Each takes the target and an empty directory, drives real engines, and raises
``ConformanceError("[contract item] what happened")`` on a violation -- and when it needs a hook the
target does not give, saying what to add: no check is ever skipped.

Most checks start the same way: engine A, with the connector, generates the kit's prompts (saving their
KV), then a fresh engine B with the same backend works from what A left.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from connectors.testing.adapter import ADAPTER_NAME, adapter_options
from connectors.testing.harness import KitEngine, kit_model_dir, max_hit_tokens
from connectors.testing.items import (
    FREED,
    HOLES,
    LOAD_ERRORS,
    LOADS,
    LOOKUP,
    NAMESPACE,
    NONE_ANSWER,
    WHOLE_BLOCKS,
    ConformanceError,
)
from connectors.testing.reference import reference
from connectors.testing.steps import (
    LONG_PARAMS,
    call_hook,
    check_answers,
    expect_loaded_bytes,
    expect_outputs,
    offered_nothing,
    save,
)
from connectors.testing.target import ConformanceTarget
from connectors.testing.workload import (
    BLOCK_SIZE,
    EXACT_MULTIPLE,
    FILLER_PROMPT,
    FORKS,
    PROMPTS,
)
from engine.sampling_params import SamplingParams


def check_lookups_are_idempotent(target: ConformanceTarget, shared: Path) -> None:
    """Asking again gives the same answer, and asking changes nothing: not what the engine later loads,
    not what another engine is told."""
    item = LOOKUP
    save(target, shared, item)
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
        expect_outputs(item, outs, ref, "engine B (after repeated lookups)")
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
    save(target, shared, item)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        bs = b.block_size
        rids = [b.add(p) for p in PROMPTS]
        answers = {(rid, nc): b.lookup_answer(rid, nc) for rid in rids for nc in (0, bs, 2 * bs)}
        check_answers(item, b)
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
        check_answers(item, b)  # the engine's own lookups, too


def check_none_is_followed_by_an_answer(target: ConformanceTarget, shared: Path) -> None:
    """A lookup may answer None ("still looking") while its backend works; a number must follow within
    ``lookup_deadline_s``, and the request then runs normally."""
    item = NONE_ANSWER
    save(target, shared, item)
    ref = reference(target, PROMPTS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        # Every step loop of the kit fails a request told None for longer than lookup_deadline_s.
        rids = [b.add(p) for p in PROMPTS]
        b.wait(rids, deadline_s=target.lookup_deadline_s + 60)
        expect_outputs(item, [b.results[r] for r in rids], ref, "engine B")


def check_loads_reproduce_saved_kv(target: ConformanceTarget, shared: Path) -> None:
    """Engine B loads every block but the tail's from the connector, byte for byte what engine A computed,
    computes only the tail, and generates what an engine without a connector generates.  Engine C first
    caches a prompt's first blocks itself (a fork): the connector then provides the blocks after that
    local hit, into the blocks after it."""
    item = LOADS
    saved = save(target, shared, item, snapshot=True)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        bs = b.block_size
        rids = [b.add(p) for p in PROMPTS]
        outs = b.wait(rids)
        expect_outputs(item, outs, reference(target, PROMPTS), "engine B (loading)")
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
            expect_loaded_bytes(item, b, rid, hashes, saved, f"prompt {i}")
    # A local hit first: a fork of the longest prompt puts its first two blocks in engine C's own cache,
    # then the prompt itself must take those two locally and the rest -- only the rest -- from the
    # connector, into the blocks after the local hit.
    longest = max(range(len(PROMPTS)), key=lambda k: len(PROMPTS[k]))
    prompt = PROMPTS[longest]
    fork = FORKS[[p for p in PROMPTS if len(p) > 2 * BLOCK_SIZE].index(prompt)]
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-c") as c:
        expect_outputs(item, c.generate([fork]), reference(target, [fork]), "engine C (a fork)")
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
        expect_loaded_bytes(item, c, rid, hashes, saved, f"prompt {longest} after a local hit")
        expect_outputs(item, [out], reference(target, [prompt]), "engine C (after a local hit)")


def check_load_errors_are_reported(target: ConformanceTarget, shared: Path) -> None:
    """After ``corrupt(shared)``, damaged blocks are load errors (the engine recomputes) or misses: no
    exception, no failed request, correct outputs, and nothing damaged left in the local cache."""
    item = LOAD_ERRORS
    missing = target.missing_hook("corrupt")
    if missing is not None:
        raise ConformanceError(item, missing)
    save(target, shared, item)
    if target.corrupt is not None:
        call_hook(item, "corrupt(shared)", lambda: target.corrupt(shared))  # type: ignore[misc]
    ref = reference(target, PROMPTS)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        # First, forks of the damaged prompts: their shared blocks fail to load, and the blocks computed
        # in that step attended to damaged KV -- a connector must not save them (engine C checks).
        expect_outputs(item, b.generate(FORKS), reference(target, FORKS), "engine B, forks of the prompts")
        outs = b.generate(PROMPTS)
        for i, out in enumerate(outs):
            if out.finish_reason == "error":
                raise ConformanceError(
                    item,
                    f"prompt {i} failed ({out.error}): a damaged block must be reported through "
                    "get_block_ids_with_load_errors (the engine then recomputes from it), not raised",
                )
        expect_outputs(item, outs, ref, "engine B (damaged backend)")
        loaded = sum(o.num_external_tokens for o in outs)
        if loaded and not b.engine.stats().counter("kv_load_failures"):
            raise ConformanceError(
                item,
                f"after corrupt(), engine B loaded {loaded} tokens and reported no load error: a damaged "
                "block must be detected (a checksum) and reported, or be a miss",
            )
        expect_outputs(item, b.generate(PROMPTS), ref, "engine B, second run (from its local cache)")
        b.drain(target.send_deadline_s, "engine B, after the failed loads")
        b.assert_no_leak("failed loads")
    # Whatever engine B saved or replaced after its failed loads must be right.
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-c") as c:
        expect_outputs(
            item,
            c.generate([*PROMPTS, *FORKS]),
            reference(target, [*PROMPTS, *FORKS]),
            "engine C, after engine B recovered (were blocks computed over a failed load saved?)",
        )


def check_blocks_are_keyed_by_the_namespace(target: ConformanceTarget, shared: Path) -> None:
    """What engine A saved is never offered to another tenant (another cache salt), another model of the
    same geometry (other weights), the same model in another dtype, or the same model under a LoRA
    adapter, all on one shared backend."""
    item = NAMESPACE
    save(target, shared, item)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-salt") as b:
        why = "its requests carry another tenant's cache salt"
        outs = offered_nothing(item, b, PROMPTS, "engine B", why, cache_salt="kit-another-tenant")
        expect_outputs(item, outs, reference(target, PROMPTS), "engine B (another cache salt)")
    other = kit_model_dir("other")
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-model", model=other) as c:
        why = "it runs another model (same geometry, other weights)"
        outs = offered_nothing(item, c, PROMPTS, "engine C", why)
        expect_outputs(item, outs, reference(target, PROMPTS, model=other), "engine C (another model)")
    dtype = "bfloat16" if target.engine_options.get("dtype", "float32") != "bfloat16" else "float32"
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-dtype", dtype=dtype) as d:
        why = f"its KV cache is {dtype}, engine A's another dtype (ConnectorContext.spec.dtype)"
        outs = offered_nothing(item, d, PROMPTS, "engine D", why)
        expect_outputs(item, outs, reference(target, PROMPTS, dtype=dtype), f"engine D ({dtype})")
    # An outside probe's find: a connector that hashed the tokens again without the adapter served the base
    # model's KV to an adapter's requests (other tokens, no error), and this check passed it.
    lora = adapter_options()
    try:
        want = reference(target, PROMPTS, adapter=ADAPTER_NAME, **lora)
    except ValueError:  # the target's engine serves no adapters here (bfloat16, deterministic, no native
        return  # LoRA kernel): there is no adapter's KV to keep apart
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-adapter", **lora) as e:
        why = f"its requests run LoRA adapter {ADAPTER_NAME!r} (Request.block_hashes carry it)"
        outs = offered_nothing(item, e, PROMPTS, "engine E", why, adapter=ADAPTER_NAME)
        expect_outputs(item, outs, want, f"engine E (adapter {ADAPTER_NAME!r})")


def check_a_hit_ends_at_the_first_missing_block(target: ConformanceTarget, shared: Path) -> None:
    """With one block of a saved prompt missing from the backend, a lookup offers the blocks before it
    and none after: KV past a missing block is not the prompt's prefix.  The kit makes the hole itself:
    engine A's request carries a decoy hash for block 1, so the connector saves every block of the prompt
    but that one under the prompt's keys (with ``evict``, the kit also evicts a block)."""
    item = HOLES
    longest = max(range(len(PROMPTS)), key=lambda k: len(PROMPTS[k]))
    prompt = PROMPTS[longest]
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-a") as a:
        hashes = a.block_hashes(prompt)
        decoy = hashlib.sha256(b"pdkv-conformance-hole" + hashes[1]).digest()[: len(hashes[1])]
        (out,) = a.wait([a.add(prompt, decoys={1: decoy})])
        expect_outputs(item, [out], reference(target, [prompt]), "engine A (block 1 under a decoy key)")
        a.drain(target.send_deadline_s, "engine A, after generating")
    _expect_hole(target, shared, prompt, 1, f"prompt {longest}: block 1 of {len(hashes)} was never saved")
    if target.evict is not None:
        save(target, shared, item)
        call_hook(item, "evict(shared, block_hash)", lambda: target.evict(shared, hashes[2]))  # type: ignore[misc]
        _expect_hole(target, shared, prompt, 2, f"prompt {longest}: block 2 of {len(hashes)} was evicted")


def _expect_hole(
    target: ConformanceTarget, shared: Path, prompt: Sequence[int], hole: int, what: str
) -> None:
    """Engine B asks for ``prompt``, whose block ``hole`` the backend lacks: at most the blocks before."""
    item = HOLES
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        rid = b.add(prompt)
        answer = b.lookup_answer(rid)
        (out,) = b.wait([rid])
        expect_outputs(item, [out], reference(target, [prompt]), f"engine B ({what})")
        if not target.provides_hits:
            return
        bs = b.block_size
        for got, verb in (
            (answer, "get_num_new_matched_tokens answered"),
            (out.num_external_tokens, "loaded"),
        ):
            if got > hole * bs:
                raise ConformanceError(
                    item,
                    f"{what}, and the connector {verb} {got} tokens; a hit is the prefix up to the first "
                    f"missing block: at most {hole * bs} tokens (blocks before it) here.  Stop counting at "
                    "the first block the backend does not hold",
                )


ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def check_freed_blocks_are_not_read(target: ConformanceTarget, shared: Path) -> None:
    """Engine A overwrites every block with NaN the moment the engine frees it (after request_finished
    returned ``hold=False``, or after the hold ended) and keeps it so for ``save_settle_s``: a save that
    still reads a block then saves NaN; after that the engine reuses the blocks, and a later read saves
    another request's KV.  Engine B then loads every saved block and compares it with what engine A
    computed.  A connector that reads after the free must hold the blocks instead."""
    import torch

    item = FREED
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-a", poison_freed=True) as a:
        # One output token each: a request ends in the very step that computed (and saved) its prompt
        # blocks, so the engine frees and poisons them at once -- a copy made any later reads poison,
        # however fast or slow the host runs the steps.
        ref = reference(target, PROMPTS, ONE_TOKEN)
        expect_outputs(item, a.generate(PROMPTS, ONE_TOKEN), ref, "engine A (poisoning)")
        a.settle(target.save_settle_s)  # a late save runs now, and reads the poison
        # The engine goes on serving (its freed blocks are reused), as engines do.
        a.generate([FILLER_PROMPT], LONG_PARAMS)
        a.drain(target.send_deadline_s, "engine A, after generating")
        computed = dict(a.freed_kv)
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-b") as b:
        rids = [b.add(p) for p in PROMPTS]
        outs = b.wait(rids)
        for i, (rid, out) in enumerate(zip(rids, outs, strict=True)):
            alloc = b.scheduler_spy.first_load(rid)
            hashes = b.block_hashes(PROMPTS[i])
            if not target.provides_hits:
                if out.num_external_tokens:
                    raise ConformanceError(item, f"provides_hits=False, yet prompt {i} loaded tokens")
                continue
            if alloc is None or not out.num_external_tokens:
                if max_hit_tokens(len(PROMPTS[i]), len(hashes), b.block_size) == 0:
                    continue  # nothing of it can be a hit
                raise ConformanceError(
                    item,
                    f"prompt {i}: engine B found nothing of what engine A saved, {target.save_settle_s:g}s "
                    "after A's requests ended and after A shut down: a save must have read its blocks by "
                    "the time request_finished returns hold=False (or the hold ends), so what it saved "
                    "can be compared with what A computed",
                )
            first = alloc.num_computed_tokens // b.block_size
            for j in range(first, first + out.num_external_tokens // b.block_size):
                got = b.block_bytes(alloc.block_ids[j])
                want = computed.get(hashes[j])
                if want is None:
                    continue
                if not torch.equal(got, want):
                    if bool(torch.isnan(got.view(b.engine.runner.kv_cache.dtype)).any()):
                        raise ConformanceError(
                            item,
                            f"prompt {i}, block {j}: engine B loaded NaN, which engine A wrote into the "
                            "block when the engine freed it: the connector read the block after "
                            "request_finished returned hold=False (an asynchronous save, or one flushed at "
                            "shutdown).  Return hold=True until the save has read the block, and list the "
                            "request in finished_sending then",
                        )
                    raise ConformanceError(  # not the poison: the bytes were wrong when stored or loaded
                        item,
                        f"prompt {i}, block {j}: engine B loaded bytes other than engine A computed for "
                        "that block (and not the NaN A wrote into freed blocks): the connector stored or "
                        "loaded the wrong bytes -- another block's, a partly written one, or under another "
                        "key",
                    )
        expect_outputs(item, outs, reference(target, PROMPTS), "engine B (loading what A saved)")
