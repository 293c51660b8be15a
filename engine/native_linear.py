"""The native linears' handles (``engine/csrc/quant.c``, ``bf16_linear.c``, ``decode_layer.c``), which
``engine/native.py`` loads with the other kernels and re-exports."""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.cpu_features import cpu_vendor

logger = logging.getLogger(__name__)

# 1-4: groups quant.c's batch-1 linears stream side by side (the same bits; speed only).  Unset: 4 on an
# Intel CPU, 1 elsewhere -- what measured faster on each (engine/csrc/quant.c, row_groups).
ROW_GROUPS_ENV = "PDKV_QUANT_ROW_GROUPS"


def row_groups_default() -> int:
    """PDKV_QUANT_ROW_GROUPS where set (1-4), else 4 on an Intel CPU and 1 elsewhere."""
    raw = os.environ.get(ROW_GROUPS_ENV, "")
    default = 4 if cpu_vendor() == "GenuineIntel" else 1
    if raw and raw not in ("1", "2", "3", "4"):
        logger.warning("%s=%r is not 1, 2, 3 or 4: using %d", ROW_GROUPS_ENV, raw, default)
    return int(raw) if raw in ("1", "2", "3", "4") else default


# 0 or 1: the bfloat16 linears' vector dot products as vdpbf16ps or as two FMAs per pair (the same bits:
# engine/csrc/bf16_linear.c, pdkv_bf16_fma).  Unset: FMAs on an Intel CPU, vdpbf16ps elsewhere.
BF16_FMA_ENV = "PDKV_BF16_FMA"


def bf16_fma_default() -> int:
    """PDKV_BF16_FMA where set (0 or 1), else 1 on an Intel CPU and 0 elsewhere: where the vector path
    measured faster (vdpbf16ps has half the FMAs' throughput on Intel's cores, an Emerald Rapids VM; on an
    AMD EPYC Zen 4 the FMAs made SmolLM2's bfloat16 decode step 1.10x as long at batch 1, 1.08x at 8 and
    1.34x at 32: in-process A/B, six rounds, 2026-12-06).  Speed only: the two forms give the same bits."""
    raw = os.environ.get(BF16_FMA_ENV, "")
    default = 1 if cpu_vendor() == "GenuineIntel" else 0
    if raw and raw not in ("0", "1"):
        logger.warning("%s=%r is not 0 or 1: using %d", BF16_FMA_ENV, raw, default)
    return int(raw) if raw in ("0", "1") else default


def row_prefetch_default() -> tuple[int, int, int]:
    """How the native linears prefetch the weights they stream: (near, far, nta) -- a batch-1 quantized
    call's bytes ahead into L1 and into L2 (far 0: no L2 prefetch), and whether batch-1 quantized calls
    and every bfloat16 (vector) call prefetch them non-temporally; the quantized batch tiles and the AMX
    paths keep theirs.  What measured fastest on each vendor's CPU (engine/csrc/quant.c, row_prefetch;
    speed only, the same bits): an AMD EPYC's setting for AMD (and Hygon) CPUs, the Intel Xeon's for
    every other."""
    amd = cpu_vendor() in ("AuthenticAMD", "HygonGenuine")
    return (4096, 0, 1) if amd else (1024, 2048, 0)


@dataclass(frozen=True)
class QuantKernel:
    """``engine/csrc/quant.c`` of the built library: linears over packed GGUF blocks (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; ``engine/model/quant_blocks.py`` packs them) and over packed dense
    bfloat16 weights (``engine/csrc/bf16_linear.c``), their rows as dense floats, and the read-bandwidth
    probe.  Needs AVX512-VNNI, or AVX2 + FMA + F16C (the same sums, the same bits); None in
    ``NativeKernels`` without either."""

    linear_fn: Any  # pdkv_qlinear
    rows_fn: Any  # pdkv_qdequant_rows
    bandwidth_fn: Any  # pdkv_read_bandwidth
    bf16: bool = False  # the build has bf16_linear.c's kernel (AVX-512/AVX2): dense bfloat16 weights too
    amx_fn: Any = None  # pdkv_bf16_amx
    evict_fn: Any = None  # pdkv_evict
    int8_tiles_fn: Any = None  # pdkv_quant_amx
    row_groups_fn: Any = None  # pdkv_quant_row_groups
    prefetch_fn: Any = None  # pdkv_quant_prefetch
    bf16_nta_fn: Any = None  # pdkv_bf16_prefetch_nta
    bf16_fma_fn: Any = None  # pdkv_bf16_fma

    @property
    def amx(self) -> bool:
        """bf16_linear.c runs in AMX tiles (bf16_amx.h): built for this CPU, granted by Linux, not turned
        off by PDKV_BF16_AMX=0.  Set once as the library loads; the tiles' bits are not the vectors' (the
        KV namespace names them: engine/determinism.kv_fingerprint)."""
        return self.amx_fn is not None and bool(self.amx_fn(-1))

    def int8_tiles(self, want: bool | None = None) -> bool:
        """Whether quant.c runs calls of several rows in AMX-INT8 tiles (quant_amx.h: built for this CPU,
        granted by Linux, not off by PDKV_QUANT_AMX=0; the vectors' bits), after turning them on or off
        for the whole process where ``want`` says (tests, benchmarks)."""
        return self.int8_tiles_fn is not None and bool(self.int8_tiles_fn(-1 if want is None else int(want)))

    def row_groups(self, want: int | None = None) -> int:
        """Groups a batch-1 call streams side by side (1-4; quant.c's row_groups: speed only, the same
        bits), after setting it for the whole process where ``want`` says (tests, benchmarks)."""
        return int(self.row_groups_fn(0 if want is None else want))

    def prefetch(self, near: int = -1, far: int = -1, nta: int = -1) -> tuple[int, int, int]:
        """The prefetch setting in use (``row_prefetch_default``'s meaning), after setting it for the
        whole process -- quant.c's three values and bf16_linear.c's ``nta`` -- where all three are valid
        (0 <= near, far <= 1 MB, nta 0 or 1; else nothing changes): tests and benchmarks, the library
        starts with the default."""
        now = (ctypes.c_int64 * 3)()
        if self.prefetch_fn(near, far, nta, now) == 0 and self.bf16_nta_fn is not None:
            self.bf16_nta_fn(nta)
        return (now[0], now[1], now[2])

    def bf16_fma(self, want: bool | None = None) -> bool:
        """Whether bf16_linear.c's vector path sums with FMAs (else vdpbf16ps; the same bits), after
        setting it for the whole process where ``want`` says and the build has both forms (tests,
        benchmarks); the library starts with ``bf16_fma_default``."""
        if self.bf16_fma_fn is None:
            return False
        return bool(self.bf16_fma_fn(-1 if want is None else int(want)))

    def bf16_nta(self) -> bool:
        """bf16_linear.c's non-temporal switch (``prefetch``'s ``nta``) as it is now."""
        return self.bf16_nta_fn is not None and bool(self.bf16_nta_fn(-1))

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float32)

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, out: torch.Tensor, col: int = 0
    ) -> None:
        """``out[:, col : col + n] = x @ w.T`` for ``x`` [T, k] and ``w`` [n, k] packed in format ``fmt``."""
        assert x.dim() == 2 and x.is_contiguous() and out.is_contiguous() and out.shape[0] == x.shape[0]
        assert x.dtype in (torch.bfloat16, torch.float32) and out.dtype in (torch.bfloat16, torch.float32)
        assert col >= 0 and col + n <= out.shape[1]
        failed = self.linear_fn(
            x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], packed.data_ptr(), fmt, n,
            out.data_ptr() + col * out.element_size(), out.shape[1], out.dtype == torch.bfloat16,
        )  # fmt: skip
        _check_quant(failed, "pdkv_qlinear")

    def rows(
        self, packed: torch.Tensor, fmt: int, n: int, k: int, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``ids`` of the packed [n, k] weight as dense [len(ids), k] in ``dtype`` (bf16 or f32)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=dtype)
        failed = self.rows_fn(
            packed.data_ptr(), fmt, n, k, ids.data_ptr(), ids.numel(), out.data_ptr(), dtype == torch.bfloat16
        )
        if failed == 2:
            raise IndexError(f"a row id outside 0..{n - 1} (or a shape the packed weight does not have)")
        _check_quant(failed, "pdkv_qdequant_rows")
        return out

    def read_bandwidth(self, buffer: torch.Tensor) -> int:
        """Read ``buffer`` once on every thread's share (the caller times it); a checksum."""
        return int(self.bandwidth_fn(buffer.data_ptr(), buffer.numel() * buffer.element_size()))

    def evict(self, buffer: torch.Tensor) -> None:
        """Drop ``buffer``'s bytes from every level of the caches: its next read comes from memory."""
        if self.evict_fn is None or self.evict_fn(buffer.data_ptr(), buffer.numel() * buffer.element_size()):
            raise RuntimeError("this CPU has no cache-line flush (pdkv_evict)")


@dataclass(frozen=True)
class DecodeLayerKernel:
    """``engine/csrc/decode_layer.c``: a decoder layer over packed linears in one call (driven by
    ``engine/model/fused_decode.py``, which mirrors its structs)."""

    layer_fn: Any  # pdkv_decode_layer
    scratch_fn: Any  # pdkv_decode_scratch_bytes


def _check_quant(failed: int, name: str) -> None:
    if failed == 3:
        raise MemoryError(f"{name} could not allocate its activation buffers")
    assert failed == 0, f"{name} refused the call ({failed})"
