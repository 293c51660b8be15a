"""LoRA deltas in mixed batches: every resident adapter's weights stacked per module, masked per row.

Each of q/k/v, o, gate/up and down is wrapped by a ``LoRALinear``: the base linear (plain or packed)
plus, per adapter *slot*, A [R, in] and B [R, out] (R = ``max_lora_rank``; a smaller rank is zero-padded,
the scaling folded into B).  For a step whose rows use slots ``0..k-1``

    u = x @ A[:k].T              [T, k*P*R]   one matmul for every adapter of the step (P: fused parts)
    u *= mask                    [T, k]       row t keeps only its own slot's columns (others exactly 0)
    y[:, part] += u_part @ B[:k] [T, out]     one matmul per fused part

so the work per layer does not grow with the number of adapters in the batch, only with ``k * R``; a
step with no adapter skips it all, and a module no active adapter targets skips it too.  The same torch
code runs on CUDA.  ``LoRAState`` is what the runner sets before each forward (``LoRAManager.begin_step``).
The q/k/v delta is added before RoPE and the K/V write, so the cached K/V are the adapter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapter import ModuleDelta

# Up to this many rows (decode steps), a fused module's B parts are one matmul over a block-diagonal B
# (more FLOPs, fewer calls); above, one matmul per part (prefill chunks: the FLOPs count).
FUSED_B_ROWS = 128


@dataclass(slots=True)
class LoRAState:
    """The step's adapters: slots ``lo..hi-1`` hold them (``used``: their bit set); ``mask`` [T, hi-lo]
    keeps each row's own slot -- None when every row runs the same adapter (nothing to mask)."""

    lo: int = 0
    hi: int = 0
    used: int = 0
    mask: torch.Tensor | None = None

    def clear(self) -> None:
        self.lo, self.hi, self.used, self.mask = 0, 0, 0, None


class LoRALinear(nn.Module):
    """``base`` (out = sum of ``parts``' sizes) plus the slots' deltas, one per part (q, k, v fused: 3)."""

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
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts  # (HF module name, output size) in output order
        self.rank = max_rank
        self.state = state
        self.a = torch.zeros(num_slots, len(parts), max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device) for _, size in parts]
        # The same B as one block-diagonal matrix per slot: [S, P*R, out] (the parts' own columns only).
        out = sum(size for _, size in parts)
        self.b_full = (
            self.b[0]
            if len(parts) == 1
            else torch.zeros(num_slots, len(parts) * max_rank, out, dtype=dtype, device=device)
        )
        self.slot_bits = 0  # bit s: slot s holds a delta for this module

    def set_slot(self, slot: int, deltas: list[ModuleDelta | None]) -> None:
        """Put one adapter's deltas (one per part, None where it does not target it) in ``slot``."""
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        self.b_full[slot].zero_()
        bit = 1 << slot
        self.slot_bits &= ~bit
        r, start = self.rank, 0
        for p, d in enumerate(deltas):
            size = self.parts[p][1]
            if d is not None:
                self.a[slot, p, : d.rank].copy_(d.a)
                self.b[p][slot, : d.rank].copy_((d.b.float() * d.scaling).t())
                if len(self.parts) > 1:
                    self.b_full[slot, p * r : (p + 1) * r, start : start + size].copy_(self.b[p][slot])
                self.slot_bits |= bit
            start += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        y = self.base(x)
        st = self.state
        if not st.used & self.slot_bits:
            return y
        t, lo, hi, r, num_parts = x.shape[0], st.lo, st.hi, self.rank, len(self.parts)
        k = hi - lo
        u = F.linear(x, self.a[lo:hi].view(k * num_parts * r, -1))  # [T, k*P*R]
        if st.mask is not None:
            u = u.view(t, k, num_parts * r).mul_(st.mask.view(t, k, 1))
        if num_parts == 1 or t <= FUSED_B_ROWS:
            return y.addmm_(u.view(t, k * num_parts * r), self.b_full[lo:hi].view(k * num_parts * r, -1))
        u4 = u.view(t, k, num_parts, r)
        start = 0
        for p, (_, size) in enumerate(self.parts):
            y[:, start : start + size].addmm_(
                u4[:, :, p].reshape(t, k * r), self.b[p][lo:hi].view(k * r, size)
            )
            start += size
        return y

    def extra_repr(self) -> str:
        names = "+".join(n for n, _ in self.parts)
        return f"lora={names}, slots={self.a.shape[0]}, max_rank={self.rank}"


def wrap_model(
    model: nn.Module, *, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[LoRAState, dict[tuple[int, str], tuple[LoRALinear, int]]]:
    """Wrap every layer's q/k/v, o, gate/up and down linear; returns the shared state and, per (layer,
    HF module name), its wrapper and part index."""
    from engine.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    c = model.config
    q, kv, i_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    state = LoRAState()
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
            )
            setattr(parent, attr, wrapped)
            for p, (name, _) in enumerate(parts):
                where[(i, name)] = (wrapped, p)
    return state, where
