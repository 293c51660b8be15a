"""LoRA adapters at a node's gRPC edge: the adapter messages and the admin calls (the flags:
``serving/lora_flags.py``)."""

from __future__ import annotations

from typing import Any

import grpc

from engine.hashing import ADAPTER_DIGEST_SIZE
from engine.lora.manager import LoRAManager, ServedAdapter
from pdkv_proto.pdkv.v1 import types_pb2
from serving.errors import ServingError, invalid


def adapter_info(a: ServedAdapter) -> types_pb2.AdapterInfo:
    return types_pb2.AdapterInfo(
        name=a.id.name,
        digest=a.id.digest,
        max_rank=a.max_rank,
        modules=list(a.modules),
        resident=a.resident,
    )


def adapter_ref(msg: Any) -> tuple[str | None, bytes | None]:
    """A node request's ``adapter`` (AdapterRef) -> (name, digest), (None, None) when unset."""
    if not msg.HasField("adapter"):
        return None, None
    ref = msg.adapter
    if not ref.name:
        raise invalid("adapter.name", "is empty (leave adapter unset for the base model)")
    if ref.digest and len(ref.digest) != ADAPTER_DIGEST_SIZE:
        raise invalid("adapter.digest", f"must be {ADAPTER_DIGEST_SIZE} bytes, got {len(ref.digest)}")
    return ref.name, ref.digest or None


def load_adapter(lora: LoRAManager, allowed: bool, name: str, path: str) -> types_pb2.AdapterInfo:
    """The node's LoadAdapter: refused unless runtime loading is on; the adapter's refusal names why."""
    _check_allowed(allowed)
    if not name or not path:
        raise invalid("name" if not name else "path", "is required")
    aid = lora.add(name, path)  # AdapterError (a ValueError): INVALID_ARGUMENT naming the field
    return adapter_info(next(a for a in lora.adapters() if a.id == aid))


def unload_adapter(lora: LoRAManager, allowed: bool, name: str) -> None:
    _check_allowed(allowed)
    lora.remove(name)  # UnknownAdapter: NOT_FOUND


def _check_allowed(allowed: bool) -> None:
    if not allowed:
        raise ServingError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "runtime adapter loading is off: start with --allow-runtime-lora (or serve it with --lora)",
        )
