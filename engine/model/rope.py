"""Rotary position embeddings (RoPE), with the linear and Llama 3 frequency scalings.

Frequencies are computed in float32 exactly as Hugging Face does (``position * inv_freq`` in float32,
then cos/sin, then a cast to the activation dtype), so pdkv and transformers rotate by the same angles.
The rotation uses the "half split" convention of HF checkpoints: dimension ``i`` pairs with ``i + D/2``.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The ``head_dim // 2`` inverse frequencies, float32, after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Turns token positions into the (cos, sin) pair every layer of one forward pass shares.

    The pairs come from a table per dtype, grown (to at least twice its size, in whole ``TABLE_STEP``s)
    to cover the highest position asked for: each entry is computed as a step's own would be
    (``position * inv_freq`` in float32, cos/sin, the cast), elementwise, so the table changes no bit, and
    a step gathers its rows (one op) where it computed six (~60 us of a ~4 ms batch-1 step)."""

    TABLE_STEP = 1024

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inv_frequencies(rope, head_dim).to(device)  # [D/2] float32
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T] int -> cos, sin [T, 1, D/2] in ``dtype`` (the 1 broadcasts over heads)."""
        table = self._tables.get(dtype)
        if table is not None:
            try:
                return table[0].index_select(0, positions), table[1].index_select(0, positions)
            except IndexError:  # a position past the table: grow it
                pass
        if positions.numel() == 0:
            return self.compute(positions, dtype)
        have = 0 if table is None else table[0].shape[0]
        # at least twice the old table: a generation that walks past it recomputes it log(n) times
        size = max((int(positions.max()) // self.TABLE_STEP + 1) * self.TABLE_STEP, 2 * have)
        cos, sin = self.compute(torch.arange(size, device=self.inv_freq.device), dtype)
        self._tables[dtype] = (cos, sin)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs computed from the positions themselves (what the table holds)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by the angles in ``cos``/``sin`` [T, 1, D/2]; returns a new tensor.

    Equal, element for element, to HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, heads, D]
