"""bfloat16 linears over oneDNN-packed weights (engine/model/packed.py) compute what ``F.linear`` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.packed import PackedLinear, can_pack, linear_weights, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN bfloat16 is not available on this CPU"
)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    # The same oneDNN kernel; at most a rounding of the output apart.
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


def test_pack_linears_replaces_every_linear_and_keeps_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False))).to(
        torch.bfloat16
    )
    before = [m.weight.detach().clone() for m in model.modules() if isinstance(m, nn.Linear)]
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    for w, dense in zip(before, linear_weights(model), strict=True):
        assert torch.equal(w, dense)


def test_a_bfloat16_engine_packs_its_linears_and_a_float32_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bfloat16: packed for the native kernel where it is built (engine/csrc/bf16_linear.c), for oneDNN
    with PDKV_BF16_LINEARS=onednn or without it; float32 keeps nn.Linear (MKL, the reference sums)."""
    from engine import LLM
    from engine.model.quantized import QuantLinear
    from engine.native import native_kernels
    from tests.tiny_models import tiny_model_dir

    kernels = native_kernels()
    native = kernels is not None and kernels.quant is not None and kernels.quant.bf16
    for env, dtype, kind in (
        (None, "bfloat16", QuantLinear if native else PackedLinear),
        ("onednn", "bfloat16", PackedLinear),
        (None, "float32", nn.Linear),
    ):
        if env:
            monkeypatch.setenv("PDKV_BF16_LINEARS", env)
        llm = LLM(tiny_model_dir("llama"), dtype=dtype, device="cpu", block_size=4, num_blocks=64)
        kinds = {type(m) for m in llm.engine.model.model.modules()} & {PackedLinear, QuantLinear, nn.Linear}
        assert kinds == {kind}, (env, dtype, kinds)
        monkeypatch.delenv("PDKV_BF16_LINEARS", raising=False)
