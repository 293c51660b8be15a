"""The connector that does nothing: what the engine runs when none is configured (invariant 9)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.connector.base import ConnectorContext, KVConnectorBase, KVConnectorRole


class NullConnector(KVConnectorBase):
    """Never a hit, never a byte moved; every method is the base class's no-op default."""

    name = "null"

    def __init__(
        self,
        role: KVConnectorRole = KVConnectorRole.SCHEDULER,
        context: ConnectorContext | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        # Needs no context: the scheduler builds one for itself when the engine gives it no connector.
        super().__init__(role, context, options)  # type: ignore[arg-type]
