"""pdkv's KV store: KV-cache blocks in tiers (memory, disk, Redis, a shared store server), by block hash.

What an engine uses (``docs/kvstore.md``)::

    from kvstore import BlockLayout, KVStore
    store = KVStore.open("cpu:4GiB,disk:/var/cache/pdkv:64GiB", namespace_id=..., layout=...)

Backends (redis, zmq) are imported only when a tier that needs them is configured.
"""

from kvstore.config import StoreConfig
from kvstore.engine_view import KVStore
from kvstore.results import GetResult, MissReason, PutResult
from kvstore.store import StoreStats, TieredStore
from wire.layout import BlockLayout

__all__ = [
    "BlockLayout",
    "GetResult",
    "KVStore",
    "MissReason",
    "PutResult",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
]
