"""pdkv's paged-KV engine, shared by prefill and decode nodes.

Importing ``engine`` is cheap: the model-facing parts (``engine.LLM``) load torch on first use.
"""

from __future__ import annotations

from typing import Any

from engine.hashing import BlockHash, HashNamespace, hash_blocks
from engine.request import Request, RequestId, RequestStatus
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BlockHash",
    "HashNamespace",
    "Request",
    "RequestId",
    "RequestStatus",
    "SamplingParams",
    "hash_blocks",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
