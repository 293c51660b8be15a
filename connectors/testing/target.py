"""What the conformance kit needs from a plugin author: a config factory, and optional hooks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.registry import KVConnectorConfig
from engine.connector.base import LOOKUP_DEADLINE_S

# ``factory(shared) -> config``: the connector pointed at a backend rooted at ``shared`` (a fresh, empty
# directory per check).  Two engines built from configs for the same ``shared`` must share the backend.
ConfigFactory = Callable[[Path], KVConnectorConfig]

# EngineConfig fields the kit sets itself; a target's ``engine_options`` may not override them.
_KIT_OWNED = frozenset({"model", "kv_connector", "engine_id"})
# The kit's prompts and concurrent requests fill this many blocks (of block_size 4); a smaller pool would
# fail checks for want of room, not for anything the connector did.
MIN_KIT_BLOCKS = 64


@dataclass(frozen=True)
class ConformanceTarget:
    """A connector under test.

    Every check runs for every target: a check whose hook is missing **fails**, saying what to add.

    ``factory``              ``shared -> KVConnectorConfig`` (see ``ConfigFactory``).
    ``unreachable_factory``  ``shared -> KVConnectorConfig`` for a backend that cannot be reached (a dead
                             address, a path that cannot be a directory).  Required.  A connector with
                             nothing to reach (in-process memory) passes its ``factory`` here and says
                             ``nothing_to_reach=True``; otherwise the kit checks that a second engine from
                             it is not offered what a first one saved (a reachable backend fails).
    ``corrupt``              ``shared -> None``: damage every block stored under ``shared`` (flip bytes,
                             truncate).  Required unless ``provides_hits`` is False.
    ``provides_hits``        False for a connector that never loads (e.g. ``null``): the load checks then
                             require zero external tokens instead of a full prefix hit.
    ``lookup_deadline_s``    how long a lookup may answer ``None`` before it must give a number.
    ``send_deadline_s``      how long after a request finished a hold may last, and how long a stopped
                             hold may take to be confirmed: the connector must report the request by
                             then (the engine's timeouts are set far above it, so relying on them fails).
    ``unreachable_deadline_s``  engine start + generating the kit's prompts with the backend down.
    ``evict``                ``(shared, block_hash) -> None``: remove that one block from the backend.
                             Optional: the hole check makes its own hole (a block saved under a decoy
                             key); with ``evict`` it also evicts one.
    ``save_settle_s``        how long after its requests ended the kit waits, freed blocks poisoned and
                             unused, before it reads back what was saved: a save that copies a block
                             later than ``request_finished`` allowed has run by then and copied poison.
    ``tracked_requests``     ``scheduler_half -> int``: how many requests the connector's scheduler half
                             keeps state for.  Without it the kit looks for finished request ids in the
                             half's attributes (dicts, sets, lists), which finds the usual leaks.
    ``call_deadline_s``      the longest one connector call may take (a lookup, a save, a step's
                             bookkeeping); a call that blocks longer fails the check, it never hangs it.
    ``load_deadline_s``      how long an async load may keep its request waiting before the worker lists
                             it in ``finished_recving``.
    ``engine_options``       extra ``EngineConfig`` fields (e.g. ``{"device": "cuda"}``).  The kit runs
                             on the CPU in float32 with ``block_size=4`` unless told otherwise.
    """

    factory: ConfigFactory
    unreachable_factory: ConfigFactory | None = None
    corrupt: Callable[[Path], None] | None = None
    provides_hits: bool = True
    nothing_to_reach: bool = False
    lookup_deadline_s: float = LOOKUP_DEADLINE_S  # the engine gives up on a lookup then too
    send_deadline_s: float = 5.0
    unreachable_deadline_s: float = 10.0
    evict: Callable[[Path, bytes], None] | None = None
    tracked_requests: Callable[[Any], int] | None = None
    call_deadline_s: float = 30.0
    load_deadline_s: float = 30.0
    save_settle_s: float = 1.0
    engine_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise TypeError("ConformanceTarget.factory must be callable: shared_dir -> KVConnectorConfig")
        for name in ("unreachable_factory", "corrupt", "evict", "tracked_requests"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise TypeError(f"ConformanceTarget.{name} must be callable or None")
        for name in (
            "lookup_deadline_s",
            "send_deadline_s",
            "unreachable_deadline_s",
            "call_deadline_s",
            "load_deadline_s",
            "save_settle_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(
                    f"ConformanceTarget.{name} must be a positive number of seconds, got {value!r}"
                )
        owned = sorted(_KIT_OWNED & set(self.engine_options))
        if owned:
            raise ValueError(f"ConformanceTarget.engine_options may not set {owned[0]!r}: the kit sets it")
        num_blocks = self.engine_options.get("num_blocks", MIN_KIT_BLOCKS)
        if not isinstance(num_blocks, int) or num_blocks < MIN_KIT_BLOCKS:
            raise ValueError(
                f"ConformanceTarget.engine_options num_blocks is {num_blocks!r}; the kit's prompts and "
                f"concurrent requests need at least {MIN_KIT_BLOCKS} blocks (leave it out for the default)"
            )

    def config(self, shared: Path) -> KVConnectorConfig:
        return _checked(self.factory(shared), "factory")

    def unreachable_config(self, shared: Path) -> KVConnectorConfig:
        assert self.unreachable_factory is not None
        return _checked(self.unreachable_factory(shared), "unreachable_factory")

    def missing_hook(self, hook: str) -> str | None:
        """What to add when the check needing ``hook`` cannot run (None: it can)."""
        if hook == "unreachable_factory" and self.unreachable_factory is None:
            return (
                "the target gives no unreachable_factory(shared) hook, so the kit cannot check that an "
                "unreachable backend costs bounded time and zero hits.  Add one returning the connector's "
                "config pointed at a backend that cannot be reached (a dead address, a path under a "
                "regular file); a connector with nothing to reach passes its own factory"
            )
        if hook == "corrupt" and self.corrupt is None and self.provides_hits:
            return (
                "the target gives no corrupt(shared) hook, so the kit cannot check that damaged blocks "
                "are reported as load errors (never loaded, never raised).  Add one that damages every "
                "block stored under shared (flip a payload byte; for memory, reach the store the way "
                "your tests can), or declare provides_hits=False if the connector never loads"
            )
        return None


def _checked(config: object, hook: str) -> KVConnectorConfig:
    if not isinstance(config, KVConnectorConfig):
        raise TypeError(
            f"ConformanceTarget.{hook} must return a KVConnectorConfig, got {type(config).__name__}"
        )
    return config
