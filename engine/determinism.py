"""Deterministic mode: the same bits for a request whatever else runs with it.

With it on, each token's forward pass reduces in an order fixed by that token alone -- not by the batch
size, the chunking, the row's place in the batch, the thread count, or whether its keys and values were
computed here, loaded from a store tier or received from a peer:

- linears: the native kernels, each output summed in input order whatever the batch -- bf16_linear.c in
  AVX512-BF16 vectors (AVX-512's FMAs where the CPU lacks it) or AMX tiles (one path per process),
  quant.c for quantized weights; where they are not built, oneDNN's packed bfloat16 matmuls under a
  plan measured on the host to keep each row's sums at every row count -- small batches padded to the
  row count where oneDNN's kernel stops changing, or K in pieces (``engine/model/batch_invariance.py``);
- attention: every row of a step, prefill or decode, through the native prefill kernel in one call,
  whose key tiles sit at absolute positions, so each query's sums run in an order fixed by its position
  (``engine/csrc/paged_prefill.c``, ``engine/attention.py``).  The cache holds keys and values in the
  kernel's own pairs inside each block (``KV_PAIRED``, engine/native_attention.py), so a decode row's
  tiles are copies of its blocks, not transposes of them, every step;
- norms, RoPE, SwiGLU, the LM head and sampling were per row already (the native kernels; the sampler's
  seeded noise depends on the request's seed and output index only).

So temperature 0 gives one answer at any load, a stream resumed on another decode node continues as the
one that died would have, and a prefix loaded from a tier is the KV a recompute would make.  It serves
bfloat16 on the CPU with the native kernels built; float32's linears are MKL's, whose sums depend on the
batch (float32 is the dtype compared with transformers token for token, not bit for bit).

The switch changes bits (decode rows take the prefill kernel's arithmetic, and a linear's plan may
round differently from the fast path) and the order of the bytes inside a block, so it is part of the
KV's namespace with the dtype and the linears' tiles (``kv_fingerprint``): a deterministic node never
loads a block a non-deterministic one made, nor sends one to it (a p2p pull checks the namespace too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.batch_invariance import make_batch_invariant
from engine.native import native_kernels
from engine.native_attention import PrefillKernel


@dataclass(frozen=True)
class Determinism:
    """What an engine runs: ``on``, and ``note`` saying why (or why not) in a line."""

    on: bool
    note: str


class DeterminismUnavailable(ValueError):
    """``--deterministic on`` was asked for where it cannot be served."""


def enable_determinism(
    model: torch.nn.Module,
    *,
    requested: bool | None,
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_rows: int,
    block_size: int,
) -> Determinism:
    """Turn deterministic mode on for ``model`` where ``requested`` (None: where it can be served) and
    this host serves it.  Raises ``DeterminismUnavailable`` when ``requested`` is True and it cannot."""
    if requested is False:
        return Determinism(False, "off (--deterministic off)")
    why = _unavailable(dtype, device, num_heads, num_kv_heads, head_dim, block_size)
    if why is None:
        why = make_batch_invariant(model, max_rows)
    if why is None:
        return Determinism(True, "on: batch-invariant linears and attention (bfloat16)")
    if requested:
        raise DeterminismUnavailable(f"--deterministic on cannot be served here: {why}")
    return Determinism(False, f"off: {why}")


def _unavailable(
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str | None:
    if device.type != "cpu":
        return f"it serves the CPU, not {device.type}"
    if dtype != torch.bfloat16:
        return f"it serves bfloat16; this engine runs {str(dtype).removeprefix('torch.')}"
    if not PrefillKernel.supports(dtype, num_heads, num_kv_heads, head_dim):
        return f"the native prefill attention does not serve this model's heads (head_dim {head_dim})"
    if block_size % 2:
        return f"the cache's paired order needs an even block size, not {block_size}"
    kernels = native_kernels()
    if kernels is None:
        return "the native kernels could not be built (no C compiler?)"
    if kernels.prefill is None:
        return "the native prefill attention was not built (the compiler emitted no AVX-512 or AVX2 code)"
    return None


def kv_fingerprint(
    model_fingerprint: str,
    dtype: torch.dtype,
    deterministic: bool,
    *,
    tiles: bool = False,
    torch_linears: bool = False,
    attention_tiles: bool = False,
    quantized: bool = False,
    packed_types: frozenset[str] = frozenset(),
    bf16_dot: int | None = 1,
) -> str:
    """The fingerprint a ``HashNamespace`` takes: the model's, plus what makes its KV bits differ -- the
    dtype, the mode, whether the bfloat16 linears run in AMX tiles (engine/csrc/bf16_amx.h) or in torch's
    matmuls (``torch_linears``: oneDNN, whose sums follow the CPU's instruction set), whether the
    bfloat16 attention does (``attention_tiles``: engine/csrc/attn_amx.h), whether the weights run
    quantized (engine/model/quantized.py; with the rule its activations are quantized by, int16 at a
    step of max|a| / 32639 since 2026-12-06, so no node loads a block made under the old rule; and of
    ``packed_types``, the GGUF types packed since 2026-12-07 -- Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, dequantized
    before -- named: ``;packed=Q4_K,Q5_0``; both of the layers' linears only, as engine/llm_engine.py
    passes them: an LM head or embedding makes no KV bit) and, for
    bfloat16, the kernels' dot products: ``bf16_dot`` is
    ``NativeKernels.bf16_dot`` (engine/csrc/simd.h's PDKV_BF16: 1 vdpbf16ps, 2 its FMA emulation on
    AVX-512, 3 that emulation on AVX2's halves, 0 scalar loops), None where no native kernels run (torch's
    own).  The native bfloat16 kernels flush denormals as vdpbf16ps does (simd.h's bf16_mode_enter:
    ``;denormals=flushed``), so in deterministic mode -- one attention kernel for every row, and each row's
    sums in one order -- forms 1, 2 and 3 give the same bits (compared on one CPU that runs all three,
    tests/engine/test_bf16_forms.py) and share blocks: a CPU with AVX2 and one with AVX512-BF16 serve one
    deterministic namespace.  Outside it the decode attention has a kernel of each form, with its own sums:
    the form is named (``;bf16dot=fma``, ``;bf16dot=avx2``)."""
    mode = ";deterministic" if deterministic else ""
    linears = ";linears=amx" if tiles else ""
    if torch_linears and dtype == torch.bfloat16:
        linears = ";linears=torch"
    attention = ";attention=amx" if attention_tiles and dtype == torch.bfloat16 else ""
    weights = ";weights=quantized;activations=int16/32639" if quantized else ""
    newly_packed = sorted(packed_types & {"Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
    if quantized and newly_packed:
        weights += f";packed={','.join(newly_packed)}"
    dots = ""
    if dtype == torch.bfloat16:
        if bf16_dot is None:
            dots = ";bf16dot=torch"
        else:
            shared = deterministic and bf16_dot in (1, 2, 3)  # the same bits in every form
            named = "" if shared else {0: "scalar", 2: "fma", 3: "avx2"}.get(bf16_dot, "")
            dots = (f";bf16dot={named}" if named else "") + ";denormals=flushed"
    kv = str(dtype).removeprefix("torch.")
    return f"{model_fingerprint};kv={kv}{mode}{linears}{attention}{dots}{weights}"
