"""GGUF's quantized matrices kept quantized: packed once at load, run by ``engine/csrc/quant.c``.

A Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K matrix of a GGUF file is not dequantized (270 MB of
bfloat16 for the built-in model's 98 MB file): its blocks are repacked into the kernel's layout
(``engine/model/quant_blocks.py``, ``quant.c``'s header; per 16 output rows and 32 inputs the same bytes
the file holds, so the weights stay 1.0x the file -- Q5_0 and Q5_1's five-bit quants as Q8's bytes, 1.64x
and 1.5x theirs; Q4_K's sub-blocks with their scales and mins as float32, 1.33x, where float16 would round
them; Q5_K's the same over Q8's bytes, 1.82x; Q6_K's quants as Q8's bytes with a float32 scale per 16,
1.52x) and the linear runs on them -- the activations quantized per row and block of 32 to int16
(1/65278 of the block's largest value: llama.cpp's int8 activations moved greedy picks at logit margins
up to 0.4), exact integer dot products (AVX512-VNNI, or AVX2 with the same sums), float32 sums per block,
every row's reduction order its own (batch-invariant).  The tied embedding is read row by row from the
same packed bytes its LM head multiplies.

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
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.memory import huge_page_buffer
from engine.model.gguf import RawBlocks
from engine.model.packed import PackedLinear
from engine.model.quant_blocks import KERNEL_TYPES, PackError, QuantWeight, pack, pack_bf16
from engine.native import QuantKernel

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM


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
