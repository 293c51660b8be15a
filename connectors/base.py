"""The connector contract, where plugin authors import it from.

The contract is the engine's (``engine/connector/base.py``, whose module docstring is the documentation
of every method and rule); this module names the same objects so that a plugin written against
``connectors.base`` keeps working.
"""

from engine.connector.base import (
    ConnectorContext,
    ConnectorOptionsError,
    ConnectorStats,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    parse_options,
)
from engine.connector.params import KVTransferParams, RemoteDecode, RemotePrefill

__all__ = [
    "ConnectorContext",
    "ConnectorOptionsError",
    "ConnectorStats",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVTransferParams",
    "RemoteDecode",
    "RemotePrefill",
    "parse_options",
]
