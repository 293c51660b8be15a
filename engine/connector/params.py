"""``KVTransferParams``: what a request carries between a prefill engine and a decode engine.

Two kinds, one type each (``KVTransferParams = RemoteDecode | RemotePrefill``)::

    router -> prefill engine    RemoteDecode()        keep this prompt's KV for a decode engine to pull
    prefill engine -> router    RemotePrefill(...)    where that KV waits (the connector's answer, in
    router -> decode engine     RemotePrefill(...)    ``RequestOutput.kv_transfer_params``), passed on as is

On the wire (gRPC ``bytes`` fields, sealed with the cluster secret where one is set) they are one msgpack
map, written by ``encode_transfer_params`` and read back by ``decode_transfer_params``, which refuses
anything else with a ``TransferParamsError`` naming the key::

    {"do_remote_decode": true}

    {
      "do_remote_prefill": true,
      "engine_id": "prefill-0",                    # the producer engine, for logs and metrics
      "kv_endpoint": "tcp://10.0.0.5:5601",        # its block server (ZeroMQ ROUTER)
      "remote_request_id": "req-42",               # the lease's name on the producer
      "block_ids": [7, 8, 9],                      # the producer's blocks (informational: reads name indices)
      "block_hashes": ["9f2c...", ...],            # hex, one per leased block
      "num_tokens": 48,                            # whole blocks: floor(prompt_len / block_size) * block_size
      "lease_s": 30.0,                             # how long the producer holds them unread
      "layout": {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "block_size": 16, "dtype": "float32"},
      "namespace_id": "3a1f..."                    # HashNamespace.namespace_id (model, block size, hash algo)
    }

The router never opens them: it hands the prefill node's bytes to the decode node untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TypeAlias

import msgpack

from wire.layout import BlockLayout

# A producer's answer is a few hundred bytes per thousand blocks; anything far larger is not one.
MAX_ENCODED_BYTES = 8 * 1024**2


class TransferParamsError(ValueError):
    """Bytes or a map that are not transfer parameters; the message names the key."""


@dataclass(frozen=True)
class RemoteDecode:
    """The router's ask to a prefill engine: hold this request's prompt KV for a decode engine."""


@dataclass(frozen=True)
class RemotePrefill:
    """A producer's answer: where the prompt's leading whole blocks wait, and what they are."""

    engine_id: str
    kv_endpoint: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    lease_s: float
    layout: BlockLayout
    namespace_id: str

    def to_map(self) -> dict[str, object]:
        return {
            "do_remote_prefill": True,
            "engine_id": self.engine_id,
            "kv_endpoint": self.kv_endpoint,
            "remote_request_id": self.remote_request_id,
            "block_ids": list(self.block_ids),
            "block_hashes": [h.hex() for h in self.block_hashes],
            "num_tokens": self.num_tokens,
            "lease_s": self.lease_s,
            "layout": asdict(self.layout),
            "namespace_id": self.namespace_id,
        }

    @classmethod
    def from_map(cls, params: Mapping[object, object]) -> RemotePrefill:
        """Parse a producer's map; ``TransferParamsError`` names the first bad key."""
        if params.get("do_remote_prefill") is not True:
            raise TransferParamsError("'do_remote_prefill' must be true")
        engine_id = _str(params, "engine_id")
        endpoint = _str(params, "kv_endpoint")
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise TransferParamsError(f"'kv_endpoint' must be a tcp:// or ipc:// address, got {endpoint!r}")
        remote_request_id = _str(params, "remote_request_id")
        block_ids = params.get("block_ids")
        if not isinstance(block_ids, list) or not all(_is_int(b) and b >= 0 for b in block_ids):
            raise TransferParamsError("'block_ids' must be a list of non-negative ints")
        raw_hashes = params.get("block_hashes")
        if not isinstance(raw_hashes, list):
            raise TransferParamsError("'block_hashes' must be a list of hex strings")
        try:
            hashes = tuple(bytes.fromhex(h) for h in raw_hashes)
        except (TypeError, ValueError):
            raise TransferParamsError("'block_hashes' must be a list of hex strings") from None
        if any(len(h) not in (16, 32) for h in hashes):
            raise TransferParamsError("every entry of 'block_hashes' must be 16 or 32 bytes of hex")
        layout_raw = params.get("layout")
        if not isinstance(layout_raw, Mapping):
            raise TransferParamsError("'layout' must be a map of BlockLayout fields")
        try:
            layout = BlockLayout(
                num_layers=_layout_int(layout_raw, "num_layers"),
                num_kv_heads=_layout_int(layout_raw, "num_kv_heads"),
                head_dim=_layout_int(layout_raw, "head_dim"),
                block_size=_layout_int(layout_raw, "block_size"),
                dtype=str(layout_raw.get("dtype")),
            )
            if set(layout_raw) != {"num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"}:
                raise ValueError(f"its keys are {sorted(map(str, layout_raw))}")
        except (TypeError, ValueError) as exc:
            raise TransferParamsError(f"'layout' is not a block layout: {exc}") from None
        num_tokens = params.get("num_tokens")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise TransferParamsError(f"'num_tokens' must be a non-negative int, got {num_tokens!r}")
        if num_tokens % layout.block_size:
            raise TransferParamsError(
                f"'num_tokens' must be a multiple of the block size {layout.block_size}, got {num_tokens}"
            )
        num_blocks = num_tokens // layout.block_size
        if len(hashes) != num_blocks or len(block_ids) != num_blocks:
            raise TransferParamsError(
                f"'block_ids' and 'block_hashes' must list num_tokens / block_size = {num_blocks} blocks"
            )
        lease_s = params.get("lease_s")
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or lease_s <= 0:
            raise TransferParamsError(f"'lease_s' must be a positive number, got {lease_s!r}")
        return cls(
            engine_id=engine_id,
            kv_endpoint=endpoint,
            remote_request_id=remote_request_id,
            block_ids=tuple(block_ids),
            block_hashes=hashes,
            num_tokens=num_tokens,
            lease_s=float(lease_s),
            layout=layout,
            namespace_id=_str(params, "namespace_id"),
        )


KVTransferParams: TypeAlias = RemoteDecode | RemotePrefill


def encode_transfer_params(params: KVTransferParams | None) -> bytes:
    """The wire form (see the module docstring); empty bytes for none."""
    if params is None:
        return b""
    body = {"do_remote_decode": True} if isinstance(params, RemoteDecode) else params.to_map()
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def decode_transfer_params(raw: bytes) -> KVTransferParams | None:
    """Read ``encode_transfer_params``'s bytes back; ``TransferParamsError`` says what is wrong."""
    if not raw:
        return None
    if len(raw) > MAX_ENCODED_BYTES:
        raise TransferParamsError(f"are {len(raw)} bytes, more than {MAX_ENCODED_BYTES}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise TransferParamsError(f"are not a msgpack map ({exc})") from None
    if not isinstance(body, dict):
        raise TransferParamsError(f"must be a msgpack map, got {type(body).__name__}")
    if body.get("do_remote_decode") is True:
        if len(body) != 1:
            raise TransferParamsError("'do_remote_decode' takes no other key")
        return RemoteDecode()
    if "do_remote_prefill" in body:
        return RemotePrefill.from_map(body)
    raise TransferParamsError("must hold 'do_remote_decode' or 'do_remote_prefill'")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layout_int(layout: Mapping[object, object], key: str) -> int:
    value = layout.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"BlockLayout.{key} must be an int, got {value!r}")
    return value


def _str(params: Mapping[object, object], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise TransferParamsError(f"{key!r} must be a non-empty string, got {value!r}")
    return value
