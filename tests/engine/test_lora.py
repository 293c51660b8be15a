"""LoRA in the engine: greedy parity with transformers + peft on adapters peft writes, mixed batches,
prefix-cache isolation by adapter content, and every refusal of a folder that cannot be served."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.lora.adapter import AdapterError
from engine.lora.layers import FUSED_B_ROWS
from engine.lora.manager import AdapterUnavailable, UnknownAdapter
from engine.outputs import GenerationOutput
from tests.tiny_adapters import ADAPTERS, peft_adapter_dir, peft_greedy
from tests.tiny_models import Reference, random_prompts, tiny_model_dir

BASE = "llama"
NEW = 10
PROMPTS = random_prompts([6, 19, 35], seed=2)  # no near-tie in the references of any adapter here
GREEDY = SamplingParams(max_tokens=NEW, logprobs=True)
MIN_MARGIN = 1e-3


def make_llm(loras: dict[str, Path], **options: object) -> LLM:
    opts: dict[str, object] = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_blocks": 256}
    opts.update(options)
    return LLM(tiny_model_dir(BASE), loras=tuple((n, str(p)) for n, p in loras.items()), **opts)


def assert_equal(outs: list[GenerationOutput], refs: list[Reference]) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert ref.min_margin > MIN_MARGIN, f"prompt {i}: the reference has a near-tie"
        assert out.token_ids == ref.token_ids, f"prompt {i} diverged from peft"
        assert out.logprobs is not None
        for a, b in zip(out.logprobs, ref.logprobs, strict=True):
            assert math.isclose(a, b, abs_tol=1e-4)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_output_under_an_adapter_equals_peft(name: str) -> None:
    adapter = peft_adapter_dir(BASE, name)
    llm = make_llm({name: adapter})
    refs = peft_greedy(BASE, adapter, PROMPTS, NEW)
    assert_equal(llm.generate(PROMPTS, GREEDY, adapters=name), refs)
    # The adapter really changes the output (else parity would prove nothing).
    assert [r.token_ids for r in refs] != [r.token_ids for r in peft_greedy(BASE, None, PROMPTS, NEW)]
    llm.engine.scheduler.check_integrity()


def test_a_mixed_batch_equals_each_request_alone_and_fewer_slots_than_adapters_wait() -> None:
    a, b = peft_adapter_dir(BASE, "r16"), peft_adapter_dir(BASE, "attn_only")
    refs = {
        None: peft_greedy(BASE, None, PROMPTS, NEW),
        "A": peft_greedy(BASE, a, PROMPTS, NEW),
        "B": peft_greedy(BASE, b, PROMPTS, NEW),
    }
    order: list[str | None] = [None, "A", "B", "A", "B", None]
    prompts = [PROMPTS[i % 3] for i in range(len(order))]
    for max_loras in (2, 1):  # with one slot, B's requests wait until A's are done
        llm = make_llm({"A": a, "B": b}, max_loras=max_loras)
        outs = llm.generate(prompts, GREEDY, adapters=order)
        assert_equal(outs, [refs[name][i % 3] for i, name in enumerate(order)])
        llm.engine.scheduler.check_integrity()


def test_long_prefill_chunks_mixed_with_other_adapters_equal_peft() -> None:
    """Chunks of more than FUSED_B_ROWS rows take the per-part path; mixed, they are masked too."""
    a, b = peft_adapter_dir(BASE, "r16"), peft_adapter_dir(BASE, "patterns")
    assert FUSED_B_ROWS < 150
    long = random_prompts([150, 170], seed=3)
    llm = make_llm({"A": a, "B": b})
    outs = llm.generate([*long, PROMPTS[0]], GREEDY, adapters=["A", "B", None])
    refs = [*peft_greedy(BASE, a, long[:1], NEW), *peft_greedy(BASE, b, long[1:], NEW)]
    assert_equal(outs, [*refs, *peft_greedy(BASE, None, PROMPTS[:1], NEW)])
    fresh = random_prompts([160], seed=5)
    alone = llm.generate(fresh, GREEDY, adapters="A")  # a long chunk of one adapter: no mask
    assert_equal(alone, peft_greedy(BASE, a, fresh, NEW))


def test_chunked_prefill_and_prefix_hits_under_an_adapter() -> None:
    a = peft_adapter_dir(BASE, "all_linear")
    llm = make_llm({"A": a}, max_num_batched_tokens=8)  # 35 tokens: five chunks
    shared = PROMPTS[2]
    [first] = llm.generate([shared], GREEDY, adapters="A")
    [again] = llm.generate([shared], GREEDY, adapters="A")
    assert again.num_cached_tokens == 32  # every whole block but the one holding the last token
    assert_equal([first, again], peft_greedy(BASE, a, [shared, shared], NEW))


def test_an_adapters_kv_is_never_another_adapters_or_the_base_models() -> None:
    a, b = peft_adapter_dir(BASE, "r16"), peft_adapter_dir(BASE, "r16", seed=1)
    llm = make_llm({"A": a, "B": b, "tenant": a})
    prompt = PROMPTS[2]
    [warm] = llm.generate([prompt], GREEDY, adapters="A")
    assert warm.num_cached_tokens == 0
    for other in (None, "B"):
        [out] = llm.generate([prompt], GREEDY, adapters=other)
        assert out.num_cached_tokens == 0, other
    # An adapter named like a tenant's salt is not that tenant (another tag in the hash).
    out = llm.engine.add_request("salted", prompt, GREEDY, cache_salt="A")
    assert out.block_hashes[0] != llm.engine.add_request("named", prompt, GREEDY, adapter="A").block_hashes[0]
    for rid in ("salted", "named"):
        llm.engine.abort_request(rid)
    # Other weights loaded under the same name: a new identity, so the old KV is never hit.
    old = llm.engine.lora.resolve("A")
    new = llm.engine.lora.add("A", b)
    assert new != old and new.name == old.name
    [reloaded] = llm.generate([prompt], GREEDY, adapters="A")
    assert reloaded.num_cached_tokens == 0
    assert_equal([reloaded], peft_greedy(BASE, b, [prompt], NEW))
    # The same weights under another folder are the same adapter: the digest is of the content.
    copy = Path(shutil.copytree(a, a.parent / "copy-of-r16", dirs_exist_ok=True))
    assert llm.engine.lora.add("C", copy).digest == old.digest


def test_an_unknown_adapter_is_refused_and_an_unloaded_one_lets_its_requests_finish() -> None:
    a = peft_adapter_dir(BASE, "r4")
    llm = make_llm({"A": a})
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded"):
        llm.engine.add_request("x", PROMPTS[0], GREEDY, adapter="nope")
    running = llm.engine.add_request("running", PROMPTS[1], GREEDY, adapter="A")
    tokens = [t for out in llm.engine.step() for t in out.new_token_ids]
    llm.engine.lora.remove("A")
    with pytest.raises(UnknownAdapter):
        llm.engine.add_request("late", PROMPTS[0], GREEDY, adapter="A")
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens += out.new_token_ids
    assert tokens == peft_greedy(BASE, a, [PROMPTS[1]], NEW)[0].token_ids
    assert running.is_finished
    plain = make_llm({})
    with pytest.raises(UnknownAdapter, match="serves no adapters"):
        plain.engine.add_request("x", PROMPTS[0], GREEDY, adapter="A")


def test_a_request_admitted_under_a_replaced_or_unloaded_identity_runs_on_its_weights() -> None:
    """An outside probe through P/D: an adapter replaced or unloaded while a request ran failed the
    request's later parts -- its decode phase, its next choices -- which reach the nodes after the change
    and resolved the name anew ("adapter 'A' is not loaded").  A request names the identity it was
    admitted with (name and digest): one this engine has served runs on those weights; the name alone
    resolves to what is served now, and an unloaded name without a digest is refused."""
    a, b = peft_adapter_dir(BASE, "r4"), peft_adapter_dir(BASE, "r16")
    llm = make_llm({"A": a})
    engine = llm.engine

    def run(rid: str, adapter: str, digest: bytes | None = None) -> list[int]:
        engine.add_request(rid, PROMPTS[1], GREEDY, adapter=adapter, adapter_digest=digest)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    old = engine.lora.resolve("A")
    with_a, with_b = (peft_greedy(BASE, f, [PROMPTS[1]], NEW)[0].token_ids for f in (a, b))
    new = engine.lora.add("A", b)  # replaced
    assert run("admitted-before", "A", old.digest) == with_a
    assert run("admitted-after", "A", new.digest) == run("by-name", "A") == with_b
    engine.lora.remove("A")  # unloaded
    assert run("admitted-before-unload", "A", new.digest) == with_b
    with pytest.raises(UnknownAdapter, match="'A' is not loaded"):
        engine.add_request("late", PROMPTS[0], GREEDY, adapter="A")
    with pytest.raises(UnknownAdapter):  # a digest never served here under the name
        engine.add_request("other", PROMPTS[0], GREEDY, adapter="A", adapter_digest=b"\x01" * len(old.digest))
    assert [a.id for a in engine.lora.adapters()] == []  # served: nothing; /v1/models lists nothing


def test_adapters_beyond_max_cpu_loras_are_read_again_and_refused_if_changed(tmp_path: Path) -> None:
    names = ["r4", "attn_only", "patterns"]
    folders = {n: Path(shutil.copytree(peft_adapter_dir(BASE, n), tmp_path / n)) for n in names}
    llm = make_llm(folders, max_loras=1, max_cpu_loras=1)
    for n in names:
        [out] = llm.generate([PROMPTS[0]], GREEDY, adapters=n)
        assert out.token_ids == peft_greedy(BASE, folders[n], [PROMPTS[0]], NEW)[0].token_ids
    shutil.copy(peft_adapter_dir(BASE, "r4", seed=3) / "adapter_model.safetensors", folders["r4"])
    with pytest.raises(AdapterUnavailable, match="changed since it was loaded") as changed:
        llm.generate([PROMPTS[0]], GREEDY, adapters="r4")
    assert str(tmp_path) not in str(changed.value)  # a client reads it: no server path
    shutil.rmtree(folders["r4"])  # still out of memory, and now gone: refused as well
    with pytest.raises(AdapterUnavailable, match="cannot be read again"):
        llm.generate([PROMPTS[0]], GREEDY, adapters="r4")
    [out] = llm.generate([PROMPTS[0]], GREEDY, adapters="patterns")  # the others serve on
    assert out.token_ids == peft_greedy(BASE, folders["patterns"], [PROMPTS[0]], NEW)[0].token_ids


# ---- refusals ------------------------------------------------------------------------------------------


def _edited(tmp_path: Path, **config: object) -> Path:
    folder = Path(shutil.copytree(peft_adapter_dir(BASE, "r4"), tmp_path / "edited", dirs_exist_ok=True))
    raw = json.loads((folder / "adapter_config.json").read_text())
    raw.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules includes 'lm_head'"),
        ({"r": 0}, "r must be a positive integer"),
        ({"rank_pattern": {"q_proj": 8}}, "has shape"),
        # An outside probe's find: PEFT fields that change the output, accepted and dropped (aLoRA's
        # invocation tokens gave other text under peft, the same as plain LoRA here)
        ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
        ({"use_qalora": True}, "use_qalora"),
        ({"use_bdlora": {"block": 2}}, "use_bdlora"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"layers_pattern": "h"}, "layers_pattern"),
        ({"a_future_switch": 3}, "a_future_switch"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_naming_the_field(
    tmp_path: Path, config: dict[str, object], field: str
) -> None:
    match = field if " " in field else f"{field}="
    with pytest.raises(AdapterError, match=match):
        make_llm({"bad": _edited(tmp_path, **config)})
    # Loaded at run time, the same refusal: nothing is served under the name.
    llm = make_llm({}, enable_lora=True)
    with pytest.raises(AdapterError, match=match):
        llm.engine.lora.add("bad", _edited(tmp_path, **config))
    with pytest.raises(UnknownAdapter):
        llm.engine.lora.resolve("bad")


def test_keys_that_leave_inference_alone_or_switch_nothing_on_are_served(tmp_path: Path) -> None:
    """What peft writes for a plain LoRA (its defaults, metadata, training-only settings) loads, with the
    same identity as without those keys."""
    from peft import LoraConfig

    defaults = LoraConfig(target_modules=["q_proj"]).to_dict()
    inert = {k: v for k, v in defaults.items() if k not in ("target_modules", "peft_type", "r", "lora_alpha")}
    inert.update(lora_dropout=0.1, init_lora_weights="gaussian", peft_version="9.9", a_future_switch=None)
    llm = make_llm({}, enable_lora=True)
    plain = llm.engine.lora.add("plain", peft_adapter_dir(BASE, "r4"))
    edited = llm.engine.lora.add("edited", _edited(tmp_path, **json.loads(json.dumps(inert, default=list))))
    assert edited.digest == plain.digest


def test_an_adapter_with_a_non_finite_weight_is_refused_naming_it(tmp_path: Path) -> None:
    """A NaN (or inf) in one LoRA matrix would make every output of its module NaN -- served as garbage
    text, or a logprob JSON cannot carry (an outside probe's find): refused at load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    folder = _edited(tmp_path)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    llm = make_llm({}, enable_lora=True)
    with pytest.raises(AdapterError, match=r"lora_B.* has values that are not finite"):
        llm.engine.lora.add("nan", folder)
    with pytest.raises(UnknownAdapter):
        llm.engine.lora.resolve("nan")


def test_rank_above_the_limit_wrong_shapes_and_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="max_lora_rank 8"):
        make_llm({"big": peft_adapter_dir(BASE, "r16")}, max_lora_rank=8)
    other_model = peft_adapter_dir("llama_hd32", "r4")
    with pytest.raises(AdapterError, match="made for another model"):
        make_llm({"other": other_model})
    folder = _edited(tmp_path)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(weights))
    with pytest.raises(AdapterError, match="is missing"):
        make_llm({"dropped": folder})
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match="truncated"):
        make_llm({"cut": folder})
    weights.unlink()
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is missing"):
        make_llm({"gone": folder})
    with pytest.raises(AdapterError, match="does not exist"):
        make_llm({"nowhere": tmp_path / "nowhere"})
    with pytest.raises(AdapterError, match="printable"):
        make_llm({"a name": peft_adapter_dir(BASE, "r4")})
