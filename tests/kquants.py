"""GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) for tests: random valid blocks, and a dequantizer written
here from ggml's C (``dequantize_row_q4_K`` / ``_q5_K`` / ``_q6_K`` in ggml-quants.c) -- independent of the
``gguf`` package's numpy one that pdkv's loader calls.

A super-block is 256 weights of one row:

- Q4_K (144 bytes): float16 ``d``, ``dmin``; 12 bytes of eight 6-bit scales and mins (``_scale_min``);
  128 bytes of 4-bit quants -- each 64 weights' 32 bytes hold the first 32 in their low nibbles and the
  next 32 in the high ones.  w = d sc q - dmin m, per sub-block of 32.
- Q5_K (176 bytes): as Q4_K, then 32 bytes ``qh`` before the 128 of low nibbles: bit 2c of qh[l] is the
  fifth bit of weight 64c + l, bit 2c + 1 of weight 64c + 32 + l.
- Q6_K (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 ``qh`` (high 2 bits), 16 signed 8-bit scales (one
  per 16 weights), float16 ``d``; q in -32..31, w = d sc q.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

QK = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8 of random ``qtype`` blocks, their float16 steps small
    enough that the weights stay within about +-0.5."""
    assert cols % QK == 0, "K-quant rows are whole super-blocks of 256"
    nb = cols // QK
    blocks = rng.integers(0, 256, size=(rows, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == "Q6_K":
        blocks[:, :, 208:210] = _f16_bytes(rng.uniform(5e-5, 1e-4, size=(rows, nb)))
    else:
        step = 3e-4 if qtype == "Q5_K" else 5e-4
        blocks[:, :, 0:2] = _f16_bytes(rng.uniform(step / 2, step, size=(rows, nb)))
        blocks[:, :, 2:4] = _f16_bytes(rng.uniform(step / 4, step / 2, size=(rows, nb)))
    return blocks.reshape(rows, nb * BLOCK_BYTES[qtype])


def dequantize(qtype: str, data: np.ndarray) -> np.ndarray:
    """[rows, bytes] of ``qtype`` blocks -> float32 [rows, cols], ggml's arithmetic in float32."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, BLOCK_BYTES[qtype])
    out = np.stack([np.concatenate([_block(qtype, b) for b in row]) for row in blocks])
    return out.astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _f16(b: np.ndarray) -> np.float32:
    return np.float32(b[:2].copy().view(np.float16)[0])


def _scale_min(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _block(qtype: str, b: np.ndarray) -> np.ndarray:
    y = np.zeros(QK, dtype=np.float32)
    if qtype == "Q6_K":
        ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:210])
        for n in range(2):  # halves of 128 weights: ql += 64, qh += 32, sc += 8
            for l in range(32):
                i = l // 16
                h = int(qh[32 * n + l])
                lo0, lo1 = int(ql[64 * n + l]), int(ql[64 * n + l + 32])
                q1 = ((lo0 & 0xF) | ((h >> 0 & 3) << 4)) - 32
                q2 = ((lo1 & 0xF) | ((h >> 2 & 3) << 4)) - 32
                q3 = ((lo0 >> 4) | ((h >> 4 & 3) << 4)) - 32
                q4 = ((lo1 >> 4) | ((h >> 6 & 3) << 4)) - 32
                s = sc[8 * n :]
                y[128 * n + l] = d * np.float32(s[i]) * np.float32(q1)
                y[128 * n + l + 32] = d * np.float32(s[i + 2]) * np.float32(q2)
                y[128 * n + l + 64] = d * np.float32(s[i + 4]) * np.float32(q3)
                y[128 * n + l + 96] = d * np.float32(s[i + 6]) * np.float32(q4)
        return y
    d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
    qh = b[16:48] if qtype == "Q5_K" else None
    qs = b[48:176] if qtype == "Q5_K" else b[16:144]
    for c in range(4):  # 64 weights: two sub-blocks, the low then the high nibbles of 32 bytes
        for half in range(2):
            sc, m = _scale_min(2 * c + half, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                q = int(qs[32 * c + l]) >> (4 * half) & 0xF
                if qh is not None and int(qh[l]) >> (2 * c + half) & 1:
                    q += 16
                y[64 * c + 32 * half + l] = d1 * np.float32(q) - m1
    return y


def kquant_tensors(
    folder: Path, pick: Callable[[str], str | None], seed: int = 0
) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, np.ndarray]]:
    """Random K-quant blocks for the matrices of a make-model ``folder`` that ``pick(name)`` gives a type
    (by Hugging Face name; None: left as they are) -- ``write_gguf``'s ``raw`` -- and their dequantized
    float32 values (Hugging Face row order), for a dense twin: ``f32_matrices``."""
    from safetensors.torch import load_file

    rng = np.random.default_rng(seed)
    raw: dict[str, tuple[str, np.ndarray]] = {}
    dense: dict[str, np.ndarray] = {}
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        qtype = pick(name) if t.dim() == 2 else None
        if qtype is None:
            continue
        rows, cols = t.shape
        blocks = random_blocks(qtype, rows, cols, rng)
        raw[name] = (qtype, blocks)
        dense[name] = dequantize(qtype, blocks)
    return raw, dense


def f32_matrices(dense: dict[str, np.ndarray]) -> dict[str, tuple[str, np.ndarray]]:
    """``write_gguf``'s ``raw`` writing each of ``dense``'s matrices as float32: a K-quant file's twin."""
    return {name: ("F32", values) for name, values in dense.items()}
