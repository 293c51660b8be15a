"""An example pdkv KV connector plugin: ``example-memory`` (see ``memory.py``)."""

from pdkv_example_connector.memory import MemoryConnector, MemoryOptions, MemoryStore, get_store

__all__ = ["MemoryConnector", "MemoryOptions", "MemoryStore", "get_store"]
