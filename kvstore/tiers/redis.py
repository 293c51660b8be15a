"""The ``redis`` tier: one key per block on a Redis, Valkey or Redis Cluster, through redis-py (hiredis).

Keys and values:

    key   = PREFIX ":" first 8 bytes of the namespace, hex ":{" first 4 bytes of the block's anchor, hex "}:"
            raw hash bytes
    value = the 96-byte block header followed by the payload (``wire.codec``), SET with PX when a TTL
            is configured

The ``{...}`` hash tag puts a group of ``ANCHOR_SPAN`` consecutive blocks in one cluster slot
(``wire.keys``), so on a cluster a lookup is one pipelined round trip per node, and on a single server
one round trip.  Keys are kept short because a lookup sends and hashes every one of them: the hash goes in
raw, and 8 bytes of namespace are plenty to keep namespaces apart (the block hash already differs between
models; between layouts of one model a collision would only be a checked miss).

    lookup   one EVALSHA of ``LOOKUP_SCRIPT`` over the run's keys (per slot group on a cluster, pipelined
             per node).  One multi-key EXISTS answers a full hit; otherwise the script halves the range
             with multi-key EXISTS calls until it finds the first missing key.  Never one EXISTS round trip
             per key.  A server that lost the script (restart, SCRIPT FLUSH) costs one extra round trip.
    get      pipelined GETs, ``batch`` per round trip; replies are read straight off the connection's
             socket into a header buffer and the caller's block (no intermediate ``bytes``), then checked.
    put      pipelined SETs, ``batch`` per round trip; the payload goes to ``sendall`` as a memoryview,
             never concatenated with its header.

Every socket operation has a timeout no longer than the call's deadline; redis-py's own retries are off
(the circuit breaker decides when to try again).  Connections come from a bounded pool; a connection that
saw an error, a timeout or an unexpected reply is disconnected, never reused out of step.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.buffers import BufferFence
from kvstore.config import RedisTierConfig
from kvstore.deadline import Deadline
from kvstore.results import GetResult, MissReason, PutResult, ReadResult, Unit
from kvstore.tiers.base import Tier, TierError, TierPolicy, TierTimeout
from kvstore.tiers.resp import CRLF, LOOKUP_SCRIPT, LOOKUP_SHA, BulkReader, pack_command
from wire.codec import HEADER_SIZE, HeaderMatcher, check_header, payload_checksum, verify_payload
from wire.keys import ANCHOR_SPAN, KeyRun
from wire.layout import BlockLayout

_TOPOLOGY_ERRORS = (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.ClusterDownError)


class RedisTier(Tier):
    kind = "redis"

    def __init__(
        self,
        config: RedisTierConfig,
        *,
        policy: TierPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config.name, policy=policy, clock=clock)
        self.config = config
        self._prefix = config.prefix.encode()
        self._px = None if config.ttl_s is None else max(1, int(config.ttl_s * 1000))
        self._connection_kwargs: dict[str, Any] = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        # Credentials and TLS by reference (kvstore/config.py): read here, never carried in a URL.
        password = config.password()
        if config.username:
            self._connection_kwargs["username"] = config.username
        if password is not None:
            self._connection_kwargs["password"] = password
        for option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if getattr(config, option):
                path = getattr(config, option)
                if not os.access(path, os.R_OK) or not os.path.isfile(path):  # else every connect fails
                    raise ValueError(f"redis tier {option} {path}: not a readable file")
                self._connection_kwargs[option] = path
        self._pool: redis.ConnectionPool | None = None
        self._cluster: Any = None  # redis.cluster.RedisCluster, created on first use
        self._topology_stale = False
        self._client_lock = threading.Lock()

    # ---- keys and connections ------------------------------------------------------------------------

    def keys(self, run: KeyRun) -> list[bytes]:
        """The Redis keys of ``run``'s blocks (module docstring), in order."""
        ns = run.namespace[:8].hex().encode()
        out: list[bytes] = []
        first_group = run.start // ANCHOR_SPAN
        for g, anchor in enumerate(run.anchors):
            tag = b"%s:%s:{%s}:" % (self._prefix, ns, anchor[:4].hex().encode())
            lo = max(0, (first_group + g) * ANCHOR_SPAN - run.start)
            hi = min(len(run), (first_group + g + 1) * ANCHOR_SPAN - run.start)
            out.extend([tag + h for h in run.hashes[lo:hi]])
        return out

    def _standalone_pool(self) -> redis.ConnectionPool:
        with self._client_lock:
            if self._pool is None:
                self._pool = redis.ConnectionPool.from_url(
                    self.config.url, max_connections=self.config.max_connections, **self._connection_kwargs
                )
            return self._pool

    def _cluster_client(self) -> Any:
        with self._client_lock:
            if self._cluster is None:
                from redis.cluster import RedisCluster

                self._cluster = RedisCluster.from_url(
                    self.config.url,
                    max_connections=self.config.max_connections,
                    require_full_coverage=False,
                    **self._connection_kwargs,
                )
            return self._cluster

    def _pools_for(self, keys: Sequence[bytes]) -> list[tuple[redis.ConnectionPool, list[int]]]:
        """Which pool serves which keys (by index), in first-seen order: one pool unless clustered."""
        if not self.config.cluster:
            return [(self._standalone_pool(), list(range(len(keys))))]
        cluster = self._cluster_client()
        if self._topology_stale:
            self._topology_stale = False
            cluster.nodes_manager.initialize()
        by_node: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
        for i, key in enumerate(keys):
            node = cluster.get_node_from_key(key)
            if node.name not in by_node:
                by_node[node.name] = (cluster.get_redis_connection(node).connection_pool, [])
            by_node[node.name][1].append(i)
        return list(by_node.values())

    @contextmanager
    def _connection(self, pool: redis.ConnectionPool, deadline: Deadline) -> Iterator[Any]:
        """A pooled connection whose socket times out by the deadline; disconnected on any failure."""
        try:
            conn = pool.get_connection()
        except redis.TimeoutError as exc:
            raise TierTimeout(str(exc)) from exc
        except redis.RedisError as exc:
            raise TierError(str(exc)) from exc
        try:
            sock = conn._sock
            if sock is None:
                raise TierError("redis connection is not connected")
            sock.settimeout(deadline.clamp(self.config.timeout_s))
            yield conn
        except BaseException as exc:
            conn.disconnect()
            if isinstance(exc, _TOPOLOGY_ERRORS):
                self._topology_stale = True  # slots moved (resharding, failover): re-read the map next call
            if isinstance(exc, (redis.TimeoutError, socket.timeout)):
                raise TierTimeout(str(exc) or "socket timeout") from exc
            if isinstance(exc, redis.RedisError):
                raise TierError(str(exc)) from exc
            raise
        finally:
            pool.release(conn)

    def _enter(self, stack: ExitStack, plan: list[tuple[Any, list[int]]], deadline: Deadline) -> list[Any]:
        """One connection per pool of ``plan``, released (and on failure disconnected) with ``stack``."""
        return [stack.enter_context(self._connection(pool, deadline)) for pool, _ in plan]

    def _probe(self, deadline: Deadline) -> None:
        """PING the server (every primary of a cluster), each over a pooled connection by the deadline."""
        for pool in self._server_pools():
            with self._connection(pool, deadline) as conn:
                conn.send_command("PING")
                conn.read_response()

    # ---- lookups ---------------------------------------------------------------------------------------

    def _contains_prefix(self, run: KeyRun, deadline: Deadline) -> int:
        keys = self.keys(run)
        groups = self._slot_groups(run) if self.config.cluster else [(0, len(keys))]
        try:
            counts = self._eval_lookups(keys, groups, deadline)
        except redis.exceptions.NoScriptError:
            self._load_script(deadline)  # a restarted or new server: one extra round trip, once
            counts = self._eval_lookups(keys, groups, deadline)
        total = 0
        for (a, b), count in zip(groups, counts, strict=True):
            total += count
            if count < b - a:
                break
        return total

    @staticmethod
    def _slot_groups(run: KeyRun) -> list[tuple[int, int]]:
        """Index ranges of ``run`` whose keys share a hash tag (one cluster slot each)."""
        first = -run.start % ANCHOR_SPAN or ANCHOR_SPAN
        bounds = [0, *range(first, len(run), ANCHOR_SPAN), len(run)]
        return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]

    def _eval_lookups(
        self, keys: list[bytes], groups: list[tuple[int, int]], deadline: Deadline
    ) -> list[int]:
        """One EVALSHA of the lookup script per group, pipelined per node; the count of each group."""
        counts = [0] * len(groups)
        plan = self._pools_for([keys[a] for a, _ in groups])
        noscript = False
        with ExitStack() as stack:
            conns = self._enter(stack, plan, deadline)
            for conn, (_, ids) in zip(conns, plan, strict=True):
                packed: list[bytes] = []
                for g in ids:
                    a, b = groups[g]
                    packed.extend(pack_command([b"EVALSHA", LOOKUP_SHA, b"%d" % (b - a)], keys[a:b]))
                conn.send_packed_command(packed)
            for conn, (_, ids) in zip(conns, plan, strict=True):
                for g in ids:
                    try:
                        counts[g] = int(conn.read_response())
                    except redis.exceptions.NoScriptError:
                        noscript = True  # keep reading: the connection stays in step
        if noscript:
            raise redis.exceptions.NoScriptError("lookup script not loaded")
        return counts

    def _load_script(self, deadline: Deadline) -> None:
        for pool in self._server_pools():
            with self._connection(pool, deadline) as conn:
                conn.send_command("SCRIPT", "LOAD", LOOKUP_SCRIPT)
                conn.read_response()

    def _server_pools(self) -> list[redis.ConnectionPool]:
        """One pool for each server that holds keys: the server, or every primary of a cluster."""
        return self._primary_pools() if self.config.cluster else [self._standalone_pool()]

    def _primary_pools(self) -> list[redis.ConnectionPool]:
        cluster = self._cluster_client()
        return [cluster.get_redis_connection(node).connection_pool for node in cluster.get_primaries()]

    # ---- reads ---------------------------------------------------------------------------------------

    def _get_into(
        self, run: KeyRun, fence: BufferFence, layout: BlockLayout, deadline: Deadline
    ) -> GetResult:
        keys = self.keys(run)
        checksums: list[int] = []
        header_buf = bytearray(HEADER_SIZE)
        matcher = HeaderMatcher(run.namespace, layout)
        batch = self.config.batch
        for lo in range(0, len(keys), batch):
            hi = min(lo + batch, len(keys))
            replies = self._fetch(keys, lo, hi, deadline, fence, header_buf, run, matcher)
            for i, reason, checksum in replies:
                if reason is not None:
                    return GetResult(i, reason, tuple(checksums))
                checksums.append(checksum)
            if deadline.expired() and hi < len(keys):
                return GetResult(hi, MissReason.TIMEOUT, tuple(checksums))
        return GetResult(len(keys), None, tuple(checksums))

    def _fetch(
        self,
        keys: list[bytes],
        lo: int,
        hi: int,
        deadline: Deadline,
        fence: BufferFence,
        header_buf: bytearray,
        run: KeyRun,
        matcher: HeaderMatcher,
    ) -> list[tuple[int, MissReason | None, int]]:
        """GET keys[lo:hi] in one round trip per node; (index, reason, checksum) for the leading run."""
        results: dict[int, tuple[MissReason | None, int]] = {}
        plan = self._pools_for(keys[lo:hi])
        with ExitStack() as stack:
            conns = self._enter(stack, plan, deadline)
            for conn, (_, ids) in zip(conns, plan, strict=True):
                conn.send_packed_command(conn.pack_commands([("GET", keys[lo + j]) for j in ids]))
            stop = hi
            for conn, (_, ids) in zip(conns, plan, strict=True):
                reader = BulkReader(conn._sock)
                for j in ids:
                    i = lo + j
                    size = reader.bulk_length()
                    if size < 0:
                        results[i] = (MissReason.ABSENT, 0)
                        stop = min(stop, i)
                        continue
                    if i > stop:  # past the first miss: not part of the answer
                        reader.skip(size)
                        continue
                    reason, checksum = self._receive_block(reader, size, i, fence, header_buf, run, matcher)
                    results[i] = (reason, checksum)
                    if reason is not None:
                        stop = min(stop, i)
                reader.finish()
        out = []
        for i in range(lo, hi):
            reason, checksum = results[i]
            out.append((i, reason, checksum))
            if reason is not None:
                break
        return out

    @staticmethod
    def _receive_block(
        reader: BulkReader,
        size: int,
        i: int,
        fence: BufferFence,
        header_buf: bytearray,
        run: KeyRun,
        matcher: HeaderMatcher,
    ) -> tuple[MissReason | None, int]:
        """Read one bulk reply of ``size`` bytes: the header into ``header_buf``, the payload into block i."""
        if size < HEADER_SIZE:
            reader.skip(size)
            return MissReason.TRUNCATED, 0
        reader.read_into(memoryview(header_buf))
        checksum = matcher.match(header_buf, run.hashes[i])
        if isinstance(checksum, MissReason):
            reader.skip(size - HEADER_SIZE)
            return checksum, 0
        expected = fence.nbytes(i)
        if size - HEADER_SIZE != expected:
            reader.skip(size - HEADER_SIZE)
            return (MissReason.TRUNCATED if size - HEADER_SIZE < expected else MissReason.CORRUPT), 0
        dst = fence.hold(i)
        try:
            reader.read_into(dst)
        finally:
            fence.let_go()
        reader.end_of_bulk()
        return (None if payload_checksum(dst) == checksum else MissReason.CORRUPT), checksum

    def _read(self, run: KeyRun, deadline: Deadline, layout: BlockLayout | None) -> ReadResult:
        keys = self.keys(run)
        units: list[Unit] = []
        batch = self.config.batch
        for lo in range(0, len(keys), batch):
            hi = min(lo + batch, len(keys))
            plan = self._pools_for(keys[lo:hi])
            values: dict[int, Any] = {}
            with ExitStack() as stack:
                conns = self._enter(stack, plan, deadline)
                for conn, (_, ids) in zip(conns, plan, strict=True):
                    conn.send_packed_command(conn.pack_commands([("GET", keys[lo + j]) for j in ids]))
                for conn, (_, ids) in zip(conns, plan, strict=True):
                    for j in ids:
                        values[lo + j] = conn.read_response()
            for i in range(lo, hi):
                value = values[i]
                if value is None:
                    return ReadResult(units, MissReason.ABSENT)
                view = memoryview(value)
                header = check_header(view, run.namespace, run.hashes[i], None)
                if isinstance(header, MissReason):
                    return ReadResult(units, header)
                reason = verify_payload(header, view[HEADER_SIZE:])
                if reason is not None:
                    return ReadResult(units, reason)
                units.append(Unit(view[HEADER_SIZE:], bytes(view[:HEADER_SIZE])))
        return ReadResult(units)

    # ---- writes ----------------------------------------------------------------------------------------

    def _put(self, run: KeyRun, units: Sequence[Unit], deadline: Deadline) -> PutResult:
        keys = self.keys(run)
        batch = self.config.batch
        stored = 0
        for lo in range(0, len(keys), batch):
            hi = min(lo + batch, len(keys))
            plan = self._pools_for(keys[lo:hi])
            with ExitStack() as stack:
                conns = self._enter(stack, plan, deadline)
                for conn, (_, ids) in zip(conns, plan, strict=True):
                    conn.send_packed_command(self._pack_sets([(keys[lo + j], units[lo + j]) for j in ids]))
                for unit in units[hi : hi + batch]:
                    unit.seal()  # the next batch's checksums, while the server stores this one
                for conn, (_, ids) in zip(conns, plan, strict=True):
                    for _ in ids:
                        conn.read_response()  # +OK, or raises ResponseError (OOM, READONLY...)
            stored = hi
            if deadline.expired() and hi < len(keys):
                return PutResult(stored, MissReason.TIMEOUT)
        return PutResult(stored)

    def _pack_sets(self, items: list[tuple[bytes, Unit]]) -> list[Any]:
        """RESP for SET key header+payload [PX ms], with every payload as its own chunk (no copy)."""
        argc = 3 if self._px is None else 5
        tail = CRLF if self._px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(self._px)), self._px)
        parts: list[Any] = []
        pending = b""
        for key, unit in items:
            header = unit.seal()
            value_len = HEADER_SIZE + unit.payload.nbytes
            parts.append(
                b"%s*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
                % (pending, argc, len(key), key, value_len, header)
            )
            parts.append(unit.payload)
            pending = tail
        parts.append(pending)
        return parts

    def _delete(self, run: KeyRun, deadline: Deadline) -> int:
        keys = self.keys(run)
        deleted = 0
        groups: dict[int, list[bytes]] = {}
        for i, key in enumerate(keys):
            groups.setdefault((run.start + i) // ANCHOR_SPAN, []).append(key)
        group_keys = list(groups.values())
        plan = self._pools_for([g[0] for g in group_keys])
        with ExitStack() as stack:
            conns = self._enter(stack, plan, deadline)
            for conn, (_, ids) in zip(conns, plan, strict=True):
                conn.send_packed_command(conn.pack_commands([("DEL", *group_keys[g]) for g in ids]))
            for conn, (_, ids) in zip(conns, plan, strict=True):
                for _ in ids:
                    deleted += int(conn.read_response())
        return deleted

    def _backend_stats(self) -> dict[str, Any]:
        return {"url": _redact(self.config.url), "cluster": self.config.cluster, "ttl_s": self.config.ttl_s}

    def _close(self) -> None:
        with self._client_lock:
            if self._pool is not None:
                self._pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
