"""The native attention kernels (``engine/csrc/paged_decode.c``'s decode attention and
``engine/csrc/paged_prefill.c``'s prefill attention) over the paged KV cache, as ``engine/native.py``
loads them: shape checks, argument marshalling and the errors they return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MAX_GROUP = 16  # query heads per KV head (MAX_GROUP in the C source)
MAX_HEAD_DIM = 256
DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}  # the kernels' bf16 flag
# The order of keys and values inside a block of the paged cache (engine/csrc/simd.h): canonical, the
# tensor's [position][kv head][dim]; paired, deterministic mode's (bfloat16, block_size even), the
# layout the prefill kernel's dot products take -- keys as pairs of dims by position, values as pairs of
# positions by dim -- so that its tiles are copies instead of transposes.  engine/attention.py's
# write_kv gives the same map in torch.
KV_CANONICAL = 0
KV_PAIRED = 1


def _rows_of_contiguous_heads(q: torch.Tensor) -> torch.Tensor:
    """``q`` [rows, H, D] as the attention kernels read it: rows may be strided (the engine's q is a view
    of the rotated q and k), each row's heads may not."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


@dataclass(frozen=True)
class DecodeKernel:
    """``pdkv_paged_decode`` of the built library."""

    function: Any  # the ctypes function pdkv_paged_decode

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (
            dtype in DTYPE_FLAGS
            and num_kv_heads > 0
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and 0 < head_dim <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """``q`` [B, H, D] -> [B, H, D]: each row attends to keys 0..positions[b] (within ``window``) of
        the blocks ``block_table[b]`` ([B, W] int64) in ``kv_cache[:, layer]``."""
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        b, num_heads, _ = q.shape
        assert kv_cache.is_contiguous() and block_table.is_contiguous() and positions.is_contiguous()
        assert block_table.dtype == torch.int64 and positions.dtype == torch.int64
        assert q.dtype == kv_cache.dtype and kv_cache.device.type == "cpu"  # one dtype flag for both
        q = _rows_of_contiguous_heads(q)
        out = torch.empty(b, num_heads, head_dim, dtype=q.dtype)
        failed = self.function(
            q.data_ptr(),
            kv_cache.data_ptr(),
            out.data_ptr(),
            block_table.data_ptr(),
            positions.data_ptr(),
            b,
            block_table.shape[1],
            num_layers,
            layer,
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
            window or 0,
            scale,
            DTYPE_FLAGS[q.dtype],
            q.stride(0),
            num_blocks,
        )
        if failed == 1:
            raise MemoryError("the native decode attention could not allocate its score buffer")
        if failed == 3:
            raise IndexError(
                f"decode attention: a position or block id lies outside the block table [{b}, "
                f"{block_table.shape[1]}] or the cache's {num_blocks} blocks, or layer {layer} outside "
                f"{num_layers}"
            )
        assert failed == 0, "shape checked by supports()"
        return out


@dataclass(frozen=True)
class PrefillKernel:
    """``pdkv_paged_prefill_many`` of the built library (engine/csrc/paged_prefill.c): prefill chunks'
    causal attention over their cached prefixes and themselves, read from the paged cache, with
    AVX512-BF16 dot products (or the same sums in FMAs on AVX-512 without it, or on AVX2: csrc/simd.h)
    -- 3-4x torch's CPU flash attention on this machine kind.  bfloat16 only; it exists only where gcc
    built AVX-512 or AVX2 code for this CPU (``NativeKernels.prefill`` is None elsewhere); float32 (the
    dtype compared with transformers token for token) keeps SDPA."""

    many_function: Any  # the ctypes function pdkv_paged_prefill_many
    amx_fn: Any = None  # pdkv_attn_amx

    @property
    def amx(self) -> bool:
        """Whether every call attends in AMX tiles (engine/csrc/attn_amx.h: built for this CPU, granted by
        Linux, not turned off by PDKV_ATTN_AMX=0).  Set once as the library loads; the tiles' bits are
        not the vectors', so the KV namespace names them (engine/determinism.kv_fingerprint)."""
        return self.amx_fn is not None and bool(self.amx_fn(-1))

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (
            DecodeKernel.supports(dtype, num_heads, num_kv_heads, head_dim)
            and dtype == torch.bfloat16
            and head_dim % 32 == 0
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        block_ids: torch.Tensor,
        start: int,
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """``q`` [n, H, D] (the chunk's queries, at positions ``start`` .. ``start + n - 1``) -> [n, H, D]:
        each attends to the keys at positions up to its own (within ``window``) of the blocks
        ``block_ids`` ([nb] int64) in ``kv_cache[:, layer]``, the chunk's own keys already written."""
        assert block_ids.is_contiguous() and block_ids.dtype == torch.int64
        starts = torch.tensor([start], dtype=torch.int64)
        counts = torch.tensor([q.shape[0]], dtype=torch.int64)
        return self.many(q, kv_cache, layer, block_ids[None], starts, counts, scale=scale, window=window)

    def many(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        block_table: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        kv_order: int = KV_CANONICAL,
    ) -> torch.Tensor:
        """Many chunks in one call: ``q`` [T, H, D] holds chunk c's ``counts[c]`` rows (at positions
        ``starts[c]`` ..) after chunk c - 1's; ``block_table[c]`` ([C, W] int64) are its sequence's
        blocks.  A decode row is a chunk of one.  -> [T, H, D].  Each row's bits depend on its own position
        and keys only, whatever the chunks around it (engine/csrc/paged_prefill.c)."""
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        t, num_heads, _ = q.shape
        assert kv_cache.is_contiguous() and block_table.is_contiguous() and block_table.dtype == torch.int64
        assert (
            starts.is_contiguous() and counts.is_contiguous() and starts.dtype == counts.dtype == torch.int64
        )
        assert q.dtype == kv_cache.dtype == torch.bfloat16 and kv_cache.device.type == "cpu"
        q = _rows_of_contiguous_heads(q)
        out = torch.empty(t, num_heads, head_dim, dtype=q.dtype)
        if t == 0:
            return out
        failed = self.many_function(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            out.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            starts.data_ptr(),
            counts.data_ptr(),
            starts.shape[0],
            num_layers,
            layer,
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
            window or 0,
            scale,
            num_blocks,
            kv_order,
        )
        _check_prefill(failed, f"{starts.shape[0]} chunks", block_table.shape[1], kv_cache, layer)
        return out


def _check_prefill(failed: int, what: str, width: int, kv_cache: torch.Tensor, layer: int) -> None:
    num_blocks, num_layers, _, _, num_kv_heads, head_dim = kv_cache.shape
    if failed == 1:
        raise MemoryError("the native prefill attention could not allocate its buffers")
    if failed == 3:
        raise IndexError(
            f"prefill attention: {what} need blocks beyond the {width} given, or a block id lies outside "
            f"the cache's {num_blocks} blocks, or layer {layer} outside {num_layers}"
        )
    if failed == 2:
        raise ValueError(
            f"the native prefill attention does not take these heads over {num_kv_heads} KV heads of "
            f"{head_dim}, or a chunk of no rows (PrefillKernel.supports says which heads it does)"
        )
    assert failed == 0
