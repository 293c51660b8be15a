"""Finding connector classes by name: built-ins, entry-point plugins, or a ``"pkg.module:Class"`` path.

Built-ins are listed here by name and imported only when chosen, so a missing optional dependency matters
only for the connector that needs it.  External plugins register in the entry-point group
``pdkv.kv_connectors`` (``name = "pkg.module:Class"``).  A name defined twice is an error.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from connectors.base import ConnectorContext, KVConnectorBase, KVConnectorRole

ENTRY_POINT_GROUP = "pdkv.kv_connectors"

BUILTINS: dict[str, str] = {
    "null": "connectors.null:NullConnector",
    "shared-dir": "connectors.shared_dir:SharedDirConnector",
    "multi": "connectors.multi:MultiConnector",
}


class ConnectorNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class KVConnectorConfig:
    """Which connector an engine runs, and its options (validated by the connector itself)."""

    name: str = "null"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("kv connector name must be a non-empty string (e.g. 'shared-dir')")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"kv connector options must be a mapping, got {type(self.options).__name__}")


def discover() -> dict[str, str]:
    """Every connector name known here -> its ``module:Class`` target.  Duplicates are an error."""
    found = dict(BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name] != ep.value:
            raise ValueError(
                f"kv connector name {ep.name!r} is defined twice: {found[ep.name]} and {ep.value} "
                f"(entry point of {ep.dist.name if ep.dist else 'an unknown distribution'})"
            )
        found[ep.name] = ep.value
    return found


def _import_target(target: str) -> type[KVConnectorBase]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConnectorNotFoundError(f"connector path {target!r} must look like 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConnectorNotFoundError(f"cannot import connector module {module_name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConnectorNotFoundError(f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ConnectorNotFoundError(f"{target!r} is not a subclass of connectors.base.KVConnectorBase")
    return cls


def resolve(name_or_path: str) -> type[KVConnectorBase]:
    """The connector class for a registered name or a ``"pkg.module:Class"`` path."""
    if ":" in name_or_path:
        return _import_target(name_or_path)
    known = discover()
    target = known.get(name_or_path)
    if target is None:
        raise ConnectorNotFoundError(
            f"unknown kv connector {name_or_path!r}; known: {', '.join(sorted(known))} "
            f"(or give a 'package.module:Class' path)"
        )
    return _import_target(target)


def create_connector(
    config: KVConnectorConfig, role: KVConnectorRole, context: ConnectorContext
) -> KVConnectorBase:
    return resolve(config.name)(role, context, config.options)
