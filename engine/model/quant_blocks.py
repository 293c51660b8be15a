"""GGUF's blocks in quant.c's packed layouts (``engine/csrc/quant.c``'s header): each type the kernels run,
repacked once at load -- Q8_0, Q4_0 and Q4_1 as the file's own bytes transposed, Q5_0 and Q5_1 into Q8's
bytes, the K-quants' sub-blocks with their float32 scales (Q4F, Q8F, Q8H) -- and dense bfloat16 into
bf16_linear.c's.  Nothing is requantized: every packed matrix dequantizes to the file's values bit for
bit.  ``engine/model/quantized.py`` builds the model's linears on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.model.gguf import RawBlocks

FMT_Q8, FMT_Q4, FMT_BF16, FMT_Q4F, FMT_Q8H, FMT_Q8F = 0, 1, 2, 3, 4, 5  # quant.c's layouts; bf16_linear.c's
# GGUF type name -> (quant.c layout, weights and bytes of one GGUF block)
KERNEL_TYPES = {
    "Q8_0": (FMT_Q8, 32, 34),
    "Q4_0": (FMT_Q4, 32, 18),
    "Q4_1": (FMT_Q4, 32, 20),
    "Q5_0": (FMT_Q8, 32, 22),  # five-bit quants held as Q8's bytes: 1.64x the file's bytes
    "Q5_1": (FMT_Q8, 32, 24),  # (1.5x), exact -- the kernels' w = q d + m as the file has it
    "Q4_K": (FMT_Q4F, 256, 144),
    "Q5_K": (FMT_Q8F, 256, 176),
    "Q6_K": (FMT_Q8H, 256, 210),
}
GROUP, QBLOCK = 16, 32


class PackError(ValueError):
    """A matrix the kernels cannot hold as it is (the message says why); it is dequantized instead."""


class CorruptBlocks(ValueError):
    """A matrix whose file blocks store a scale or min that is not finite (inf or NaN): no path can run it
    (dequantized, it is the same inf or NaN), so the loader refuses the file; the message names it."""


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] matrix in quant.c's packed layout."""

    qtype: str  # the GGUF type it came from
    fmt: int
    rows: int
    cols: int
    packed: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def pack(raws: list[RawBlocks]) -> QuantWeight:
    """The row-wise concatenation of ``raws`` (one GGUF type, one width) packed for quant.c."""
    qtype, cols = raws[0].qtype, raws[0].cols
    if any(r.qtype != qtype or r.cols != cols for r in raws):
        raise PackError("parts of different types or widths are packed separately")
    if qtype not in KERNEL_TYPES:
        raise PackError(f"no kernel for {qtype}")
    fmt, block_weights, block_bytes = KERNEL_TYPES[qtype]
    if cols % block_weights:
        raise PackError(f"{cols} columns is not a whole number of blocks of {block_weights}")
    data = np.concatenate([r.data for r in raws]) if len(raws) > 1 else raws[0].data
    rows, nb = data.shape[0], cols // QBLOCK
    expected = cols // block_weights * block_bytes
    if data.shape[1] != expected:
        raise PackError(f"{data.shape[1]} bytes per row, expected {expected} for {qtype}")
    padded = -(-rows // GROUP) * GROUP
    if qtype in ("Q4_K", "Q5_K"):
        d, m, qs = _q45k_blocks(data, qtype, rows, padded, nb)
    elif qtype == "Q6_K":
        d, m, qs = _q6k_blocks(data, rows, padded, nb)  # m: the second half's scales
    else:
        blocks = np.zeros((padded, nb, block_bytes), dtype=np.uint8)  # zero rows pad the last group
        blocks[:rows] = data.reshape(rows, nb, block_bytes)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]  # [padded, nb]
        if qtype == "Q4_1":
            m, qs = blocks[:, :, 2:4].copy().view(np.float16)[..., 0], blocks[:, :, 4:20]
        elif qtype in ("Q5_0", "Q5_1"):
            m, qs = _q5_blocks(blocks, qtype, d)
        elif qtype == "Q4_0":
            with np.errstate(over="ignore"):  # an overflow is refused below, by name
                m, qs = d * np.float16(-8), blocks[:, :, 2:18]
        else:  # Q8_0: the signed bytes as they are, no offset
            m, qs = np.zeros_like(d), blocks[:, :, 2:34]
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~(np.isfinite(d) & np.isfinite(m))
    if bad.any():
        if qtype == "Q4_0" and np.all(np.isfinite(d)):  # a finite d whose min -8 d overflows float16
            raise PackError("a Q4_0 scale too large for its offset (-8 d) in float16")
        row = int(np.argwhere(bad)[0][0])
        for r in raws:  # the matrix whose rows hold the first bad block
            if row < r.rows:
                raise CorruptBlocks(
                    f"{r.name} ({qtype}): row {row} has a block whose scale or min is not finite"
                )
            row -= r.rows
    quads = qs.shape[2] // 4  # 4 (Q4) or 8 (Q8) runs of 4 bytes per row and block
    groups = padded // GROUP
    # [g, r, b, s, 4] -> [g, b, s, r, 4]: per (group, block) the quad-major bytes quant.c reads
    q = qs.reshape(groups, GROUP, nb, quads, 4).transpose(0, 2, 3, 1, 4).reshape(groups, nb, quads * 64)
    dm = np.stack([d, m], axis=-1).reshape(groups, GROUP, nb, 2).transpose(0, 2, 3, 1)  # [g, b, 2, r]
    scale_bytes = 2 * GROUP * d.itemsize  # 64 (float16) or 128 (Q4F's float32)
    scales = np.ascontiguousarray(dm).view(np.uint8).reshape(groups, nb, scale_bytes)
    tile = np.concatenate([q, scales], axis=2)
    packed = torch.from_numpy(np.ascontiguousarray(tile).reshape(-1))
    return QuantWeight(qtype, fmt, rows, cols, packed)


def _q5_blocks(blocks: np.ndarray, qtype: str, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 / Q5_1 blocks ([rows, nb, 22 or 24] bytes: float16 d, Q5_1's float16 m, 32 high bits, 16
    bytes of nibbles) as Q8's: (m [rows, nb], the signed byte quants [rows, nb, 32]).  Weight j is
    ((qs[j mod 16] nibble) | high bit j << 4) d, less 16 d for Q5_0 (ggml's dequantize_row_q5_0) or plus
    m for Q5_1 -- so Q5_0's quant less 16, Q5_1's as it is, both within a signed byte."""
    off = 2 if qtype == "Q5_0" else 4
    m = np.zeros_like(d) if qtype == "Q5_0" else blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    qh = blocks[:, :, off : off + 4].copy().view("<u4")[..., 0]  # [rows, nb]
    nibbles = blocks[:, :, off + 4 : off + 20]
    low = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=2).astype(np.int16)  # weights 0..15, 16..31
    high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
    q = low | high
    if qtype == "Q5_0":
        q -= 16
    return m, q.astype(np.int8).view(np.uint8)


def _q6k_blocks(
    data: np.ndarray, rows: int, padded: int, nb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks (210 bytes: 128 of low nibbles, 64 of high bit pairs, sixteen int8 scales, a
    float16 d) as Q8H's blocks of 32: (the scales of inputs 0-15 [padded, nb], of inputs 16-31, the
    quants less 32 as signed bytes [padded, nb, 32]).  Weight w of a super-block is d sc[w / 16] (q - 32)
    (ggml's dequantize_row_q6_K): each 128 -- half h -- takes its quant j 32 + l (j < 4, l < 32) from the
    low (j even) or high nibble of ql[64 h + 32 (j % 2) + l] and bits 2 j, 2 j + 1 of qh[32 h + l]; its
    scale d sc, a float16 times an 8-bit integer, is exact in float32.  Zero rows pad the last group."""
    sb = data.reshape(rows, nb // 8, 210)
    ql = sb[:, :, 0:128].reshape(rows, nb // 8, 2, 1, 2, 32)  # [h][.][j % 2][l]
    qh = sb[:, :, 128:192].reshape(rows, nb // 8, 2, 1, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=3).reshape(
        rows, nb // 8, 2, 4, 32
    )  # j = 2 (j / 2) + j % 2
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [h][j][l]
    q = ((low | (high << 4)).astype(np.int16) - 32).reshape(rows, nb, QBLOCK)
    sc = sb[:, :, 192:208].copy().view(np.int8).astype(np.float32)  # [rows, nsb, 16]
    d = sb[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    out = np.zeros((2, padded, nb), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        halves = (d[..., None] * sc).reshape(rows, nb, 2)
    out[0, :rows], out[1, :rows] = halves[..., 0], halves[..., 1]
    out_q = np.zeros((padded, nb, QBLOCK), dtype=np.uint8)
    out_q[:rows] = q.astype(np.int8).view(np.uint8)
    return out[0], out[1], out_q


def _q45k_blocks(
    data: np.ndarray, qtype: str, rows: int, padded: int, nb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (144 bytes: float16 d and dmin, twelve bytes of 6-bit scales and mins, 128 of
    nibbles) or Q5_K's (176: the same and 32 bytes of high bits before the nibbles) as blocks of 32 with
    float32 scales: (d [padded, nb], m [padded, nb], the quants -- Q4_0-order nibbles [padded, nb, 16]
    for Q4_K, bytes [padded, nb, 32] for Q5_K).  Sub-block j's weights are d sc_j q - dmin mn_j (ggml's
    dequantize_row_q4_K / _q5_K), so d = d sc_j and m = -dmin mn_j -- a float16 times a 6-bit integer,
    exact in float32; its quants are the low nibbles of bytes 32 (j / 2) .. + 31 for j even, the high
    ones for j odd, and for Q5_K bit j of qh[l] their fifth.  Zero rows pad the last group."""
    size = 144 if qtype == "Q4_K" else 176
    sb = data.reshape(rows, nb // 8, size)
    d = sb[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nsb]
    dmin = sb[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc = sb[:, :, 4:16].astype(np.uint8)
    scale = np.empty((rows, nb // 8, 8), dtype=np.uint8)
    mins = np.empty_like(scale)
    scale[..., :4], mins[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    scale[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    qs = sb[:, :, size - 128 :].reshape(rows, nb // 8, 4, 1, 32)
    subs = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(rows, nb // 8, 8, 32)  # sub-block 2i, 2i + 1
    if qtype == "Q5_K":
        qh = sb[:, :, 16:48].reshape(rows, nb // 8, 1, 32)
        subs = subs | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    values = subs.reshape(rows, nb, QBLOCK)
    out_d = np.zeros((padded, nb), dtype=np.float32)
    out_m = np.zeros((padded, nb), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out_d[:rows] = (d[..., None] * scale).reshape(rows, nb)
        out_m[:rows] = -(dmin[..., None] * mins).reshape(rows, nb)
    if qtype == "Q5_K":  # 0..31: Q8's bytes as they are
        out_q = np.zeros((padded, nb, QBLOCK), dtype=np.uint8)
        out_q[:rows] = values
    else:
        out_q = np.zeros((padded, nb, 16), dtype=np.uint8)
        out_q[:rows] = values[..., :16] | (values[..., 16:] << 4)  # Q4_0's byte j: weights j and 16 + j
    return out_d, out_m, out_q


def pack_bf16(weight: torch.Tensor) -> QuantWeight:
    """A dense [rows, cols] matrix (cols even) as bfloat16 in bf16_linear.c's layout: per 16 rows, per
    pair of inputs, the 16 rows' two values side by side."""
    rows, cols = weight.shape
    if cols % 2:
        raise PackError(f"{cols} columns: the bfloat16 kernel takes inputs in pairs")
    groups = -(-rows // GROUP)
    padded = torch.zeros(groups * GROUP, cols, dtype=torch.bfloat16)
    padded[:rows] = weight
    packed = padded.view(groups, GROUP, cols // 2, 2).permute(0, 2, 1, 3).contiguous().view(torch.uint8)
    return QuantWeight("BF16", FMT_BF16, rows, cols, packed.reshape(-1))
