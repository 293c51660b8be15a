"""The native prefill attention (engine/csrc/paged_prefill.c) against the torch path.

The kernel reads a chunk's keys and values -- its cached prefix and its own, already written -- from the
paged cache and runs flash-attention style with bfloat16 dot products; the torch path gathers the prefix
and runs SDPA with a causal mask.  Both must agree (to bfloat16 rounding of the probabilities and the
output) for every chunk the engine makes: first chunks and later ones, one row or hundreds, grouped and
plain heads, sliding windows, blocks in any order, and must never read a block outside the chunk's table.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from engine import native
from engine.attention import PrefillChunk, _prefill_attention
from engine.cpu_features import bf16_kernels_cpu
from tests.engine.test_model_parity import GREEDY, assert_teacher_forced, make_llm
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.skipif(not bf16_kernels_cpu(), reason="needs AVX-512 or AVX2 (the kernel)")


@pytest.fixture(scope="module", params=["vectors", "tiles"])
def kernel(request: pytest.FixtureRequest) -> Iterator[native.PrefillKernel]:
    """The kernel on each of its paths (process-wide for the module's tests, then put back): vdpbf16ps
    vectors (or their FMA form), and AMX tiles where the CPU, the build and Linux give them
    (engine/csrc/attn_amx.h: other bits, the same promises)."""
    kernels = native.native_kernels()
    assert kernels is not None, "the native kernels did not build on this machine (gcc is part of the setup)"
    prefill = kernels.prefill
    assert prefill is not None, "gcc built no AVX-512 code on a CPU that has it"
    was = prefill.amx
    if prefill.amx_fn(int(request.param == "tiles")) != (request.param == "tiles"):
        prefill.amx_fn(int(was))
        pytest.skip("no AMX-BF16 tiles here (the CPU, the build or Linux's grant)")
    try:
        yield prefill
    finally:
        prefill.amx_fn(int(was))


def _case(
    heads: int, kv_heads: int, head_dim: int, block_size: int, start: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, PrefillChunk]:
    """A cache whose blocks outside the chunk's table are NaN, the chunk's (shuffled) table, and its
    queries as the engine hands them over: a strided view of the rotated [n, H + Hkv, D]."""
    gen = torch.Generator().manual_seed(start * 31 + n + heads + head_dim)
    layers, used = 2, -(-(start + n) // block_size)
    num_blocks = used + 16
    cache = torch.full((num_blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"))
    table = torch.randperm(num_blocks, generator=gen)[:used]
    cache[table] = torch.randn(used, layers, 2, block_size, kv_heads, head_dim, generator=gen)
    qk = torch.randn(n, heads + kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    return qk[:, :heads], cache.to(torch.bfloat16), PrefillChunk(0, n, start, table)


def _torch_path(
    q: torch.Tensor, cache: torch.Tensor, layer: int, chunk: PrefillChunk, window: int | None
) -> torch.Tensor:
    """The engine's SDPA path, its own keys and values taken from the cache where the kernel reads them."""
    bs, head_dim = cache.shape[3], cache.shape[5]
    rows = torch.arange(chunk.start_position, chunk.context_len)
    blocks = chunk.block_ids[rows // bs]
    k = cache[blocks, layer, 0, rows % bs]  # [n, Hkv, D]
    v = cache[blocks, layer, 1, rows % bs]
    clean = cache.nan_to_num(0.0)  # SDPA reads whole gathered blocks; the kernel only visible keys
    return _prefill_attention(q, k, v, clean, layer, chunk, head_dim**-0.5, window)


SHAPES = [
    # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2's heads
    (4, 2, 128, 8),
    (8, 8, 32, 4),  # no grouping
    (16, 1, 64, 16),  # multi-query: 4 rows per task
]
CHUNKS = [
    # start, n: a first chunk of one row, rows ending on and off tiles and tasks, later chunks
    (0, 1),
    (0, 7),
    (0, 64),
    (0, 150),
    (5, 1),
    (37, 50),
    (100, 300),
]


@pytest.mark.parametrize("window", [None, 1, 8, 40])
@pytest.mark.parametrize("chunk", CHUNKS, ids=[f"start{c[0]}n{c[1]}" for c in CHUNKS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{s[0]}kv{s[1]}d{s[2]}bs{s[3]}" for s in SHAPES])
def test_the_kernel_matches_the_torch_path(
    kernel: native.PrefillKernel, shape: tuple, chunk: tuple, window: int | None
) -> None:
    heads, kv_heads, head_dim, block_size = shape
    q, cache, pc = _case(heads, kv_heads, head_dim, block_size, *chunk)
    for layer in range(cache.shape[1]):
        got = kernel(q, cache, layer, pc.block_ids, pc.start_position, scale=head_dim**-0.5, window=window)
        want = _torch_path(q, cache, layer, pc, window)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert torch.isfinite(got).all(), "the kernel read a block outside the chunk's table"
        # both round their probabilities to bfloat16, in different places, and the output once
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _batch_cache(
    shape: tuple, seqs: int, longest: int, gen: torch.Generator, layers: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 cache with room for ``seqs`` sequences of up to ``longest`` positions, their tables
    (shuffled blocks, filled at random) and every other block NaN: a read outside a table shows."""
    _, kv_heads, head_dim, block_size = shape
    width = -(-longest // block_size) + 1
    num_blocks = seqs * width + 8
    cache = torch.full((num_blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"))
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)
    used = tables.flatten()
    cache[used] = torch.randn(used.shape[0], layers, 2, block_size, kv_heads, head_dim, generator=gen)
    return cache.bfloat16(), tables


PAIRED_SHAPES = [*SHAPES, (9, 3, 64, 32), (4, 2, 64, 6)]


@pytest.mark.parametrize("shape", PAIRED_SHAPES, ids=["h{}kv{}d{}bs{}".format(*s) for s in PAIRED_SHAPES])
def test_the_paired_order_gives_the_canonical_orders_bits(kernel: native.PrefillKernel, shape: tuple) -> None:
    """Deterministic mode's cache order (keys and values as the kernel's tiles take them: copies, not
    transposes) changes where the bytes sit, not one bit of the attention: prefill chunks and a decode
    batch (a chunk of one per sequence, enough of them for one task per row), windows, blocks shuffled,
    blocks outside the tables NaN."""
    from engine.native_attention import KV_PAIRED
    from tests.engine.test_native_attention import to_paired

    heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim)
    layers, seqs, longest = 2, 12, 200
    cache, tables = _batch_cache(shape, seqs, longest, gen, layers)
    paired = to_paired(cache)
    cases = [  # (starts, counts): a decode batch; prefill chunks, first and later, with a decode row
        (torch.randint(0, longest, (seqs,), generator=gen), torch.ones(seqs, dtype=torch.int64)),
        (torch.tensor([0, 37, 150, 199]), torch.tensor([64, 50, 40, 1])),
    ]
    for starts, counts in cases:
        table = tables[: starts.shape[0]].contiguous()
        q = torch.randn(int(counts.sum()), heads + kv_heads, head_dim, generator=gen).bfloat16()[:, :heads]
        for window in (None, 8, 40):
            for layer in range(layers):
                args = (layer, table, starts, counts)
                want = kernel.many(q, cache, *args, scale=head_dim**-0.5, window=window)
                got = kernel.many(q, paired, *args, scale=head_dim**-0.5, window=window, kv_order=KV_PAIRED)
                assert torch.isfinite(want).all()
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))


ROW_SHAPES = [*PAIRED_SHAPES, (12, 4, 64, 16), (24, 8, 128, 16), (10, 5, 32, 16)]


@pytest.mark.parametrize("paired", [False, True], ids=["canonical", "paired"])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=["h{}kv{}d{}bs{}".format(*s) for s in ROW_SHAPES])
def test_a_decode_rows_bits_are_the_same_alone_and_in_a_batch(
    kernel: native.PrefillKernel, shape: tuple, paired: bool
) -> None:
    """In a decode batch (enough rows for a task per row) one task packs and attends every KV head of a
    row; alone, a row runs one task per KV head.  Same bits either way, at every position (tile ends,
    partial tiles, windows), for grouped, plain and many KV heads, with blocks outside the tables NaN."""
    from engine.native_attention import KV_PAIRED
    from tests.engine.test_native_attention import to_paired

    heads, kv_heads, head_dim, _ = shape
    gen = torch.Generator().manual_seed(heads * 13 + head_dim)
    longest = 120
    marks = [0, 1, 31, 32, 33, 63, 64, 95, 100, longest - 1]  # around the 32-key tiles
    seqs = max(len(marks), 4 * torch.get_num_threads())  # a task per row from 4 rows per thread
    cache, tables = _batch_cache(shape, seqs, longest, gen)
    order = {}
    if paired:
        cache, order = to_paired(cache), {"kv_order": KV_PAIRED}
    starts = torch.tensor([marks[r % len(marks)] for r in range(seqs)])
    counts = torch.ones(seqs, dtype=torch.int64)
    q = torch.randn(seqs, heads + kv_heads, head_dim, generator=gen).bfloat16()[:, :heads]
    for window in (None, 40):
        args = {"scale": head_dim**-0.5, "window": window, **order}
        batch = kernel.many(q, cache, 1, tables, starts, counts, **args)
        assert torch.isfinite(batch).all()
        for r in range(seqs):
            one = slice(r, r + 1)
            alone = kernel.many(q[one], cache, 1, tables[one], starts[one], counts[:1], **args)
            assert torch.equal(alone.view(torch.int16), batch[one].view(torch.int16)), (r, window)


# SmolLM2's heads; head dims whose 16-dim columns are not a multiple of 4 (the tiles' last value step
# takes two) and the largest; 16 query heads per KV head (a task's 64 vectors); blocks of 8 (no tile read
# in place)
INVARIANT_SHAPES = [(9, 3, 64, 16), (16, 1, 96, 16), (8, 1, 256, 8), (32, 2, 160, 16)]


@pytest.mark.parametrize("paired", [False, True], ids=["canonical", "paired"])
@pytest.mark.parametrize("window", [None, 40, 300])
@pytest.mark.parametrize(
    "shape", INVARIANT_SHAPES, ids=["h{}kv{}d{}bs{}".format(*s) for s in INVARIANT_SHAPES]
)
def test_a_tokens_bits_are_the_same_in_any_chunk_and_as_a_decode_row(
    kernel: native.PrefillKernel, shape: tuple, window: int | None, paired: bool
) -> None:
    """A sequence of 700 positions -- past the 32-key tiles and the tiles' 256-key spans of the AMX
    path's softmax -- attended as one chunk, as chunks split on and off those edges (all in one call, and
    beside a decode row of another sequence), as a decode batch of every 7th position (a task per row,
    each streaming the next in) and a row at a time: every row the same bits.  With a window the rows'
    first keys move through the spans, so a span counted from anything but absolute positions shows."""
    from engine.native_attention import KV_PAIRED
    from tests.engine.test_native_attention import to_paired

    heads, kv_heads, head_dim, _ = shape
    gen = torch.Generator().manual_seed(700 + (window or 0) + head_dim)
    longest = 700
    cache, tables = _batch_cache(shape, 2, longest, gen)
    order = {}
    if paired:
        cache, order = to_paired(cache), {"kv_order": KV_PAIRED}
    args = {"scale": head_dim**-0.5, "window": window, **order}
    q = torch.randn(longest + 1, heads + kv_heads, head_dim, generator=gen).bfloat16()[:, :heads]
    one = tables[:1].contiguous()
    whole = kernel.many(q[:longest], cache, 1, one, torch.tensor([0]), torch.tensor([longest]), **args)
    assert torch.isfinite(whole).all()
    for cuts in ([0, 255, 256, 257, 511, 512, 700], [0, 31, 300, 700], [0, 1, 699, 700]):
        starts = torch.tensor([*cuts[:-1], 5])
        counts = torch.tensor([b - a for a, b in itertools.pairwise(cuts)] + [1])
        table = torch.cat([one.expand(len(cuts) - 1, -1), tables[1:2]]).contiguous()
        got = kernel.many(q, cache, 1, table, starts, counts, **args)  # q's last row: the decode row
        assert torch.equal(got[:longest].view(torch.int16), whole.view(torch.int16)), cuts
    rows = torch.arange(3, longest, 7)
    batch = kernel.many(
        q[rows], cache, 1, one.expand(len(rows), -1).contiguous(), rows, torch.ones_like(rows), **args
    )
    assert torch.equal(batch.view(torch.int16), whole[rows].view(torch.int16))
    for pos in (0, 1, 31, 32, 255, 256, 257, 300, 511, 512, 513, 530, 699):
        row = kernel.many(q[pos : pos + 1], cache, 1, one, torch.tensor([pos]), torch.tensor([1]), **args)
        assert torch.equal(row.view(torch.int16), whole[pos : pos + 1].view(torch.int16)), pos


def test_strided_queries_are_read_in_place(kernel: native.PrefillKernel) -> None:
    q, cache, pc = _case(9, 3, 64, 16, 20, 45)
    assert not q.is_contiguous()
    got = kernel(q, cache, 1, pc.block_ids, 20, scale=0.125, window=None)
    assert torch.equal(got, kernel(q.contiguous(), cache, 1, pc.block_ids, 20, scale=0.125, window=None))


def test_a_bad_block_table_raises_instead_of_reading_outside_the_cache(kernel: native.PrefillKernel) -> None:
    q, cache, pc = _case(4, 2, 32, 4, 6, 9)  # positions 6..14: blocks 0..3
    for table, match in (
        (pc.block_ids.clone().fill_(cache.shape[0]), "outside"),  # a block id past the cache
        (pc.block_ids.clone().fill_(-1), "outside"),
        (pc.block_ids[:3], "beyond the 3 given"),  # too short for the chunk
    ):
        with pytest.raises(IndexError, match=match):
            kernel(q, cache, 0, table, 6, scale=0.25, window=None)
    with pytest.raises(IndexError, match="layer"):
        kernel(q, cache, cache.shape[1], pc.block_ids, 6, scale=0.25, window=None)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("name", ["llama_hd32", "mistral_window_hd32"])
def test_a_bfloat16_engine_prefills_with_the_kernel_and_matches_transformers(
    name: str, deterministic: bool
) -> None:
    """Chunked (7 tokens a step), with a prefix hit and a window: teacher-forced against transformers,
    within bfloat16's tie rule -- with deterministic mode too (engine/determinism.py)."""
    shared = random_prompts([26], seed=3)[0]
    prompts = [*random_prompts([5, 17, 40], seed=2), [*shared, 4, 5], [*shared, 9]]
    llm = make_llm(name, dtype="bfloat16", max_num_batched_tokens=7, deterministic=deterministic)
    assert llm.engine.runner.prefill_kernel is not None
    assert llm.engine.determinism.on == deterministic
    outs = llm.generate(prompts[:4], GREEDY) + llm.generate(prompts[4:], GREEDY)
    assert outs[-1].num_cached_tokens == 24
    assert_teacher_forced(name, "bfloat16", prompts, outs)


def test_an_empty_chunk_and_a_long_prefix_then_a_short_one(kernel: native.PrefillKernel) -> None:
    """Nothing to attend returns nothing; a short chunk after a long prefix reuses the packing buffer the
    long one grew, and both answer right."""
    q, cache, pc = _case(4, 2, 32, 4, 0, 3)
    assert kernel(q[:0], cache, 0, pc.block_ids, 0, scale=0.2, window=None).shape == (0, 4, 32)
    for heads, kv_heads, head_dim, start, n in ((16, 8, 256, 4200, 2), (4, 2, 32, 0, 9)):
        q, cache, pc = _case(heads, kv_heads, head_dim, 16, start, n)
        got = kernel(q, cache, 1, pc.block_ids, start, scale=head_dim**-0.5, window=None)
        torch.testing.assert_close(
            got.float(), _torch_path(q, cache, 1, pc, None).float(), atol=2e-2, rtol=2e-2
        )


def test_float32_keeps_sdpa() -> None:
    """float32 is the dtype compared with transformers token for token: its prefill stays on SDPA."""
    assert make_llm("llama_hd32").engine.runner.prefill_kernel is None
