"""The block codec: round trips, and every kind of damage is a miss with its reason, never data."""

from __future__ import annotations

import pytest
import torch
from kvtest import BLOCK, LAYOUT, NAMESPACE, OTHER_NAMESPACE, chain

from engine.hashing import HashNamespace, hash_blocks
from kvstore.results import MissReason
from wire.codec import (
    HEADER_SIZE,
    BlockCodec,
    HeaderMatcher,
    check_header,
    namespace_bytes,
    pack_header,
    parse_header,
    payload_checksum,
    store_namespace,
)
from wire.layout import BlockLayout

HASH = chain(1)[0]


def payload(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_is_exact_and_writes_into_the_destination() -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    src = payload()
    encoded = codec.encode(HASH, src.numpy())
    assert len(encoded) == HEADER_SIZE + BLOCK
    dst = torch.zeros(BLOCK, dtype=torch.uint8)
    assert codec.decode_into(HASH, encoded, dst.numpy()) is None
    assert torch.equal(dst, src)


def test_header_records_every_field() -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    src = payload()
    header = parse_header(codec.header_of(HASH, src.numpy()))
    assert not isinstance(header, MissReason)
    assert header.namespace == NAMESPACE
    assert header.block_hash == HASH
    assert header.layout == LAYOUT
    assert header.payload_len == BLOCK
    assert header.checksum == payload_checksum(src.numpy())


def test_a_16_byte_hash_round_trips() -> None:
    short = chain(1, size=16)[0]
    codec = BlockCodec(NAMESPACE, LAYOUT)
    header = check_header(codec.header_of(short, payload().numpy()), NAMESPACE, short, LAYOUT)
    assert not isinstance(header, MissReason) and header.block_hash == short


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + BLOCK - 1])
def test_truncated_is_a_miss(cut: int) -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    encoded = codec.encode(HASH, payload().numpy())
    reason = codec.decode_into(HASH, encoded[:cut], torch.zeros(BLOCK, dtype=torch.uint8).numpy())
    assert reason is MissReason.TRUNCATED


def test_trailing_bytes_are_corrupt() -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    encoded = codec.encode(HASH, payload().numpy()) + b"x"
    assert codec.decode_into(HASH, encoded, bytearray(BLOCK)) is MissReason.CORRUPT


@pytest.mark.parametrize("offset", [HEADER_SIZE, HEADER_SIZE + BLOCK // 2, HEADER_SIZE + BLOCK - 1])
def test_bit_flipped_payload_is_corrupt(offset: int) -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    encoded = bytearray(codec.encode(HASH, payload().numpy()))
    encoded[offset] ^= 0x10
    assert codec.decode_into(HASH, encoded, bytearray(BLOCK)) is MissReason.CORRUPT


@pytest.mark.parametrize("offset", [0, 5, 30, 60, 80, 90, 95])
def test_bit_flipped_header_is_corrupt(offset: int) -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    encoded = bytearray(codec.encode(HASH, payload().numpy()))
    encoded[offset] ^= 0x01
    assert codec.decode_into(HASH, encoded, bytearray(BLOCK)) is MissReason.CORRUPT


def test_another_models_block_is_wrong_namespace() -> None:
    encoded = BlockCodec(OTHER_NAMESPACE, LAYOUT).encode(HASH, payload().numpy())
    assert (
        BlockCodec(NAMESPACE, LAYOUT).decode_into(HASH, encoded, bytearray(BLOCK))
        is MissReason.WRONG_NAMESPACE
    )


@pytest.mark.parametrize(
    "other",
    [
        BlockLayout(2, 2, 8, 4, "bfloat16"),  # same size, another dtype
        BlockLayout(2, 4, 4, 4, "float16"),  # same size, other heads x dims
        BlockLayout(4, 2, 8, 4, "float16"),  # another size
    ],
)
def test_another_layout_is_wrong_layout(other: BlockLayout) -> None:
    encoded = BlockCodec(NAMESPACE, other).encode(HASH, bytes(other.payload_nbytes))
    dst = bytearray(BLOCK)
    assert BlockCodec(NAMESPACE, LAYOUT).decode_into(HASH, encoded, dst) is MissReason.WRONG_LAYOUT
    assert dst == bytearray(BLOCK), "a miss never writes data"


def test_another_blocks_hash_is_wrong_hash() -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    encoded = codec.encode(chain(2)[1], payload().numpy())
    assert codec.decode_into(HASH, encoded, bytearray(BLOCK)) is MissReason.WRONG_HASH


def test_header_matcher_agrees_with_the_full_check() -> None:
    codec = BlockCodec(NAMESPACE, LAYOUT)
    matcher = HeaderMatcher(NAMESPACE, LAYOUT)
    src = payload().numpy()
    good = codec.header_of(HASH, src)
    assert matcher.match(good, HASH) == payload_checksum(src)
    assert matcher.match(good, chain(2)[1]) is MissReason.WRONG_HASH
    other_ns = pack_header(OTHER_NAMESPACE, HASH, LAYOUT, 1)
    assert matcher.match(other_ns, HASH) is MissReason.WRONG_NAMESPACE
    other_layout = pack_header(NAMESPACE, HASH, BlockLayout(2, 2, 8, 4, "bfloat16"), 1)
    assert matcher.match(other_layout, HASH) is MissReason.WRONG_LAYOUT
    flipped = bytearray(good)
    flipped[2] ^= 1
    assert matcher.match(flipped, HASH) is MissReason.CORRUPT


@pytest.mark.parametrize("hash_size", [16, 32])
def test_header_matcher_match_run_answers_what_match_answers_block_by_block(hash_size: int) -> None:
    matcher = HeaderMatcher(NAMESPACE, LAYOUT)
    hashes = [h[:hash_size] for h in chain(12)]
    headers = [bytearray(pack_header(NAMESPACE, h, LAYOUT, 1000 + i)) for i, h in enumerate(hashes)]
    assert matcher.match_run(b"".join(headers), hashes) == ([1000 + i for i in range(12)], None)
    assert matcher.match_run(b"", []) == ([], None)
    # damage: a header for another block at 7, a corrupt header checksum at 5 (the first one decides)
    headers[7] = bytearray(pack_header(NAMESPACE, hashes[8], LAYOUT, 1))
    assert matcher.match_run(b"".join(headers), hashes) == (
        [1000 + i for i in range(7)],
        (7, MissReason.WRONG_HASH),
    )
    headers[5][2] ^= 1
    assert matcher.match_run(b"".join(headers), hashes) == (
        [1000 + i for i in range(5)],
        (5, MissReason.CORRUPT),
    )
    # a run of mixed hash lengths takes the block-by-block path and answers the same
    mixed = [*hashes[:3], chain(1)[0]]
    mixed_headers = b"".join(pack_header(NAMESPACE, h, LAYOUT, 7) for h in mixed)
    assert matcher.match_run(mixed_headers, mixed) == ([7, 7, 7, 7], None)


def test_store_namespace_separates_models_and_layouts() -> None:
    model_a = HashNamespace("model-a", 16).namespace_id
    model_b = HashNamespace("model-b", 16).namespace_id
    fp16, bf16 = LAYOUT, BlockLayout(2, 2, 8, 4, "bfloat16")
    assert store_namespace(model_a, fp16) == store_namespace(model_a, fp16)
    assert (
        len({store_namespace(model_a, fp16), store_namespace(model_b, fp16), store_namespace(model_a, bf16)})
        == 3
    )


def test_real_block_hashes_are_accepted() -> None:
    namespace = HashNamespace("model-a", 4)
    hashes = hash_blocks(list(range(8)), namespace=namespace)
    codec = BlockCodec(namespace.namespace_id, LAYOUT)
    encoded = codec.encode(hashes[1], payload().numpy())
    assert codec.decode_into(hashes[1], encoded, bytearray(BLOCK)) is None


@pytest.mark.parametrize("bad", ["", "xyz", "00" * 15, "00" * 17])
def test_namespace_ids_are_validated(bad: str) -> None:
    with pytest.raises(ValueError, match="32 hex"):
        namespace_bytes(bad)


def test_encode_rejects_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="needs 512"):
        BlockCodec(NAMESPACE, LAYOUT).encode(HASH, bytes(100))


def test_layout_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        BlockLayout(2, 0, 8, 4, "float16")
    with pytest.raises(ValueError, match="float7"):
        BlockLayout(2, 2, 8, 4, "float7")


def test_layout_from_a_kv_cache_tensor() -> None:
    cache = torch.zeros(10, 2, 2, 4, 2, 8, dtype=torch.float16)
    assert BlockLayout.from_kv_cache(cache) == LAYOUT
    with pytest.raises(ValueError, match="shape"):
        BlockLayout.from_kv_cache(torch.zeros(10, 2, 4))
