"""What this CPU does fast, read from ``/proc/cpuinfo`` (no torch import, so ``pdkv --help`` can say it).

bfloat16 matmuls run on AVX512_BF16 (``avx512_bf16``) or AMX (``amx_bf16``) at about 2.4x the float32 rate
at small batch on the machines pdkv is developed on.  Without either, torch emulates bfloat16 and it is
slower than float32 -- but on AVX-512 (``avx512f``, ``avx512bw``, ``avx512vl``) pdkv's native kernels
run the same sums in FMAs (engine/csrc/simd.h), and a model's decode steps there are 1.3-3x float32's (an
Emerald Rapids VM that hides AVX512-BF16, docs/BENCHMARKS.md); with AVX2 and FMA alone the same kernels
run on 256-bit halves (engine/csrc/avx512_avx2.h), and SmolLM2's dense decode steps are still 2.3-5x
float32's (an AMD EPYC Zen 3, docs/BENCHMARKS.md: half the bytes to read, and kernels where torch's
float32 path is MKL's per-op calls).  That decides ``dtype="auto"`` on the CPU (``EngineConfig.torch_dtype``).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=4)
def _cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line's value in ``/proc/cpuinfo``; empty where it has none (or no file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(name):
            return line.partition(":")[2].strip()
    return ""


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """``/proc/cpuinfo``'s ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...); empty where unknown."""
    return _cpuinfo_field("vendor_id")


# What the native bfloat16 kernels (attention, LoRA, the dense linears: deterministic mode's) need of the
# CPU, gcc building for it: AVX-512 F, BW and VL -- with AVX512-BF16's dot product, or without it the same
# sums in FMAs (engine/csrc/simd.h's PDKV_BF16).
BF16_KERNEL_FLAGS = ("avx512f", "avx512bw", "avx512vl")
# Or, slower, AVX2 and FMA: the same kernels on two 256-bit halves of each vector (csrc/avx512_avx2.h).
BF16_AVX2_FLAGS = ("avx2", "fma")


# The native kernels' flag sets, first match wins, with what --help calls them and what the CPU lacks.
_KERNEL_FLAG_SETS = {
    BF16_KERNEL_FLAGS: ("avx512f/bw/vl", "no avx512_bf16"),
    BF16_AVX2_FLAGS: ("avx2/fma", "no AVX-512"),
}


def kernel_flags() -> tuple[str, ...]:
    """The flag set (``BF16_KERNEL_FLAGS`` or ``BF16_AVX2_FLAGS``) this CPU runs the native bfloat16
    kernels on; empty where it has neither."""
    flags = cpu_flags()
    return next((need for need in _KERNEL_FLAG_SETS if flags >= frozenset(need)), ())


def kernel_flags_label(flags: tuple[str, ...]) -> str:
    """``kernel_flags()``'s set as --help names it: ``avx512f/bw/vl`` or ``avx2/fma``."""
    return _KERNEL_FLAG_SETS[flags][0]


def bf16_kernels_cpu() -> bool:
    """Whether this CPU runs the native bfloat16 kernels: on AVX-512 (``BF16_KERNEL_FLAGS``) or on AVX2's
    halves (``BF16_AVX2_FLAGS``)."""
    return bool(kernel_flags())


def fast_bf16_flags() -> tuple[str, ...]:
    """Why bfloat16 is fast on this CPU: the flags of ``BF16_FLAGS`` it has, else ``BF16_KERNEL_FLAGS`` or
    ``BF16_AVX2_FLAGS`` where it has those and the native kernels are not turned off (``PDKV_NATIVE=0``);
    empty: not fast."""
    flags = cpu_flags()
    found = tuple(f for f in BF16_FLAGS if f in flags)
    if found or os.environ.get("PDKV_NATIVE", "1") == "0":
        return found
    return kernel_flags()


def auto_cpu_dtype_note() -> str:
    """One line for logs and ``--help``: what ``--dtype auto`` picks on this CPU and why."""
    found = fast_bf16_flags()
    if found in _KERNEL_FLAG_SETS:
        label, lacks = _KERNEL_FLAG_SETS[found]
        return (
            f"auto = bfloat16 on this CPU ({label}: pdkv's native kernels, {lacks}); "
            "float32 checkpoints stay float32"
        )
    if found:
        return f"auto = bfloat16 on this CPU ({', '.join(found)}); float32 checkpoints stay float32"
    return "auto = float32 on this CPU (no avx512_bf16, amx_bf16, avx512f/bw/vl or avx2/fma)"
