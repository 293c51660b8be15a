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


@dataclass(slots=True)
class LoRAState:
    """The step's adapters: slots ``0..k-1`` in use, ``used`` their bit set, ``mask`` [T, k]."""

    k: int = 0
    used: int = 0
    mask: torch.Tensor | None = None

    def clear(self) -> None:
        self.k, self.used, self.mask = 0, 0, None


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
        self.slot_bits = 0  # bit s: slot s holds a delta for this module

    def set_slot(self, slot: int, deltas: list[ModuleDelta | None]) -> None:
        """Put one adapter's deltas (one per part, None where it does not target it) in ``slot``."""
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        bit = 1 << slot
        self.slot_bits &= ~bit
        for p, d in enumerate(deltas):
            if d is None:
                continue
            self.a[slot, p, : d.rank].copy_(d.a)
            self.b[p][slot, : d.rank].copy_((d.b.float() * d.scaling).t())
            self.slot_bits |= bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        y = self.base(x)
        st = self.state
        if not st.used & self.slot_bits:
            return y
        assert st.mask is not None
        t, k, r, num_parts = x.shape[0], st.k, self.rank, len(self.parts)
        u = F.linear(x, self.a[:k].view(k * num_parts * r, -1))  # [T, k*P*R]
        u = u.view(t, k, num_parts, r).mul_(st.mask.view(t, k, 1, 1))
        start = 0
        for p, (_, size) in enumerate(self.parts):
            up = u[:, :, p].reshape(t, k * r)
            y[:, start : start + size] += up @ self.b[p][:k].view(k * r, size)
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
