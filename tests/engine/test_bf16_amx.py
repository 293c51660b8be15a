"""bf16_linear.c in AMX tiles (engine/csrc/bf16_amx.h), on CPUs with AMX-BF16: the exact product within
float32's sums and one bfloat16 rounding, each row's bits the same in any batch, at any thread count and
in any block of rows, shapes the tiles do not take left to the vectors -- and the tiles' bits named in the
KV namespace, since they are not the vectors', as are the attention's in tiles (engine/csrc/attn_amx.h,
whose kernel tests are tests/engine/test_native_prefill.py's on both paths)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.registry import KVConnectorConfig
from engine.determinism import kv_fingerprint
from engine.llm import LLM
from engine.model.quant_blocks import pack_bf16
from engine.model.quantized import QuantLinear
from engine.native import AMX_ENV, ATTN_AMX_ENV, QuantKernel, native_kernels
from engine.sampling_params import SamplingParams
from tests.tiny_models import tiny_model_dir

SHAPES = [(16, 32), (17, 64), (200, 576), (960, 576), (576, 1536), (33, 96)]  # (n, k)
ROWS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 129, 300)  # the blocks of 16 and 32, the chunks of 128


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    kernels = native_kernels()
    if kernels is None or kernels.quant is None or not kernels.quant.bf16:
        pytest.skip("this build has no AVX-512 code (the bfloat16 kernel)")
    if not kernels.quant.amx:
        pytest.skip(f"no AMX-BF16 tiles here (the CPU, the build, Linux's grant, or {AMX_ENV}=0)")
    return kernels.quant


@contextmanager
def vectors(kernel: QuantKernel) -> Iterator[None]:
    """The vector path for the duration (process-wide), the tiles after."""
    kernel.amx_fn(0)
    try:
        yield
    finally:
        assert kernel.amx_fn(1) == 1


def linear(kernel: QuantKernel, n: int, k: int, seed: int) -> tuple[QuantLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    return QuantLinear([pack_bf16(w)], None, kernel), w


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_tiles_give_the_product_within_float32_sums_and_one_rounding(
    kernel: QuantKernel, n: int, k: int
) -> None:
    layer, w = linear(kernel, n, k, seed=n * k)
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T
        y = layer(x).double()
        bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().T) * k * 2.0**-24
        assert torch.all((y - exact).abs() <= bound), rows


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_each_row_has_the_same_bits_in_any_batch_block_and_threads(kernel: QuantKernel, threads: int) -> None:
    layer, _ = linear(kernel, 200, 576, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), alone)
        for count in ROWS:
            assert torch.equal(layer(x[:count]), alone[:count]), count
        # a row at every place of a block of 16 / 32 and of a chunk of 128, among random companions
        for start in (1, 15, 16, 17, 100, 127, 128, 250):
            assert torch.equal(layer(x[start : start + 40]), alone[start : start + 40]), start
        perm = torch.randperm(300, generator=g)
        assert torch.equal(layer(x[perm]), alone[perm])
    finally:
        torch.set_num_threads(before)


def test_tiles_and_vectors_agree_in_value_not_in_bits(kernel: QuantKernel) -> None:
    """Why the namespace names the tiles: the same product rounds differently in TDPBF16PS."""
    layer, _ = linear(kernel, 960, 576, seed=5)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    tiles = layer(x)
    with vectors(kernel):
        vec = layer(x)
    torch.testing.assert_close(tiles.float(), vec.float(), rtol=2**-7, atol=1e-2)
    assert not torch.equal(tiles, vec)


def test_a_k_the_tiles_do_not_take_runs_in_vectors_the_same_at_every_batch(kernel: QuantKernel) -> None:
    layer, _ = linear(kernel, 40, 48, seed=7)  # k 48: not a multiple of the tiles' 32
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    whole = layer(x)
    with vectors(kernel):
        assert torch.equal(layer(x), whole)  # the same kernel: the vector path for this shape always
    for i in (0, 17, 39):
        assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1])


def test_the_namespace_names_the_tiles() -> None:  # on every host: a node on tiles is another namespace
    tiles = kv_fingerprint("m", torch.bfloat16, True, tiles=True)
    assert tiles == "m;kv=bfloat16;deterministic;linears=amx;denormals=flushed"
    assert kv_fingerprint("m", torch.bfloat16, True) == "m;kv=bfloat16;deterministic;denormals=flushed"
    both = kv_fingerprint("m", torch.bfloat16, False, tiles=True, quantized=True)
    assert both == "m;kv=bfloat16;linears=amx;denormals=flushed;weights=quantized;activations=int16/32639"


def test_the_variable_turns_the_tiles_off(kernel: QuantKernel) -> None:
    probe = "from engine.native import native_kernels\nq = native_kernels().quant\nprint(q.bf16, q.amx)\n"
    env = {**os.environ, AMX_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_the_variable_turns_the_attentions_tiles_off(kernel: QuantKernel) -> None:
    probe = "from engine.native import native_kernels\np = native_kernels().prefill\nprint(p.amx)\n"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, ATTN_AMX_ENV: value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.split() == [expected], out.stderr[-2000:]


@pytest.mark.parametrize(
    ("variable", "name"),
    [(AMX_ENV, "linears=amx"), (ATTN_AMX_ENV, "attention=amx")],
    ids=["linears", "attention"],
)
def test_a_node_on_vectors_never_loads_what_a_node_on_tiles_saved(
    kernel: QuantKernel, tmp_path: Path, variable: str, name: str
) -> None:
    """Same model, store and mode; the reader runs with the linears' or the attention's tiles off
    (PDKV_BF16_AMX=0, PDKV_ATTN_AMX=0: the switches are per process): no hit, while a second tile node
    hits the same prefix."""
    model, store = tiny_model_dir("llama_smol_shapes"), f"disk:{tmp_path / 'kv'}:64MiB"
    prompt, params = list(range(3, 99)), SamplingParams(max_tokens=2, ignore_eos=True)
    options: dict[str, Any] = {"dtype": "bfloat16", "block_size": 16, "num_blocks": 256}
    options["deterministic"] = True
    connector = KVConnectorConfig("offload", {"kv_store": store, "lookup_timeout_s": 5.0})
    writer = LLM(model, kv_connector=connector, **options)
    assert name in writer.engine.namespace.model_fingerprint
    writer.generate([prompt], params)
    assert writer.engine.drain(20.0)
    writer.engine.shutdown()
    reader = (
        "import sys\n"
        "from connectors.registry import KVConnectorConfig\n"
        "from engine.llm import LLM\n"
        "from engine.sampling_params import SamplingParams\n"
        f"llm = LLM({str(model)!r}, kv_connector=KVConnectorConfig('offload', {{'kv_store': {store!r}}}),"
        f" **{options!r})\n"
        f"[out] = llm.generate([{prompt!r}], SamplingParams(max_tokens=2, ignore_eos=True))\n"
        f"print({name!r} in llm.engine.namespace.model_fingerprint, out.num_external_tokens)\n"
        "llm.engine.shutdown()\n"
    )
    for value, expected in (("0", ["False", "0"]), ("1", ["True", "80"])):
        env = {**os.environ, variable: value}
        out = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True)
        why = (value, out.stdout, out.stderr[-2000:])
        assert out.returncode == 0 and out.stdout.split()[-2:] == expected, why
