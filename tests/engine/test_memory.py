"""Host buffers on 2 MB pages (engine/memory.py): the KV cache and the packed weights' arena."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.llm import LLM
from engine.memory import huge_page_buffer
from engine.model.quantized import packed_weights
from tests.gguf_models import write_gguf
from tests.tiny_models import pdkv_tiny_model_dir

THP = Path("/sys/kernel/mm/transparent_hugepage").is_dir()  # a kernel built with them


def _advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping that holds ``tensor``'s first byte is advised MADV_HUGEPAGE (VmFlags "hg" in
    /proc/self/smaps): what the kernel then backs with 2 MB pages as far as it has them free."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


def test_a_huge_page_buffer_is_zeroed_writable_and_outlives_its_mapping_object() -> None:
    t = huge_page_buffer(3 * 2**20 + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * 2**20 + 5 and t.is_contiguous()
    assert int(t.count_nonzero()) == 0
    gc.collect()  # the mapping object is only referenced through the tensor
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t.sum()) == 7 * t.numel()


def test_the_kv_cache_is_zeroed_on_its_own_mapping_advised_huge_pages() -> None:
    spec = KVCacheSpec(
        num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    kv = allocate_kv_cache(spec, torch.device("cpu"))
    assert kv.shape == spec.shape and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert kv.nbytes == spec.num_blocks * spec.bytes_per_block
    assert not kv.any()
    kv[3, 1, 0, 5] = 1.5  # one slot, through the same views the kernels use
    assert float(kv.float().sum()) == 1.5 * spec.num_kv_heads * spec.head_dim
    assert _advised_huge(kv) == THP


def test_an_engines_packed_weights_lie_in_one_arena_advised_huge_pages(tmp_path: Path) -> None:
    """The quantized engine's matrices, moved at load into one buffer (quantized.gather_packed): every
    one of them inside it, and the buffer advised like the KV cache."""
    gguf = write_gguf(pdkv_tiny_model_dir(), tmp_path / "tiny-q4.gguf", qtype="Q4_1")
    llm = LLM(gguf, dtype="float32", weights="quantized", device="cpu", block_size=16, num_blocks=64)
    model = llm.engine.model.model
    arena = model._packed_arena
    weights = packed_weights(model)
    assert weights and isinstance(arena, torch.Tensor)
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.nbytes
    assert all(lo <= w.packed.data_ptr() and w.packed.data_ptr() + w.nbytes <= hi for w in weights)
    assert _advised_huge(arena) == THP
    assert _advised_huge(llm.engine.runner.kv_cache) == THP
