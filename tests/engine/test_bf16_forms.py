"""The bfloat16 kernels' three forms give the same bits (engine/csrc/simd.h's PDKV_BF16): vdpbf16ps
(AVX512-BF16), its FMA emulation on AVX-512 without it, and that emulation on AVX2's 256-bit halves
(engine/csrc/avx512_avx2.h) -- so that deterministic nodes on CPUs of each kind share one KV namespace
(engine/determinism.kv_fingerprint), and a stream resumed on a node of another kind continues with the
same tokens.

A CPU runs the forms up to its own: this one builds the library once per form it can run
(``native.load_bf16_form``: ``-mno-avx512bf16``, ``-mno-avx512f``) and compares every bfloat16 kernel
on inputs laced with denormals and with values whose products underflow (each kernel runs with
denormals flushed, the rule vdpbf16ps follows: simd.h's bf16_mode_enter), then a model end to end in
deterministic mode: tokens, logprobs and the KV cache's bytes.  A CPU with AVX2 alone runs one form and
has nothing to compare (skipped there, run on every AVX-512 host).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from engine import native
from engine.determinism import kv_fingerprint
from engine.llm import LLM
from engine.model.quant_blocks import pack, pack_bf16
from engine.native_attention import KV_CANONICAL, KV_PAIRED
from engine.sampling_params import SamplingParams
from tests.gguf_models import write_gguf
from tests.tiny_models import pdkv_tiny_model_dir, tiny_model_dir

FORMS = native.bf16_forms_here()
NAMES = {1: "vdpbf16ps", 2: "fma", 3: "avx2"}
pytestmark = pytest.mark.skipif(
    len(FORMS) < 2, reason="this CPU runs one bfloat16 form at most (AVX2 alone): nothing to compare"
)
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def forms() -> Iterator[dict[int, native.NativeKernels]]:
    """A build of each form this CPU runs, the AMX tiles off while the module runs (their bits are theirs)
    and put back after: the vdpbf16ps build is the engine's own library (the same file, one handle)."""
    built = {form: native.load_bf16_form(form) for form in FORMS}
    missing = [NAMES[form] for form, kernels in built.items() if kernels is None]
    assert not missing, f"gcc built no {missing} form on a CPU that runs it"
    out: dict[int, native.NativeKernels] = {}
    switches = []
    for form, kernels in built.items():
        assert kernels is not None and kernels.quant is not None and kernels.prefill is not None
        for switch in (kernels.quant.amx_fn, kernels.prefill.amx_fn):
            if switch is not None:
                switches.append((switch, int(switch(-1))))
                switch(0)
        out[form] = kernels
    try:
        yield out
    finally:
        for switch, was in reversed(switches):
            switch(was)


def laced(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random bfloat16 values, a tenth of them denormal (either sign) and a tenth so small (~2^-70) that
    their products with each other underflow to denormals, or below."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * scale).to(BF16)
    pick = torch.rand(*shape, generator=g)
    bits = x.view(torch.int16)
    denormal = torch.randint(1, 0x80, shape, generator=g, dtype=torch.int16)
    denormal |= (torch.rand(*shape, generator=g) < 0.5).to(torch.int16) << 15
    tiny = (torch.randn(*shape, generator=g) * 2.0**-70).to(BF16).view(torch.int16)
    bits = torch.where(pick < 0.1, denormal, torch.where(pick < 0.2, tiny, bits))
    return bits.view(BF16)


def same(results: Mapping[int | str, torch.Tensor | tuple[torch.Tensor, ...]], what: str) -> None:
    """Every form's result (by form, or by a label) has the first one's bits (bfloat16 as 16-bit patterns)."""
    first, *rest = results
    for form in rest:
        a, b = results[first], results[form]
        for x, y in zip(
            a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True
        ):
            xi, yi = (t.view(torch.int16) if t.dtype == BF16 else t for t in (x, y))
            differ = f"{(xi != yi).sum().item()} of {xi.numel()}"
            name, first_name = (NAMES.get(k, k) if isinstance(k, int) else k for k in (form, first))
            assert torch.equal(xi, yi), f"{what}: {name} differs from {first_name} in {differ}"


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_norm_silu_and_rope_give_every_forms_bits(forms: dict[int, native.NativeKernels], rows: int) -> None:
    x, d = laced(rows, 576, seed=rows), laced(rows, 576, seed=rows + 1)
    w = laced(576, seed=3, scale=0.5)
    same({f: k.rms_norm(x, w, 1e-5) for f, k in forms.items()}, "RMSNorm")
    same({f: k.rms_norm.add(x, d, w, 1e-5) for f, k in forms.items()}, "RMSNorm with the residual add")
    gate_up = laced(rows, 2 * 1536, seed=rows + 2, scale=3.0)
    same({f: k.silu_mul(gate_up) for f, k in forms.items()}, "SiLU-mul")
    heads, kv_heads, dim, block = 9, 3, 64, 16
    qkv = laced(rows, (heads + 2 * kv_heads) * dim, seed=rows + 4)
    pos = torch.arange(rows, dtype=torch.float32)[:, None] * 0.37
    cos, sin = (
        torch.cos(pos + torch.arange(dim // 2)).to(BF16),
        torch.sin(pos + torch.arange(dim // 2)).to(BF16),
    )
    slots = torch.arange(rows, dtype=torch.int64)
    outs: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for form, k in forms.items():
        for order in (KV_CANONICAL, KV_PAIRED):
            cache = torch.zeros(rows // block + 1, 2, 2, block, kv_heads, dim, dtype=BF16)
            qk, _ = k.rope(
                qkv, cos[:, None], sin[:, None], cache, 1, slots // block, slots % block, heads, order
            )
            outs.setdefault(order, {})[form] = (qk, cache)
    for order, results in outs.items():
        same(results, f"RoPE and the K/V write (order {order})")


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_the_dense_linears_give_every_forms_bits(forms: dict[int, native.NativeKernels], rows: int) -> None:
    """bf16_linear.c, batch 1 (groups) and batch tiles; the vdpbf16ps build in both of its forms."""
    weight = pack_bf16(laced(200, 576, seed=11, scale=0.05))
    x = laced(rows, 576, seed=rows + 12)
    results: dict[int | str, torch.Tensor] = {}
    for form, k in forms.items():
        assert k.quant is not None
        for fma in (False, True) if form == 1 else (True,):
            was = k.quant.bf16_fma()
            k.quant.bf16_fma(fma)
            out = torch.empty(rows, 200, dtype=BF16)
            k.quant.linear(x, weight.packed, weight.fmt, weight.rows, out)
            k.quant.bf16_fma(was)
            results[f"{NAMES[form]}, the FMA form" if form == 1 and fma else NAMES[form]] = out
    same(results, f"linear of {rows} rows")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 9, 32])
def test_the_quantized_linears_give_every_forms_bits(
    forms: dict[int, native.NativeKernels], qtype: str, rows: int
) -> None:
    """quant.c on bfloat16 activations laced with denormals (integer dot products, the same float scaling
    in every build: no flush needed, and none set), batch 1 and batch tiles, out in bfloat16."""
    from tests.engine.test_quantized import random_blocks, width

    cols = width(qtype, 576)
    weight = pack([random_blocks(qtype, 200, cols, seed=41)])
    x = laced(rows, cols, seed=rows + 42)
    results = {}
    for form, k in forms.items():
        assert k.quant is not None
        out = torch.empty(rows, 200, dtype=BF16)
        k.quant.linear(x, weight.packed, weight.fmt, weight.rows, out)
        results[form] = out
    same(results, f"{qtype} linear of {rows} rows")


# SmolLM2's heads, and head dims 128 and 32 (the kernel's unrolled sizes and its smallest)
ATTENTION_SHAPES = [(9, 3, 64), (4, 1, 128), (4, 2, 32)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=["h{}kv{}d{}".format(*s) for s in ATTENTION_SHAPES])
@pytest.mark.parametrize("order", [KV_CANONICAL, KV_PAIRED], ids=["canonical", "paired"])
def test_the_attention_gives_every_forms_bits(
    forms: dict[int, native.NativeKernels], order: int, shape: tuple[int, int, int]
) -> None:
    """paged_prefill.c (deterministic mode's kernel for every row): prefill chunks and decode rows (enough
    for a task each), on keys and values laced with denormals and one head's values so small that their
    sums underflow."""
    from tests.engine.test_native_attention import to_paired

    heads, kv_heads, dim = shape
    block, longest, seqs = 16, 150, 12
    cache = laced(seqs * 10, 2, 2, block, kv_heads, dim, seed=21)
    cache[:, :, 1, :, kv_heads - 1] = laced(seqs * 10, 2, block, dim, seed=22, scale=2.0**-100)
    if order == KV_PAIRED:
        cache = to_paired(cache)
    tables = torch.arange(seqs * 10, dtype=torch.int64).view(seqs, 10)
    q = laced(longest, heads + kv_heads, dim, seed=23)[:, :heads]
    cases = {
        "a prefill chunk": (q[:100], tables[:1], torch.tensor([40]), torch.tensor([100])),
        "decode rows": (
            q[:seqs],
            tables,
            torch.tensor([0, 1, 31, 64, 100, 149] * 2),
            torch.ones(seqs, dtype=torch.int64),
        ),
    }
    for what, (qs, table, starts, counts) in cases.items():
        for window in (None, 40):
            results = {}
            for form, k in forms.items():
                assert k.prefill is not None
                results[form] = k.prefill.many(
                    qs, cache, 1, table, starts, counts, scale=dim**-0.5, window=window, kv_order=order
                )
            same(results, f"attention, {what}, window {window}")


def test_the_lora_kernel_gives_every_forms_bits(forms: dict[int, native.NativeKernels]) -> None:
    slots, rank, width, out, rows = 2, 16, 576, 192, 9
    a = laced(slots, width // 2, rank, 2, seed=31, scale=0.1)
    a[1] = laced(width // 2, rank, 2, seed=35, scale=2.0**-100)
    b = laced(slots, rank // 2, out, 2, seed=32, scale=0.1)
    b[1] = laced(rank // 2, out, 2, seed=36, scale=2.0**-64)  # adapter 1: deltas ~2^-127, denormal
    part_start = torch.tensor([0, out], dtype=torch.int64)
    x = laced(rows, width, seed=33)
    y0 = laced(rows, out, seed=34)
    y0[3:7] = 0  # rows whose outputs are their deltas alone
    which = torch.tensor([0, 1, -1, 1, 0, 0, 1, 1, 0], dtype=torch.int64)
    results = {}
    for form, k in forms.items():
        assert k.lora is not None
        y = y0.clone()
        k.lora.bind(a, b, part_start)(x, y, which)
        results[form] = y
    same(results, "LoRA deltas")


@contextlib.contextmanager
def kernels_in_use(kernels: native.NativeKernels) -> Iterator[None]:
    """Engines made inside run ``kernels`` (``native.native_kernels``'s answer, put back after)."""
    native.native_kernels()  # loaded once first, so the list holds the engine's own
    was = list(native._loaded)
    native._loaded[:] = [kernels]
    try:
        yield
    finally:
        native._loaded[:] = was


@pytest.mark.parametrize("weights", ["bf16", "quantized"])
def test_a_deterministic_engine_gives_every_forms_tokens_logprobs_and_kv(
    forms: dict[int, native.NativeKernels], weights: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SmolLM2's layer shapes, prefill in chunks and a decode batch: the same tokens, logprobs and KV
    bytes from each form, under one namespace; off, the namespace names the form."""
    rng = random.Random(5)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 40, 130, 300, 17, 64)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2)
    model = tiny_model_dir("llama_smol_shapes")
    if weights == "quantized":  # a GGUF file of Q4_1 blocks, head_dim 64
        folder = pdkv_tiny_model_dir(init_std=0.2, hidden=128, heads=2, kv_heads=1)
        model = write_gguf(folder, tmp_path_factory.mktemp("forms") / "q4.gguf", qtype="Q4_1")
    runs: dict[int, list[Any]] = {}
    caches: dict[int, torch.Tensor] = {}
    namespaces: dict[int, str] = {}
    for form, kernels in forms.items():
        with kernels_in_use(kernels):
            llm = LLM(
                model,
                dtype="bfloat16",
                weights=weights,
                block_size=16,
                num_blocks=256,
                max_num_batched_tokens=96,
                deterministic=True,
            )
            try:
                assert llm.engine.determinism.on, llm.engine.determinism.note
                outs = llm.generate(prompts, params)
                kv = llm.engine.runner.kv_cache.clone()
                namespaces[form] = llm.engine.namespace.model_fingerprint
            finally:
                llm.engine.shutdown()
        runs[form] = [(o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs) for o in outs]
        caches[form] = kv.view(torch.int16)
    first, *rest = forms
    for form in rest:
        assert runs[form] == runs[first], f"{NAMES[form]}: other tokens or logprobs"
        assert torch.equal(caches[form], caches[first]), f"{NAMES[form]}: other KV bytes"
        assert namespaces[form] == namespaces[first]
    fp = namespaces[first].split(";kv=")[0]
    for form in forms:  # the namespace the same in deterministic mode, the form's own outside it
        assert kv_fingerprint(fp, BF16, True, bf16_dot=form) == kv_fingerprint(fp, BF16, True, bf16_dot=1)
    assert len({kv_fingerprint(fp, BF16, False, bf16_dot=form) for form in forms}) == len(forms)
