"""The shape of one stored block: what a payload's bytes mean.

The engine keeps its paged KV cache as one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]``, so one engine block ``kv_cache[block_id]`` is a C-contiguous buffer

    payload = [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]  of ``dtype``

and ``payload_nbytes = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize``.  (An engine in
deterministic mode orders the elements inside each [block_size, kv_heads, head_dim] slab as its attention
kernel reads them -- engine/native_attention.py's ``KV_PAIRED`` -- same size; its blocks live in their
own namespace, which every store lookup and p2p pull checks, so they never meet a canonical engine.)
Two engines may exchange a block only if their layouts are equal; the codec writes the layout into
every block header and refuses a block whose layout differs.  Dtypes are named the way torch prints
them, without ``torch.``; the one-byte code is part of the on-disk/on-wire format (``docs/kvstore.md``)
and never changes meaning.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

# name -> (format code, bytes per element).  Codes are stable: add new dtypes at the end, never reuse one.
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "uint8": (6, 1),
    "int8": (7, 1),
    "float64": (8, 8),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
_MAX_DIM = 2**32 - 1  # every dimension travels as a u32


@dataclass(frozen=True)
class BlockLayout:
    """Layers x KV heads x head dim x block size x dtype of one engine block (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= _MAX_DIM:
                raise ValueError(
                    f"BlockLayout.{field_name} must be a positive int below 2**32, got {value!r}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"BlockLayout.dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}"
            )

    @property
    def dtype_code(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @functools.cached_property
    def payload_nbytes(self) -> int:
        """Bytes of one block's payload (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @classmethod
    def from_code(
        cls, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_code: int
    ) -> BlockLayout:
        """Rebuild a layout from header fields; raises ``ValueError`` for an unknown dtype code."""
        return _layout_from_code(num_layers, num_kv_heads, head_dim, block_size, dtype_code)

    @classmethod
    def from_spec(cls, spec: Any) -> BlockLayout:
        """The layout of an engine's blocks, from its ``KVCacheSpec`` (the one place it is derived; a
        cache tensor's layout, ``from_kv_cache``, must equal it)."""
        dtype = str(spec.dtype).removeprefix("torch.")
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, dtype)

    @classmethod
    def from_kv_cache(cls, kv_cache: Any) -> BlockLayout:
        """The layout of the blocks of a paged cache tensor ``[num_blocks, L, 2, block_size, H, D]``."""
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(
                f"kv_cache must have shape [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                f"got {list(shape)}"
            )
        _, num_layers, _, block_size, num_kv_heads, head_dim = shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype)

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} head dim x "
            f"{self.block_size} tokens x {self.dtype}"
        )


@functools.lru_cache(maxsize=64)
def _layout_from_code(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, code: int
) -> BlockLayout:
    # Every header read rebuilds its layout: a process sees few distinct ones, so cache them.
    name = _DTYPE_BY_CODE.get(code)
    if name is None:
        raise ValueError(f"unknown dtype code {code}")
    return BlockLayout(num_layers, num_kv_heads, head_dim, block_size, name)
