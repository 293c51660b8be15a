"""Steps the checks share: engine A saving the kit's prompts, outputs compared with an engine without a
connector, lookups' answers checked, loaded bytes compared with what engine A computed, and lookups that
must offer nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from connectors.testing.harness import KitEngine, max_hit_tokens
from connectors.testing.items import (
    ConformanceError,
)
from connectors.testing.reference import reference
from connectors.testing.target import ConformanceTarget
from connectors.testing.workload import (
    PROMPTS,
)
from engine.outputs import GenerationOutput
from engine.sampling_params import SamplingParams

LONG_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# The engine's hold (and stop) timeout when the kit checks that the connector itself ends its holds.


LONG_HOLD_S = 600.0


# The longest a whole check may run (a correct connector's checks take well under a second each).


def expect_outputs(
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


def save(
    target: ConformanceTarget, shared: Path, item: str, *, snapshot: bool = False, **options: Any
) -> dict[bytes, Any]:
    """Engine A generates the kit's prompts with the connector; returns A's prompt blocks if asked."""
    with KitEngine(target, target.config(shared), item=item, engine_id="kit-a", **options) as a:
        expect_outputs(item, a.generate(PROMPTS), reference(target, PROMPTS), "engine A (saving)")
        a.drain(target.send_deadline_s, "engine A, after generating")
        blocks: dict[bytes, Any] = {}
        if snapshot:
            for prompt in PROMPTS:
                hashes = a.block_hashes(prompt)
                for h in hashes[: max_hit_tokens(len(prompt), len(hashes), a.block_size) // a.block_size]:
                    blocks[h] = a.cached_block_bytes(h)
        return blocks


def check_answers(item: str, kit: KitEngine) -> None:
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


def expect_loaded_bytes(
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


def offered_nothing(
    item: str, kit: KitEngine, prompts: Sequence[Sequence[int]], who: str, why: str, **add: Any
) -> list[GenerationOutput]:
    """Run ``prompts`` on ``kit``, failing if the connector *offers* any of what engine A saved.  The
    verdict rests on the lookup's answers, which depend only on what the backend holds, not on whether
    a load of the wrong bytes then fails or in what order things happen."""
    rids = [kit.add(p, **add) for p in prompts]
    offered = [kit.lookup_answer(rid) for rid in rids]
    outs = kit.wait(rids)
    expect_no_hits(item, offered, who, why, "offered")
    expect_no_hits(item, [o.num_external_tokens for o in outs], who, why, "provided")
    return outs


def expect_no_hits(item: str, tokens: Sequence[int], who: str, why: str, verb: str) -> None:
    if any(tokens):
        raise ConformanceError(
            item,
            f"{who}: the connector {verb} {list(tokens)} tokens of what engine A saved, although {why}; the "
            "block hashes (Request.block_hashes: key by them, never hash the tokens again) carry the "
            "namespace (model, block size), the cache salt and the LoRA adapter, and the layout "
            "(ConnectorContext.spec: dtype, geometry) is the connector's to key by -- a block is only "
            "ever offered to an engine with the same namespace, salt, adapter and layout",
        )


def call_hook(item: str, name: str, hook: Callable[[], object]) -> None:
    """Run one of the target's hooks; what it raises fails the check by name (a hook that finds nothing
    to damage or evict usually means the connector had not saved by the time its requests ended)."""
    try:
        hook()
    except Exception as exc:
        raise ConformanceError(
            item,
            f"the target's {name} hook raised {exc!r} after engine A's requests ended and its holds were "
            "over; if it found nothing stored, the connector had not saved by then (a save must have read "
            "its blocks by the time request_finished returns hold=False, or the hold ends)",
        ) from exc
