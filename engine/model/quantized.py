"""GGUF's quantized matrices kept quantized: packed once at load, run by ``engine/csrc/quant.c``.

A Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K matrix of a GGUF file is not dequantized (270 MB of
bfloat16 for the built-in model's 98 MB file): its blocks are repacked into the kernel's layout (``quant.c``'s
header; per 16 output rows and 32 inputs the same bytes the file holds, so the weights stay 1.0x the file
-- Q5_0 and Q5_1's five-bit quants as Q8's bytes, 1.64x and 1.5x theirs; Q4_K's sub-blocks with their
scales and mins as float32, 1.33x, where float16 would round them; Q5_K's the same over Q8's bytes,
1.82x; Q6_K's quants as Q8's bytes with a float32 scale per 16, 1.52x) and the linear runs
on them -- the activations quantized per row and block of 32 to int16 (1/65278 of the block's largest
value: llama.cpp's int8 activations moved greedy picks at logit margins up to 0.4), exact integer dot
products (AVX512-VNNI, or AVX2 with the same sums), float32 sums per block, every row's reduction order
its own (batch-invariant).  The tied embedding is read row by row from the same packed bytes its LM
head multiplies.

Which weights a model runs is ``EngineConfig.weights`` (``--weights``): ``quantized`` (this), ``bf16`` or
``float32`` (dequantized at load, torch's and oneDNN's matmuls: the reference).  ``auto`` picks
``quantized`` where the file has such matrices, the device is the CPU and the kernels were built
(AVX512-VNNI, or AVX2 + FMA + F16C), else the dense path in the engine's dtype.  The KV a node computes
depends on it, so the format is part of the KV fingerprint (``engine/determinism.kv_fingerprint``):
nodes on quantized and on dequantized weights of one file never exchange blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.memory import huge_page_buffer
from engine.model.gguf import RawBlocks
from engine.model.packed import PackedLinear
from engine.native import QuantKernel

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

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
            m, qs = d * np.float16(-8), blocks[:, :, 2:18]
        else:  # Q8_0: the signed bytes as they are, no offset
            m, qs = np.zeros_like(d), blocks[:, :, 2:34]
    with np.errstate(over="ignore", invalid="ignore"):
        if not (np.all(np.isfinite(m)) and np.all(np.isfinite(d))):
            raise PackError("a block scale or min not finite (or too large for its offset in float16)")
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


def native_bf16_linears(model: nn.Module, kernel: QuantKernel) -> int:
    """Replace every ``nn.Linear`` under ``model`` (bfloat16) by a ``QuantLinear`` over its weight packed
    for bf16_linear.c; returns how many.  Each row's sums then run in one fixed order at any batch size:
    the linears are batch-invariant by construction (engine/determinism.py needs no per-host plan)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.in_features % 2 == 0
    ]
    for parent, name, child in targets:
        bias = None if child.bias is None else child.bias.detach()
        setattr(parent, name, QuantLinear([pack_bf16(child.weight.detach())], bias, kernel))
    return len(targets)


class QuantLinear(nn.Module):
    """A linear layer (no training) over packed weights -- GGUF's quantized blocks or dense bfloat16 --
    run by the native kernels: one part per run of equal formats."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, kernel: QuantKernel) -> None:
        super().__init__()
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        starts = np.cumsum([0] + [p.rows for p in parts[:-1]])
        self.parts = [(int(s), p) for s, p in zip(starts, parts, strict=True)]
        self.bias = bias  # a plain attribute: to_empty/to never touch these tensors
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out], in ``x``'s dtype."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        for start, w in self.parts:
            self.kernel.linear(x, w.packed, w.fmt, w.rows, out, start)
        return out if self.bias is None else out + self.bias

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (tests, the bench's matmul floor)."""
        return torch.cat([dequantize(self.kernel, w, dtype) for _, w in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(f"{w.qtype}[{w.rows}]" for _, w in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, quantized={kinds}"


class QuantEmbedding(nn.Module):
    """Token embeddings looked up row by row from a packed matrix (the tied LM head's own bytes)."""

    def __init__(self, weight: QuantWeight, kernel: QuantKernel, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.kernel = kernel
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_q
        return self.kernel.rows(w.packed, w.fmt, w.rows, w.cols, ids.reshape(-1), self.dtype)

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{w.rows}, {w.cols}, quantized={w.qtype}"


def choose_weights(
    choice: str,
    dtype_choice: str,
    tensor_types: Mapping[str, int],
    device: torch.device,
    dtype: torch.dtype,
    kernel: QuantKernel | None,
) -> tuple[bool, str]:
    """``EngineConfig.weights`` resolved for a model whose tensors have ``tensor_types`` (GGUF type name
    -> count; empty for a safetensors folder), with ``kernel`` the native linears (None: not built, or
    ``PDKV_NATIVE=0``): (whether the file's quantized matrices stay packed; a phrase for the log).
    ``quantized`` refuses, naming why, where it cannot be served; ``auto`` falls back."""
    if choice in ("bf16", "float32"):
        return False, f"--weights {choice}: dequantized at load"
    kinds = sorted(set(tensor_types) & set(KERNEL_TYPES))
    if not kinds:
        *most, last = KERNEL_TYPES
        why = f"the model has no {', '.join(most)} or {last} matrices"
    elif device.type != "cpu":
        why = "the quantized kernels run on the CPU"
    elif not QuantKernel.supports(dtype):
        why = f"they compute in bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
    elif kernel is None:
        why = "the native kernels are not built here (no C compiler, no AVX2 or AVX512-VNNI, PDKV_NATIVE=0)"
    else:
        why = ""
    if choice == "quantized":
        if why:
            raise ValueError(f"weights 'quantized' cannot be served: {why}")
        return True, f"--weights quantized ({', '.join(kinds)} as the file ships them)"
    if dtype_choice == "float32":
        return False, "auto: --dtype float32 runs the weights dequantized (the reference path)"
    if why:
        return False, f"auto: dequantized ({why})"
    return True, f"auto: quantized ({', '.join(kinds)} as the file ships them)"


def dequantize(kernel: QuantKernel, w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return kernel.rows(w.packed, w.fmt, w.rows, w.cols, torch.arange(w.rows), dtype)


# Our fused modules: (module path under a layer, the Hugging Face shards in order)
_FUSED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.o_proj", ("self_attn.o_proj",)),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.down_proj", ("mlp.down_proj",)),
)


def quantize_model(
    model: LlamaForCausalLM, raw: Mapping[str, RawBlocks], kernel: QuantKernel, dtype: torch.dtype
) -> tuple[set[str], list[tuple[str, torch.Tensor]]]:
    """Replace every linear (and the embedding) whose file matrices are all in ``raw`` by its packed form.

    Returns (the Hugging Face names consumed, the (name, dense tensor) pairs still to load: matrices that
    could not be packed, or whose fused module has a shard the kernels do not run)."""
    consumed: set[str] = set()
    dense: list[tuple[str, torch.Tensor]] = []

    def parts_of(names: Iterable[str]) -> list[QuantWeight] | None:
        shards = [raw.get(n) for n in names]
        if any(s is None for s in shards):
            return None
        runs: list[list[RawBlocks]] = []
        for s in shards:
            assert s is not None
            if runs and runs[-1][0].qtype == s.qtype:
                runs[-1].append(s)
            else:
                runs.append([s])
        try:
            return [pack(run) for run in runs]
        except PackError:
            return None

    for i, layer in enumerate(model.layers):
        for path, shards in _FUSED:
            names = [f"model.layers.{i}.{s}.weight" for s in shards]
            parts = parts_of(names)
            if parts is None:
                continue
            parent_path, attr = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            old = getattr(parent, attr)
            bias = None if old.bias is None else old.bias.detach().clone()
            setattr(parent, attr, QuantLinear(parts, bias, kernel))
            consumed.update(names)
    embed = raw.get("model.embed_tokens.weight")
    if embed is not None:
        try:
            w = pack([embed])
        except PackError:
            w = None
        if w is not None:
            model.embed_tokens = QuantEmbedding(w, kernel, dtype)  # type: ignore[assignment]
            consumed.add(embed.name)
            if model.config.tie_word_embeddings:
                model.lm_head = QuantLinear([w], None, kernel)  # type: ignore[assignment]
    head = raw.get("lm_head.weight")
    if head is not None:
        parts = parts_of([head.name])
        if parts is not None:
            model.lm_head = QuantLinear(parts, None, kernel)  # type: ignore[assignment]
            consumed.add(head.name)
    for name, r in raw.items():
        if name not in consumed:
            dense.append((name, r.dense(dtype)))
    return consumed, dense


ARENA_ALIGN = 4096


def packed_weights(model: nn.Module, *, lookups: bool = True) -> list[QuantWeight]:
    """Every packed matrix of ``model`` once, in module order: the linears' parts and (with ``lookups``)
    the embeddings read row by row; a tied LM head and its embedding are one matrix."""
    weights: dict[int, QuantWeight] = {}  # by the packed tensor's id
    for m in model.modules():
        parts = [w for _, w in m.parts] if isinstance(m, QuantLinear) else []
        parts += [m.weight_q] if lookups and isinstance(m, QuantEmbedding) else []
        for w in parts:
            weights.setdefault(id(w.packed), w)
    return list(weights.values())


def gather_packed(model: nn.Module) -> int:
    """Move every packed matrix of ``model`` into one buffer, in the order the forward reads them, that
    the kernel is asked to back with 2 MB pages (``MADV_HUGEPAGE``; transparent huge pages are opt-in
    on most hosts): a decode step then streams one region instead of ~120 separate allocations, with
    1/512th of the TLB misses.  Returns the buffer's size (0: nothing packed)."""
    weights = packed_weights(model)
    if not weights:
        return 0
    offsets, size = {}, 0
    for w in weights:
        offsets[id(w.packed)] = size
        size += -(-w.nbytes // ARENA_ALIGN) * ARENA_ALIGN
    arena = huge_page_buffer(size)
    moved: dict[int, QuantWeight] = {}
    for w in weights:
        start = offsets[id(w.packed)]
        view = arena[start : start + w.nbytes]
        view.copy_(w.packed)
        moved[id(w.packed)] = dataclasses.replace(w, packed=view)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.parts = [(start, moved[id(w.packed)]) for start, w in m.parts]
        elif isinstance(m, QuantEmbedding):
            m.weight_q = moved[id(m.weight_q.packed)]
    model._packed_arena = arena  # type: ignore[assignment]  # the views keep it alive; this names it
    return size


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters, buffers and packed matrices, each storage once."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if t.device.type != "meta" and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in (*model.parameters(), *model.buffers(), *(w.packed for w in packed_weights(model))):
        add(t)
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.bias is not None:
            add(m.bias)
        elif isinstance(m, PackedLinear):  # oneDNN's opaque blocked tensors: counted by their elements
            for t in (m.packed, *(piece for _, _, piece in m.pieces)):
                seen[id(t)] = t.numel() * t.element_size()
            if m.bias is not None:
                add(m.bias)
    return sum(seen.values())
