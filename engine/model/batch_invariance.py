"""Batch-invariant bfloat16 linears: every output row summed in an order fixed by the row alone.

oneDNN's packed bfloat16 matmul (``engine/model/packed.py``) keeps each row's sums whatever the number
of rows, their position in the batch and the thread count -- as long as it does not split the reduction
dimension K into blocks, which it does for large K with a blocking chosen by the row count.  Measured on
an AMD EPYC with AVX512-BF16 (torch 2.13's oneDNN): K <= 1024 holds at every row count 1..2048 for every
N tried; K = 1056..4096 differs from the row computed alone at some row count (K = 1536, SmolLM2's
down projection: from 9-15 rows on).  Other CPUs (AMX) block differently, so nothing here is assumed:
``make_batch_invariant`` measures each of the model's linear shapes on this host -- the rows of a
``ROW_COUNTS`` batch against the same rows computed one at a time, on the engine's thread count -- and
splits K into the largest pieces (``PIECE_LIMITS``) that hold, computing a linear as consecutive
matmuls added into one float32 sum (``PackedLinear.split_k``).  A shape no piece size holds for makes the
model non-invariant, with the reason.

The measurement takes a few seconds per new shape and is kept in ``$PDKV_CACHE_DIR/batch_invariance.json``
keyed by CPU, torch version, thread count and shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from engine.cpu_features import cpu_flags
from engine.model.packed import PackedLinear, split_linear

logger = logging.getLogger(__name__)

PIECE_LIMITS = (1024, 512, 256, 128)  # the largest K piece tried first
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129)
ROW_COUNTS_LARGE = (255, 256, 257, 511, 512, 1000, 1024, 2048)
PROBE_FLOPS_LARGE = 4e9  # a larger batch is measured where it costs less than this (the LM head does not)
PIECE_ALIGN = 32  # pieces are whole multiples of this (bfloat16 pairs, oneDNN's K steps)
CACHE_VERSION = 1


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


def _pack(weight: torch.Tensor, sizes: list[int]) -> list[tuple[int, int, torch.Tensor]]:
    pieces, start = [], 0
    for size in sizes:
        part = weight[:, start : start + size].contiguous()
        pieces.append((start, start + size, torch.ops.mkldnn._reorder_linear_weight(part, None)))
        start += size
    return pieces


def holds(k: int, n: int, sizes: list[int], max_rows: int, threads: int) -> bool:
    """Whether a [rows, k] x [k, n] bfloat16 matmul in ``sizes`` pieces gives each row the bits it gets
    alone, for every count in ``ROW_COUNTS`` up to ``max_rows`` on ``threads`` threads."""
    gen = torch.Generator().manual_seed(k * 1_000_003 + n)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    pieces = _pack(weight, sizes)
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
        alone = {i: split_linear(x[i : i + 1], pieces, None) for i in probe}
        torch.set_num_threads(threads)
        for count in counts:
            y = split_linear(x[:count], pieces, None)
            for i in probe:
                if i < count and not torch.equal(y[i : i + 1], alone[i]):
                    return False
        return True
    finally:
        torch.set_num_threads(before)


def _cache_path() -> Path:
    from engine.model.embedded import cache_dir

    return cache_dir() / "batch_invariance.json"


def _host_key(threads: int) -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return f"v{CACHE_VERSION}|{model}|{flags}|torch {torch.__version__}|threads {threads}"


def _load_cache() -> dict[str, int | None]:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
        return {str(k): (None if v is None else int(v)) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _save_cache(cache: dict[str, int | None]) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".batch_invariance-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache only costs the measurement next time
        logger.info("batch-invariance measurements not kept (%s): %s", path, exc)


def piece_limit(k: int, n: int, max_rows: int, threads: int, cache: dict[str, int | None]) -> int | None:
    """The largest ``PIECE_LIMITS`` entry whose pieces hold for a [*, k] x [k, n] matmul on this host
    (None: none does), measured once and kept in ``cache``."""
    key = f"{_host_key(threads)}|{k}x{n}|rows {max_rows}"
    if key in cache:
        return cache[key]
    found: int | None = None
    tried: list[list[int]] = []
    for limit in PIECE_LIMITS:
        sizes = k_pieces(k, limit)
        if sizes in tried:
            continue
        tried.append(sizes)
        if holds(k, n, sizes, max_rows, threads):
            found = limit
            break
    cache[key] = found
    return found


def make_batch_invariant(model: nn.Module, max_rows: int) -> str | None:
    """Split every ``PackedLinear`` of ``model`` into K pieces that keep each row's sums at every batch
    size up to ``max_rows`` on this host.  Returns None when done, else why it cannot be (the model is
    left as it was)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return "its linear layers are not oneDNN-packed bfloat16 (float32, or no oneDNN bfloat16 here)"
    threads = torch.get_num_threads()
    cache = _load_cache()
    size = len(cache)
    plan: dict[tuple[int, int], list[int]] = {}
    for m in linears:
        shape = (m.in_features, m.out_features)
        if shape in plan:
            continue
        limit = piece_limit(*shape, max_rows, threads, cache)
        if limit is None:
            if len(cache) != size:
                _save_cache(cache)
            return (
                f"oneDNN's bfloat16 matmul [{shape[0]} -> {shape[1]}] changes a row's sums with the batch "
                f"size on this CPU even in K pieces of {PIECE_LIMITS[-1]}"
            )
        plan[shape] = k_pieces(shape[0], limit)
    if len(cache) != size:
        _save_cache(cache)
    for m in linears:
        m.split_k(plan[(m.in_features, m.out_features)])
    split = {f"{k}->{n}": sizes for (k, n), sizes in plan.items() if len(sizes) > 1}
    logger.info("batch-invariant linears: K pieces %s", split or "none needed")
    return None
