"""Block hashes of a 32k-token prompt: pdkv's default against the methods vLLM offers, and the floor.

    python -m bench.hashing [--quick] [--json PATH]

- pdkv: ``engine.hashing.hash_blocks`` (SHA-256 over parent || le_i32 tokens || extra keys).
- pickle: SHA-256 over ``pickle.dumps((parent, tuple(tokens), extra))`` per block.
- cbor: SHA-256 over canonical CBOR of the same tuple per block.
- floor: the bare primitive, ``sha256(msg).digest()`` over the very bytes pdkv hashes, prebuilt.
"""

from __future__ import annotations

import hashlib
import pickle
import struct

import cbor2

from bench.common import Report, best_of, best_of_interleaved, parser
from engine.hashing import HashNamespace, hash_blocks

BLOCK_SIZE = 16


def pickle_method(tokens: list[int], root: bytes) -> list[bytes]:
    parent, out = root, []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        parent = hashlib.sha256(
            pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        out.append(parent)
    return out


def cbor_method(tokens: list[int], root: bytes) -> list[bytes]:
    parent, out = root, []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(parent)
    return out


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    num_tokens = 32768
    repeat = 20 if args.quick else 100
    tokens = [(i * 7919) % 128000 for i in range(num_tokens)]
    ns = HashNamespace("bench-model", BLOCK_SIZE)
    root = ns.root
    ours = hash_blocks(tokens, namespace=ns)
    # The floor hashes exactly the messages pdkv hashes, built ahead of time.
    parents = [root, *ours[:-1]]
    msgs = [
        parents[i] + struct.pack(f"<{BLOCK_SIZE}i", *tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        for i in range(len(ours))
    ]
    sha = hashlib.sha256
    assert [sha(m).digest() for m in msgs] == ours

    xns = HashNamespace("bench-model", BLOCK_SIZE, "xxh3_128")
    # Ours and the floor in turns (their ratio is the target); the slow baselines separately.
    fast = best_of_interleaved(
        {
            "ours": lambda: hash_blocks(tokens, namespace=ns),
            "floor": lambda: [sha(m).digest() for m in msgs],
            "xxh3": lambda: hash_blocks(tokens, namespace=xns),
        },
        repeat=repeat,
    )
    t_ours, t_floor, t_xxh3 = fast["ours"], fast["floor"], fast["xxh3"]
    t_pickle = best_of(lambda: pickle_method(tokens, root), repeat=max(5, repeat // 4))
    t_cbor = best_of(lambda: cbor_method(tokens, root), repeat=max(3, repeat // 10))

    r = Report("bench.hashing: 32k-token prompt, block size 16 (2048 blocks)")
    r.figure("pdkv_sha256_ms", t_ours * 1e3)
    r.figure("pdkv_xxh3_128_ms", t_xxh3 * 1e3)
    r.figure("floor_sha256_ms", t_floor * 1e3)
    r.figure("pickle_sha256_ms", t_pickle * 1e3)
    r.figure("cbor_sha256_ms", t_cbor * 1e3)
    r.ratio("speedup_vs_cbor", t_cbor / t_ours, ">= 3")
    r.ratio("speedup_vs_pickle", t_pickle / t_ours)
    r.ratio("slowdown_vs_floor", t_ours / t_floor, "<= 1.7")
    r.emit(args.json)


if __name__ == "__main__":
    main()
