"""What a decoder layer sees of the KV connector: the two per-layer hooks.

Each layer calls ``wait_for_layer_load(l)`` before it reads (or writes) its KV and
``save_kv_layer(l, kv, attn)`` after it wrote this step's KV.  The runner passes the connector's worker
half (``connectors/base.py``), which satisfies this protocol; with no connector configured it is a
``NullConnector``, so the model never asks whether a connector exists (invariant 9).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class KVHooks(Protocol):
    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None: ...
