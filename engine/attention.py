"""Paged attention over the block-contiguous KV cache, for one ragged step.

A step's tokens are one flat batch of ``T`` rows, decodes first::

    rows  [0, B)                     B single-token queries (decodes, and 1-token chunks after a hit),
                                     shortest context first, in groups of at most DECODE_GROUP_SIZE
    rows  [B, B + n_1)               prefill chunk 1 (n_1 tokens at positions start_1 ..)
    rows  [B + n_1, B + n_1 + n_2)   prefill chunk 2, ...

Per layer, ``write_kv`` first stores the K/V of *all* T rows into their slots; only then does
``paged_attention`` read the cache.  That order is load-bearing: the scheduler may let request B
prefix-hit a block that request A computes in this very step.

- Decodes attend in one call per group: the group's blocks are gathered into a padded ``[b, Hkv, S, D]``
  (reusing one workspace buffer, so no fresh memory is faulted in per step) with a key mask for the
  padding.  Sorting by context length before grouping keeps the padding -- gathered and attended for
  nothing -- small when lengths differ a lot.
- Each prefill chunk attends on its own with an explicit causal mask shifted by the cached prefix
  (``is_causal`` in SDPA aligns the triangle top-left, which is wrong when there are more keys than
  queries).  A chunk with no cached prefix uses its fresh K/V directly instead of reading them back.
- Sliding windows (Mistral, some Qwen2 layers) narrow both masks: key ``j`` is visible to query
  position ``p`` iff ``p - window < j <= p``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.native_attention import KV_PAIRED, DecodeKernel, PrefillKernel


@dataclass(slots=True)
class PrefillChunk:
    """One request's multi-token chunk.  ``block_ids`` covers every position up to the chunk's end."""

    row_start: int
    num_tokens: int
    start_position: int
    block_ids: torch.Tensor  # [cdiv(start_position + num_tokens, block_size)] int64
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return self.start_position + self.num_tokens

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, context] bool, True where query row i may see key j (built once per step and window)."""
        mask = self._masks.get(window)
        if mask is None:
            device = self.block_ids.device
            q_pos = torch.arange(self.start_position, self.context_len, device=device)[:, None]  # [n, 1]
            k_pos = torch.arange(self.context_len, device=device)[None, :]  # [1, context]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[window] = mask
        return mask


DECODE_GROUP_SIZE = 8


@dataclass(slots=True)
class DecodeBatch:
    """A group of single-token queries: rows ``[row_start, row_start + num)`` of the flat batch."""

    row_start: int
    num: int
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    positions: torch.Tensor  # [B] int64, position of each query token (= context_len - 1)
    block_size: int
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def max_keys(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, S] bool, True for keys a query may see; the padding of shorter requests is False."""
        mask = self._masks.get(window)
        if mask is None:
            k_pos = torch.arange(self.max_keys, device=self.positions.device)[None, :]  # [1, S]
            q_pos = self.positions[:, None]  # [B, 1]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            mask = mask[:, None, None, :]  # [B, 1, 1, S]: broadcast over heads and the one query
            self._masks[window] = mask
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    """Where each row's K/V goes and what each query attends to.  Built by the runner once per step."""

    slot_blocks: torch.Tensor  # [T] int64: block id of each row's slot
    slot_offsets: torch.Tensor  # [T] int64: offset of the slot within its block
    decodes: list[DecodeBatch]
    prefills: list[PrefillChunk]
    _chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_blocks.shape[0]

    def as_chunks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row of the step as ``PrefillKernel.many`` takes them, built once per step: (block table
        [C, W], starts [C], counts [C]) -- a decode row is a chunk of one at its position."""
        if self._chunks is None and not self.prefills and len(self.decodes) == 1:  # a decode step
            dec = self.decodes[0]
            self._chunks = (dec.block_table, dec.positions, torch.ones(dec.num, dtype=torch.int64))
        if self._chunks is None:
            tables = [dec.block_table for dec in self.decodes] + [c.block_ids[None] for c in self.prefills]
            starts = [dec.positions for dec in self.decodes]
            starts.append(torch.tensor([c.start_position for c in self.prefills], dtype=torch.int64))
            counts = [torch.ones(sum(dec.num for dec in self.decodes), dtype=torch.int64)]
            counts.append(torch.tensor([c.num_tokens for c in self.prefills], dtype=torch.int64))
            rows = [dec.row_start for dec in self.decodes] + [c.row_start for c in self.prefills]
            sizes = [dec.num for dec in self.decodes] + [c.num_tokens for c in self.prefills]
            assert rows == [sum(sizes[:i]) for i in range(len(sizes))], "rows: decodes, then chunks, in order"
            width = max(t.shape[1] for t in tables)
            table = torch.zeros(sum(t.shape[0] for t in tables), width, dtype=torch.int64)  # padding: unread
            i = 0
            for t in tables:
                table[i : i + t.shape[0], : t.shape[1]] = t
                i += t.shape[0]
            self._chunks = (table, torch.cat(starts), torch.cat(counts))
        return self._chunks


class GatherWorkspace:
    """Grow-only scratch buffers for the decode gather, reused by every layer of every step.

    Allocating (and page-faulting) a fresh multi-MB buffer per layer costs more than the gather itself.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    paired: bool = False,
) -> None:
    """Store the step's keys and values ``[T, Hkv, D]`` into their slots of ``kv_cache[:, layer]``; with
    ``paired``, in deterministic mode's order inside each block (``paired_views``)."""
    if not paired:
        kv_cache[meta.slot_blocks, layer, 0, meta.slot_offsets] = k
        kv_cache[meta.slot_blocks, layer, 1, meta.slot_offsets] = v
        return
    keys, values = paired_views(kv_cache, layer)
    blocks, offsets = meta.slot_blocks, meta.slot_offsets
    keys[blocks, :, :, offsets] = k.contiguous().view(torch.int32)  # [T, Hkv, D/2] pairs
    values[blocks, :, offsets // 2, :, offsets % 2] = v


def paired_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_cache[:, layer]``'s key and value slabs seen in the paired order (engine/native_attention.py's
    ``KV_PAIRED``): keys ``[num_blocks, Hkv, D/2, block_size]`` int32 (each a pair of bfloat16 dims),
    values ``[num_blocks, Hkv, block_size/2, D, 2]`` (element [.., j // 2, d, j % 2] is position j's dim
    d).  Views of the same bytes as the canonical ``[block_size, Hkv, D]`` slabs."""
    num_blocks, num_layers, _, bs, hkv, d = kv_cache.shape
    assert kv_cache.is_contiguous() and kv_cache.dtype == torch.bfloat16 and bs % 2 == 0 and d % 2 == 0
    slab = bs * hkv * d  # elements of one block's K (or V) slab of one layer
    block = num_layers * 2 * slab
    pairs = kv_cache.view(torch.int32)
    keys = pairs.as_strided(
        (num_blocks, hkv, d // 2, bs), (block // 2, d // 2 * bs, bs, 1), layer * 2 * slab // 2
    )
    values = kv_cache.as_strided(
        (num_blocks, hkv, bs // 2, d, 2), (block, bs // 2 * d * 2, d * 2, 2, 1), (layer * 2 + 1) * slab
    )
    return keys, values


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    *,
    scale: float,
    window: int | None,
    workspace: GatherWorkspace,
    kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of the step's queries ``q`` [T, H, D] over the cache (``k``/``v`` [T, Hkv, D] are this
    step's own keys and values, already written).  Returns [T, H, D].  With ``kernel`` (the native
    decode attention, engine/native.py) decodes read the cache in place instead of gathering it; with
    ``prefill_kernel`` so do prefill chunks.

    ``deterministic`` (needs ``prefill_kernel``): every row of the step, decode or prefill, goes through
    the prefill kernel in one call, whose arithmetic for a row depends on the row's position and keys
    alone -- so a token's attention is the same bits in any batch, any chunking, prefill or decode; the
    cache holds keys and values in the paired order then (``write_kv``)."""
    if deterministic:
        assert prefill_kernel is not None, "deterministic attention runs on the native prefill kernel"
        table, starts, counts = meta.as_chunks()
        return prefill_kernel.many(
            q, kv_cache, layer, table, starts, counts, scale=scale, window=window, kv_order=KV_PAIRED
        )
    parts = []  # in row order: decode groups, then each prefill chunk
    for dec in meta.decodes:
        rows = slice(dec.row_start, dec.row_start + dec.num)
        if kernel is not None:
            parts.append(
                kernel(q[rows], kv_cache, layer, dec.block_table, dec.positions, scale=scale, window=window)
            )
        else:
            parts.append(_decode_attention(q[rows], kv_cache, layer, dec, scale, window, workspace))
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
        if prefill_kernel is not None:
            start = chunk.start_position
            parts.append(
                prefill_kernel(q[rows], kv_cache, layer, chunk.block_ids, start, scale=scale, window=window)
            )
        else:
            parts.append(_prefill_attention(q[rows], k[rows], v[rows], kv_cache, layer, chunk, scale, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, H, D]


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    dec: DecodeBatch,
    scale: float,
    window: int | None,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    _, _, _, bs, num_kv_heads, _ = kv_cache.shape
    max_blocks = dec.block_table.shape[1]
    flat_table = dec.block_table.view(-1)  # [B * max_blocks]
    shape = (b * max_blocks, bs, num_kv_heads, head_dim)
    keys = workspace.get("k", shape, kv_cache.dtype, kv_cache.device)
    values = workspace.get("v", shape, kv_cache.dtype, kv_cache.device)
    torch.index_select(kv_cache[:, layer, 0], 0, flat_table, out=keys)  # [B * max_blocks, bs, Hkv, D]
    torch.index_select(kv_cache[:, layer, 1], 0, flat_table, out=values)
    s = max_blocks * bs
    keys_t = keys.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    values_t = values.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, H, 1, D]
        keys_t,
        values_t,
        attn_mask=dec.mask(window),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, 1, D]
    return out[:, :, 0, :]  # [B, H, D]


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    chunk: PrefillChunk,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if chunk.start_position == 0:
        keys, values = k, v  # [n, Hkv, D]: the chunk is the whole context
    else:
        ctx = chunk.context_len
        blocks = chunk.block_ids
        # [nb, bs, Hkv, D] -> [nb * bs, Hkv, D] -> the first ctx positions
        keys = kv_cache[:, layer, 0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        values = kv_cache[:, layer, 1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx]
    causal_only = chunk.start_position == 0 and (window is None or window >= n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, n, D]
        keys.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
        values.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
        attn_mask=None if causal_only else chunk.mask(window),
        is_causal=causal_only,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1)  # [n, H, D]
