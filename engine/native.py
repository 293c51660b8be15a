"""The engine's native kernels, built on first use with the system C compiler and loaded with ctypes.

``engine/csrc/paged_decode.c`` holds five: decode attention straight from the paged cache (see its
header), RMSNorm (with the residual add before it) in one call instead of nine torch ops, RoPE with the
step's K/V written into the cache in one call instead of ten, SwiGLU's ``silu(gate) * up``, and greedy
sampling's argmax over the logits.  ``engine/csrc/paged_prefill.c`` holds the prefill attention
(bfloat16, AVX-512 or AVX2: simd.h's bfloat16 dot products), also read from the paged cache.  ``lora.c``
applies a mixed batch's LoRA deltas; ``quant.c`` and ``bf16_linear.c`` run linears over packed weights
(GGUF's quantized blocks, or dense bfloat16) and ``decode_layer.c`` a whole decoder layer of a decode
step.  All of them (and their shared ``simd.h``) are compiled into one library once per source version,
compiler flags and CPU into ``$PDKV_CACHE_DIR/native/<digest>/libpdkv_native.so`` -- about a second with
gcc -- and reused by every later process.  Without a compiler, or if the build fails, ``native_kernels()``
returns None once, logs why, and the model keeps its torch paths (gather + SDPA;
the norm's torch ops), which give the same tokens more slowly.  ``PDKV_NATIVE=0`` turns the kernels
off (the tests compare both paths).

The shared object links libgomp by soname; torch has loaded its own libgomp already, so the kernel's
OpenMP threads are torch's pool (same thread count, no second pool spinning against it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.cpu_features import BF16_AVX2_FLAGS, BF16_KERNEL_FLAGS, bf16_kernels_cpu, cpu_flags
from engine.native_attention import DTYPE_FLAGS, KV_CANONICAL, MAX_HEAD_DIM, DecodeKernel, PrefillKernel
from engine.native_build import build_library
from engine.native_linear import (
    DecodeLayerKernel,
    QuantKernel,
    bf16_fma_default,
    row_groups_default,
    row_prefetch_default,
)

logger = logging.getLogger(__name__)

_INT64 = ctypes.c_int64
# "0" keeps bf16_linear.c in vectors on a CPU with AMX tiles (engine/csrc/bf16_amx.h).
AMX_ENV = "PDKV_BF16_AMX"
# "0" keeps quant.c's linears in vectors on a CPU with AMX-INT8 (quant_amx.h): the same bits, slower.
QUANT_AMX_ENV = "PDKV_QUANT_AMX"
# "0" keeps paged_prefill.c's attention in vectors on a CPU with AMX-BF16 (attn_amx.h): other bits, slower.
ATTN_AMX_ENV = "PDKV_ATTN_AMX"
_PTR = ctypes.c_void_p
_ARGTYPES: list[Any] = [_PTR, _PTR, _PTR, _PTR, _PTR] + [_INT64] * 9 + [ctypes.c_float] + [_INT64] * 3


@dataclass(frozen=True)
class RMSNormKernel:
    """``pdkv_rms_norm`` of the built library, with or without the residual add before it."""

    function: Any  # the ctypes function pdkv_rms_norm

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in DTYPE_FLAGS

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [T, hidden] -> ``weight * dtype(x * rsqrt(mean(x^2) + eps))`` [T, hidden]."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._run(x, None, None, weight, out, eps)
        return out

    def add(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + delta (both [T, hidden], h rounded to the dtype)."""
        x, delta = x.contiguous(), delta.contiguous()
        assert delta.dtype == x.dtype and delta.shape == x.shape
        h, out = torch.empty_like(x), torch.empty_like(x)
        self._run(x, delta, h, weight, out, eps)
        return h, out

    def _run(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        h: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        assert x.dim() == 2 and x.device.type == "cpu"
        assert weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[1:]
        failed = self.function(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            None if h is None else h.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            DTYPE_FLAGS[x.dtype],
        )
        if failed == 1:
            raise MemoryError("the native RMSNorm could not allocate its row buffers")
        assert failed == 0, "shape checked by supports()"


@dataclass(frozen=True)
class SiluMulKernel:
    """``pdkv_silu_mul`` of the built library: SwiGLU's ``silu(gate) * up`` in one call.

    bfloat16 where the vector path was built (AVX-512 or AVX2): its scalar loop calls ``expf`` per element,
    slower than torch's vectorized SiLU.  float32 (AVX-512 or AVX2 + FMA vector paths) only for a model
    whose linears all run packed (``packed``: the quantized weights, compared with transformers within a
    tolerance, whose decode steps the fused layer serves with this kernel): its exponential may differ
    from torch's in the last bit, and a dense float32 model is the reference path, torch's SiLU."""

    function: Any  # the ctypes function pdkv_silu_mul

    @staticmethod
    def supports(dtype: torch.dtype, packed: bool = False) -> bool:
        flags = cpu_flags()
        if dtype == torch.float32:
            return packed and ("avx512f" in flags or {"avx2", "fma"} <= flags)
        return dtype == torch.bfloat16 and bf16_kernels_cpu()

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] (gate, then up) -> [T, I]."""
        assert gate_up.dim() == 2 and gate_up.device.type == "cpu"
        assert gate_up.dtype in (torch.bfloat16, torch.float32)
        gate_up = gate_up.contiguous()
        t, two_i = gate_up.shape
        out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
        failed = self.function(
            gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, gate_up.dtype == torch.bfloat16
        )
        assert failed == 0, "shape checked by supports()"
        return out


@dataclass(frozen=True)
class RopeKernel:
    """``pdkv_rope_write_kv`` of the built library: rotary embedding and the step's K/V into the cache."""

    function: Any  # the ctypes function pdkv_rope_write_kv

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in DTYPE_FLAGS and head_dim % 2 == 0 and 0 < head_dim <= MAX_HEAD_DIM

    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        num_heads: int,
        kv_order: int = KV_CANONICAL,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qkv`` [T, (H + 2 Hkv) * D], ``cos``/``sin`` [T, 1, D/2] -> (rotated queries and keys
        [T, H + Hkv, D], values [T, Hkv, D], a view of ``qkv``); the rotated keys and the values are
        written into their slots of ``kv_cache[:, layer]`` on the way, in ``kv_order``
        (engine/attention.py)."""
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        t = qkv.shape[0]
        assert kv_cache.is_contiguous() and qkv.is_contiguous() and qkv.dtype == kv_cache.dtype
        assert cos.dtype == sin.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous()
        assert slot_blocks.dtype == slot_offsets.dtype == torch.int64
        qk = torch.empty(t, num_heads + num_kv_heads, head_dim, dtype=qkv.dtype)
        failed = self.function(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qk.data_ptr(),
            kv_cache.data_ptr(),
            slot_blocks.data_ptr(),
            slot_offsets.data_ptr(),
            t,
            num_heads,
            num_kv_heads,
            head_dim,
            num_layers,
            layer,
            block_size,
            DTYPE_FLAGS[qkv.dtype],
            num_blocks,
            kv_order,
        )
        if failed == 3:
            raise IndexError(
                f"K/V write: a slot lies outside the cache's {num_blocks} blocks of {block_size}"
            )
        assert failed == 0, "shape checked by supports()"
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
        return qk, v


@dataclass(frozen=True)
class ArgmaxKernel:
    """``pdkv_argmax_f32`` / ``pdkv_argmax_bf16`` of the built library: greedy sampling, each row's first
    maximum (or first NaN) -- ``max(dim=-1).indices`` over the float32 values in two vector passes instead
    of torch's element-at-a-time reduction; bfloat16 logits are read as they are (widened exactly)."""

    function: Any  # the ctypes function pdkv_argmax_f32
    bf16_function: Any  # pdkv_argmax_bf16

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 or bfloat16 [R, V] on the CPU -> int64 [R]."""
        assert logits.dim() == 2 and logits.device.type == "cpu"
        assert logits.dtype in (torch.float32, torch.bfloat16)
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        fn = self.function if logits.dtype == torch.float32 else self.bf16_function
        failed = fn(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
        assert failed == 0, "an empty vocabulary"
        return out


@dataclass(frozen=True)
class LoRAKernel:
    """``pdkv_lora_bf16`` of the built library (``engine/csrc/lora.c``): a mixed batch's LoRA deltas
    segmented by adapter in one call per module.  bfloat16 with AVX-512 or AVX2 only."""

    function: Any  # the ctypes function pdkv_lora_bf16

    def bind(self, a: torch.Tensor, b: torch.Tensor, part_start: torch.Tensor) -> Callable[..., None]:
        """One module's call, its weights' pointers and shapes fixed (they never move):
        ``call(x, y, rows)`` adds to ``y`` [T, out] each row's adapter delta; ``rows`` [T] int64 slots
        (-1: none); ``a`` [S, in/2, P*R, 2] (input dims in pairs), ``b`` [S, R/2, out, 2] (ranks in
        pairs; the parts' columns side by side, bounds in ``part_start`` [P + 1]): csrc/lora.c's
        layouts.  Per call only the rows move, so it costs a ctypes call and no more."""
        assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
        num_slots, half, pr, _ = a.shape
        rank = b.shape[1] * 2
        parts, width = pr // rank, half * 2
        assert a.shape[-1] == b.shape[-1] == 2 and parts * rank == pr and part_start.numel() == parts + 1
        fixed = (a.data_ptr(), b.data_ptr())
        out, starts = b.shape[2], part_start.data_ptr()
        function = self.function

        def call(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
            assert x.dtype == y.dtype == torch.bfloat16 and x.shape[1] == width and y.shape[1] == out
            assert x.is_contiguous() and y.is_contiguous() and rows.dtype == torch.int64
            failed = function(
                x.data_ptr(), y.data_ptr(), rows.data_ptr(), *fixed,
                x.shape[0], width, out, parts, starts, rank, num_slots,
            )  # fmt: skip
            _check_lora(failed)

        return call


def _check_lora(failed: int) -> None:
    if failed == 3:
        raise MemoryError("the native LoRA kernel could not allocate its row lists")
    assert failed == 0, f"pdkv_lora_bf16 refused the shapes ({failed})"


@dataclass(frozen=True)
class NativeKernels:
    decode: DecodeKernel
    prefill: PrefillKernel | None  # None where the build has neither AVX-512 nor AVX2 code
    rms_norm: RMSNormKernel
    rope: RopeKernel
    silu_mul: SiluMulKernel
    argmax: ArgmaxKernel
    lora: LoRAKernel | None = None  # None where the build has neither AVX-512 nor AVX2 code
    quant: QuantKernel | None = None  # None where the build has neither AVX512-VNNI nor AVX2 code
    decode_layer: DecodeLayerKernel | None = None  # with quant
    # The form of the bfloat16 dot products (attention, LoRA, dense linears; csrc/simd.h's PDKV_BF16):
    # 1 vdpbf16ps, 2 emulated with FMAs (an AVX-512 CPU without AVX512-BF16), 3 those FMAs on AVX2's
    # 256-bit halves (csrc/avx512_avx2.h), 0 none (scalar loops).  The same bits in deterministic mode;
    # the KV namespace names the form otherwise (engine/determinism.kv_fingerprint).
    bf16_dot: int = 1


_lock = threading.Lock()
_loaded: list[NativeKernels | None] = []  # empty: not tried yet


def native_kernels() -> NativeKernels | None:
    """The built kernels, or None (no compiler, a failed build, or ``PDKV_NATIVE=0``); tried once."""
    if os.environ.get("PDKV_NATIVE", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


# The bfloat16 dot products' forms (csrc/simd.h's PDKV_BF16): 1 vdpbf16ps, 2 its FMA emulation on AVX-512,
# 3 that emulation on AVX2's halves -- with the extra compiler flags that build each on a CPU that has the
# first (no AMX tiles in 2 and 3: their bits are the tiles' own, engine/determinism.kv_fingerprint).
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
BF16_FORM_FLAGS: dict[int, tuple[str, ...]] = {
    1: (),
    2: ("-mno-avx512bf16", *_NO_AMX),
    3: ("-mno-avx512f", *_NO_AMX),
}
_FORM_CPU_FLAGS = {
    1: {"avx512_bf16", *BF16_KERNEL_FLAGS},
    2: set(BF16_KERNEL_FLAGS),
    3: {*BF16_AVX2_FLAGS, "f16c"},  # and F16C, for quant.c's vector path
}


def bf16_forms_here() -> tuple[int, ...]:
    """The forms of ``BF16_FORM_FLAGS`` this CPU runs (a build of each: ``load_bf16_form``)."""
    flags = cpu_flags()
    return tuple(form for form, need in _FORM_CPU_FLAGS.items() if need <= flags)


def load_bf16_form(form: int) -> NativeKernels | None:
    """A separate build of the kernels in bfloat16 dot-product form ``form`` (``BF16_FORM_FLAGS``), loaded
    beside the engine's own (tests compare the forms' bits on one machine); None if it would not build or
    the build is not that form (a CPU without it: ``bf16_forms_here``)."""
    kernels = _load(BF16_FORM_FLAGS[form])
    return kernels if kernels is not None and kernels.bf16_dot == form else None


def _load(extra_flags: tuple[str, ...] = ()) -> NativeKernels | None:
    try:
        path = build_library(extra_flags)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("native kernels unavailable (%s); using the torch paths", exc)
        return None
    decode = lib.pdkv_paged_decode
    decode.argtypes = _ARGTYPES
    decode.restype = ctypes.c_int
    many = lib.pdkv_paged_prefill_many
    many.argtypes = [
        _PTR,
        _INT64,
        _PTR,
        _PTR,
        _PTR,
        _INT64,
        _PTR,
        _PTR,
        *[_INT64] * 8,
        ctypes.c_float,
        _INT64,
        _INT64,
    ]
    many.restype = ctypes.c_int
    lib.pdkv_paged_prefill_built.restype = ctypes.c_int
    norm = lib.pdkv_rms_norm
    norm.argtypes = [_PTR] * 5 + [_INT64, _INT64, ctypes.c_float, _INT64]
    norm.restype = ctypes.c_int
    rope = lib.pdkv_rope_write_kv
    rope.argtypes = [_PTR] * 7 + [_INT64] * 10
    rope.restype = ctypes.c_int
    silu = lib.pdkv_silu_mul
    silu.argtypes = [_PTR, _PTR, _INT64, _INT64, _INT64]
    silu.restype = ctypes.c_int
    argmax = lib.pdkv_argmax_f32
    argmax_bf16 = lib.pdkv_argmax_bf16
    for fn in (argmax, argmax_bf16):
        fn.argtypes = [_PTR, _PTR, _INT64, _INT64]
        fn.restype = ctypes.c_int
    lora = lib.pdkv_lora_bf16
    lora.argtypes = [_PTR] * 5 + [_INT64] * 4 + [_PTR, _INT64, _INT64]
    lora.restype = ctypes.c_int
    lib.pdkv_lora_built.restype = ctypes.c_int
    qlinear = lib.pdkv_qlinear
    qlinear.argtypes = [_PTR, _INT64, _INT64, _INT64, _PTR, _INT64, _INT64, _PTR, _INT64, _INT64]
    qlinear.restype = ctypes.c_int
    qrows = lib.pdkv_qdequant_rows
    qrows.argtypes = [_PTR, _INT64, _INT64, _INT64, _PTR, _INT64, _PTR, _INT64]
    qrows.restype = ctypes.c_int
    bandwidth = lib.pdkv_read_bandwidth
    bandwidth.argtypes = [_PTR, _INT64]
    bandwidth.restype = _INT64
    evict = lib.pdkv_evict
    evict.argtypes = [_PTR, _INT64]
    evict.restype = ctypes.c_int
    lib.pdkv_quant_built.restype = ctypes.c_int
    lib.pdkv_bf16_built.restype = ctypes.c_int
    layer = lib.pdkv_decode_layer
    layer.argtypes = [_PTR] * 7
    layer.restype = ctypes.c_int
    scratch = lib.pdkv_decode_scratch_bytes
    scratch.argtypes = [_PTR, _INT64]
    scratch.restype = _INT64
    # the AMX tiles' switches, set once here
    amx, int8_tiles, attn_tiles = lib.pdkv_bf16_amx, lib.pdkv_quant_amx, lib.pdkv_attn_amx
    for switch, env in ((amx, AMX_ENV), (int8_tiles, QUANT_AMX_ENV), (attn_tiles, ATTN_AMX_ENV)):
        switch.argtypes, switch.restype = [_INT64], ctypes.c_int
        switch(int(os.environ.get(env, "1") != "0"))
    row_groups = lib.pdkv_quant_row_groups
    row_groups.argtypes, row_groups.restype = [_INT64], _INT64
    row_groups(row_groups_default())
    prefetch, bf16_nta = lib.pdkv_quant_prefetch, lib.pdkv_bf16_prefetch_nta
    prefetch.argtypes, prefetch.restype = [_INT64] * 3 + [_PTR], ctypes.c_int
    bf16_nta.argtypes, bf16_nta.restype = [_INT64], _INT64
    bf16_fma = lib.pdkv_bf16_fma
    bf16_fma.argtypes, bf16_fma.restype = [_INT64], _INT64
    bf16_fma(bf16_fma_default())  # the linears' dot products: FMAs or vdpbf16ps (the same bits)
    bf16_dot = lib.pdkv_bf16_built()  # simd.h's PDKV_BF16: 1 vdpbf16ps, 2 emulated, 3 on AVX2, 0 none
    quant = QuantKernel(
        qlinear,
        qrows,
        bandwidth,
        bf16_dot != 0,
        amx,
        evict,
        int8_tiles,
        row_groups,
        prefetch,
        bf16_nta,
        bf16_fma,
    )
    quant.prefetch(*row_prefetch_default())  # both files' prefetches, set once
    built = lib.pdkv_quant_built() != 0  # quant.c has its vector kernels
    logger.info(
        "native kernels (decode and prefill attention, RMSNorm, RoPE + K/V write, SiLU-mul, argmax): %s", path
    )
    return NativeKernels(
        DecodeKernel(decode),
        PrefillKernel(many, attn_tiles) if lib.pdkv_paged_prefill_built() else None,
        RMSNormKernel(norm),
        RopeKernel(rope),
        SiluMulKernel(silu),
        ArgmaxKernel(argmax, argmax_bf16),
        LoRAKernel(lora) if lib.pdkv_lora_built() else None,
        quant if built else None,
        DecodeLayerKernel(layer, scratch) if built else None,
        bf16_dot=bf16_dot,
    )
