"""Deterministic mode (engine/determinism.py): in bfloat16, a request's tokens *and* logprobs are the same
bits alone or in any batch, at any chunk size and thread count, from a prefix hit or a recompute, and from
every store tier; seeded sampling draws the same tokens.  And the switch is refused by name where it
cannot be served, and it is part of the KV's namespace.

The model has SmolLM2-135M's layer shapes (two layers): its down projection [1536 -> 576] is one oneDNN
blocks by the row count on the CPUs measured, so the K pieces are exercised wherever this host needs them.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.cpu_features import bf16_kernels_cpu
from engine.determinism import DeterminismUnavailable, kv_fingerprint
from engine.llm import LLM
from engine.model import batch_invariance
from engine.model.batch_invariance import k_pieces
from engine.model.packed import PackedLinear, can_pack
from engine.native import native_kernels
from engine.sampling_params import SamplingParams
from tests.factories import store_tier_spec
from tests.tiny_models import tiny_model_dir

needs_bf16 = pytest.mark.skipif(not bf16_kernels_cpu(), reason="needs AVX-512 or AVX2 (the bfloat16 kernels)")
# the plan for oneDNN's packed matmuls (the fallback where the native linears are not built): its bfloat16
# needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
needs_onednn_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN bfloat16 is not available on this CPU"
)

MODEL = "llama_smol_shapes"
VOCAB = 320
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1234, logprobs=True)


def make(**options: Any) -> LLM:
    opts: dict[str, Any] = {
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 2048,
        "max_num_seqs": 64,
        "deterministic": True,
    }
    opts.update(options)
    return LLM(tiny_model_dir(MODEL), **opts)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(length)]


def bits(out: Any) -> tuple[Any, ...]:
    """What must be equal: the tokens, their logprobs and the top logprobs, exactly."""
    return (out.token_ids, out.logprobs, out.top_logprobs)


def alone(llm: LLM, p: list[int], params: SamplingParams = GREEDY) -> tuple[Any, ...]:
    assert llm.engine.reset_prefix_cache()
    [out] = llm.generate([p], params)
    return bits(out)


def in_batch(llm: LLM, p: list[int], companions: list[list[int]], at: int, params: SamplingParams) -> Any:
    assert llm.engine.reset_prefix_cache()
    batch = [*companions[:at], p, *companions[at:]]
    return bits(llm.generate(batch, params)[at])


@pytest.fixture(scope="module")
def det() -> LLM:
    if not bf16_kernels_cpu():
        pytest.skip("needs a CPU with AVX-512 or AVX2 (the bfloat16 kernels)")
    llm = make()
    assert llm.engine.determinism.on, llm.engine.determinism.note
    return llm


@needs_bf16
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-t0.8"])
def test_alone_equals_every_batch(det: LLM, params: SamplingParams) -> None:
    rng = random.Random(7)
    probe = prompt(rng, 150)
    expected = alone(det, probe, params)
    assert len(expected[0]) == 12
    for size in (2, 3, 8, 17, 33, 64):
        companions = [prompt(rng, rng.randrange(5, 300)) for _ in range(size - 1)]
        got = in_batch(det, probe, companions, rng.randrange(size), params)
        assert got == expected, f"batch of {size}"


@needs_bf16
def test_joining_a_running_batch_mid_decode(det: LLM) -> None:
    """The probe arrives while others decode: its prefill shares steps with their decodes."""
    rng = random.Random(8)
    probe = prompt(rng, 200)
    expected = alone(det, probe)
    assert det.engine.reset_prefix_cache()
    engine = det.engine
    for i in range(12):
        engine.add_request(f"bg-{i}", prompt(rng, rng.randrange(20, 200)), SamplingParams(max_tokens=40))
    for _ in range(5):
        engine.step()
    engine.add_request("probe", probe, GREEDY)
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "probe":
                outputs.setdefault("probe", []).append(out)
    [final] = det.generate([probe], GREEDY)  # the same once more, now a prefix hit
    assert bits(final) == expected
    assert [t for o in outputs["probe"] for t in o.new_token_ids] == expected[0]
    assert [lp for o in outputs["probe"] for lp in o.new_logprobs] == expected[1]


@needs_bf16
@pytest.mark.parametrize("chunk", [16, 64, 256, 2048])
def test_chunk_sizes(chunk: int) -> None:
    rng = random.Random(9)
    probe = prompt(rng, 1500)
    reference = make(max_num_batched_tokens=2048)
    expected = alone(reference, probe)
    llm = make(max_num_batched_tokens=chunk, max_model_len=4096)
    assert llm.engine.determinism.on
    assert alone(llm, probe) == expected
    companions = [prompt(rng, rng.randrange(100, 900)) for _ in range(5)]
    assert in_batch(llm, probe, companions, 2, GREEDY) == expected


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_thread_counts(threads: int) -> None:
    rng = random.Random(10)
    probe = prompt(rng, 300)
    companions = [prompt(rng, rng.randrange(10, 300)) for _ in range(9)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = alone(make(), probe)
        torch.set_num_threads(threads)
        llm = make()
        assert llm.engine.determinism.on
        assert alone(llm, probe) == expected
        assert in_batch(llm, probe, companions, 4, GREEDY) == expected
    finally:
        torch.set_num_threads(before)


@needs_bf16
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-t0.8"])
def test_a_resumed_stream_continues_as_the_uninterrupted_one(det: LLM, params: SamplingParams) -> None:
    """What a decode node does when it takes over a stream whose node died: prefill the prompt and the
    output so far in one chunk (a fresh cache, other requests beside it), then decode on."""
    rng = random.Random(14)
    probe = prompt(rng, 90)
    tokens, logprobs, _ = alone(det, probe, dataclasses.replace(params, max_tokens=24))
    for cut in (1, 5, 17):
        assert det.engine.reset_prefix_cache()
        rest = dataclasses.replace(params, max_tokens=24 - cut)
        companions = [prompt(rng, rng.randrange(10, 120)) for _ in range(4)]
        # as the router resumes it: the output so far ends the prompt (seeded draws count it)
        engine = det.engine
        engine.add_request("resumed", probe + tokens[:cut], rest, prior_output_token_ids=tokens[:cut])
        for i, c in enumerate(companions):
            engine.add_request(f"c{i}", c, GREEDY)
        new_tokens: list[int] = []
        new_logprobs: list[float] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "resumed":
                    new_tokens += out.new_token_ids
                    new_logprobs += out.new_logprobs
        assert new_tokens == tokens[cut:], cut
        assert new_logprobs == logprobs[cut:], cut


@needs_bf16
def test_prefix_hit_equals_recompute(det: LLM) -> None:
    rng = random.Random(11)
    shared = prompt(rng, 160)  # 10 whole blocks
    full = shared + prompt(rng, 37)
    expected = alone(det, full)  # computed from scratch
    assert det.engine.reset_prefix_cache()
    det.generate([shared], GREEDY)  # its blocks now cached
    [out] = det.generate([full], GREEDY)
    assert out.num_cached_tokens == 160
    assert bits(out) == expected


def _offload(spec: str) -> KVConnectorConfig:
    return KVConnectorConfig("offload", {"kv_store": spec, "lookup_timeout_s": 5.0})


@needs_bf16
@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "remote"])
def test_loaded_from_each_tier_equals_recompute(
    det: LLM, tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(12)
    probe = prompt(rng, 170)
    companions = [prompt(rng, rng.randrange(10, 200)) for _ in range(6)]
    expected = alone(det, probe)
    spec = store_tier_spec(tier, tmp_path, request)
    writer = make(kv_connector=_offload(spec))
    writer.generate([*companions[:3], probe], GREEDY)  # computed in a batch, saved to the tier
    assert writer.engine.drain(20.0)
    reader = make(kv_connector=_offload(spec))
    outs = reader.generate([*companions[3:], probe], GREEDY)  # loaded, in another batch
    assert outs[-1].num_external_tokens == 160
    assert bits(outs[-1]) == expected
    for llm in (writer, reader):
        llm.engine.shutdown()


def test_the_namespace_names_the_dot_products_form_outside_deterministic_mode() -> None:  # every host
    """The bfloat16 kernels' dot products in their three forms (engine/csrc/simd.h: vdpbf16ps, FMAs on
    AVX-512, FMAs on AVX2's halves) give the same bits in deterministic mode, denormals flushed in each
    (tests/engine/test_bf16_forms.py): one namespace.  Outside it the decode attention has a kernel of
    each form: the form is named.  Scalar loops (no vector code) and torch's kernels are their own."""
    bf16 = torch.bfloat16
    det = "m;kv=bfloat16;deterministic;denormals=flushed"
    for form in (1, 2, 3):
        assert kv_fingerprint("m", bf16, True, bf16_dot=form) == det
    assert kv_fingerprint("m", bf16, False, bf16_dot=1) == "m;kv=bfloat16;denormals=flushed"
    assert kv_fingerprint("m", bf16, False, quantized=True, bf16_dot=2) == (
        "m;kv=bfloat16;bf16dot=fma;denormals=flushed;weights=quantized;activations=int16/32639"
    )
    assert kv_fingerprint("m", bf16, False, bf16_dot=3) == "m;kv=bfloat16;bf16dot=avx2;denormals=flushed"
    assert (
        kv_fingerprint("m", bf16, True, bf16_dot=0)
        == "m;kv=bfloat16;deterministic;bf16dot=scalar;denormals=flushed"
    )
    assert kv_fingerprint("m", bf16, False, bf16_dot=None) == "m;kv=bfloat16;bf16dot=torch"
    # the linears in torch's matmuls (oneDNN: sums by the CPU's instruction set) are named in either mode
    onednn = kv_fingerprint("m", bf16, True, torch_linears=True, bf16_dot=2)
    assert onednn == "m;kv=bfloat16;deterministic;linears=torch;denormals=flushed"
    assert kv_fingerprint("m", torch.float32, True, torch_linears=True) == "m;kv=float32;deterministic"
    for form in (None, 0, 1, 2, 3):
        assert kv_fingerprint("m", torch.float32, False, bf16_dot=form) == "m;kv=float32"


def test_the_namespace_names_attention_in_amx_tiles() -> None:  # on every host
    """The attention in AMX tiles (engine/csrc/attn_amx.h) gives other bits than in vectors: another
    namespace, in bfloat16 (float32 keeps SDPA, whatever the switch)."""
    bf16 = torch.bfloat16
    assert kv_fingerprint("m", bf16, True, tiles=True, attention_tiles=True) == (
        "m;kv=bfloat16;deterministic;linears=amx;attention=amx;denormals=flushed"
    )
    assert kv_fingerprint("m", bf16, False, attention_tiles=True, quantized=True) == (
        "m;kv=bfloat16;attention=amx;denormals=flushed;weights=quantized;activations=int16/32639"
    )
    assert kv_fingerprint("m", torch.float32, False, attention_tiles=True) == "m;kv=float32"


@needs_bf16
def test_the_switch_is_in_the_namespace_and_blocks_never_cross(det: LLM) -> None:
    off = make(deterministic=False)
    assert not off.engine.determinism.on
    fp = off.engine.model.fingerprint
    tiles = off.engine.model.bf16_tiles  # the AMX path's bits are its own (engine/csrc/bf16_amx.h)
    assert tiles == det.engine.model.bf16_tiles
    kernels = native_kernels()
    assert kernels is not None
    # the attention in AMX tiles likewise (engine/csrc/attn_amx.h)
    attention = kernels.prefill is not None and kernels.prefill.amx
    flags = {
        "tiles": tiles,
        "torch_linears": off.engine.model.torch_linears,
        "attention_tiles": attention,
        "bf16_dot": kernels.bf16_dot,
    }
    assert off.engine.namespace.model_fingerprint == kv_fingerprint(fp, torch.bfloat16, False, **flags)
    assert det.engine.namespace.model_fingerprint == kv_fingerprint(fp, torch.bfloat16, True, **flags)
    assert "bf16dot" not in det.engine.namespace.model_fingerprint  # one namespace for the three forms
    named = {1: "", 2: ";bf16dot=fma", 3: ";bf16dot=avx2"}[kernels.bf16_dot]
    assert off.engine.namespace.model_fingerprint.endswith(f"{named};denormals=flushed")
    assert off.engine.namespace.namespace_id != det.engine.namespace.namespace_id
    # a block a non-deterministic engine saved is never loaded by a deterministic one (same store)
    rng = random.Random(13)
    probe = prompt(rng, 100)
    writer = make(deterministic=False, kv_connector=_offload("cpu:64MiB"))
    writer.generate([probe], GREEDY)
    assert writer.engine.drain(20.0)
    reader = make(kv_connector=_offload("cpu:64MiB"))
    [out] = reader.generate([probe], GREEDY)
    assert out.num_external_tokens == 0
    assert bits(out) == alone(det, probe)
    for llm in (writer, reader, off):
        llm.engine.shutdown()


def test_float32_runs_without_it_and_refuses_it_by_name() -> None:
    default = LLM(tiny_model_dir("llama"), dtype="float32", block_size=16, num_blocks=64)  # auto: off here
    assert not default.engine.determinism.on
    assert "bfloat16" in default.engine.determinism.note
    default.engine.shutdown()
    off = LLM(tiny_model_dir("llama"), dtype="float32", block_size=16, num_blocks=64, deterministic=False)
    assert off.engine.determinism.note == "off (--deterministic off)"
    off.engine.shutdown()
    with pytest.raises(DeterminismUnavailable, match=r"--deterministic on cannot be served here.*bfloat16"):
        LLM(tiny_model_dir("llama"), dtype="float32", block_size=16, num_blocks=64, deterministic=True)


@needs_bf16
def test_on_by_default_in_bfloat16_and_an_odd_block_size_is_refused_by_name() -> None:
    """Within its cost budget, the mode is the default wherever it is served; the cache's paired order
    needs an even block size, which ``on`` names and the default falls back from."""
    default = LLM(tiny_model_dir("llama_hd32"), dtype="bfloat16", block_size=16, num_blocks=64)
    assert default.engine.determinism.on
    default.engine.shutdown()
    odd = LLM(tiny_model_dir("llama_hd32"), dtype="bfloat16", block_size=5, num_blocks=64)
    assert not odd.engine.determinism.on and "even block size" in odd.engine.determinism.note
    assert odd.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids  # it still serves
    odd.engine.shutdown()
    with pytest.raises(DeterminismUnavailable, match="even block size, not 5"):
        LLM(tiny_model_dir("llama_hd32"), dtype="bfloat16", block_size=5, num_blocks=64, deterministic=True)


def test_k_pieces() -> None:
    assert k_pieces(576, 1024) == [576]
    assert k_pieces(1536, 1024) == [768, 768]
    assert k_pieces(1536, 512) == [512, 512, 512]
    assert k_pieces(1100, 512) == [384, 384, 332]
    for k in (100, 1000, 1536, 4096, 11008):
        for limit in {limit for _, limit in batch_invariance.PLANS if limit}:
            sizes = k_pieces(k, limit)
            assert sum(sizes) == k
            assert sizes == [k] if k <= limit else max(sizes) <= limit
            assert all(size % 32 == 0 for size in sizes[:-1])


@needs_onednn_bf16
def test_split_linears_compute_the_same_product() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 200, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(37, 1536, dtype=torch.bfloat16)
    whole = packed(x).float()
    packed.split_k([768, 768])
    assert "k_pieces=[768, 768]" in repr(packed)
    assert torch.equal(packed.dense_weight(), linear.weight.detach())
    split = packed(x).float()
    exact = x.float() @ linear.weight.detach().float().T + linear.bias.detach().float()
    # one more rounding than the whole product: within a bfloat16 ulp or two of the exact sums
    assert (split - exact).abs().max() <= 4 * (whole - exact).abs().max() + 1e-2
    packed.split_k([])
    assert torch.equal(packed(x).float(), whole)


@needs_onednn_bf16
def test_the_measurement_is_kept_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's linears (not the native bfloat16 kernel, batch-invariant as built) get a measured plan."""
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PDKV_BF16_LINEARS", "onednn")
    llm = make()
    assert llm.engine.determinism.on
    kept = json.loads((tmp_path / "batch_invariance.json").read_text())
    shapes = {key.split("|")[-2] for key in kept}
    assert {"576x960", "576x576", "576x3072", "1536x576", "576x320"} <= shapes
    assert all(tuple(v) in batch_invariance.PLANS for v in kept.values())
    calls: list[Any] = []
    monkeypatch.setattr(batch_invariance, "holds", lambda *a: calls.append(a) or True)
    again = make()
    assert again.engine.determinism.on and calls == []  # measured once, read back
    # oneDNN's sums follow the CPU's instruction set: never the native linears' namespace
    assert ";linears=torch" in again.engine.namespace.model_fingerprint
    assert again.engine.model.torch_linears
    for m in llm.engine.model.model.modules():
        if isinstance(m, PackedLinear):
            min_rows, limit = next(v for k, v in kept.items() if f"|{m.in_features}x{m.out_features}|" in k)
            assert m.min_rows == min_rows
            assert [b - a for a, b, _ in m.pieces] == (k_pieces(m.in_features, limit) if limit else [])


@needs_onednn_bf16
def test_padding_to_min_rows_computes_the_same_rows() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(1536, 576, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(20, 1536, dtype=torch.bfloat16)
    packed.min_rows = 8
    for t in (1, 3, 7):
        y = packed(x[:t])
        assert y.shape == (t, 576)
        padded = torch.zeros(8, 1536, dtype=torch.bfloat16)
        padded[:t] = x[:t]
        packed.min_rows = 1
        assert torch.equal(y, packed(padded)[:t])
        packed.min_rows = 8


@pytest.mark.parametrize(
    ("flags", "native", "want"),
    [
        ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, "1", "avx512_bf16"),
        ({"amx_bf16", "avx512f", "avx512bw", "avx512vl"}, "1", "amx_bf16"),
        ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "1", "avx512f/bw/vl: pdkv"),  # the FMAs
        ({"avx512f", "avx512bw", "avx512vl"}, "0", "auto = float32"),  # PDKV_NATIVE=0: torch's is slow
        ({"avx512f", "avx512bw", "avx512vl"}, "no build", "not built"),  # no compiler, a failed build
        # AVX2 + FMA: the same kernels on 256-bit halves (csrc/avx512_avx2.h), 2.3-5x float32's steps
        ({"avx2", "fma", "f16c"}, "1", "avx2/fma: pdkv"),
        ({"avx2", "fma"}, "0", "auto = float32"),
        ({"avx2", "fma"}, "no build", "avx2/fma, but the native bfloat16 kernels were not built"),
        ({"avx2"}, "1", "auto = float32"),  # no FMA: no kernels
        ({"sse4_2"}, "1", "auto = float32"),
    ],
)
def test_auto_runs_bfloat16_where_the_cpu_or_the_native_kernels_make_it_fast(
    flags: set[str], native: str, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dtype auto on the CPU, and the line --help prints for it: bfloat16 on AVX512-BF16 or AMX, and on
    plain AVX-512 or AVX2 where the native kernels run (so deterministic mode is served there by default)."""
    from engine import cpu_features
    from engine import native as native_module
    from engine.engine_config import EngineConfig

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("PDKV_NATIVE", "0" if native == "0" else "1")
    built = SimpleNamespace(prefill=None if native == "no build" else object())  # the library, as if built
    monkeypatch.setattr(native_module, "native_kernels", lambda: built)
    note = EngineConfig().dtype_reason(torch.device("cpu"))
    assert want in note, note
    dtype = EngineConfig().torch_dtype(torch.device("cpu"), "bfloat16")
    assert dtype == (torch.float32 if note.startswith("auto = float32") else torch.bfloat16), note
    assert EngineConfig().torch_dtype(torch.device("cpu"), "float32") == torch.float32  # stays float32


def test_the_namespace_names_the_gguf_types_packed_since_they_ran_dequantized() -> None:  # every host
    """Q5_0, Q5_1, Q4_K, Q5_K and Q6_K ran dequantized before 2026-12-07 and packed since (other bits): a
    file with any of them packed is named with them, so no node loads a block of the old rule; the types
    packed all along (Q8_0, Q4_0, Q4_1) and a dequantized node add nothing."""
    f32, types = torch.float32, frozenset({"Q8_0", "Q5_0", "Q4_K", "Q6_K", "BF16"})
    assert kv_fingerprint("m", f32, False, quantized=True, packed_types=types) == (
        "m;kv=float32;weights=quantized;activations=int16/32639;packed=Q4_K,Q5_0,Q6_K"
    )
    assert kv_fingerprint("m", f32, False, quantized=True, packed_types=frozenset({"Q8_0", "Q4_1"})) == (
        "m;kv=float32;weights=quantized;activations=int16/32639"
    )
    assert kv_fingerprint("m", f32, False, packed_types=types) == "m;kv=float32"
