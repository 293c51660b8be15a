"""The ``kv_transfer_params`` of the ``p2p`` connector: what travels from prefill to decode via the router.

They are plain msgpack/JSON-safe dicts (the gRPC nodes and the router pass them through untouched).

The router asks a prefill engine to keep the prompt's KV for a decode engine::

    {"do_remote_decode": true}

The prefill engine's connector answers, when the request finishes (``RequestOutput.kv_transfer_params``)::

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

and the decode engine receives the request (prompt + the first sampled token) with exactly these params.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from wire.layout import BlockLayout


class TransferParamsError(ValueError):
    """``kv_transfer_params`` that cannot be a producer's answer; the message names the key."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """True for a prefill request whose KV a decode engine will pull (``{"do_remote_decode": true}``)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True for a decode request whose prompt KV a producer holds (``{"do_remote_prefill": true, ...}``)."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


@dataclass(frozen=True)
class RemotePrefill:
    """A producer's ``kv_transfer_params``, validated (see the module docstring for the dict form)."""

    engine_id: str
    kv_endpoint: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    lease_s: float
    layout: BlockLayout
    namespace_id: str

    def to_params(self) -> dict[str, Any]:
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
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Parse a producer's params; ``TransferParamsError`` names the first bad key."""
        if not is_remote_prefill(params):
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
            layout = BlockLayout(**layout_raw)
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise TransferParamsError(f"{key!r} must be a non-empty string, got {value!r}")
    return value
