"""The native LoRA kernel (engine/csrc/lora.c) against a float64 reference and against itself: each
row's delta within bfloat16 rounding of the exact one, rows without an adapter untouched, and a row's
bits independent of the other rows of the call -- so in deterministic mode a request under an adapter
gets the same tokens and logprobs alone or in any mixed batch."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.cpu_features import bf16_kernels_cpu
from engine.llm import LLM
from engine.lora.adapter import ModuleDelta
from engine.lora.layers import LoRALinear, LoRAState
from engine.native import native_kernels
from engine.sampling_params import SamplingParams
from tests.tiny_adapters import peft_adapter_dir
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.skipif(
    not bf16_kernels_cpu() or native_kernels() is None, reason="needs the kernel (AVX-512)"
)
PARTS = [("q_proj", 96), ("k_proj", 40), ("v_proj", 40)]  # 40: a tail of columns past 16-wide vectors
IN = 70  # not a multiple of 32


def _module(num_slots: int = 4, rank: int = 16) -> tuple[LoRALinear, dict[int, list[Any]]]:
    kernels = native_kernels()
    assert kernels is not None and kernels.lora is not None
    state = LoRAState(kernel=kernels.lora)
    base = torch.nn.Linear(IN, 176, bias=False).to(torch.bfloat16)
    m = LoRALinear(
        base, IN, PARTS, num_slots=num_slots, max_rank=rank, state=state,
        dtype=torch.bfloat16, device=torch.device("cpu"), native=True,
    )  # fmt: skip
    deltas = {}
    for s in range(num_slots):
        g = torch.Generator().manual_seed(s)
        r = [4, 16, 6, 12][s % 4]
        deltas[s] = [
            ModuleDelta(r, 0.5, torch.randn(r, IN, generator=g), torch.randn(size, r, generator=g))
            if (s + p) % 3
            else None
            for p, (_, size) in enumerate(PARTS)
        ]
        m.set_slot(s, deltas[s])
    return m, deltas


def _run(m: LoRALinear, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    st = m.state
    used = sorted({s for s in slots if s >= 0})
    st.lo, st.hi, st.used = (used[0], used[-1] + 1, sum(1 << s for s in used)) if used else (0, 0, 0)
    st.rows = torch.tensor(slots, dtype=torch.int64)
    try:
        return m(x)
    finally:
        st.clear()


@pytest.mark.parametrize("rows", [1, 5, 37, 300])
def test_each_row_gets_its_adapters_delta_within_bf16_rounding(rows: int) -> None:
    m, deltas = _module()
    torch.manual_seed(rows)
    x = torch.randn(rows, IN).to(torch.bfloat16)
    slots = [random.Random(t).choice([-1, 0, 1, 3]) for t in range(rows)]
    y = _run(m, x, slots).double()
    base = m.base(x)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(y[t].to(torch.bfloat16), base[t])  # untouched, bit for bit
            continue
        exact = base[t].double().clone()
        start = 0
        for p, (_, size) in enumerate(PARTS):
            d = deltas[s][p]
            if d is not None:
                exact[start : start + size] += (d.b.double() * d.scaling) @ (d.a.double() @ x[t].double())
            start += size
        # the delta's own rounding (u to bf16) and the sum's: a few bf16 ulps of the largest term
        tol = 4 * 2.0**-8 * float(exact.abs().max()) + 1e-3
        assert float((y[t] - exact).abs().max()) <= tol, (t, s)


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    m, _ = _module()
    x = torch.randn(40, IN).to(torch.bfloat16)
    slots = [t % 4 - 1 for t in range(40)]  # -1, 0, 1, 2, ...
    together = _run(m, x, slots)
    for t in range(40):
        alone = _run(m, x[t : t + 1].contiguous(), slots[t : t + 1])
        assert torch.equal(alone[0], together[t]), t


def test_in_deterministic_mode_a_request_under_an_adapter_is_the_same_bits_in_any_batch() -> None:
    model = "llama_smol_shapes"
    a, b = peft_adapter_dir(model, "r16"), peft_adapter_dir(model, "all_linear")
    llm = LLM(
        tiny_model_dir(model), dtype="bfloat16", block_size=16, num_blocks=512, deterministic=True,
        loras=(("A", str(a)), ("B", str(b))),
    )  # fmt: skip
    assert llm.engine.lora.state.kernel is not None
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)
    rng = random.Random(9)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (20, 47, 33, 90)]
    order: list[str | None] = ["A", None, "B", "A"]
    mixed = llm.generate(prompts, params, adapters=order)
    llm.engine.reset_prefix_cache()
    for p, adapter, out in zip(prompts, order, mixed, strict=True):
        [alone] = llm.generate([p], params, adapters=adapter)
        llm.engine.reset_prefix_cache()
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs), adapter
    assert mixed[0].token_ids != llm.generate([prompts[0]], params)[0].token_ids  # A changes the output


def test_deterministic_mode_refuses_adapters_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDKV_LORA_NATIVE", "0")
    with pytest.raises(
        ValueError, match="deterministic mode with LoRA adapters needs the native LoRA kernel"
    ):
        LLM(
            tiny_model_dir("llama_smol_shapes"), dtype="bfloat16", block_size=16, num_blocks=64,
            deterministic=True, enable_lora=True,
        )  # fmt: skip
