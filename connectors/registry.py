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

from engine.connector.base import ConnectorContext, KVConnectorBase, KVConnectorRole

ENTRY_POINT_GROUP = "pdkv.kv_connectors"

BUILTINS: dict[str, str] = {
    "null": "engine.connector.null:NullConnector",
    "shared-dir": "connectors.shared_dir:SharedDirConnector",
    "multi": "connectors.multi:MultiConnector",
    "offload": "connectors.offload:OffloadConnector",
    "p2p": "connectors.p2p:P2PConnector",
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

    def create(self, role: KVConnectorRole, context: ConnectorContext) -> KVConnectorBase:
        """One half of this connector (``engine.connector.spec.KVConnectorSpec``): the engine calls it
        without knowing the registry."""
        return resolve(self.name)(role, context, self.options)


BUILTIN_ORIGIN = "built-in"


@dataclass(frozen=True)
class ConnectorEntry:
    """One connector the registry knows: its name, its ``module:Class`` target and where it comes from."""

    name: str
    target: str
    origin: str  # BUILTIN_ORIGIN, or the distribution that provides the entry point


def discover_entries() -> list[ConnectorEntry]:
    """Built-ins (in registry order), then entry-point plugins by name.  A name defined twice is an error.

    Nothing is imported: targets are strings until a connector is chosen.
    """
    found = {name: ConnectorEntry(name, target, BUILTIN_ORIGIN) for name, target in BUILTINS.items()}
    plugins: list[ConnectorEntry] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        entry = ConnectorEntry(
            ep.name, ep.value, dist.name if dist is not None else "an unknown distribution"
        )
        seen = found.get(ep.name)
        if seen is not None:
            if seen.target == entry.target and seen.origin == entry.origin:
                continue  # the same distribution seen twice on sys.path (e.g. an editable install)
            raise ValueError(
                f"kv connector name {ep.name!r} is defined twice: {seen.target} ({seen.origin}) and "
                f"{entry.target} (entry point of {entry.origin}); uninstall one or rename its entry point"
            )
        found[ep.name] = entry
        plugins.append(entry)
    return [found[name] for name in BUILTINS] + sorted(plugins, key=lambda e: e.name)


def discover() -> dict[str, str]:
    """Every connector name known here -> its ``module:Class`` target.  Duplicates are an error."""
    return {e.name: e.target for e in discover_entries()}


def _import_target(target: str) -> type[KVConnectorBase]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConnectorNotFoundError(f"connector path {target!r} must look like 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConnectorNotFoundError(f"cannot import connector module {module_name!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, its configuration): one line
        raise ConnectorNotFoundError(
            f"connector module {module_name!r} failed while importing: {type(exc).__name__}: {exc}"
        ) from exc
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
    return config.create(role, context)
