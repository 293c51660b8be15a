"""The engine's adapters: which names are served, which are in memory, which sit in the step's slots.

- ``add(name, path)`` loads and checks a PEFT folder (``engine/lora/adapter.py``) and serves it under
  ``name``; loading other weights under a served name replaces it for new requests (a new ``AdapterId``:
  its KV is never the old one's), while requests already admitted finish on the weights they started
  with.  ``remove(name)`` stops serving it the same way.
- ``resolve(name)`` is what a request is admitted with: the served ``AdapterId``, or ``UnknownAdapter``;
  its tensors are in memory from then on (read again if they were evicted: ``AdapterUnavailable`` if
  they changed or cannot be read), so a step never waits for a file or fails on one.
- Memory: at most ``max_cpu_loras`` adapters' tensors are kept (least recently used first out, never one
  an unfinished request uses); an evicted one is read again from its folder when next needed, and
  refused if its content changed meanwhile (the digest says so).
- Slots: ``begin_step`` puts each adapter of the step in one of ``max_loras`` slots (the scheduler admits
  at most that many distinct adapters per step), reusing the least recently used slot no row of the step
  needs, and sets what the ``LoRALinear`` modules read: each row's slot (the native kernel) or the
  per-row mask (the torch path).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.hashing import AdapterId
from engine.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from engine.lora.layers import LoRALinear, LoRAState, wrap_model
from engine.model.config import ModelConfig
from engine.native import LoRAKernel, native_kernels

logger = logging.getLogger(__name__)


def _native_kernel(
    dtype: torch.dtype, device: torch.device, max_rank: int, config: ModelConfig
) -> LoRAKernel | None:
    """The segmented kernel (engine/csrc/lora.c) where it serves: bfloat16 on this CPU, an even rank
    limit up to 64, even layer widths; ``PDKV_LORA_NATIVE=0`` keeps the torch path."""
    widths = (config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)
    if device.type != "cpu" or dtype != torch.bfloat16 or max_rank > 64 or max_rank % 2:
        return None
    if any(w % 2 for w in widths):
        return None
    if os.environ.get("PDKV_LORA_NATIVE", "1") == "0":
        return None
    kernels = native_kernels()
    return kernels.lora if kernels is not None else None


class UnknownAdapter(KeyError):
    """A request names an adapter this engine does not serve (404 / NOT_FOUND at the front ends)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown adapter"


class AdapterUnavailable(RuntimeError):
    """A served adapter evicted from memory whose folder no longer gives the weights it was loaded with
    (changed, gone, unreadable): the server's state, not the request's fault -- FAILED_PRECONDITION (409
    over HTTP) until an operator loads it again.  The message names no server path (the node logs it)."""


@dataclass(frozen=True)
class ServedAdapter:
    """What ``adapters()`` reports of one served name."""

    id: AdapterId
    path: Path
    max_rank: int
    modules: tuple[str, ...]
    resident: bool  # in a slot now


class LoRAManager:
    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        model: torch.nn.Module | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        deterministic: bool = False,
    ) -> None:
        """``max_loras`` 0 serves no adapter (and wraps nothing: no step pays for LoRA).  ``deterministic``:
        the deltas must be batch-invariant too -- the native kernel's are (each row alone), the torch
        path's masked matmuls are not, so without the kernel this is refused."""
        if max_loras < 0 or max_lora_rank <= 0:
            raise ValueError("max_loras must be >= 0 and max_lora_rank positive")
        if max_loras and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.config = config
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.state = LoRAState()
        self._where: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        self._device = device if device is not None else torch.device("cpu")
        self._dtype = dtype
        if max_loras and model is not None:
            self.state, self._where = wrap_model(
                model,
                num_slots=max_loras,
                max_rank=max_lora_rank,
                dtype=dtype,
                device=self._device,
                kernel=_native_kernel(dtype, self._device, max_lora_rank, config),
            )
            if deterministic and self.state.kernel is None:
                raise ValueError(
                    "deterministic mode with LoRA adapters needs the native LoRA kernel (bfloat16 on a CPU "
                    "with AVX-512, an even --max-lora-rank up to 64): its deltas are the same bits in "
                    "any batch; turn one of the two off"
                )
        self._served: dict[str, AdapterId] = {}
        # every adapter ever loaded, served or not (requests may still run on it): folder, rank, modules
        self._known: dict[AdapterId, tuple[Path, int, tuple[str, ...]]] = {}
        self._loaded: OrderedDict[AdapterId, LoRAAdapter] = OrderedDict()  # LRU: oldest first
        self._slots: list[AdapterId | None] = [None] * max_loras
        self._slot_step = [0] * max_loras
        self._step = 0
        self._lock = threading.Lock()  # add/remove come from other threads than the step loop
        self.in_use: Callable[[], set[AdapterId]] = set

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    # -- what is served -----------------------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> AdapterId:
        """Serve the adapter in folder ``path`` as ``name``; raises ``AdapterError`` (naming the field)."""
        if not self.enabled:
            raise AdapterError("LoRA is not enabled on this engine (max_loras is 0)")
        adapter = load_adapter(name, path, self.config, max_rank=self.max_lora_rank)
        with self._lock:
            old = self._served.get(name)
            self._served[name] = adapter.id
            self._known[adapter.id] = (adapter.path, adapter.max_rank, tuple(sorted(adapter.modules())))
            self._keep(adapter)
        if old is not None and old != adapter.id:
            logger.info("adapter %s: replaced %s by %s (new requests only)", name, old, adapter.id)
        logger.info("adapter %s served from %s (max rank %d)", adapter.id, path, adapter.max_rank)
        return adapter.id

    def remove(self, name: str) -> AdapterId:
        """Stop serving ``name``: new requests are refused, admitted ones finish.  ``UnknownAdapter``."""
        with self._lock:
            served = self._served.pop(name, None)
        if served is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        return served

    def resolve(self, name: str, digest: bytes | None = None) -> AdapterId:
        """The served identity of ``name`` (with ``digest``: only if it has that content) -- or, with a
        ``digest`` this engine has served under ``name`` before (replaced or unloaded since), that one: a
        router admits requests only for what is served, so a request naming a retired identity was
        admitted before the change, and finishes on the weights it began with (its decode phase, its
        later choices)."""
        with self._lock:
            served = self._served.get(name)
            known = {aid for aid in self._known if aid.name == name and aid.digest == digest}
        if known and (served is None or served.digest != digest):
            [aid] = known
            self._get(aid)  # in memory from now until its requests finish (read again if evicted)
            return aid
        if served is None:
            if not self.enabled:
                raise UnknownAdapter(f"adapter {name!r}: this engine serves no adapters (LoRA is off)")
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {sorted(self._served) or 'none'}")
        if digest is not None and digest != served.digest:
            raise UnknownAdapter(
                f"adapter {name!r} here is {served}, not the {digest.hex()[:16]} the request was "
                "admitted with: load the same files on every node"
            )
        self._get(served)  # in memory from now until its requests finish (read again if evicted)
        return served

    def adapters(self) -> list[ServedAdapter]:
        with self._lock:
            served = [aid for _, aid in sorted(self._served.items())]
            slots = set(self._slots)
        return [ServedAdapter(aid, *self._known[aid], resident=aid in slots) for aid in served]

    # -- memory -------------------------------------------------------------------------------------------

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Hold ``adapter`` in memory, evicting the least recently used ones beyond ``max_cpu_loras``."""
        self._loaded[adapter.id] = adapter
        self._loaded.move_to_end(adapter.id)
        if len(self._loaded) <= self.max_cpu_loras:
            return
        busy = self.in_use() | {a for a in self._slots if a is not None}
        for aid in list(self._loaded):
            if len(self._loaded) <= self.max_cpu_loras:
                break
            if aid not in busy and aid != adapter.id:
                del self._loaded[aid]

    def _get(self, aid: AdapterId) -> LoRAAdapter:
        with self._lock:
            adapter = self._loaded.get(aid)
            if adapter is not None:
                self._loaded.move_to_end(aid)
                return adapter
            path = self._known[aid][0]
        try:
            again = load_adapter(aid.name, path, self.config, max_rank=self.max_lora_rank)
        except AdapterError as exc:
            logger.warning("adapter %s: its folder %s cannot be read again: %s", aid.name, path, exc)
            raise AdapterUnavailable(
                f"adapter {aid.name}: its files cannot be read again since it was loaded; an operator must "
                "load it again"
            ) from exc
        if again.id != aid:
            logger.warning("adapter %s: the files in %s changed since it was loaded", aid.name, path)
            raise AdapterUnavailable(
                f"adapter {aid.name}: its files changed since it was loaded; an operator must load it again"
            )
        with self._lock:
            self._keep(again)
        return again

    # -- the step -----------------------------------------------------------------------------------------

    def begin_step(self, rows: Sequence[tuple[AdapterId | None, int]]) -> None:
        """``rows``: the step's flat rows as runs of (adapter or None, count), in row order."""
        self.state.clear()
        wanted = {a for a, _ in rows if a is not None}
        if not wanted:
            return
        assert len(wanted) <= self.max_loras, "the scheduler admitted more adapters than slots"
        self._step += 1
        slot_of: dict[AdapterId, int] = {}
        for aid in wanted:
            if aid in self._slots:
                slot_of[aid] = self._slots.index(aid)
        for aid in sorted(wanted - set(slot_of), key=str):
            free = [s for s in range(self.max_loras) if self._slots[s] not in wanted]
            slot = min(free, key=lambda s: (self._slots[s] is not None, self._slot_step[s], s))
            self._load_slot(slot, self._get(aid))
            slot_of[aid] = slot
        for slot in slot_of.values():
            self._slot_step[slot] = self._step
        lo, hi = min(slot_of.values()), max(slot_of.values()) + 1
        self.state.lo, self.state.hi = lo, hi
        self.state.used = sum(1 << s for s in slot_of.values())
        each: list[int] = []  # per row: its slot, -1 for none
        for adapter, n in rows:
            each += [-1 if adapter is None else slot_of[adapter]] * n
        slots = torch.tensor(each, dtype=torch.int64)
        if self.state.kernel is not None:
            self.state.rows = slots
        elif not all(a == rows[0][0] for a, _ in rows):  # one adapter on every row: nothing to mask
            # each row's column of the slots lo..hi-1, shifted by one so that column 0 takes the rows
            # without an adapter (and is dropped)
            index = torch.where(slots < 0, 0, slots - lo + 1).view(-1, 1)
            mask = torch.zeros(len(each), hi - lo + 1, dtype=self._dtype).scatter_(1, index, 1.0)
            self.state.mask = mask[:, 1:].contiguous().to(self._device)

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        per_module: dict[LoRALinear, list] = {}  # type: ignore[type-arg]
        for (layer, module), (wrapped, part) in self._where.items():
            deltas = per_module.setdefault(wrapped, [None] * len(wrapped.parts))
            deltas[part] = adapter.deltas.get((layer, module))
        for wrapped, deltas in per_module.items():
            wrapped.set_slot(slot, deltas)
        self._slots[slot] = adapter.id
