"""A model's identity for the block-hash namespace: two models, or two revisions of one, never collide.

    fingerprint = "<architecture>:" + sha256(canonical config.json || weights digest)[:32 hex]

The weights digest is xxh3-128 over every weight file (name, size, bytes) when they total under
``FULL_HASH_LIMIT``; above that, reading tens of GB at every start-up is too slow, so it covers each
file's size, its safetensors header (tensor names, dtypes, shapes, offsets) and ``SAMPLES_PER_FILE``
evenly spaced 1 MiB chunks of its payload.  A retrained revision changes every chunk, so sampling still
tells revisions apart; only a deliberate edit of unsampled bytes could slip through.

A GGUF model is one file whose name is the user's choice, so its digest leaves the name out (a renamed
copy on another node hashes the same) and, when sampled, covers the first ``GGUF_HEAD_BYTES`` (its
metadata and tensor index) instead of a safetensors header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

FULL_HASH_LIMIT = 2 * 1024**3
SAMPLE_BYTES = 1024 * 1024
SAMPLES_PER_FILE = 16
GGUF_HEAD_BYTES = 32 * 1024 * 1024
_READ_BYTES = 8 * 1024 * 1024
# Keys that change when a file is re-saved, not when the model changes.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})


def model_fingerprint(
    architecture: str, config: Mapping[str, Any], weight_files: Sequence[Path], *, by_name: bool = True
) -> str:
    """The string ``HashNamespace.model_fingerprint`` takes.  ``by_name=False``: file names do not count."""
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256()
    h.update(json.dumps(stable, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    h.update(b"\x00")
    h.update(weights_digest(weight_files, by_name=by_name).encode("ascii"))
    return f"{architecture}:{h.hexdigest()[:32]}"


def weights_digest(files: Sequence[Path], *, by_name: bool = True) -> str:
    """xxh3-128 hex of the weight files, whole or sampled (see the module docstring)."""
    ordered = sorted(files, key=lambda p: p.name)
    total = sum(p.stat().st_size for p in ordered)
    h = xxhash.xxh3_128()
    h.update(b"full" if total < FULL_HASH_LIMIT else b"sampled")
    for path in ordered:
        size = path.stat().st_size
        h.update((path.name.encode("utf-8") if by_name else b"") + b"\x00" + struct.pack("<Q", size))
        with path.open("rb") as f:
            if total < FULL_HASH_LIMIT:
                _hash_whole(f, h)
            else:
                _hash_sampled(f, size, h)
    return h.hexdigest()


def _hash_whole(f: Any, h: Any) -> None:
    while chunk := f.read(_READ_BYTES):
        h.update(chunk)


def _hash_sampled(f: Any, size: int, h: Any) -> None:
    header_len_raw = f.read(8)
    h.update(header_len_raw)
    if header_len_raw[:4] == b"GGUF":
        h.update(f.read(GGUF_HEAD_BYTES))
    elif len(header_len_raw) == 8:
        (header_len,) = struct.unpack("<Q", header_len_raw)
        h.update(f.read(min(header_len, size)))
    if size <= SAMPLE_BYTES * SAMPLES_PER_FILE:
        f.seek(0)
        _hash_whole(f, h)
        return
    stride = (size - SAMPLE_BYTES) // (SAMPLES_PER_FILE - 1)
    for i in range(SAMPLES_PER_FILE):
        f.seek(i * stride)
        h.update(f.read(SAMPLE_BYTES))
