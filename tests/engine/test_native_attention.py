"""The native decode attention (engine/csrc/paged_decode.c) against the torch path, and its fallback.

The kernel reads the paged cache in place; the torch path gathers and runs SDPA.  Both must give the same
attention (to float32 rounding; bfloat16 to one rounding of the output) for every shape the engine meets:
grouped and plain heads, sliding windows, contexts ending on and off block boundaries, padded tables.
Without a compiler, or with ``PDKV_NATIVE=0``, the engine runs the torch path and still matches
transformers (the parity suite runs with the kernel, this file runs one variant without it).
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import native, native_build
from engine.attention import DecodeBatch, GatherWorkspace, _decode_attention
from tests.engine.test_model_parity import GREEDY, PROMPTS, assert_matches_transformers, make_llm


@pytest.fixture(scope="module")
def kernel() -> native.DecodeKernel:
    kernels = native.native_kernels()
    assert kernels is not None, "the native kernels did not build on this machine (gcc is part of the setup)"
    return kernels.decode


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, DecodeBatch]:
    gen = torch.Generator().manual_seed(len(positions) * 7 + heads + head_dim)
    num_blocks, layers = 64, 3
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    width = max(p // block_size + 1 for p in positions)
    table = torch.zeros(len(positions), width, dtype=torch.int64)
    free = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the padding
    taken = 0
    for b, p in enumerate(positions):
        used = p // block_size + 1
        table[b, :used] = free[taken : taken + used]
        taken += used
    cache[0] = float("nan")  # padding is never read: a NaN there would reach the output
    q = torch.randn(len(positions), heads, head_dim, generator=gen).to(dtype)
    return q, cache, DecodeBatch(0, len(positions), table, torch.tensor(positions), block_size)


SHAPES = [
    # heads, kv_heads, head_dim, block_size, positions (the query's position = context - 1)
    (4, 2, 16, 4, [0, 3, 4, 9, 30]),  # contexts ending on and off block boundaries, and of one token
    (9, 3, 64, 16, [143, 127, 128, 5]),  # SmolLM2's heads
    (8, 8, 32, 16, [40]),  # no grouping, batch 1
    (16, 1, 128, 8, [17, 63, 64, 65, 99, 2, 31, 8, 1]),  # multi-query, head_dim 128, more rows than threads
    (6, 2, 20, 5, [23, 11]),  # head_dim not a multiple of the vector width
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 1, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{s[0]}kv{s[1]}d{s[2]}bs{s[3]}" for s in SHAPES])
def test_the_kernel_matches_the_torch_path(
    kernel: native.DecodeKernel, shape: tuple, window: int | None, dtype: torch.dtype
) -> None:
    heads, kv_heads, head_dim, block_size, positions = shape
    q, cache, dec = _case(dtype, heads, kv_heads, head_dim, block_size, positions)
    scale = head_dim**-0.5
    cache_ok = cache.clone()
    cache_ok[0] = 0.0  # the torch path multiplies the padding by a zero weight: NaN would poison it
    for layer in range(cache.shape[1]):
        got = kernel(q, cache, layer, dec.block_table, dec.positions, scale=scale, window=window)
        want = _decode_attention(q, cache_ok, layer, dec, scale, window, GatherWorkspace())
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.isfinite(got).all(), "the kernel read a padding block"
        # float32: summation order only; bfloat16: SDPA rounds its weights to bfloat16, the kernel not.
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_queries_may_be_a_strided_view(kernel: native.DecodeKernel) -> None:
    """The engine hands the kernel q as a view of [T, H + Hkv, D] (rows strided): read in place."""
    q, cache, dec = _case(torch.bfloat16, 9, 3, 64, 16, [143, 5, 60])
    qk = torch.cat([q, torch.randn(3, 3, 64).to(torch.bfloat16)], dim=1)  # [B, H + Hkv, D]
    view = qk[:, :9]
    assert not view.is_contiguous()
    got = kernel(view, cache, 1, dec.block_table, dec.positions, scale=0.125, window=None)
    want = kernel(view.contiguous(), cache, 1, dec.block_table, dec.positions, scale=0.125, window=None)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 32)], ids=["fp32", "bf16-grouped-heads"]
)
def test_nan_in_a_visible_key_reaches_the_output(
    kernel: native.DecodeKernel, dtype: torch.dtype, head_dim: int
) -> None:
    """Neither the vector max nor the vector exponential may turn a NaN score into a weight of zero."""
    q, cache, dec = _case(dtype, 4, 2, head_dim, 4, [9, 9])
    cache[dec.block_table[0, 1], 0, 0, 2, 0] = float("nan")  # row 0's key 6, KV head 0
    out = kernel(q, cache, 0, dec.block_table, dec.positions, scale=0.25, window=None).float()
    assert torch.isnan(out[0, :2]).all(), "the query heads of KV head 0 of row 0 see the NaN key"
    assert torch.isfinite(out[0, 2:]).all() and torch.isfinite(out[1]).all()


def test_engine_without_the_kernel_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDKV_NATIVE", "0")
    for name in ("llama", "mistral_window"):
        llm = make_llm(name)
        assert llm.engine.runner.decode_kernel is None
        assert_matches_transformers(name, PROMPTS, llm.generate(PROMPTS, GREEDY))


def test_the_engine_uses_the_kernel_on_the_cpu() -> None:
    llm = make_llm("llama")
    assert llm.engine.runner.decode_kernel is not None
    [out] = llm.generate(PROMPTS[:1], GREEDY)
    assert_matches_transformers("llama", PROMPTS[:1], [out])


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"], ids=["missing", "failing"])
def test_a_failed_build_falls_back_to_torch_with_a_warning(
    compiler: str, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        assert native._load() is None
    assert "native kernels unavailable" in caplog.text
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"


def test_a_built_library_is_reused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path))
    first = native_build.build_library()
    stamp = first.stat().st_mtime_ns
    assert native_build.build_library() == first and first.stat().st_mtime_ns == stamp


def test_every_source_file_keys_the_built_library() -> None:
    """An edit to any file the compiler reads (a header included by one kernel only, too) must rebuild
    the library: a cached build of the old code would run instead."""
    csrc = native_build.CSRC
    assert set(native_build.SOURCES) == set(csrc.glob("*.c"))
    assert set(native_build.HEADERS) == set(csrc.glob("*.h"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 64), (300, 576), (3, 20), (9, 2049), (2, 4096)])
def test_the_rms_norm_kernel_matches_the_torch_ops(rows: int, hidden: int, dtype: torch.dtype) -> None:
    from engine.model.llama import RMSNorm

    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm.to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        want = norm(x)
        norm.kernel = kernels.rms_norm
        got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    # Only the order of the sum of squares differs: float32 to a few ulp, bfloat16 to one rounding.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01, "a rounding apart on a few elements at most"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rows", [(9, 3, 64, 5), (4, 4, 16, 300), (8, 2, 128, 1)])
def test_the_rope_kernel_equals_the_torch_ops(
    heads: int, kv_heads: int, head_dim: int, rows: int, dtype: torch.dtype
) -> None:
    """Exactly equal (each product and sum rounded as torch rounds it), and the same cache afterwards."""
    from engine.attention import AttentionMetadata, write_kv
    from engine.model.config import RopeConfig
    from engine.model.rope import RotaryEmbedding, apply_rotary

    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows + head_dim)
    block_size, layers, layer = 4, 3, 1
    cache_a = torch.randn(80, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    cache_b = cache_a.clone()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (rows,), generator=gen)
    cos, sin = RotaryEmbedding(RopeConfig(), head_dim, torch.device("cpu")).cos_sin(positions, dtype)
    slots = torch.randperm(80 * block_size, generator=gen)[:rows]
    meta = AttentionMetadata(slots // block_size, slots % block_size, [], [])

    qk_want = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(rows, -1, head_dim), cos, sin)
    v_want = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    write_kv(cache_a, layer, qk_want[:, heads:], v_want, meta)
    qk, v = kernels.rope(qkv, cos, sin, cache_b, layer, meta.slot_blocks, meta.slot_offsets, heads)
    assert torch.equal(qk, qk_want) and torch.equal(v, v_want)
    assert torch.equal(cache_b, cache_a), "the same K/V in the same slots, nothing else touched"


def to_paired(cache: torch.Tensor) -> torch.Tensor:
    """A canonical cache ``[nb, L, 2, bs, Hkv, D]`` rewritten in deterministic mode's paired order
    (engine/csrc/simd.h): per block and layer, keys as pairs of dims by position -- element (j, h, d) at
    ((h D/2 + d // 2) bs + j) 2 + d % 2 -- and values as pairs of positions by dim -- at
    ((h bs/2 + j // 2) D + d) 2 + j % 2.  Written from the definition, apart from the engine's views."""
    nb, layers, _, bs, hkv, d = cache.shape
    out = torch.empty_like(cache)
    flat = out.view(nb, layers, 2, bs * hkv * d)
    keys = cache[:, :, 0].reshape(nb, layers, bs, hkv, d // 2, 2)  # [.., j, h, d // 2, d % 2]
    flat[:, :, 0] = keys.permute(0, 1, 3, 4, 2, 5).reshape(nb, layers, -1)  # [.., h, d // 2, j, d % 2]
    values = cache[:, :, 1].reshape(nb, layers, bs // 2, 2, hkv, d)  # [.., j // 2, j % 2, h, d]
    flat[:, :, 1] = values.permute(0, 1, 4, 2, 5, 3).reshape(nb, layers, -1)  # [.., h, j // 2, d, j % 2]
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,rows", [(9, 3, 64, 16, 37), (4, 2, 32, 4, 300)])
def test_the_paired_order_is_written_alike_by_the_rope_kernel_and_by_torch(
    heads: int, kv_heads: int, head_dim: int, block_size: int, rows: int
) -> None:
    """Deterministic mode's cache order: the native K/V write and ``write_kv(paired=True)`` put the same
    bytes where the order's definition (``to_paired`` of the canonical write) says, nothing else."""
    from engine.attention import AttentionMetadata, write_kv
    from engine.native_attention import KV_PAIRED

    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows)
    layers, layer, num_blocks = 3, 2, rows // block_size + 10
    canonical = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    cos = torch.ones(rows, 1, head_dim // 2, dtype=torch.bfloat16)  # no rotation: the write is the point
    sin = torch.zeros(rows, 1, head_dim // 2, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    meta = AttentionMetadata(slots // block_size, slots % block_size, [], [])
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    native_paired, torch_paired = to_paired(canonical), to_paired(canonical)
    write_kv(canonical, layer, k, v, meta)
    write_kv(torch_paired, layer, k, v, meta, paired=True)
    kernels.rope(qkv, cos, sin, native_paired, layer, meta.slot_blocks, meta.slot_offsets, heads, KV_PAIRED)
    want = to_paired(canonical)
    assert torch.equal(torch_paired.view(torch.int16), want.view(torch.int16))
    assert torch.equal(native_paired.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(33, 576), (2, 2048), (9, 2049)])  # shared out; the stack's edge
def test_the_residual_add_and_norm_in_one_call(dtype: torch.dtype, rows: int, hidden: int) -> None:
    from engine.model.llama import RMSNorm

    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm.to(dtype)
    h, delta = (torch.randn(2, rows, hidden, generator=gen) * 2).to(dtype)
    with torch.inference_mode():
        want_h, want = norm.add_forward(h, delta)
        norm.kernel = kernels.rms_norm
        got_h, got = norm.add_forward(h, delta)
    assert torch.equal(got_h, want_h), "the add rounds exactly as torch's"
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_residual_add_rounds_ties_overflow_and_nans_as_torch() -> None:
    """The bfloat16 add of the residual and the delta, rounded to nearest even in every vector form (AVX2's
    halves blend a NaN by the compare's lanes): exact ties either way, sums that overflow to an infinity,
    infinities and NaNs in, in the 16-wide vector part and in the scalar tail (71 columns)."""
    from engine.model.llama import RMSNorm

    kernels = native.native_kernels()
    assert kernels is not None
    bf = torch.bfloat16
    one, odd = 1.0, 1.0078125  # odd: the next bfloat16 after 1.0, its last mantissa bit set
    half_ulp, big = 2.0**-8, float(torch.finfo(bf).max)
    pairs = [(one, half_ulp), (odd, half_ulp), (-odd, -half_ulp), (big, big), (-big, -big)]
    pairs += [(float("inf"), 1.0), (float("-inf"), -1.0), (float("nan"), 1.0), (1.0, float("nan"))]
    pairs += [(3.0, 0.25), (-2.5, 0.0078125), (0.0, -0.0)]
    cols = 71
    h = torch.empty(3, cols)
    delta = torch.empty(3, cols)
    for i in range(3 * cols):
        h.view(-1)[i], delta.view(-1)[i] = pairs[(i * 7) % len(pairs)]
    h, delta = h.to(bf), delta.to(bf)
    norm = RMSNorm(cols, 1e-5)
    norm.weight.data = torch.ones(cols)
    norm.to(bf)
    with torch.inference_mode():
        want_h, _ = norm.add_forward(h, delta)
        norm.kernel = kernels.rms_norm
        got_h, _ = norm.add_forward(h, delta)
    nan = torch.isnan(want_h)
    assert torch.equal(torch.isnan(got_h), nan), "a NaN in stays a NaN out, and only there"
    assert torch.equal(got_h[~nan].view(torch.int16), want_h[~nan].view(torch.int16))
    assert torch.isinf(got_h).sum() >= 4, "the cases that overflow and the infinities in"


@pytest.mark.parametrize("rows,inter", [(1, 1536), (40, 64), (3, 20), (20, 1536)])
def test_the_silu_mul_kernel_matches_the_torch_ops(rows: int, inter: int) -> None:
    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, float("nan")])  # 0, far tails, NaN
    if not kernels.silu_mul.supports(gate_up.dtype):
        pytest.skip("no AVX-512 on this CPU: the torch ops run")
    gate, up = gate_up.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    assert torch.isnan(got[0, 3]) and torch.isnan(want[0, 3])
    # exp differs from torch's in the last float32 bit at most: one bfloat16 rounding apart, rarely
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7, equal_nan=True)
    mismatched = int(((got != want) & ~torch.isnan(want)).sum())
    assert mismatched <= max(1, 0.02 * want.numel()), f"{mismatched} of {want.numel()} elements differ"


@pytest.mark.parametrize("rows,cols", [(1, 49152), (32, 49152), (7, 17), (3, 1), (5, 16), (4, 33)])
def test_the_argmax_kernel_returns_what_torch_max_returns(rows: int, cols: int) -> None:
    """The first maximum of each row, or its first NaN: ties, NaNs, -inf rows, signed zeros, tails; over
    float32 and over bfloat16 (rounding makes more ties)."""
    kernels = native.native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows * cols)
    cases = [torch.randn(rows, cols, generator=gen)]
    cases.append((cases[0] * 2).round())  # many ties
    with_nan = cases[0].clone()
    with_nan[torch.rand(rows, cols, generator=gen) < 0.01] = float("nan")
    with_nan[-1, -1] = float("nan")  # in the scalar tail too
    cases.append(with_nan)
    cases.append(torch.full((rows, cols), float("-inf")))
    zeros = torch.zeros(rows, cols)
    zeros[:, ::3] = -0.0
    cases.append(zeros)
    for x in cases:
        assert torch.equal(kernels.argmax(x), x.max(dim=-1).indices)
        # bfloat16 logits as the LM head gives them: the index over their float32 values
        half = x.to(torch.bfloat16)
        assert torch.equal(kernels.argmax(half), half.float().max(dim=-1).indices)


def test_greedy_sampling_uses_the_argmax_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm("llama")
    assert llm.engine.runner.sampler.argmax is not None
    monkeypatch.setenv("PDKV_NATIVE", "0")
    assert make_llm("llama").engine.runner.sampler.argmax is None  # the torch reduction


def test_a_bad_block_table_raises_instead_of_reading_outside_the_cache(kernel: native.DecodeKernel) -> None:
    q, cache, dec = _case(torch.bfloat16, 4, 2, 16, 4, [9, 5])
    for table, positions in (
        (dec.block_table.clone().fill_(cache.shape[0]), dec.positions),  # a block id past the cache
        (dec.block_table.clone().fill_(-1), dec.positions),
        (dec.block_table, torch.tensor([9, dec.block_table.shape[1] * 4])),  # a position past the table
    ):
        with pytest.raises(IndexError, match="outside"):
            kernel(q, cache, 0, table, positions, scale=0.25, window=None)
    with pytest.raises(IndexError, match="layer"):
        kernel(q, cache, cache.shape[1], dec.block_table, dec.positions, scale=0.25, window=None)


def test_a_slot_outside_the_cache_raises_and_writes_nothing() -> None:
    kernels = native.native_kernels()
    assert kernels is not None
    cache = torch.zeros(8, 2, 2, 4, 2, 16)
    qkv = torch.randn(3, (4 + 4) * 16)
    cos, sin = torch.ones(3, 1, 8), torch.zeros(3, 1, 8)
    for blocks, offsets in (
        (torch.tensor([0, 1, 8]), torch.tensor([0, 1, 2])),
        (torch.tensor([0, 1, 2]), torch.tensor([0, 4, 1])),
    ):
        with pytest.raises(IndexError, match="outside"):
            kernels.rope(qkv, cos, sin, cache, 0, blocks, offsets, 4)
    assert not cache.any(), "refused before any write"
