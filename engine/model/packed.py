"""bfloat16 linear layers with their weights reordered once into oneDNN's blocked layout.

``F.linear`` on a bfloat16 CPU tensor goes through oneDNN, which reorders the (dense, row-major) weight
into its blocked layout on every call.  Doing that once at load time and calling oneDNN's linear on the
packed weight gives the same numbers (the same kernel) at 1.5-2.5x the speed on this machine kind:
the 30-layer SmolLM2 decode step's matmuls take 13 ms instead of 20 ms at batch 1 to 32, and prefill
chunks gain 10-30%.  float32 stays on ``F.linear`` (MKL), whose sums a oneDNN float32 kernel would not
reproduce bit for bit -- and float32 is the dtype the tests compare with transformers token for token.

The packed weight is the only copy of a layer's weight (it replaces ``nn.Linear.weight``);
``dense_weight()`` unpacks one when something needs the plain tensor (the bench's matmul floor).  A tied
LM head is packed from the embedding, which keeps its own dense copy for the lookups.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN serves bfloat16 linears on this CPU (AVX512-BF16, AMX, or at least AVX512 emulation)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` (no weight init, no training) over a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # batch_size=None: a layout good for every row count (decode batches and prefill chunks alike).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # With split_k: the weight as column pieces [out, k_i], packed each, and where each starts.
        self.pieces: list[tuple[int, int, torch.Tensor]] = []
        # Fewer rows than this are computed padded to it with zero rows (batch_invariance.py says why).
        self.min_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]."""
        t = x.shape[0]
        if t < self.min_rows:
            padded = x.new_zeros(self.min_rows, x.shape[1])
            padded[:t] = x
            return self.forward(padded)[:t]
        if not self.pieces:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return split_linear(x, self.pieces, self.bias)

    def split_k(self, sizes: list[int]) -> None:
        """Compute as len(sizes) matmuls over consecutive column pieces of these sizes, each added into
        the running sum by oneDNN's add post-op (float32 inside, one rounding per piece): where oneDNN
        picks its K blocking by the row count, a piece small enough that it never splits gives every row
        the same sums at any batch size (``engine/model/batch_invariance.py`` measures which).  ``[]``
        (or one piece) undoes it."""
        assert sum(sizes) == self.in_features if sizes else True
        dense = self.dense_weight() if self.pieces else None
        if len(sizes) <= 1:
            if dense is not None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
            self.pieces = []
            return
        dense = dense if dense is not None else self.packed.to_dense()
        pieces, start = [], 0
        for size in sizes:
            part = dense[:, start : start + size].contiguous()
            pieces.append((start, start + size, torch.ops.mkldnn._reorder_linear_weight(part, None)))
            start += size
        self.pieces = pieces
        self.packed = torch.empty(0, dtype=dense.dtype)  # the pieces hold the weight now

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (a fresh copy)."""
        if self.pieces:
            return torch.cat([p.to_dense() for _, _, p in self.pieces], dim=1)
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        split = f", k_pieces={[b - a for a, b, _ in self.pieces]}" if self.pieces else ""
        pad = f", min_rows={self.min_rows}" if self.min_rows > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN{split}{pad}"


def split_linear(
    x: torch.Tensor, pieces: list[tuple[int, int, torch.Tensor]], bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` [T, in] times the weight held as packed column pieces (start, end, packed) -> [T, out]."""
    (a, b, first), rest = pieces[0], pieces[1:]
    y = torch.ops.mkldnn._linear_pointwise(x[:, a:b].contiguous(), first, bias, "none", [], "")
    for a, b, packed in rest:
        y = torch.ops.mkldnn._linear_pointwise.binary(x[:, a:b].contiguous(), y, packed, None, "add")
    return y


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a ``PackedLinear``; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every linear layer's weight as a dense [out, in] tensor, packed or not."""
    weights = []
    for m in model.modules():
        if isinstance(m, PackedLinear):
            weights.append(m.dense_weight())
        elif isinstance(m, nn.Linear):
            weights.append(m.weight.detach())
    return weights
