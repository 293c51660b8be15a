"""The rotary table (engine/model/rope.py): a step's (cos, sin) gathered from it are the bits computing
them from the step's own positions gives -- whatever the positions, their order, the table's growth."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import RopeConfig
from engine.model.rope import RotaryEmbedding

ROPES = [
    RopeConfig(),
    RopeConfig(kind="linear", factor=4.0),
    RopeConfig(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192, theta=500000.0,
    ),
]  # fmt: skip


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_table_gives_the_bits_the_positions_themselves_give(rope: RopeConfig, dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(rope, 64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    asks = [
        torch.tensor([5]),  # the first table: TABLE_STEP positions
        torch.randint(0, 900, (333,), generator=gen),
        torch.tensor([RotaryEmbedding.TABLE_STEP]),  # one past it: the table grows
        torch.randint(0, 20000, (2049,), generator=gen),  # grows again, a chunk's rows out of order
        torch.arange(100, 140),
        torch.tensor([], dtype=torch.int64),
    ]
    for positions in asks:
        cos, sin = rotary.cos_sin(positions, dtype)
        want_cos, want_sin = rotary.compute(positions, dtype)
        assert cos.shape == (positions.numel(), 1, 32) and cos.dtype == dtype and cos.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rotary._tables[dtype][0].shape[0] == 20 * RotaryEmbedding.TABLE_STEP  # grown to cover 19999


def test_a_generation_walking_past_the_table_regrows_it_a_logarithmic_number_of_times() -> None:
    rotary = RotaryEmbedding(RopeConfig(), 64, torch.device("cpu"))
    sizes = []
    for position in range(0, 40 * RotaryEmbedding.TABLE_STEP, 97):  # decode steps, one token each
        cos, _ = rotary.cos_sin(torch.tensor([position]), torch.bfloat16)
        assert torch.equal(cos, rotary.compute(torch.tensor([position]), torch.bfloat16)[0])
        size = rotary._tables[torch.bfloat16][0].shape[0]
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    assert sizes == [RotaryEmbedding.TABLE_STEP * 2**i for i in range(7)]  # 1, 2, 4, ... 64 steps
