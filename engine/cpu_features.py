"""What this CPU does fast, read from ``/proc/cpuinfo`` (no torch import, so ``pdkv --help`` can say it).

bfloat16 matmuls run on AVX512_BF16 (``avx512_bf16``) or AMX (``amx_bf16``) at about 2.4x the float32 rate
at small batch on the machines pdkv is developed on; without either, torch emulates bfloat16 and it is
slower than float32.  That decides ``dtype="auto"`` on the CPU (``EngineConfig.torch_dtype``).
"""

from __future__ import annotations

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


def fast_bf16_flags() -> tuple[str, ...]:
    """The flags of ``BF16_FLAGS`` this CPU has (empty: bfloat16 is not fast here)."""
    flags = cpu_flags()
    return tuple(f for f in BF16_FLAGS if f in flags)


# What the native bfloat16 kernels (attention, LoRA, the dense linears: deterministic mode's) need of the
# CPU, gcc building for it: AVX-512 F and BW -- with AVX512-BF16's dot product, or without it the same sums
# in FMAs (engine/csrc/simd.h's PDKV_BF16).
BF16_KERNEL_FLAGS = frozenset({"avx512f", "avx512bw"})


def bf16_kernels_cpu() -> bool:
    """Whether this CPU runs the native bfloat16 kernels (``BF16_KERNEL_FLAGS``)."""
    return cpu_flags() >= BF16_KERNEL_FLAGS


def auto_cpu_dtype_note() -> str:
    """One line for logs and ``--help``: what ``--dtype auto`` picks on this CPU and why."""
    found = fast_bf16_flags()
    if found:
        return f"auto = bfloat16 on this CPU ({', '.join(found)}); float32 checkpoints stay float32"
    return "auto = float32 on this CPU (no avx512_bf16 or amx_bf16)"
