"""Block hashes: the spec in docs/hashing.md, its vectors, determinism across processes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from engine.hashing import AdapterId, HashNamespace, hash_blocks
from engine.request import Request
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
VECTORS = json.loads((ROOT / "docs" / "hashing-vectors.json").read_text(encoding="utf-8"))


def reference_hashes(case: dict) -> tuple[str, list[str]]:  # type: ignore[type-arg]
    """docs/hashing.md, written out again from the text alone (not from engine.hashing)."""
    h = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxh3_128": xxhash.xxh3_128_digest}[case["algo"]]
    bs = case["block_size"]
    root = h(
        b"pdkv-block-hash/v2\x00"
        + case["algo"].encode()
        + b"\x00"
        + case["fingerprint"].encode("utf-8")
        + b"\x00"
        + struct.pack("<I", bs)
    )

    def field(tag: int, value: str) -> bytes:
        raw = value.encode("utf-8")
        return bytes([tag]) + len(raw).to_bytes(4, "little") + raw

    parent, out = root, []
    tokens = case["tokens"]
    for i in range(len(tokens) // bs):
        data = parent + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * bs : (i + 1) * bs])
        if case["adapter"] is not None:
            data += field(1, case["adapter"]["name"]) + bytes.fromhex(case["adapter"]["digest"])
        if case["cache_salt"] is not None and i == 0:
            data += field(2, case["cache_salt"])
        parent = h(data)
        out.append(parent.hex())
    return root.hex(), out


def _adapter(spec: dict | None) -> AdapterId | None:  # type: ignore[type-arg]
    return None if spec is None else AdapterId(spec["name"], bytes.fromhex(spec["digest"]))


A = AdapterId("adapter", bytes(range(32)))


@pytest.mark.parametrize("case", VECTORS["vectors"], ids=lambda c: c["name"])
def test_vectors_match_the_spec_and_the_implementation(case: dict) -> None:  # type: ignore[type-arg]
    root, expected = reference_hashes(case)
    assert root == case["root"]
    assert expected == case["block_hashes"]
    ns = HashNamespace(case["fingerprint"], case["block_size"], case["algo"])
    got = hash_blocks(
        case["tokens"], namespace=ns, cache_salt=case["cache_salt"], adapter=_adapter(case["adapter"])
    )
    assert [g.hex() for g in got] == expected


_SUBPROCESS = """
import sys
from engine.hashing import AdapterId, HashNamespace, hash_blocks
ns = HashNamespace("model-x", 16)
hs = hash_blocks(list(range(5000)), namespace=ns, cache_salt="tenant")
hs += hash_blocks(list(range(300)), namespace=HashNamespace("model-x", 16, "xxh3_128"),
                  adapter=AdapterId("l", bytes(32)))
sys.stdout.write("".join(h.hex() for h in hs))
"""


def test_identical_bytes_across_processes_with_different_hash_seeds() -> None:
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=ROOT,
        )
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_request_block_hashes_after_generation_equal_hash_blocks_over_all_tokens() -> None:
    ns = HashNamespace("model-x", 4)
    for salt, lora in [(None, None), ("tenant", None), (None, A), ("tenant", A)]:
        req = Request(
            "r", list(range(7)), SamplingParams(max_tokens=50), namespace=ns, cache_salt=salt, adapter=lora
        )
        for t in range(100, 130):
            req.append_output_token_ids(t)
        req.append_output_token_ids([1, 2, 3, 4, 5])
        expected = hash_blocks(req.all_token_ids, namespace=ns, cache_salt=salt, adapter=lora)
        assert req.block_hashes == expected
        assert len(req.block_hashes) == 42 // 4


def test_every_namespace_field_changes_every_hash() -> None:
    tokens = list(range(32))
    base = hash_blocks(tokens, namespace=HashNamespace("m", 4))
    others = [
        hash_blocks(tokens, namespace=HashNamespace("m2", 4)),
        hash_blocks(tokens, namespace=HashNamespace("m", 4, "xxh3_128")),
        hash_blocks(tokens + [0] * 0, namespace=HashNamespace("m", 4), cache_salt="s"),
        hash_blocks(tokens, namespace=HashNamespace("m", 4), adapter=A),
        # The same name over other weights, and a name equal to a tenant's salt, are other blocks.
        hash_blocks(tokens, namespace=HashNamespace("m", 4), adapter=AdapterId("adapter", bytes(32))),
        hash_blocks(tokens, namespace=HashNamespace("m", 4), adapter=AdapterId("s", bytes(32))),
    ]
    for other in others:
        assert not set(base) & set(other)
    # A different block size gives different blocks altogether; their roots differ too.
    assert HashNamespace("m", 4).root != HashNamespace("m", 8).root


def test_hashes_are_chained() -> None:
    ns = HashNamespace("m", 4)
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], namespace=ns)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], namespace=ns)
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parents


def test_bad_namespace_and_tokens_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="algo 'md5'"):
        HashNamespace("m", 4, "md5")
    with pytest.raises(ValueError, match="block_size"):
        HashNamespace("m", 0)
    with pytest.raises(ValueError, match="model_fingerprint"):
        HashNamespace("", 4)
    with pytest.raises(ValueError, match="int32"):
        hash_blocks([1, 2, 3, 2**40], namespace=HashNamespace("m", 4))
