"""Where the model runner lets a KV connector's worker half in, and the no-op that stands in for none.

The runner calls, in this order (the names and meanings are the worker half of ``connectors/base.py``)::

    register_kv_caches(kv_cache)         once, when the cache tensor is allocated
    every step:
      handle_preemptions(metadata)       fence saves of preempted requests before their blocks are reused
      start_load_kv(metadata)            start the loads this step needs
      per layer l:
        wait_for_layer_load(l)           before layer l touches its KV
        (layer l writes this step's K/V into the cache, then attends)
        save_kv_layer(l, kv, attn)       after layer l wrote its KV
      wait_for_save()                    after the forward: saves no longer read the blocks

The loop calls these unconditionally (architecture invariant 9): with no connector configured,
``NoKVHooks`` does nothing, so model code never asks whether a connector exists.  A connector's worker
half satisfies ``KVHooks`` structurally.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class KVHooks(Protocol):
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None: ...

    def handle_preemptions(self, metadata: Any) -> None: ...

    def start_load_kv(self, metadata: Any) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None: ...

    def wait_for_save(self) -> None: ...


class NoKVHooks:
    """The stand-in when no connector is configured: every hook is a no-op."""

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        return None

    def handle_preemptions(self, metadata: Any) -> None:
        return None

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
