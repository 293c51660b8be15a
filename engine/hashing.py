"""Chained block hashes: the one place pdkv turns tokens into cache keys.

The byte-level specification is ``docs/hashing.md``; ``docs/hashing-vectors.json`` holds test vectors.

    root   = H("pdkv-block-hash/v2" 0x00 algo 0x00 model_fingerprint 0x00 le_u32(block_size))
    hash_i = H(parent_i || le_i32(tokens of block i) || extra_keys_i)
    parent_0 = root, parent_i = hash_{i-1}

``extra_keys_i`` is empty for a plain block.  Otherwise it is a sequence of tagged fields, in tag order:

    0x01 le_u32(len) utf8(name) digest  in every block, when an adapter is set (``AdapterId``: its name
                                        and the 32-byte digest of its content, so other weights under
                                        the same name never share a block)
    0x02 le_u32(len) utf8(cache_salt)   in block 0 only, when a tenant salt is set

Only whole blocks are hashed; a trailing partial block has no hash.  Nothing here depends on Python's
``hash()``, a process seed or the platform's byte order, so every process on every machine agrees.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Protocol, cast

from wire.keys import (
    BlockHash as BlockHash,  # the type lives in the wire layer: events and store keys carry it
)

HASH_SPEC_VERSION = b"pdkv-block-hash/v2"
ADAPTER_DIGEST_SIZE = 32
SUPPORTED_ALGOS = ("sha256", "xxh3_128")
_MAX_TOKEN_ID = 2**31 - 1

_TAG_LORA = b"\x01"
_TAG_SALT = b"\x02"


class _Hasher(Protocol):
    def digest(self) -> bytes: ...


def _hash_constructor(algo: str) -> Callable[[bytes], _Hasher]:
    """The bare primitive: ``ctor(data).digest()`` -> 32 bytes (sha256) or 16 bytes (xxh3_128).

    Both algorithms share the ``ctor(data).digest()`` shape, so the hashing loop has no wrapper frame.
    """
    if algo == "sha256":
        return hashlib.sha256
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128  # type: ignore[no-any-return]
    raise ValueError(f"hash algo {algo!r} is not supported; choose one of {', '.join(SUPPORTED_ALGOS)}")


@lru_cache(maxsize=256)
def _packer(count: int) -> Callable[..., bytes]:
    """``pack(*ints) -> bytes`` of ``count`` little-endian int32 (a compiled Struct, reused)."""
    return struct.Struct(f"<{count}i").pack


def _tagged(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class AdapterId:
    """A LoRA adapter's identity in every cache key: its name and the SHA-256 digest of its canonical
    config and tensors (``engine/lora/adapter.py`` computes it).  Two adapters share KV only when both
    are equal: the same name with other weights is another adapter."""

    name: str
    digest: bytes

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("AdapterId.name must be a non-empty string")
        if not isinstance(self.digest, bytes) or len(self.digest) != ADAPTER_DIGEST_SIZE:
            raise ValueError(f"AdapterId.digest must be {ADAPTER_DIGEST_SIZE} bytes")

    @property
    def extra_key(self) -> bytes:
        """Its tagged field in every block's extra keys."""
        return _tagged(_TAG_LORA, self.name) + self.digest

    def __str__(self) -> str:
        return f"{self.name}@{self.digest.hex()[:16]}"


@dataclass(frozen=True)
class HashNamespace:
    """What makes two caches compatible: same algorithm, same model, same block size.

    ``model_fingerprint`` comes from the model loader (architecture, config and a weights digest), so two
    models, or two revisions of one, never share a block hash.
    """

    model_fingerprint: str
    block_size: int
    algo: str = "sha256"

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("HashNamespace.model_fingerprint must be a non-empty string")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"HashNamespace.block_size must be a positive int, got {self.block_size!r}")
        if self.algo not in SUPPORTED_ALGOS:
            raise ValueError(
                f"HashNamespace.algo {self.algo!r} is not supported; "
                f"choose one of {', '.join(SUPPORTED_ALGOS)}"
            )

    @cached_property
    def hasher(self) -> Callable[[bytes], _Hasher]:
        return _hash_constructor(self.algo)

    def digest(self, data: bytes) -> bytes:
        return self.hasher(data).digest()

    @cached_property
    def root(self) -> BlockHash:
        """The parent of block 0."""
        data = b"\x00".join(
            (
                HASH_SPEC_VERSION,
                self.algo.encode("ascii"),
                self.model_fingerprint.encode("utf-8"),
                struct.pack("<I", self.block_size),
            )
        )
        return BlockHash(self.digest(data))

    @cached_property
    def namespace_id(self) -> str:
        """A short printable id of the namespace (hex of the root), used in store keys and headers."""
        return self.root.hex()[:32]


# The longest cache salt a front end takes (characters): a tenant's name and a client's own salt fit.
MAX_CACHE_SALT_LEN = 256


def extra_keys(block_index: int, *, cache_salt: str | None, adapter: AdapterId | None) -> bytes:
    """The canonical extra-key bytes of block ``block_index`` (empty for a plain block)."""
    out = b""
    if adapter is not None:
        out += adapter.extra_key
    if cache_salt is not None and block_index == 0:
        out += _tagged(_TAG_SALT, cache_salt)
    return out


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    *,
    namespace: HashNamespace,
    cache_salt: str | None = None,
    adapter: AdapterId | None = None,
    offset: int = 0,
) -> None:
    """Append to ``hashes`` the hashes of every full block of ``token_ids`` not hashed yet.

    ``hashes`` already holds the hashes of the leading ``len(hashes)`` blocks; earlier blocks are never
    rehashed.  ``token_ids[0]`` is token number ``offset`` of the sequence (``offset`` is a multiple of the
    block size and at most ``len(hashes) * block_size``), so a caller can pass only the unhashed tail.
    This is the only code path that computes block hashes.
    """
    bs = namespace.block_size
    start = len(hashes)
    assert offset % bs == 0 and offset <= start * bs, "offset must be block-aligned and not skip blocks"
    end = (offset + len(token_ids)) // bs
    if end <= start:
        return
    # Work in block indices relative to token_ids from here on.
    base = offset // bs
    new = namespace.hasher
    parent: bytes = hashes[-1] if hashes else namespace.root
    lora = adapter.extra_key if adapter is not None else b""
    first = start - base
    last = end - base
    step = 4 * bs
    try:
        # One pack call for all new blocks, then 64-byte (for bs=16) slices: the per-block Python work is
        # a slice, a concatenation and the digest -- close to the bare primitive (bench.hashing).
        lo, hi = first * bs, last * bs
        raw = _packer(hi - lo)(*(token_ids if lo == 0 and hi == len(token_ids) else token_ids[lo:hi]))
    except struct.error as exc:
        bad = next(
            (t for t in token_ids if not isinstance(t, int) or not -(2**31) <= t <= _MAX_TOKEN_ID), None
        )
        raise ValueError(f"token ids must be int32 integers: found {bad!r}") from exc
    chunks = [raw[o : o + step] for o in range(0, len(raw), step)]
    salted: list[bytes] = []
    if start == 0 and cache_salt is not None:
        # Block 0 is the only one that carries the salt.
        parent = new(parent + chunks[0] + lora + _tagged(_TAG_SALT, cache_salt)).digest()
        salted.append(parent)
        chunks = chunks[1:]
    # The chain as a comprehension carrying ``parent`` (about 30% faster than a for loop with append),
    # producing plain bytes: calling the NewType would cost a Python frame per block.
    if lora:
        out = [parent := new(parent + chunk + lora).digest() for chunk in chunks]
    else:
        out = [parent := new(parent + chunk).digest() for chunk in chunks]
    hashes.extend(cast("list[BlockHash]", salted + out))


def hash_blocks(
    token_ids: Sequence[int],
    *,
    namespace: HashNamespace,
    cache_salt: str | None = None,
    adapter: AdapterId | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``: the same bytes ``Request.block_hashes`` holds."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, namespace=namespace, cache_salt=cache_salt, adapter=adapter)
    return hashes
