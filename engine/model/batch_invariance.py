"""Batch-invariant bfloat16 linears: every output row summed in an order fixed by the row alone.

oneDNN's packed bfloat16 matmul (``engine/model/packed.py``) picks its kernel and its blocking of the
reduction dimension K by the row count.  Measured on an AMD EPYC with AVX512-BF16 (torch 2.13's oneDNN):
with K <= 1024 every row gets the same bits at every row count 1..2048; with K = 1056..4096 (SmolLM2's
down projection has 1536) a row computed alone differs from the same row in a batch of 9 or more -- but
every count from 8 up agrees with every other: below 8 rows oneDNN runs another kernel.  Other CPUs (AMX)
block differently, so nothing here is assumed: ``make_batch_invariant`` measures each of the model's
linear shapes on this host -- the rows of a batch of each of ``ROW_COUNTS`` against the same rows computed
one at a time, on the engine's thread count -- for each plan of ``PLANS`` in turn, and keeps the first that
holds:

- ``min_rows``: a call with fewer rows is computed padded with zero rows to this many (8: the cost of a
  decode step's matmuls hardly changes, they are bound by reading the weights);
- ``piece_limit``: K split into pieces of at most this many, computed as consecutive matmuls added into
  one float32 sum (``PackedLinear.split_k``; one more rounding per piece, a few percent slower).

A shape no plan holds for makes the model non-invariant, with the reason.  The measurement takes a few
seconds per new shape and is kept in ``$PDKV_CACHE_DIR/batch_invariance.json`` keyed by CPU, torch
version, thread count and shape.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from engine.cpu_features import cpu_flags
from engine.model.packed import PackedLinear

logger = logging.getLogger(__name__)

# (min_rows, piece_limit) in the order tried; piece_limit 0: K whole.
PLANS = ((1, 0), (8, 0), (16, 0), (64, 0), (1, 1024), (8, 1024), (8, 512), (8, 256), (8, 128))
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129)
ROW_COUNTS_LARGE = (255, 256, 257, 511, 512, 1000, 1024, 2048)
PROBE_FLOPS_LARGE = 4e9  # a larger batch is measured where it costs less than this (the LM head does not)
PIECE_ALIGN = 32  # pieces are whole multiples of this (bfloat16 pairs, oneDNN's K steps)
CACHE_VERSION = 2


def k_pieces(k: int, limit: int) -> list[int]:
    """``k`` split into as few pieces of at most ``limit`` as it takes, equal up to ``PIECE_ALIGN``."""
    if k <= limit:
        return [k]
    count = -(-k // limit)
    size = -(-k // count)
    size = -(-size // PIECE_ALIGN) * PIECE_ALIGN
    sizes = []
    left = k
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes


def holds(k: int, n: int, plan: tuple[int, int], max_rows: int, threads: int) -> bool:
    """Whether a [rows, k] x [k, n] bfloat16 matmul computed by ``plan`` (min_rows, piece_limit) gives
    each row the bits it gets alone, for every count in ``ROW_COUNTS`` up to ``max_rows`` on ``threads``
    threads."""
    min_rows, limit = plan
    gen = torch.Generator().manual_seed(k * 1_000_003 + n)
    dense = nn.utils.skip_init(nn.Linear, k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
    linear = PackedLinear(dense)  # the engine's own linear, under the plan tried
    linear.split_k(k_pieces(k, limit) if limit else [])
    linear.min_rows = min_rows
    counts = [c for c in ROW_COUNTS if c <= max_rows]
    if 2.0 * k * n * max_rows <= PROBE_FLOPS_LARGE:
        counts += [c for c in ROW_COUNTS_LARGE if c <= max_rows]
        if max_rows not in counts:
            counts.append(max_rows)
    rows = max(counts)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    # the rows compared: the first ones, each count's last one and a few between
    probe = sorted({0, 1, 2, 3} | {c - 1 for c in counts} | {c // 2 for c in counts})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {i: linear(x[i : i + 1]) for i in probe}
        torch.set_num_threads(threads)
        for count in counts:
            y = linear(x[:count])
            for i in probe:
                if i < count and not torch.equal(y[i : i + 1], alone[i]):
                    return False
        return True
    finally:
        torch.set_num_threads(before)


def _cache_path() -> Path:
    from engine.model.embedded import cache_dir

    return cache_dir() / "batch_invariance.json"


@functools.cache
def _host_key(threads: int) -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return f"v{CACHE_VERSION}|{model}|{flags}|torch {torch.__version__}|threads {threads}"


Cache = dict[str, tuple[int, int] | None]


def _load_cache() -> Cache:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
        return {str(k): (None if v is None else (int(v[0]), int(v[1]))) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError, IndexError):
        return {}


def _save_cache(cache: Cache) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".batch_invariance-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache only costs the measurement next time
        logger.info("batch-invariance measurements not kept (%s): %s", path, exc)


def plan_for(k: int, n: int, max_rows: int, threads: int, cache: Cache) -> tuple[int, int] | None:
    """The first of ``PLANS`` that holds for a [*, k] x [k, n] matmul on this host (None: none does),
    measured once and kept in ``cache``."""
    key = f"{_host_key(threads)}|{k}x{n}|rows {max_rows}"
    if key in cache:
        return cache[key]
    found: tuple[int, int] | None = None
    for min_rows, limit in PLANS:
        if limit and k <= limit:
            continue  # K whole: tried already
        if holds(k, n, (min_rows, limit), max_rows, threads):
            found = (min_rows, limit)
            break
    cache[key] = found
    return found


def make_batch_invariant(model: nn.Module, max_rows: int) -> str | None:
    """Give every ``PackedLinear`` of ``model`` the plan that keeps each row's sums at every batch size up
    to ``max_rows`` on this host.  Returns None when done, else why it cannot be (the model is left as it
    was)."""
    if any(isinstance(m, nn.Linear) for m in model.modules()):
        return "its linear layers are not packed bfloat16 (float32, or no oneDNN bfloat16 here)"
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return None  # the native packed linears (engine/model/quantized.py): batch-invariant as built
    threads = torch.get_num_threads()
    cache = _load_cache()
    size = len(cache)
    plans: dict[tuple[int, int], tuple[int, int]] = {}
    why = None
    for m in linears:
        shape = (m.in_features, m.out_features)
        if shape in plans:
            continue
        plan = plan_for(*shape, max_rows, threads, cache)
        if plan is None:
            why = (
                f"oneDNN's bfloat16 matmul [{shape[0]} -> {shape[1]}] changes a row's sums with the batch "
                f"size on this CPU under every plan tried (padding, K pieces down to {PLANS[-1][1]})"
            )
            break
        plans[shape] = plan
    if len(cache) != size:
        _save_cache(cache)
    if why is not None:
        return why
    for m in linears:
        min_rows, limit = plans[(m.in_features, m.out_features)]
        m.split_k(k_pieces(m.in_features, limit) if limit else [])
        m.min_rows = min_rows
    logger.info(
        "batch-invariant linears (min rows, K piece limit): %s",
        {f"{k}->{n}": p for (k, n), p in plans.items()},
    )
    return None
