"""What an engine needs to build its connector halves, without knowing where connectors come from.

The engine never imports the registry (``connectors/registry.py``): the node assembly -- or a user of the
offline ``LLM`` -- hands it a spec, and the spec builds one half per role.  The registry's
``KVConnectorConfig`` (a connector name or ``pkg.module:Class`` path, and its options) is the spec every
caller uses; ``None`` runs the ``NullConnector``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.connector.base import ConnectorContext, KVConnectorBase, KVConnectorRole


@runtime_checkable
class KVConnectorSpec(Protocol):
    """Builds one half of a connector for an engine."""

    @property
    def name(self) -> str:
        """The connector's name, for logs and errors."""
        ...

    def create(self, role: KVConnectorRole, context: ConnectorContext) -> KVConnectorBase:
        """One half of the connector, for ``role``, over the engine described by ``context``."""
        ...
