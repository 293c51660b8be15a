"""Quantized weights (engine/model/quantized.py, engine/csrc/quant.c, engine/csrc/decode_layer.c): each
kernel against dequantize-then-matmul on random blocks of every format, odd shapes and tails; greedy
output against transformers on the same weights dequantized; the fused decode layer against the per-op
path bit for bit; every path (prefix hit, each tier, P/D) giving the local tokens; the KV of quantized and
dequantized weights kept apart; the weights' choice, its refusals and its fallback; bad files."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.connector.params import RemoteDecode, RemotePrefill
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model.gguf import GGUFError, RawBlocks
from engine.model.packed import PackedLinear
from engine.model.quant_blocks import KERNEL_TYPES, CorruptBlocks, PackError, pack, pack_bf16
from engine.model.quantized import QuantEmbedding, QuantLinear, dequantize, weight_bytes
from engine.native import QuantKernel, SiluMulKernel, native_kernels
from engine.native_linear import row_prefetch_default
from engine.sampling_params import SamplingParams
from tests import kquants
from tests.factories import store_tier_spec
from tests.gguf_models import write_gguf
from tests.kquants import kquant_tensors
from tests.p2p_harness import assert_idle, run_until, tokens
from tests.tiny_models import pdkv_tiny_model_dir

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # GGUF's blocks of 32: any width of whole blocks
KERNEL_FORMATS = tuple(KERNEL_TYPES)  # and the K-quants' super-blocks of 256: widths rounded up (width)
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")
SHAPES = [(1, 32, 1), (17, 32, 3), (37, 96, 1), (48, 608, 9), (130, 256, 70), (16, 64, 8)]  # (n, k, rows)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300, 50, 60], [42] * 17, list(range(30, 70))]
BS = 4


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    kernels = native_kernels()
    if kernels is None or kernels.quant is None:
        pytest.skip("this CPU or compiler has neither AVX512-VNNI nor AVX2 code: no quantized kernels")
    return kernels.quant


def width(qtype: str, k: int) -> int:
    """``k`` for a test's matrix of ``qtype``: rounded up to whole K-quant super-blocks of 256."""
    return -(-k // 256) * 256 if qtype in K_FORMATS else k


def random_blocks(qtype: str, n: int, k: int, seed: int) -> RawBlocks:
    from gguf import GGMLQuantizationType, quants

    if qtype in K_FORMATS:  # the gguf package cannot quantize K-quants: random blocks (tests/kquants.py)
        return RawBlocks("w", qtype, n, k, kquants.random_blocks(qtype, n, k, np.random.default_rng(seed)))
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, : min(k, 32)] = 0.0  # an all-zero block: scale 0
    return RawBlocks("w", qtype, n, k, quants.quantize(w, GGMLQuantizationType[qtype]))


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, the most that quantizing each row's blocks of 32 to int16 (quant.c: step max|x| /
    32639, error at most half a step) can move it: sum over blocks of step / 2 * sum |w| -> [rows, n]."""
    rows, k = x.shape
    step = x.double().abs().reshape(rows, k // 32, 32).amax(-1) / 32639  # [rows, blocks]
    wsum = w.double().abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    return (step / 2) @ wsum.T


@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
@pytest.mark.parametrize(("n", "k", "rows"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_dequantize_then_matmul_within_the_activation_rounding(
    kernel: QuantKernel, qtype: str, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    k = width(qtype, k)
    raw = random_blocks(qtype, n, k, seed=n * 1000 + k)
    linear = QuantLinear([pack([raw])], None, kernel)
    w = raw.dense(torch.float64)  # the gguf package's reference dequantizer
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.double() @ w.T
    out_rounding = ref.abs() * (2.0**-8 if dtype == torch.bfloat16 else 1e-6)
    err = (y.double() - ref).abs()
    assert torch.all(err <= activation_bound(x, w) * 1.001 + out_rounding + 1e-5), float(err.max())


def integer_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> tuple[RawBlocks, np.ndarray]:
    """Blocks of ``qtype`` with every scale 1 (and Q4_1's mins 0), their quants drawn over the whole
    range, extremes included: the blocks and their weights as integers [n, k]."""
    nb = k // 32
    one, zero = np.array([1.0], np.float16).view(np.uint8), np.array([0.0], np.float16).view(np.uint8)
    if qtype in ("Q4_K", "Q5_K"):  # d 1, dmin 0, every sub-block's 6-bit scale 1 and min 0
        top = 16 if qtype == "Q4_K" else 32
        q = rng.integers(0, top, size=(n, nb, 32))
        q[:, :, :4] = [0, top - 1, top - 1, 0]
        pairs = (q & 0xF).reshape(n, nb // 8, 4, 2, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
        body = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).astype(np.uint8).reshape(n, nb // 8, 128)
        scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
        parts = [np.broadcast_to(np.concatenate([one, zero, scales]), (n, nb // 8, 16))]
        if qtype == "Q5_K":  # qh[l]'s bit j: the fifth bit of sub-block j's quant l
            fifth = (q >> 4).reshape(n, nb // 8, 8, 32)
            parts.append(sum(fifth[:, :, j] << j for j in range(8)).astype(np.uint8))
        data = np.concatenate([*parts, body], axis=2).reshape(n, -1)
        return RawBlocks("w", qtype, n, k, np.ascontiguousarray(data)), q.reshape(n, k)
    if qtype == "Q6_K":  # d 1; scales 1 and 2 by turns -- a block's halves: weights (q - 32) (1 or 2)
        q = rng.integers(0, 64, size=(n, nb // 8, 2, 4, 32))  # [super-block][h][j][l]: weight 128h + 32j + l
        q[..., 0, :4] = [0, 63, 63, 0]
        ql = (q[:, :, :, 0:2] & 0xF) | ((q[:, :, :, 2:4] & 0xF) << 4)  # [h][j % 2][l]
        qh = sum(((q[:, :, :, j] >> 4) & 3) << (2 * j) for j in range(4))  # [h][l]
        scales = np.broadcast_to(np.arange(16, dtype=np.uint8) % 2 + 1, (n, nb // 8, 16))  # sc[w / 16]
        tail = np.concatenate([scales, np.broadcast_to(one, (n, nb // 8, 2))], axis=2)
        data = np.concatenate(
            [ql.astype(np.uint8).reshape(n, nb // 8, 128), qh.astype(np.uint8).reshape(n, nb // 8, 64), tail],
            axis=2,
        )
        w = (q - 32) * (np.arange(32) // 16 + 1)  # l < 16: the block's first half
        return RawBlocks("w", qtype, n, k, np.ascontiguousarray(data.reshape(n, -1))), w.reshape(n, k)
    if qtype in ("Q5_0", "Q5_1"):  # 16 nibbles and 32 high bits; Q5_0's weights q - 16, Q5_1's q (m 0)
        q = rng.integers(0, 32, size=(n, nb, 32))
        q[:, :, :4] = [0, 31, 31, 0]
        low = (q[:, :, :16] & 0xF | (q[:, :, 16:] & 0xF) << 4).astype(np.uint8)
        qh = ((q >> 4) << np.arange(32)).sum(axis=2).astype("<u4").view(np.uint8).reshape(n, nb, 4)
        head = one if qtype == "Q5_0" else np.concatenate([one, zero])
        data = np.concatenate([np.broadcast_to(head, (n, nb, head.size)), qh, low], axis=2).reshape(n, -1)
        w = q - 16 if qtype == "Q5_0" else q
        return RawBlocks("w", qtype, n, k, np.ascontiguousarray(data)), w.reshape(n, k)
    if qtype == "Q8_0":
        q = rng.integers(-128, 128, size=(n, nb, 32))
        q[:, :, :4] = [-128, 127, -128, 127]
        body, w = q.astype(np.int8).view(np.uint8), q
        head = np.broadcast_to(one, (n, nb, 2))
    else:
        q = rng.integers(0, 16, size=(n, nb, 32))
        q[:, :, :4] = [0, 15, 15, 0]
        body = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)
        if qtype == "Q4_0":
            head, w = np.broadcast_to(one, (n, nb, 2)), q - 8
        else:
            head, w = np.broadcast_to(np.concatenate([one, zero]), (n, nb, 4)), q
    data = np.concatenate([head, body], axis=2).reshape(n, -1)
    return RawBlocks("w", qtype, n, k, np.ascontiguousarray(data)), w.reshape(n, k)


@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
@pytest.mark.parametrize("rows", [1, 9])  # the batch-1 kernel; the batch tiles and a last row of its own
def test_the_integer_sums_are_exact_at_the_ends_of_both_ranges(
    kernel: QuantKernel, qtype: str, rows: int
) -> None:
    """Scales of 1 and activations that are integers with a block maximum of exactly 32639 (so the step
    is 1 and qa = x): the kernel's result is then the exact integer sum, in float32 -- with quants at
    their extremes (Q8's -128, which the byte dot products take as an offset) and activations whose low
    byte reads -128 or whose high byte is at +-127, where a split into two signed bytes could overflow."""
    rng = np.random.default_rng(7)
    n, k = 40, width(qtype, 64)
    raw, w = integer_blocks(qtype, n, k, rng)
    x = rng.integers(-100, 101, size=(rows, k))
    edges = [128, -128, 384, -129, 255, -256, 32512 - 128, -32513]  # low bytes -128; 0x7e80: hi 127, lo -128
    for r in range(rows):
        x[r, 4 : 4 + len(edges) - 2] = edges[:-2]  # block 0: the small ones (the sums stay below 2^24)
        x[r, 32 + 4 : 32 + 4 + len(edges)] = edges
        x[r, r % 4] = 32639 if r % 2 else -32639  # each block's maximum
        x[r, 32 + (r + 1) % 4] = -32639 if r % 2 else 32639
        for b in range(2, k // 32):  # Q4_K's width: the other blocks' too
            x[r, 32 * b + (r + b) % 4] = 32639 if (r + b) % 2 else -32639
    y = torch.empty(rows, n)
    kernel.linear(torch.from_numpy(x.astype(np.float32)), pack([raw]).packed, KERNEL_TYPES[qtype][0], n, y)
    exact = x.astype(np.int64) @ w.T.astype(np.int64)
    assert np.abs(exact).max() < 2**24  # every partial sum exact in float32 too
    assert np.array_equal(y.numpy().astype(np.int64), exact)


@pytest.mark.parametrize(
    ("qtype", "scale"), [("Q4_K", np.inf), ("Q6_K", np.nan), ("Q8_0", np.inf), ("Q4_0", 6e4)]
)
def test_a_block_whose_scale_is_not_finite_is_not_packed(qtype: str, scale: float) -> None:
    """A non-finite float16 scale is a corrupt block: refused by the packer, naming the matrix and the row
    (the loader refuses the file: below).  Q4_0's finite d whose min -8 d overflows float16 is only too
    large for the packed layout: PackError, and the loader dequantizes that matrix instead."""
    raw = random_blocks(qtype, 16, width(qtype, 64), seed=9)
    data = raw.data.copy()
    at = KERNEL_TYPES[qtype][2] - 2 if qtype == "Q6_K" else 0  # the float16 d: Q6_K's last, the others' first
    row = 5 if qtype == "Q4_K" else 0
    data[row, at : at + 2] = np.array([scale], np.float16).view(np.uint8)
    first = RawBlocks("first", qtype, 3, raw.cols, raw.data[:3].copy())
    bad = RawBlocks("w", qtype, raw.rows, raw.cols, data)
    if qtype == "Q4_0":
        with pytest.raises(PackError, match="too large for its offset"):
            pack([bad])
        return
    with pytest.raises(
        CorruptBlocks, match=f"^w \\({qtype}\\): row {row} has a block whose scale or min is not"
    ):
        pack([first, bad])  # the second matrix of a fused run, named as itself


def _corrupt_file(tmp_path: Path, qtype: str, scale: float) -> Path:
    """A tiny model's file whose first layer's up projection is ``qtype`` (Q4_K, or Q4_0) with ``scale`` as
    the float16 d of its first block, every other matrix Q8_0."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file

    folder = pdkv_tiny_model_dir(init_std=0.2, hidden=256, heads=4, kv_heads=2, intermediate_size=512)
    name = "model.layers.0.mlp.up_proj.weight"
    if qtype == "Q4_K":
        blocks = kquant_tensors(folder, lambda n: qtype if n == name else None)[0][name][1].copy()
    else:
        up = load_file(str(folder / "model.safetensors"))[name].float().numpy()
        blocks = quants.quantize(up, GGMLQuantizationType[qtype])
    blocks[0, 0:2] = np.array([scale], np.float16).view(np.uint8)
    return write_gguf(folder, tmp_path / f"{qtype}.gguf", qtype="Q8_0", raw={name: (qtype, blocks)})


@pytest.mark.parametrize("weights", ["quantized", "bf16", "float32"])
def test_a_file_with_a_non_finite_block_scale_is_refused_by_name_in_every_path(
    weights: str, tmp_path: Path
) -> None:
    """A Q4_K block whose d is inf: packed or dequantized, every output of that matrix would be inf or NaN
    -- the file is refused at load, naming the weight, never served."""
    path = _corrupt_file(tmp_path, "Q4_K", np.inf)
    dtype = "float32" if weights == "float32" else "bfloat16"
    with pytest.raises(GGUFError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*not finite.*corrupt"):
        LLM(path, weights=weights, dtype=dtype, device="cpu")


def test_convert_gguf_refuses_a_corrupt_file_as_loading_it_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe: convert-gguf wrote a folder of inf weights from the file every load refuses
    (rc 0); and an OUT_DIR that is a file, or under one, was "not empty" or a traceback."""
    from pdkv.cli import main

    path = _corrupt_file(tmp_path, "Q4_K", np.inf)
    assert main(["convert-gguf", str(path), str(tmp_path / "out")]) == 2
    assert "model.layers.0.mlp.up_proj.weight has values that are not finite" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    (tmp_path / "afile").write_text("x")
    assert main(["convert-gguf", str(path), str(tmp_path / "afile")]) == 2
    assert "'afile' is a file, not a folder" in capsys.readouterr().err.replace(str(tmp_path) + "/", "")
    assert main(["convert-gguf", str(path), str(tmp_path / "afile" / "sub")]) == 2
    assert "cannot be made there" in capsys.readouterr().err


def test_a_q4_0_scale_too_large_for_its_packed_offset_runs_dequantized(
    kernel: QuantKernel, tmp_path: Path
) -> None:
    """Q4_0's d = 6e4 is finite, its -8 d is not in float16: that fused linear runs dequantized (its Q8_0
    gate shard too), every other one packed, and the model serves finite log-probs."""
    path = _corrupt_file(tmp_path, "Q4_0", 6e4)
    llm = _llm(path, "float32")
    layers = llm.engine.model.model.layers
    assert not isinstance(layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(layers[1].mlp.gate_up_proj, QuantLinear)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert all(o.logprobs is not None and np.isfinite(o.logprobs).all() for o in outs)


@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
def test_rows_dequantize_exactly_as_the_reference_does(kernel: QuantKernel, qtype: str) -> None:
    raw = random_blocks(qtype, 37, width(qtype, 96), seed=3)  # 37 rows: the last group padded
    packed = pack([raw])
    assert torch.equal(dequantize(kernel, packed), raw.dense(torch.float32))
    ids = torch.tensor([36, 0, 17, 17])
    rows = kernel.rows(packed.packed, packed.fmt, packed.rows, packed.cols, ids, torch.bfloat16)
    assert torch.equal(rows, raw.dense(torch.float32)[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match=r"outside 0\.\.36"):
        kernel.rows(packed.packed, packed.fmt, packed.rows, packed.cols, torch.tensor([37]), torch.float32)


@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [200, 40])  # one row: groups in pairs, a pair ending in a part group
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(
    kernel: QuantKernel, qtype: str, dtype: torch.dtype, n: int
) -> None:
    k = width(qtype, 576)
    linear = QuantLinear([pack([random_blocks(qtype, n, k, seed=5)])], None, kernel)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = linear(x)
    for count in (1, 2, 4, 5, 7, 8, 9, 33, 64, 65):  # 4 | 5: private activation buffers | shared
        assert torch.equal(linear(x[:count]), whole[:count])
    for i in (0, 8, 63, 69):
        assert torch.equal(linear(x[i : i + 1]), whole[i : i + 1])


@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 576), (200, 576), (576, 1536), (130, 96)])
def test_a_batch_1_call_gives_the_same_bits_with_1_to_4_groups_side_by_side(
    kernel: QuantKernel, qtype: str, dtype: torch.dtype, n: int, k: int
) -> None:
    """How many groups a batch-1 call streams side by side (PDKV_QUANT_ROW_GROUPS; by default 4 on an
    Intel CPU, 1 elsewhere) and how far ahead it prefetches (by the vendor) are speed only: each group's
    arithmetic is its own -- whole and part groups, a share per thread ending on any of them, prefetches
    reaching past the matrix's end."""
    k = width(qtype, k)
    linear = QuantLinear([pack([random_blocks(qtype, n, k, seed=n * 3 + k)])], None, kernel)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    was, was_prefetch = kernel.row_groups(), kernel.prefetch()
    try:
        outs = []
        ways = ((0, 0, 0), (1024, 2048, 0), (4096, 0, 1), (64, 1 << 20, 1))
        for groups, (near, far, nta) in itertools.product((1, 2, 3, 4), ways):
            assert kernel.row_groups(groups) == groups and kernel.prefetch(near, far, nta) == (near, far, nta)
            outs.append([linear(x[i : i + 1]) for i in range(3)])
    finally:
        kernel.row_groups(was)
        kernel.prefetch(*was_prefetch)
    assert kernel.prefetch() == was_prefetch
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", [*FORMATS, "bf16"])
def test_batch_calls_give_the_same_bits_with_the_weights_prefetched_either_way(
    kernel: QuantKernel, qtype: str
) -> None:
    """Non-temporal prefetches (prefetchnta, an AMD EPYC's default) or into L1 (an Intel Xeon's) are
    speed only: for the quantized batch-1 rows and the bfloat16 kernel at any batch alike (the quantized
    batch tiles, which keep theirs in L1 either way, give the same bits too)."""
    if qtype == "bf16" and not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    g = torch.Generator().manual_seed(7)
    if qtype == "bf16":
        linear = QuantLinear([pack_bf16(torch.randn(200, 576, generator=g).to(torch.bfloat16))], None, kernel)
    else:
        linear = QuantLinear([pack([random_blocks(qtype, 200, 576, seed=7)])], None, kernel)
    x = torch.randn(13, 576, generator=g).to(torch.bfloat16)
    outs, was = [], kernel.prefetch()
    try:
        for nta in (0, 1):
            kernel.prefetch(1024, 2048, nta)
            assert kernel.bf16_nta() == (nta == 1)
            outs.append([linear(x[:rows]) for rows in (1, 8, 13)])
    finally:
        kernel.prefetch(*was)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_the_prefetch_setting_follows_the_cpu_and_refuses_what_it_does_not_serve(
    kernel: QuantKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library starts with the vendor's setting (quant.c's three values and bf16_linear.c's non-
    temporal switch alike); a setting out of range changes nothing, in either file."""
    import engine.native_linear as nl

    start = row_prefetch_default()
    assert kernel.prefetch() == start
    assert kernel.bf16_nta() == (start[2] == 1)
    intel, amd = (1024, 2048, 0), (4096, 0, 1)
    for vendor, want in (("GenuineIntel", intel), ("AuthenticAMD", amd), ("HygonGenuine", amd), ("", intel)):
        monkeypatch.setattr(nl, "cpu_vendor", lambda v=vendor: v)
        assert nl.row_prefetch_default() == want
    try:
        kernel.prefetch(2048, 4096, 1)
        for refused in ((-1, 5, 0), (5, -1, 0), (5, 5, 2), (1 << 21, 0, 0), (0, 1 << 21, 0)):
            assert kernel.prefetch(*refused) == (2048, 4096, 1), refused
            assert kernel.bf16_nta()  # still on: the refused call set nothing
    finally:
        kernel.prefetch(*start)
    assert kernel.prefetch() == start


def test_the_row_groups_default_follows_the_cpu_and_the_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import engine.native_linear as nl

    monkeypatch.setattr(nl, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.delenv(nl.ROW_GROUPS_ENV, raising=False)
    assert nl.row_groups_default() == 4
    monkeypatch.setattr(nl, "cpu_vendor", lambda: "AuthenticAMD")
    assert nl.row_groups_default() == 1
    monkeypatch.setenv(nl.ROW_GROUPS_ENV, "3")
    assert nl.row_groups_default() == 3
    monkeypatch.setenv(nl.ROW_GROUPS_ENV, "eight")  # not 1-4: the CPU's default, and a warning
    with caplog.at_level("WARNING", logger="engine.native_linear"):
        assert nl.row_groups_default() == 1
    assert "PDKV_QUANT_ROW_GROUPS='eight' is not 1, 2, 3 or 4: using 1" in caplog.text


@pytest.fixture
def int8_tiles(kernel: QuantKernel) -> Iterator[QuantKernel]:
    """The kernel with its AMX-INT8 path on (quant_amx.h), put back as it was after the test."""
    was = kernel.int8_tiles()
    if not kernel.int8_tiles(True):
        pytest.skip("this CPU or build has no AMX-INT8 tiles (or Linux did not grant them)")
    yield kernel
    kernel.int8_tiles(was)


# Q6_K (Q8H) stays in the vectors with the tiles on: the same bits, and a tile path that took its blocks
# (one scale where Q8H has one per half) fails here
@pytest.mark.parametrize("qtype", KERNEL_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 32), (37, 96), (200, 608), (576, 1536), (130, 2048)])
def test_the_int8_tiles_give_the_vectors_bits(
    int8_tiles: QuantKernel, qtype: str, dtype: torch.dtype, n: int, k: int
) -> None:
    """The tiles' byte sums are the vectors' int16 sums exactly, and the float operations after them the
    same in the same order: equal bits for every row count -- row blocks of 16 and their tails, the
    private and shared activation buffers, chunks of 128 rows -- the format, the dtype, odd widths."""
    k = width(qtype, k)
    linear = QuantLinear([pack([random_blocks(qtype, n, k, seed=n + k)])], None, int8_tiles)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    x[3] = 0.0  # a zero row: scale 0
    x[5, :32] *= 1e4  # one large block: its hi bytes at the extremes
    for rows in (2, 3, 4, 5, 8, 15, 16, 17, 33, 129, 150):
        tiles = linear(x[:rows])
        int8_tiles.int8_tiles(False)
        vectors = linear(x[:rows])
        int8_tiles.int8_tiles(True)
        assert torch.equal(tiles, vectors), (rows, (tiles.float() - vectors.float()).abs().max())


@pytest.mark.parametrize(("n", "k"), [(1, 2), (37, 64), (200, 576), (16, 1538), (70, 96)])
def test_the_bf16_kernel_sums_within_float32_rounding_and_rounds_once(
    kernel: QuantKernel, n: int, k: int
) -> None:
    if not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    linear = QuantLinear([pack_bf16(w)], None, kernel)
    assert torch.equal(linear.dense_weight(torch.bfloat16), w)
    for rows in (1, 2, 5, 6, 7, 61, 130):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T
        y = linear(x).double()
        # one bfloat16 rounding of the float32 sum, and float32's own rounding along the k products
        bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().T) * k * 2.0**-24
        assert torch.all((y - exact).abs() <= bound), rows


def built_forms(kernel: QuantKernel) -> list[bool]:
    """The forms of bf16_linear.c's vector path this build has ([False] vdpbf16ps, [True] FMAs; none
    without AVX-512), the setting left as it was."""
    if not kernel.bf16:
        return []
    was = kernel.bf16_fma()
    forms = [f for f in (False, True) if kernel.bf16_fma(f) == f]
    kernel.bf16_fma(was)
    return forms


def bf16_forms(kernel: QuantKernel) -> list[bool]:
    """``built_forms``, the test skipped where the vectors do not run the bfloat16 linears."""
    if not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    if kernel.amx:
        pytest.skip("the bfloat16 linears run in AMX tiles here (tests/engine/test_bf16_amx.py)")
    return built_forms(kernel)


@pytest.fixture
def restore_form(kernel: QuantKernel) -> Iterator[None]:
    was = kernel.bf16_fma()
    yield
    kernel.bf16_fma(was)


@pytest.mark.usefixtures("restore_form")
def test_each_form_adds_each_pair_as_vdpbf16ps_does(kernel: QuantKernel) -> None:
    """Either form of the bfloat16 vectors -- vdpbf16ps, or two FMAs per pair (csrc/simd.h; the only
    form without AVX512-BF16) -- sums each output's products as the SDM's pseudocode for vdpbf16ps does:
    input 2p + 1's, then 2p's, pair after pair, each add rounded once -- the same bits as float32 torch ops
    in that order, then one bfloat16 rounding."""
    g = torch.Generator().manual_seed(5)
    for fma in bf16_forms(kernel):
        kernel.bf16_fma(fma)
        for n, k in ((37, 64), (16, 1538)):
            w = (torch.randn(n, k, generator=g) * torch.rand(n, k, generator=g) ** 4).to(torch.bfloat16)
            x = torch.randn(7, k, generator=g).to(torch.bfloat16)
            # an output where the order shows: 1 + 2^-24 rounds to 1 (a tie, to even), so inputs 1, 0, 3, 2
            # (1, 2^-24, -1, 2^-24) sum to 2^-24 and inputs 0, 1, 2, 3 to 0
            w[0] = 0.0
            w[0, :4] = torch.tensor([2.0**-24, 1.0, 2.0**-24, -1.0])
            x[:, :4] = 1.0
            got = QuantLinear([pack_bf16(w)], None, kernel)(x)
            assert torch.all(got[:, 0] == 2.0**-24)
            xf, wf = x.float(), w.float()
            acc = torch.zeros(7, n)
            for p in range(k // 2):
                for i in (2 * p + 1, 2 * p):  # each product exact in float32; each add rounds once
                    acc = acc + xf[:, i : i + 1] * wf[:, i][None, :]
            assert torch.equal(got, acc.to(torch.bfloat16)), (fma, n, k)


@pytest.mark.usefixtures("restore_form")
def test_each_form_reads_denormals_as_zero_and_flushes_them_as_vdpbf16ps_does(kernel: QuantKernel) -> None:
    """vdpbf16ps reads a denormal input as zero and flushes a denormal result; the FMAs run with MXCSR's
    DAZ and FTZ for the call, so they do the same -- and the caller's float arithmetic after the call
    keeps its denormals (the setting is put back)."""
    tiny = torch.tensor(1e-39).to(torch.bfloat16)  # a bfloat16 denormal
    assert 0 < abs(tiny.item()) < torch.finfo(torch.float32).tiny
    for fma in bf16_forms(kernel):
        kernel.bf16_fma(fma)
        w = torch.zeros(16, 64, dtype=torch.bfloat16)
        x = torch.zeros(1, 64, dtype=torch.bfloat16)
        w[0, 0], x[0, 0] = tiny, 1e30  # read as 0 * 1e30, not 1e-9
        w[1, 2], x[0, 2] = 1e-20, 1e-20  # 1e-40: a denormal result, flushed to 0
        w[2, 0] = 1.0  # 1e30, the control
        got = QuantLinear([pack_bf16(w)], None, kernel)(x)[0]
        assert got[0].item() == 0.0 and got[1].item() == 0.0, (fma, got[:3])
        assert got[2].item() == x[0, 0].item()
        assert (torch.tensor([1e-30]) * torch.tensor([1e-10])).item() != 0.0  # this thread: no FTZ left on


@pytest.mark.usefixtures("restore_form")
def test_the_two_forms_give_the_same_bits(kernel: QuantKernel) -> None:
    """Where the CPU has AVX512-BF16 the vectors sum with vdpbf16ps or with FMAs, chosen by the vendor
    (PDKV_BF16_FMA overrides): speed only -- every output the same bits, on values from denormal to
    overflowing, odd shapes and tails, any batch."""
    if len(bf16_forms(kernel)) < 2:
        pytest.skip("this build has one form (no AVX512-BF16: the FMAs)")
    g = torch.Generator().manual_seed(11)

    def wide(*shape: int) -> torch.Tensor:  # magnitudes from 1e-40 to 1e+40: denormals, zeros, infinities
        return (torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 30)).to(
            torch.bfloat16
        )

    for n, k in ((1, 2), (37, 64), (200, 576), (16, 1538), (70, 96)):
        linear = QuantLinear([pack_bf16(wide(n, k))], None, kernel)
        x = wide(130, k)
        for rows in (1, 2, 5, 7, 32, 61, 130):
            kernel.bf16_fma(False)
            vdp = linear(x[:rows])
            kernel.bf16_fma(True)
            fma = linear(x[:rows])
            nan = torch.isnan(vdp) & torch.isnan(fma)  # a NaN's payload may differ
            assert torch.equal(torch.isnan(vdp), torch.isnan(fma)), (n, k, rows)
            assert torch.equal(vdp.view(torch.int16)[~nan], fma.view(torch.int16)[~nan]), (n, k, rows)


def test_the_form_follows_the_cpu_and_the_variable(
    kernel: QuantKernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FMAs on an Intel CPU (vdpbf16ps at half their rate), vdpbf16ps elsewhere; PDKV_BF16_FMA overrides;
    the library starts with the default where its build has both forms."""
    import engine.native_linear as nl

    if len(built_forms(kernel)) == 2:
        assert kernel.bf16_fma() == bool(nl.bf16_fma_default())
    monkeypatch.delenv(nl.BF16_FMA_ENV, raising=False)
    for vendor, want in (("GenuineIntel", 1), ("AuthenticAMD", 0), ("HygonGenuine", 0), ("", 0)):
        monkeypatch.setattr(nl, "cpu_vendor", lambda v=vendor: v)
        assert nl.bf16_fma_default() == want
    monkeypatch.setenv(nl.BF16_FMA_ENV, "1")
    assert nl.bf16_fma_default() == 1
    monkeypatch.setenv(nl.BF16_FMA_ENV, "yes")  # not 0 or 1: the CPU's default, and a warning
    with caplog.at_level("WARNING", logger="engine.native_linear"):
        assert nl.bf16_fma_default() == 0
    assert "PDKV_BF16_FMA='yes' is not 0 or 1: using 0" in caplog.text


def test_the_bf16_kernel_gives_each_row_the_same_bits_in_any_batch(kernel: QuantKernel) -> None:
    if not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    g = torch.Generator().manual_seed(9)
    linear = QuantLinear([pack_bf16(torch.randn(200, 576, generator=g).to(torch.bfloat16))], None, kernel)
    x = torch.randn(130, 576, generator=g).to(torch.bfloat16)
    whole = linear(x)
    for count in (1, 2, 5, 6, 7, 12, 59, 60, 61, 129):
        assert torch.equal(linear(x[:count]), whole[:count]), count
    for i in (0, 5, 6, 60, 129):
        assert torch.equal(linear(x[i : i + 1]), whole[i : i + 1]), i


def test_parts_of_different_types_fill_their_own_columns(kernel: QuantKernel) -> None:
    a, b = random_blocks("Q4_1", 40, 64, seed=1), random_blocks("Q8_0", 24, 64, seed=2)
    split = QuantLinear([pack([a]), pack([b])], None, kernel)
    x = torch.randn(3, 64)
    assert torch.equal(split(x), torch.cat([QuantLinear([pack([r])], None, kernel)(x) for r in (a, b)], 1))
    with pytest.raises(ValueError, match="different types"):
        pack([a, b])


@pytest.mark.parametrize("nbytes", [8, 256, 264, 4096 + 72, (1 << 22) + 40])  # tails; a threaded size
def test_the_bandwidth_probe_reads_every_word_once(kernel: QuantKernel, nbytes: int) -> None:
    """The probe's checksum is the XOR of every 64-bit word of the buffer: its wide loads, its per-thread
    shares and the tail cover the buffer exactly once (a word read twice or skipped changes it)."""
    words = torch.from_numpy(np.random.default_rng(nbytes).integers(-(2**62), 2**62, nbytes // 8))
    expected = int(np.bitwise_xor.reduce(words.numpy()))
    assert kernel.read_bandwidth(words) == expected
    words[-1] ^= 1  # the last word: the tail's
    assert kernel.read_bandwidth(words) == expected ^ 1


def test_evicting_a_buffer_from_the_caches_keeps_its_bytes(kernel: QuantKernel) -> None:
    data = torch.from_numpy(np.random.default_rng(3).integers(0, 255, (1 << 22) + 17, dtype=np.uint8))
    copy = data.clone()
    kernel.evict(data)  # a threaded range, not a whole number of lines
    kernel.evict(data[5:70])  # a slice starting inside a line
    assert torch.equal(data, copy)


# -- the engine on quantized files ----------------------------------------------------------------------


def _deterministic_here() -> bool:
    kernels = native_kernels()
    return kernels is not None and kernels.prefill is not None


def _llm(path: Path, dtype: str = "bfloat16", weights: str = "quantized", **kw: Any) -> LLM:
    return LLM(path, dtype=dtype, weights=weights, device="cpu", block_size=BS, num_blocks=64, **kw)


def _fused_then_per_op(llm: LLM, run: Callable[[], list[Any]], why: str) -> tuple[list[bool], list[Any]]:
    """``run()`` with the model's fused decode call counted, then again on the per-op path (the prefix
    cache reset before each: both compute the same steps); asserts the two give the same tokens and
    log-probabilities.  Returns whether each fused call served its step, and the first run's outputs."""
    model = llm.engine.model.model
    fused = model.fused_decode
    assert fused is not None, why
    calls: list[bool] = []

    def counted(*args: Any) -> torch.Tensor | None:
        out = fused(*args)
        calls.append(out is not None)
        return out

    runs = []
    try:
        for use in (counted, None):
            model.fused_decode = use
            assert llm.engine.reset_prefix_cache()
            runs.append(run())
    finally:
        model.fused_decode = fused  # the engine as it was, for the caller's next run
    for x, y in zip(*runs, strict=True):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
    return calls, runs[0]


def _hf_logits(path: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers on the file (its own reader, weights dequantized to float32): each sequence's logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0].float() for s in sequences]


@pytest.mark.parametrize("qtype", FORMATS)
def test_greedy_output_matches_transformers_or_parts_only_at_a_near_tie(
    kernel: QuantKernel, qtype: str, files: dict[str, Path]
) -> None:
    """The quantized math in float32 activations: greedy tokens equal transformers' (float32, the same
    weights dequantized) on every prompt, or differ first at a step where transformers' top two logits
    lie within 0.05; the chosen tokens' log-probabilities within 0.01 (measured: under 0.002)."""
    llm = _llm(files[qtype], "float32")
    assert llm.engine.model.quantized
    _assert_greedy_near_transformers(llm, files[qtype], qtype)


def _assert_greedy_near_transformers(llm: LLM, path: Path, label: str) -> None:
    """``llm``'s greedy tokens equal transformers' on ``path`` (float32, the weights dequantized), or part
    only at a step whose top two logits lie within 0.05; the chosen tokens' log-probabilities within
    0.01 before any parting."""
    params = SamplingParams(max_tokens=12, logprobs=1)
    outs = llm.generate(PROMPTS, params)
    logits = _hf_logits(path, [p + o.token_ids for p, o in zip(PROMPTS, outs, strict=True)])
    worst = 0.0
    for prompt, out, lg in zip(PROMPTS, outs, logits, strict=True):
        steps = lg[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]  # the logits each token came from
        theirs = steps.argmax(-1).tolist()
        if theirs != out.token_ids:
            first = next(i for i, (a, b) in enumerate(zip(theirs, out.token_ids, strict=True)) if a != b)
            top2 = steps[first].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 0.05, f"{label}: step {first} differs with transformers' margin {gap:.3f}"
            steps = steps[:first]  # after a near-tie the sequences part: compare what came before
        ours = torch.tensor(out.logprobs)  # the chosen tokens' log-probabilities
        ref = steps.log_softmax(-1).gather(1, torch.tensor(out.token_ids[: len(steps)])[:, None])[:, 0]
        worst = max(worst, float((ours[: len(ref)] - ref).abs().max()))
    print(f"{label}: chosen-token log-probability max |diff| {worst:.4f}")
    assert worst < 0.01, worst


@pytest.mark.parametrize(
    ("qtype", "deterministic", "dtype"),
    [
        *((q, False, "bfloat16") for q in FORMATS),
        ("bf16 folder", False, "bfloat16"),
        ("Q4_1", True, "bfloat16"),
        ("bf16 folder", True, "bfloat16"),
        *((q, False, "float32") for q in FORMATS),
    ],
)
def test_the_fused_decode_layer_is_the_per_op_path_bit_for_bit(
    kernel: QuantKernel,
    qtype: str,
    deterministic: bool,
    dtype: str,
    files: dict[str, Path],
    folder: Path,
    tmp_path: Path,
) -> None:
    """Quantized weights, and a safetensors folder's bfloat16 weights on the native bfloat16 kernel;
    decode steps of one group and of several (12 requests: groups of 8) and of one request alone, and in
    deterministic mode every step, prefill chunks included.  float32 activations on quantized weights too
    (an AVX2 host's ``--dtype auto``): the per-op path then takes the native float32 SiLU as the fused call
    does."""
    if qtype == "bf16 folder" and not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    if dtype == "bfloat16" and not SiluMulKernel.supports(torch.bfloat16):
        pytest.skip("the bfloat16 SiLU kernel needs AVX-512 or AVX2: the per-op path has torch's SiLU")
    if deterministic and not _deterministic_here():
        pytest.skip("deterministic mode needs the native prefill attention (AVX-512 or AVX2)")
    if deterministic:  # the native prefill attention (deterministic mode's) takes head_dim 64, not 16
        folder = pdkv_tiny_model_dir(init_std=0.2, hidden=128, heads=2, kv_heads=1)
        files = {"Q4_1": write_gguf(folder, tmp_path / "hd64.gguf", qtype="Q4_1")}
    path, weights = (folder, "auto") if qtype == "bf16 folder" else (files[qtype], "quantized")
    llm = _llm(path, dtype, weights=weights, deterministic=deterministic, max_num_batched_tokens=64)
    prompts = [*PROMPTS, *([p[::-1] for p in PROMPTS] * 2)]  # 12: two decode groups
    params = SamplingParams(max_tokens=10, logprobs=1, ignore_eos=True)
    calls, _ = _fused_then_per_op(
        llm,
        lambda: llm.generate(prompts, params),
        f"a {dtype} model on packed weights decodes one call per layer",
    )
    assert sum(calls) >= 9, "decode steps took the fused call"
    if deterministic:
        assert all(calls), "in deterministic mode every step does"
    # one request alone: batch-1 calls, whose quantized linears stream the next layer's KV blocks in
    # (decode_layer.c's side stream) -- over a dozen blocks of a 40-token prompt and its output
    calls, _ = _fused_then_per_op(
        llm, lambda: llm.generate([PROMPTS[3]], params), "a lone request decodes one call per layer"
    )
    assert sum(calls) >= 9, "batch-1 decode steps took the fused call"


def test_the_fused_decode_layer_adds_lora_deltas_as_the_per_op_path_does(kernel: QuantKernel) -> None:
    """bfloat16 with two adapters on the native LoRA kernel: steps with adapter rows, without, and mixed
    take the fused call and give the per-op path's bits."""
    from tests.tiny_adapters import peft_adapter_dir
    from tests.tiny_models import tiny_model_dir

    if not kernel.bf16:
        pytest.skip("this build has neither AVX-512 nor AVX2 code (the bfloat16 kernel)")
    a, b = peft_adapter_dir("llama", "r16"), peft_adapter_dir("llama", "attn_only")
    llm = LLM(
        tiny_model_dir("llama"), dtype="bfloat16", device="cpu", block_size=BS, num_blocks=128,
        loras=(("A", str(a)), ("B", str(b))),
    )  # fmt: skip
    prompts = [p[:12] for p in PROMPTS] * 2
    adapters = ["A", None, "B", "A", None, None, "B", "B"]
    params = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    calls, outs = _fused_then_per_op(
        llm,
        lambda: llm.generate(prompts, params, adapters=adapters) + llm.generate(prompts, params),
        "LoRA wrappers on the native kernel keep the fused call",
    )
    assert sum(calls) >= 14
    assert outs[0].token_ids != outs[8].token_ids or outs[2].token_ids != outs[10].token_ids


def test_lora_on_the_torch_path_keeps_the_fused_call_for_steps_without_adapters(
    kernel: QuantKernel, tmp_path: Path
) -> None:
    """float32 on quantized weights (an AVX2 host's default), adapters on the torch path (the native LoRA
    kernel is bfloat16's): steps without adapter rows take the fused call, steps with them the per-op
    path; both give the per-op path's bits.  (Before, any LoRA engine lost the fused call: ~10% of its
    decode rate with no adapter in the batch on an AVX2 EPYC.)"""
    from tests.tiny_adapters import peft_adapter_dir

    # pdkv's tiny model (it has a tokenizer to write into the GGUF) has the HF tiny llama's attention
    # shapes: adapters on q/k/v/o written by peft over that one fit it.
    gguf = write_gguf(pdkv_tiny_model_dir(), tmp_path / "tiny-q4.gguf", qtype="Q4_1")
    a, b = peft_adapter_dir("llama", "attn_only"), peft_adapter_dir("llama", "attn_only", seed=1)
    llm = _llm(gguf, "float32", loras=(("A", str(a)), ("B", str(b))))
    prompts = [p[:12] for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    calls, outs = _fused_then_per_op(
        llm,
        lambda: llm.generate(prompts, params) + llm.generate(prompts, params, adapters=["A", None] * 4),
        "a LoRA engine on the torch path keeps the fused call",
    )
    assert calls.count(True) >= 7, "the base-only decode steps took the fused call"
    assert calls.count(False) >= 7, "the steps with adapter rows did not"
    assert outs[0].token_ids != outs[8].token_ids  # adapter A changed request 0's output


def test_every_path_gives_the_local_tokens(
    kernel: QuantKernel, files: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Local, a prefix hit, a load from each store tier: the same tokens from quantized weights."""
    path = files["Q4_1"]
    prompt, params = PROMPTS[3], SamplingParams(max_tokens=10)
    local = _llm(path)
    [want] = local.generate([prompt], params)
    [hit] = local.generate([prompt], params)
    assert hit.token_ids == want.token_ids and hit.num_cached_tokens > 0
    local.engine.shutdown()
    for tier in ("cpu", "disk"):
        spec = store_tier_spec(tier, tmp_path / tier, request)
        connector = KVConnectorConfig("offload", {"kv_store": spec, "lookup_timeout_s": 5.0})
        writer = _llm(path, kv_connector=connector)
        [first] = writer.generate([prompt], params)
        assert writer.engine.drain(10.0)
        if tier == "disk":
            writer.engine.shutdown()
            writer = _llm(path, kv_connector=connector)  # a fresh engine: only the disk has the blocks
        else:
            assert writer.engine.reset_prefix_cache()  # the device cache empty: the CPU tier has them
        [loaded] = writer.generate([prompt], params)
        assert first.token_ids == loaded.token_ids == want.token_ids, tier
        assert loaded.num_external_tokens > 0, tier
        writer.engine.shutdown()


def _p2p_engine(path: Path, engine_id: str, weights: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            dtype="bfloat16",
            weights=weights,
            block_size=BS,
            num_blocks=64,
            engine_id=engine_id,
            kv_connector=KVConnectorConfig("p2p", {"recv_timeout_s": 2.0}),
        )
    )


@pytest.mark.parametrize("consumer_weights", ["quantized", "bf16"])
def test_p2p_hands_kv_over_between_quantized_nodes_only(
    kernel: QuantKernel, consumer_weights: str, files: dict[str, Path]
) -> None:
    """Prefill on quantized weights, decode elsewhere: a quantized decode node pulls the blocks and
    continues with the local tokens; one on the same file dequantized refuses them (another KV
    fingerprint) and computes its own."""
    path = files["Q4_1"]
    prompt = PROMPTS[3]
    [local] = _llm(path, weights=consumer_weights).generate([prompt], SamplingParams(max_tokens=10))
    producer = _p2p_engine(path, "producer", "quantized")
    consumer = _p2p_engine(path, "consumer", consumer_weights)
    try:
        producer.add_request("r", prompt, SamplingParams(max_tokens=1), kv_transfer_params=RemoteDecode())
        final = run_until([producer], lambda: producer.scheduler.get_request("r") is None)["r"][-1]
        assert isinstance(final.kv_transfer_params, RemotePrefill)
        first = final.new_token_ids[0]
        consumer.add_request(
            "r",
            [*prompt, first],
            SamplingParams(max_tokens=9),
            kv_transfer_params=final.kv_transfer_params,
            prior_output_token_ids=(first,),
        )
        outs = run_until(
            [consumer, producer], lambda: not consumer.has_pending_work() and not producer.has_pending_work()
        )["r"]
        if consumer_weights == "quantized":
            assert [first, *tokens(outs)] == local.token_ids
            assert outs[-1].num_external_tokens > 0
        else:
            assert outs[-1].num_external_tokens == 0
        assert_idle(producer)
        assert_idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_store_written_from_dequantized_weights_gives_quantized_nodes_no_hits(
    kernel: QuantKernel, files: dict[str, Path], tmp_path: Path
) -> None:
    connector = KVConnectorConfig("offload", {"kv_store": f"disk:{tmp_path / 'kv'}:64MiB"})
    path, prompt, params = files["Q8_0"], PROMPTS[3], SamplingParams(max_tokens=4)
    dense = _llm(path, weights="bf16", kv_connector=connector)
    dense.generate([prompt], params)
    assert dense.engine.drain(10.0)
    dense_ns = dense.engine.namespace.model_fingerprint
    dense.engine.shutdown()
    quantized = _llm(path, kv_connector=connector)
    assert (
        quantized.engine.namespace.model_fingerprint
        == f"{dense_ns};weights=quantized;activations=int16/32639"
    )
    [out] = quantized.generate([prompt], params)
    assert out.num_external_tokens == 0
    quantized.engine.shutdown()


def test_the_weights_stay_as_the_file_ships_them(kernel: QuantKernel, files: dict[str, Path]) -> None:
    """No dense copy of a quantized matrix: every linear packed, the embedding read from the LM head's
    own bytes, and the packed bytes those of the file's blocks (16-row groups padded)."""
    from gguf import GGUFReader

    path = files["Q4_1"]
    model = _llm(path).engine.model.model
    assert not any(isinstance(m, torch.nn.Linear | PackedLinear) for m in model.modules())
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, QuantLinear)
    tied = model.lm_head.parts[0][1].packed is model.embed_tokens.weight_q.packed
    assert tied == model.config.tie_word_embeddings
    file_blocks = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.tensor_type.name == "Q4_1")
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    packed += 0 if tied else model.embed_tokens.weight_q.nbytes
    assert packed == file_blocks  # the tiny model's row counts are whole groups
    assert weight_bytes(model) < 1.3 * path.stat().st_size


# -- the choice, its refusals and its fallback ----------------------------------------------------------


def test_auto_runs_quantized_in_bfloat16_and_dequantized_in_explicit_float32(
    kernel: QuantKernel, files: dict[str, Path]
) -> None:
    assert LLM(files["Q4_0"], device="cpu", dtype="bfloat16", num_blocks=16).engine.model.quantized
    assert not LLM(files["Q4_0"], device="cpu", dtype="float32", num_blocks=16).engine.model.quantized


def test_quantized_is_refused_by_name_where_it_cannot_be_served(
    files: dict[str, Path], folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="weights 'quantized' cannot be served: the model has no Q8_0"):
        LLM(folder, weights="quantized", device="cpu")
    f16 = write_gguf(folder, tmp_path / "f16.gguf", qtype="F16")
    with pytest.raises(ValueError, match="has no Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K matrices"):
        LLM(f16, weights="quantized", device="cpu")
    with pytest.raises(ValueError, match="weights 'bf16' computes in bfloat16, but dtype is 'float32'"):
        LLM(files["Q8_0"], weights="bf16", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="weights 'int3' is not supported; choose one of auto, quantized"):
        LLM(files["Q8_0"], weights="int3", device="cpu")
    monkeypatch.setenv("PDKV_NATIVE", "0")
    with pytest.raises(ValueError, match="the native kernels are not built here"):
        LLM(files["Q8_0"], weights="quantized", device="cpu")


def test_without_the_kernels_auto_falls_back_to_the_dequantized_weights(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=8)
    monkeypatch.setenv("PDKV_NATIVE", "0")  # no native kernels at all: the torch paths throughout
    dense = [o.token_ids for o in _llm(files["Q4_1"], weights="bf16").generate(PROMPTS, params)]
    llm = _llm(files["Q4_1"], weights="auto")
    assert not llm.engine.model.quantized
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == dense


def test_k_quant_mixes_run_packed_and_a_file_without_a_packed_type_dequantized(
    kernel: QuantKernel, tmp_path: Path
) -> None:
    """Q4_K q/k with a Q6_K v, Q8_0 o, Q5_K gate with a Q4_K up, Q6_K down (llama.cpp's Q4_K_M / Q5_K_M
    mixes): ``quantized`` packs every matrix (Q4_K's sub-blocks with float32 scales and mins: 4/3 of its
    bytes; Q5_K's over bytes: 20/11; Q6_K's quants as bytes with a float32 scale per 16: 32/21), a fused
    linear's shards of two types as two parts; greedy output as transformers' on the same file (float32,
    dequantized) within the quantized math's tie rule; the fused decode layer serves the parts and gives
    the per-op path's bits.  A file of F16 matrices, which no kernel runs, is refused by ``quantized`` by
    name and runs dequantized under ``auto``, as ``--weights bf16`` does."""
    folder = pdkv_tiny_model_dir(init_std=0.2, hidden=256, heads=4, kv_heads=2, intermediate_size=512)
    mix = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "gate_proj": "Q5_K", "up_proj": "Q4_K"}
    mix["down_proj"] = "Q6_K"
    raw, _ = kquant_tensors(folder, lambda name: mix.get(name.rsplit(".", 2)[-2]), seed=3)
    mixed = write_gguf(folder, tmp_path / "mixed.gguf", qtype="Q8_0", raw=raw)
    llm = _llm(mixed, "float32")
    assert llm.engine.model.quantized
    # per module, its parts: (file matrices, type, quant.c layout)
    expect = {
        "self_attn.qkv_proj": [(("q_proj", "k_proj"), "Q4_K", 3), (("v_proj",), "Q6_K", 4)],
        "self_attn.o_proj": [(("o_proj",), "Q8_0", 0)],
        "mlp.gate_up_proj": [(("gate_proj",), "Q5_K", 5), (("up_proj",), "Q4_K", 3)],
        "mlp.down_proj": [(("down_proj",), "Q6_K", 4)],
    }
    ratios = {"Q4_K": (3, 4), "Q5_K": (11, 20), "Q6_K": (21, 32)}  # packed : file bytes, whole groups of 16
    for i, layer in enumerate(llm.engine.model.model.layers):
        for path, parts in expect.items():
            got = [w for _, w in layer.get_submodule(path).parts]
            assert [(w.qtype, w.fmt) for w in got] == [(qtype, fmt) for _, qtype, fmt in parts]
            prefix = f"model.layers.{i}.{path.split('.')[0]}"
            for w, (names, qtype, _) in zip(got, parts, strict=True):
                if qtype in ratios:
                    a, b = ratios[qtype]
                    assert a * w.nbytes == b * sum(raw[f"{prefix}.{n}.weight"][1].nbytes for n in names)
    _assert_greedy_near_transformers(llm, mixed, "Q4_K_M-like mix")
    # blocks made before these types ran packed (dequantized, other bits) are another namespace
    assert llm.engine.namespace.model_fingerprint.endswith(
        ";weights=quantized;activations=int16/32639;packed=Q4_K,Q5_K,Q6_K"
    )

    bf16 = _llm(mixed, "bfloat16", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    prompts = [*PROMPTS, *([p[::-1] for p in PROMPTS] * 2)]
    calls, _ = _fused_then_per_op(bf16, lambda: bf16.generate(prompts, params), "linears of two parts fuse")
    assert sum(calls) >= 6

    f16 = write_gguf(folder, tmp_path / "f16.gguf", qtype="F16")
    with pytest.raises(ValueError, match="cannot be served: the model has no Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,"):
        _llm(f16)
    auto = _llm(f16, weights="auto")
    assert not auto.engine.model.quantized
    params = SamplingParams(max_tokens=8)
    assert [o.token_ids for o in auto.generate(PROMPTS, params)] == [
        o.token_ids for o in _llm(f16, weights="bf16").generate(PROMPTS, params)
    ]


def test_a_linear_of_three_types_runs_packed_and_in_the_fused_decode_layer(
    kernel: QuantKernel, tmp_path: Path
) -> None:
    """q, k and v in three types (the fused layer's most parts, decode_layer.c's PDKV_MAX_PARTS): three
    parts in their own columns -- greedy output as transformers' within the tie rule -- and the fused
    decode call serves them with the per-op path's bits."""
    folder = pdkv_tiny_model_dir(init_std=0.2, hidden=256, heads=4, kv_heads=2, intermediate_size=512)
    mix = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q6_K"}
    raw, _ = kquant_tensors(folder, lambda name: mix.get(name.rsplit(".", 2)[-2]), seed=4)
    path = write_gguf(folder, tmp_path / "three.gguf", qtype="Q8_0", raw=raw)
    llm = _llm(path, "float32")
    for layer in llm.engine.model.model.layers:
        assert [w.qtype for _, w in layer.self_attn.qkv_proj.parts] == ["Q4_K", "Q5_K", "Q6_K"]
    _assert_greedy_near_transformers(llm, path, "q/k/v in three types")
    bf16 = _llm(path, "bfloat16", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    calls, _ = _fused_then_per_op(bf16, lambda: bf16.generate(PROMPTS, params), "three parts fuse")
    assert sum(calls) >= 6


def test_a_packed_lm_head_alone_leaves_the_kv_namespace_as_the_layers_make_it(
    kernel: QuantKernel, tmp_path: Path
) -> None:
    """Only the layers' linears make the KV bits: a Q6_K output matrix (llama.cpp's usual head in a Q4_0 or
    Q8_0 file) adds no ``packed=Q6_K``, and a file of F16 layers whose head alone is Q8_0 runs its layers
    as --weights bf16 does and shares its namespace (and its tokens)."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file

    folder = pdkv_tiny_model_dir(init_std=0.2, hidden=256, heads=4, kv_heads=2, intermediate_size=512)
    raw, _ = kquant_tensors(folder, lambda n: "Q6_K" if n == "lm_head.weight" else None)
    llm = _llm(write_gguf(folder, tmp_path / "q6-head.gguf", qtype="Q8_0", raw=raw))
    assert [w.qtype for _, w in llm.engine.model.model.lm_head.parts] == ["Q6_K"]
    assert llm.engine.namespace.model_fingerprint.endswith(";weights=quantized;activations=int16/32639")

    head = load_file(str(folder / "model.safetensors"))["lm_head.weight"].float().numpy()
    q8 = ("Q8_0", quants.quantize(head, GGMLQuantizationType.Q8_0))
    path = write_gguf(folder, tmp_path / "f16-q8-head.gguf", qtype="F16", raw={"lm_head.weight": q8})
    packed_head, dense = _llm(path), _llm(path, weights="bf16")
    assert isinstance(packed_head.engine.model.model.lm_head, QuantLinear)
    assert not any(
        isinstance(m, QuantLinear) and m.parts[0][1].qtype != "BF16"
        for m in packed_head.engine.model.model.layers.modules()
    )
    assert packed_head.engine.namespace.model_fingerprint == dense.engine.namespace.model_fingerprint


# -- bad files ------------------------------------------------------------------------------------------


def test_a_file_cut_inside_a_block_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    data = files["Q4_1"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 7])  # the last tensor loses part of its last block
    with pytest.raises(GGUFError, match="truncated"):
        LLM(path, weights="quantized", device="cpu")


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL"])
def test_a_type_without_a_reader_is_refused_by_name(qtype: str, tmp_path: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType

    path = tmp_path / "k-quant.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    kind = GGMLQuantizationType[qtype]
    w.add_tensor("token_embd.weight", np.zeros((4, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=f"has type {qtype}, which pdkv does not dequantize"):
        LLM(path, weights="quantized", device="cpu")
