"""LoRA deltas in mixed batches: each wrapped linear adds its rows' adapters' ``B (A x)``.

Each of q/k/v, o, gate/up and down is wrapped by a ``LoRALinear``: the base linear (plain or packed)
plus, per adapter *slot*, A [R, in] and B [R, out] per fused part (R = ``max_lora_rank``; a smaller rank
is zero-padded, the scaling folded into B).  A step with no adapter skips it all, and a module no adapter
of the step targets skips it too.  Otherwise one of two paths (docs/lora.md):

- native (bfloat16 with AVX-512, ``engine/csrc/lora.c``): one call per module, the rows grouped by
  slot -- no work for other slots' columns, and each row computed alone (its bits independent of the
  batch);
- torch (any device and dtype), for the step's slots ``lo..hi-1`` (k of them)::

    u = x @ A[lo:hi].T           [T, k*P*R]   one matmul for every adapter of the step (P: fused parts)
    u *= mask                    [T, k]       row t keeps only its own slot's columns (others exactly 0);
                                              skipped when every row runs the same adapter
    y += u @ B[lo:hi]            [T, out]     one matmul (decode: B block-diagonal over the fused parts;
                                              prefill chunks: one per part, fewer FLOPs)

``LoRAState`` is what the runner sets before each forward (``LoRAManager.begin_step``).  The q/k/v delta is
added before RoPE and the K/V write, so the cached K/V are the adapter's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapter import ModuleDelta
from engine.native import LoRAKernel

# Up to this many rows (decode steps), a fused module's B parts are one matmul over a block-diagonal B
# (more FLOPs, fewer calls); above, one matmul per part (prefill chunks: the FLOPs count).
FUSED_B_ROWS = 128


@dataclass(slots=True)
class LoRAState:
    """The step's adapters: slots ``lo..hi-1`` hold them (``used``: their bit set).  Torch path:
    ``mask`` [T, hi-lo] keeps each row's own slot (None when every row runs the same adapter).  Native
    path (``kernel`` set): ``rows`` [T] int64, each row's slot or -1."""

    lo: int = 0
    hi: int = 0
    used: int = 0
    mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    kernel: LoRAKernel | None = None

    def clear(self) -> None:
        self.lo, self.hi, self.used, self.mask, self.rows = 0, 0, 0, None, None


class LoRALinear(nn.Module):
    """``base`` (out = sum of ``parts``' sizes) plus the slots' deltas, one per part (q, k, v fused: 3).

    ``a`` [S, P, R, in]; ``b`` [S, R, out], the parts' up projections side by side (scaling folded in);
    for the torch path's decode steps also ``b_full`` [S, P*R, out], the same block-diagonal."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        parts: list[tuple[str, int]],
        *,
        num_slots: int,
        max_rank: int,
        state: LoRAState,
        dtype: torch.dtype,
        device: torch.device,
        native: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts  # (HF module name, output size) in output order
        self.rank = max_rank
        self.state = state
        starts = [0]
        for _, size in parts:
            starts.append(starts[-1] + size)
        self.starts = starts  # where each part's columns begin, and the end
        self.part_start = torch.tensor(starts, dtype=torch.int64)  # the same, for the native kernel
        self.a = torch.zeros(num_slots, len(parts), max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, starts[-1], dtype=dtype, device=device)
        self.b_full: torch.Tensor | None = None
        # The native kernel's B: ranks in pairs, [S, R/2, out, 2] (csrc/lora.c)
        self.b2 = torch.zeros(num_slots, max_rank // 2, starts[-1], 2, dtype=dtype) if native else None
        # ... and its A: input dims in pairs, [S, in/2, P*R, 2]
        self.a2 = (
            torch.zeros(num_slots, in_features // 2, len(parts) * max_rank, 2, dtype=dtype)
            if native
            else None
        )
        self._native: Callable[..., None] | None = None
        if native and state.kernel is not None:
            assert self.a2 is not None and self.b2 is not None
            self._native = state.kernel.bind(self.a2, self.b2, self.part_start)
        if len(parts) == 1:
            self.b_full = self.b
        elif not native:
            self.b_full = torch.zeros(
                num_slots, len(parts) * max_rank, starts[-1], dtype=dtype, device=device
            )
        self.slot_bits = 0  # bit s: slot s holds a delta for this module

    def set_slot(self, slot: int, deltas: list[ModuleDelta | None]) -> None:
        """Put one adapter's deltas (one per part, None where it does not target it) in ``slot``."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.b_full is not None:
            self.b_full[slot].zero_()
        bit = 1 << slot
        self.slot_bits &= ~bit
        r = self.rank
        for p, d in enumerate(deltas):
            start, end = self.starts[p], self.starts[p + 1]
            if d is not None:
                self.a[slot, p, : d.rank].copy_(d.a)
                self.b[slot, : d.rank, start:end].copy_((d.b.float() * d.scaling).t())
                if self.b_full is not None and len(self.parts) > 1:
                    self.b_full[slot, p * r : (p + 1) * r, start:end].copy_(self.b[slot, :, start:end])
                self.slot_bits |= bit
        if self.b2 is not None and self.a2 is not None:
            self.b2[slot].copy_(self.b[slot].view(r // 2, 2, -1).transpose(1, 2))
            rows = self.a[slot].reshape(len(self.parts) * r, -1)  # [P*R, in]
            self.a2[slot].copy_(rows.view(rows.shape[0], -1, 2).transpose(0, 1))

    @property
    def on_native_kernel(self) -> bool:
        """Whether its deltas run on csrc/lora.c (``a2``, ``b2``, ``part_start`` its layouts)."""
        return self._native is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        y = self.base(x)
        st = self.state
        if not st.used & self.slot_bits:
            return y
        if self._native is not None:
            assert st.rows is not None
            y = y.contiguous()
            self._native(x.contiguous(), y, st.rows)
            return y
        t, lo, hi, r, num_parts = x.shape[0], st.lo, st.hi, self.rank, len(self.parts)
        k = hi - lo
        u = F.linear(x, self.a[lo:hi].view(k * num_parts * r, -1))  # [T, k*P*R]
        if st.mask is not None:
            u = u.view(t, k, num_parts * r).mul_(st.mask.view(t, k, 1))
        if self.b_full is not None and (num_parts == 1 or t <= FUSED_B_ROWS):
            return y.addmm_(u.view(t, k * num_parts * r), self.b_full[lo:hi].view(k * num_parts * r, -1))
        u4 = u.view(t, k, num_parts, r)
        for p in range(num_parts):
            start, end = self.starts[p], self.starts[p + 1]
            b = self.b[lo:hi, :, start:end].reshape(k * r, end - start)
            y[:, start:end].addmm_(u4[:, :, p].reshape(t, k * r), b)
        return y

    def extra_repr(self) -> str:
        names = "+".join(n for n, _ in self.parts)
        return f"lora={names}, slots={self.a.shape[0]}, max_rank={self.rank}"


def wrap_model(
    model: nn.Module,
    *,
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    kernel: LoRAKernel | None = None,
) -> tuple[LoRAState, dict[tuple[int, str], tuple[LoRALinear, int]]]:
    """Wrap every layer's q/k/v, o, gate/up and down linear; returns the shared state and, per (layer,
    HF module name), its wrapper and part index.  ``kernel``: the native segmented kernel, used for
    every step (bfloat16 on a CPU with AVX-512)."""
    from engine.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    c = model.config
    q, kv, i_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    state = LoRAState(kernel=kernel)
    where: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        specs = [
            (attn, "qkv_proj", c.hidden_size, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]),
            (attn, "o_proj", q, [("o_proj", c.hidden_size)]),
            (mlp, "gate_up_proj", c.hidden_size, [("gate_proj", i_size), ("up_proj", i_size)]),
            (mlp, "down_proj", i_size, [("down_proj", c.hidden_size)]),
        ]
        for parent, attr, in_features, parts in specs:
            wrapped = LoRALinear(
                getattr(parent, attr),
                in_features,
                parts,
                num_slots=num_slots,
                max_rank=max_rank,
                state=state,
                dtype=dtype,
                device=device,
                native=kernel is not None,
            )
            setattr(parent, attr, wrapped)
            for p, (name, _) in enumerate(parts):
                where[(i, name)] = (wrapped, p)
    return state, where
