"""Regenerate docs/hashing-vectors.json from pdkv's implementation.

Run only when the hashing spec version changes: `.venv/bin/python scripts/gen_hashing_vectors.py`.
tests/engine/test_hashing.py checks the file against an independent implementation of docs/hashing.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.hashing import HASH_SPEC_VERSION, AdapterId, HashNamespace, hash_blocks


def _digest(text: str) -> str:
    """A stand-in adapter content digest (hex of 32 bytes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


CASES: list[dict[str, object]] = [
    {
        "name": "two blocks, plain",
        "algo": "sha256",
        "fingerprint": "llama-test",
        "block_size": 4,
        "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "cache_salt": None,
        "adapter": None,
    },
    {
        "name": "tenant salt enters block 0 only",
        "algo": "sha256",
        "fingerprint": "llama-test",
        "block_size": 4,
        "tokens": [1, 2, 3, 4, 5, 6, 7, 8],
        "cache_salt": "tenant-a",
        "adapter": None,
    },
    {
        "name": "adapter name and digest in every block",
        "algo": "sha256",
        "fingerprint": "llama-test",
        "block_size": 4,
        "tokens": [1, 2, 3, 4, 5, 6, 7, 8],
        "cache_salt": None,
        "adapter": {"name": "sql-adapter", "digest": _digest("sql-adapter weights")},
    },
    {
        "name": "salt and adapter, non-ASCII",
        "algo": "sha256",
        "fingerprint": "qwen2/ü",
        "block_size": 2,
        "tokens": [0, 2147483647, 65535, 128000, 5, 6],
        "cache_salt": "tenant-é",
        "adapter": {"name": "lora-β", "digest": _digest("lora-β weights")},
    },
    {
        "name": "block size 16",
        "algo": "sha256",
        "fingerprint": "llama-test",
        "block_size": 16,
        "tokens": list(range(1000, 1040)),
        "cache_salt": None,
        "adapter": None,
    },
    {
        "name": "xxh3-128",
        "algo": "xxh3_128",
        "fingerprint": "llama-test",
        "block_size": 4,
        "tokens": [1, 2, 3, 4, 5, 6, 7, 8],
        "cache_salt": "t",
        "adapter": {"name": "a", "digest": _digest("a")},
    },
    {
        "name": "no full block",
        "algo": "sha256",
        "fingerprint": "llama-test",
        "block_size": 4,
        "tokens": [1, 2, 3],
        "cache_salt": None,
        "adapter": None,
    },
]


def _adapter(spec: object) -> AdapterId | None:
    if spec is None:
        return None
    assert isinstance(spec, dict)
    return AdapterId(spec["name"], bytes.fromhex(spec["digest"]))


def main() -> None:
    out = []
    for case in CASES:
        ns = HashNamespace(case["fingerprint"], case["block_size"], case["algo"])  # type: ignore[arg-type]
        hashes = hash_blocks(
            case["tokens"],
            namespace=ns,
            cache_salt=case["cache_salt"],  # type: ignore[arg-type]
            adapter=_adapter(case["adapter"]),
        )
        out.append({**case, "root": ns.root.hex(), "block_hashes": [h.hex() for h in hashes]})
    doc = {"spec": HASH_SPEC_VERSION.decode(), "see": "docs/hashing.md", "vectors": out}
    path = Path(__file__).resolve().parent.parent / "docs" / "hashing-vectors.json"
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} vectors to {path}")


if __name__ == "__main__":
    main()
