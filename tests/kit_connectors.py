"""Connectors for testing the conformance kit itself, named in a config by their ``module:Class`` path
(``"tests.kit_connectors:LastTokenConnector"``).

Each broken one is ``shared-dir`` with one thing done wrong, to prove the kit fails it.
``AsyncSharedDirConnector`` conforms but takes every slow path the contract allows, to prove the kit
passes it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connectors.base import (
    ConnectorContext,
    ConnectorStats,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferParams,
)
from connectors.shared_dir import SharedDirConnector, SharedDirMetadata
from engine.request import Request, RequestId

if TYPE_CHECKING:
    from engine.scheduler.output import SchedulerOutput


class LastTokenConnector(SharedDirConnector):
    """Offers every saved block, including the one that holds the prompt's last token."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        n = 0
        for h in request.block_hashes[num_computed_tokens // bs :]:  # bug: no "- 1" on the last token
            if not self._file(h).is_file():
                break
            n += 1
        return n * bs, False


class ShrinkingLookupConnector(SharedDirConnector):
    """Each lookup of the same request offers one block fewer (a per-request "hit budget")."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self._asked: Counter[str] = Counter()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        penalty = self._asked[request.request_id] * self.block_size
        self._asked[request.request_id] += 1
        return max(0, (n or 0) - penalty), load_async


class ClaimingLookupConnector(SharedDirConnector):
    """Claims what it finds: the matched block files are renamed to ``*.taken`` (its own loads read them
    there).  The same request gets the same answer again -- but every other engine now misses."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self._answers: dict[tuple[str, int], int] = {}

    def _file(self, block_hash: bytes) -> Path:
        path = super()._file(block_hash)
        taken = path.with_suffix(".taken")
        return taken if self.role == KVConnectorRole.WORKER and taken.exists() else path

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        key = (request.request_id, num_computed_tokens)
        if key not in self._answers:
            n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
            first = num_computed_tokens // self.block_size
            for h in request.block_hashes[first : first + (n or 0) // self.block_size]:
                path = self._file(h)
                os.replace(path, path.with_suffix(".taken"))
            self._answers[key] = n or 0
        return self._answers[key], False


class NeverAnswersConnector(SharedDirConnector):
    """An async lookup that never completes: ``None`` forever."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return None, False


class PerturbingLoadConnector(SharedDirConnector):
    """Loads, then flips the lowest bit of each loaded block's first byte: a near-copy, not the saved KV."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        super().start_load_kv(metadata)
        assert isinstance(metadata, SharedDirMetadata)
        for block_id, _ in metadata.loads:
            view = self._block_bytes(block_id)
            view[0] ^= 1


class RaisingLoadConnector(SharedDirConnector):
    """Raises on a damaged block instead of reporting it."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            raise RuntimeError(f"blocks {sorted(errors)} are damaged")
        return errors


class TrustingLoadConnector(SharedDirConnector):
    """Copies a block file's payload without checking it: damage is loaded as if it were KV."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        from wire.codec import HEADER_SIZE

        assert isinstance(metadata, SharedDirMetadata)
        for block_id, block_hash in metadata.loads:
            payload = self._file(block_hash).read_bytes()[HEADER_SIZE:]
            view = self._block_bytes(block_id)
            view[: len(payload)] = payload


class NeverSendsConnector(SharedDirConnector):
    """Holds every finished request's blocks (as if sending them to a peer), never reports
    ``finished_sending``, and ignores ``stop_request_ids``: its blocks come back only when the engine's
    last-resort stop timeout passes."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        super().request_finished(request, block_ids)
        return True, {"peer": "nowhere"}


class SlowConnectConnector(SharedDirConnector):
    """Its first lookup waits ``connect_s`` (default 1 s) for a backend that never answers, longer than the
    kit's deadline in the test."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not getattr(self, "_gave_up", False):
            threading.Event().wait(1.0)  # stands for a connect() with a long timeout
            self._gave_up = True
        return 0, False


@dataclass
class AsyncMetadata(SharedDirMetadata):
    load_requests: list[RequestId] = field(default_factory=list)  # whose blocks are in ``loads``
    sends: list[RequestId] = field(default_factory=list)  # finished requests held for a send


class AsyncSharedDirConnector(SharedDirConnector):
    """Conforms, the slow way: every first lookup of a request answers None ("still looking"), hits load
    asynchronously (the request waits in WAITING_FOR_REMOTE_KV), and every finished request is held.
    Loads and sends started in one step are reported one step later, like transfers in flight."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        # scheduler half
        self._asked: set[str] = set()
        self._load_requests: list[RequestId] = []
        self._sends: list[RequestId] = []
        # worker half: started this step / to report at the next get_finished
        self._started: tuple[set[RequestId], set[RequestId]] = (set(), set())
        self._in_flight: tuple[set[RequestId], set[RequestId]] = (set(), set())

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id not in self._asked:
            self._asked.add(request.request_id)
            return None, False
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            self._load_requests.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, SharedDirMetadata)
        out = AsyncMetadata(
            loads=meta.loads,
            saves=meta.saves,
            tables=meta.tables,
            load_requests=self._load_requests,
            sends=self._sends,
        )
        self._load_requests, self._sends = [], []
        return out

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        super().request_finished(request, block_ids)
        self._asked.discard(request.request_id)
        self._sends.append(request.request_id)
        return True, None

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, AsyncMetadata)
        super().start_load_kv(metadata)  # the bytes land now; the report comes one step later
        self._in_flight = self._started
        self._started = (set(metadata.sends), set(metadata.load_requests))

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        done, self._in_flight = self._in_flight, (set(), set())
        return done


# -- defects the stronger kit catches (issue: the kit misses these classes) ---------------------------------


class _TokenKeyedRequest:
    """A request seen through a connector that keys blocks by their tokens alone."""

    def __init__(self, request: Request, block_size: int, seed: bytes = b"") -> None:
        self._request = request
        keys: list[bytes] = []
        parent = seed
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes)):
            block = ",".join(map(str, tokens[i * block_size : (i + 1) * block_size])).encode()
            parent = hashlib.sha256(parent + block).digest()
            keys.append(parent)
        self.block_hashes = keys

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class _RekeyedConnector(SharedDirConnector):
    """Looks requests up and saves them under keys of its own making (``_keyed``), not their hashes."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return super().get_num_new_matched_tokens(self._keyed(request), num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(self._keyed(request), block_ids, num_external_tokens)

    def _keyed(self, request: Request) -> Any:
        raise NotImplementedError


class TokenKeyedConnector(_RekeyedConnector):
    """Keys blocks by a hash of their tokens, in one flat folder: another tenant's salt, another model or
    another dtype with the same tokens gets this one's KV."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self.dir = Path(self.options.path) / "flat"  # bug: no namespace, no layout in the path
        self.dir.mkdir(parents=True, exist_ok=True)

    def register_kv_caches(self, kv_cache: Any) -> None:
        from wire.codec import BlockCodec
        from wire.layout import BlockLayout

        self._kv = kv_cache
        # bug: one namespace for every model, and a layout the header is not checked against
        self._codec = BlockCodec(b"\0" * 16, BlockLayout.from_kv_cache(kv_cache))

    def _keyed(self, request: Request) -> _TokenKeyedRequest:
        return _TokenKeyedRequest(request, self.block_size)


class HoleBlindConnector(SharedDirConnector):
    """Counts every saved block of the prompt, past a missing one."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        hashes = request.block_hashes[num_computed_tokens // bs : last]
        return sum(self._file(h).is_file() for h in hashes) * bs, False  # bug: no break at a hole


class SaveAfterFreeConnector(SharedDirConnector):
    """Saves a request's blocks only once the request finished (in get_finished), yet says hold=False:
    the engine freed the blocks already, and may have reused them."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self._queued: list[SharedDirMetadata] = []

    def wait_for_save(self) -> None:
        meta = self.step_metadata
        if isinstance(meta, SharedDirMetadata) and meta.saves:
            self._queued.append(meta)

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        keep = []
        for meta in self._queued:
            if any(rid in finished_req_ids for rid, _, _ in meta.saves):
                self._save_blocks(meta)  # bug: the blocks are no longer the request's
            else:
                keep.append(meta)
        self._queued = keep
        return set(), set()


class FlushAtShutdownConnector(SharedDirConnector):
    """Collects its saves and writes them all at shutdown, long after the blocks were freed."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self._pending: list[SharedDirMetadata] = []

    def wait_for_save(self) -> None:
        meta = self.step_metadata
        if isinstance(meta, SharedDirMetadata):
            self._pending.append(meta)

    def shutdown(self) -> None:
        for meta in self._pending:
            self._save_blocks(meta)
        self._pending = []


class BlockingLookupConnector(SharedDirConnector):
    """Waits on its backend without a bound: the first lookup never returns."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        threading.Event().wait()  # bug: a backend call with no timeout
        raise AssertionError("unreachable")


class LeakyStateConnector(SharedDirConnector):
    """Keeps every request it saw: the scheduler half's books grow for ever."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        return False, None  # bug: self._requests and self._saved_upto keep the request


class IgnoresLocalHitConnector(SharedDirConnector):
    """Loads its blocks from the prompt's block 0 into the blocks after the local hit."""

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        bs = self.block_size
        first = request.num_computed_tokens // bs
        for i in range(num_external_tokens // bs):
            self._pending_loads.append((block_ids[first + i], request.block_hashes[i]))  # bug: hashes[i]
        self._requests[request.request_id] = request
        self._saved_upto[request.request_id] = first + num_external_tokens // bs


class SilentLoadConnector(AsyncSharedDirConnector):
    """Loads asynchronously and never says the load is done: its requests wait for ever."""

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        sending, _ = super().get_finished(finished_req_ids)
        return sending, set()  # bug: finished_recving never reported


# ---- the three classes the issue #31 drill found slipping through ------------------------------------------


class BackgroundSaveConnector(SharedDirConnector):
    """Saves each step's blocks on a background thread 50 ms later and returns no hold: by then the engine
    may have freed the blocks (and reused them)."""

    def wait_for_save(self) -> None:
        meta = self.step_metadata
        if isinstance(meta, SharedDirMetadata) and meta.saves:
            timer = threading.Timer(0.05, self._save_blocks, (meta,))  # bug: no hold for the late copy
            timer.daemon = True
            timer.start()


class DtypelessKeyConnector(TokenKeyedConnector):
    """Keys blocks by the model's weights fingerprint (the loader's, without the KV part the engine's
    namespace adds), the tenant's salt and a hash of the block's tokens it computes itself: an engine
    running the same model in another dtype finds the same files.  (A connector keyed by
    ``namespace.namespace_id`` or by ``request.block_hashes`` cannot make this mistake: both name the
    dtype since the namespace does.)"""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        weights = context.namespace.model_fingerprint.split(";kv=")[0]  # bug: the dtype dropped
        self.dir = Path(self.options.path) / hashlib.sha256(weights.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)

    def _keyed(self, request: Request) -> _TokenKeyedRequest:
        return _TokenKeyedRequest(request, self.block_size, seed=(request.cache_salt or "").encode())


class AdapterBlindKeyConnector(_RekeyedConnector):
    """Keys blocks by block hashes it computes again from the namespace, the salt and the tokens -- and
    not the LoRA adapter: an engine running an adapter is offered the base model's KV (an outside
    author's plugin did this, and the kit passed it)."""

    def _keyed(self, request: Request) -> Any:
        from engine.hashing import hash_blocks

        keyed = _TokenKeyedRequest(request, self.block_size)
        namespace, salt = self.context.namespace, request.cache_salt
        blocks = hash_blocks(request.all_token_ids, namespace=namespace, cache_salt=salt)  # bug: no adapter
        keyed.block_hashes = [bytes(h) for h in blocks][: len(request.block_hashes)]
        return keyed


class RaisingSaveConnector(SharedDirConnector):
    """Lets a failed save (a full disk) raise out of ``wait_for_save`` (rule 6: caught and counted)."""

    def wait_for_save(self) -> None:
        raise OSError(28, "No space left on device")


class RaisingFinishConnector(SharedDirConnector):
    """Raises from ``request_finished`` (an outside plugin did: its node's engine loop died)."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        super().request_finished(request, block_ids)
        raise RuntimeError("boom from request_finished")


class RaisingMetaConnector(SharedDirConnector):
    """Raises from ``build_connector_meta`` once a request has been admitted."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if scheduler_output.scheduled:
            raise RuntimeError("boom from build_connector_meta")
        return super().build_connector_meta(scheduler_output)


class ForeignLoadErrorsConnector(SharedDirConnector):
    """Reports blocks 0-3 as failed loads every step, whatever it loaded."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return super().get_block_ids_with_load_errors() | {0, 1, 2, 3}


class ForeignFinishedConnector(SharedDirConnector):
    """Lists a request id it never held in ``finished_sending``, once."""

    said = False

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        sending, recving = super().get_finished(finished_req_ids)
        if finished_req_ids and not self.said:
            self.said = True
            return sending | {RequestId("not-a-request")}, recving
        return sending, recving


class RaisingAllocConnector(SharedDirConnector):
    """Raises from ``update_state_after_alloc`` (an outside plugin did: its node stopped)."""

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        raise RuntimeError("boom from update_state_after_alloc")


class RaisingOutputConnector(SharedDirConnector):
    """Raises from ``update_connector_output`` (the same plugin: its node stopped too)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        raise RuntimeError("boom from update_connector_output")


class RaisingStatsConnector(SharedDirConnector):
    """Its worker half's ``get_stats`` raises (the same plugin kept its node from ever starting)."""

    def get_stats(self) -> ConnectorStats:
        if self.role is KVConnectorRole.WORKER:
            raise RuntimeError("boom from get_stats")
        return super().get_stats()


class TwiceLoadedConnector(AsyncSharedDirConnector):
    """Lists each finished async load twice, one step apart."""

    def __init__(
        self, role: KVConnectorRole, context: ConnectorContext, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(role, context, options)
        self._again: set[RequestId] = set()

    def get_finished(self, finished_req_ids: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        sending, recving = super().get_finished(finished_req_ids)
        again, self._again = self._again, set(recving)
        return sending, recving | again
