"""The local launcher behind ``pdkv up``: the compose topology as plain processes on this machine.

    with Cluster.start(Topology(num_prefill=1, num_decode=1)) as cluster:
        print(cluster.router_address)

Start order and readiness (every wait has a deadline; a process that dies while starting is reported
with the tail of its log)::

    redis-server (--redis)  ─┐
    pdkv kvstore serve      ─┴▶ ready line ─▶ prefill + decode nodes (in parallel) ─▶ ready lines
                                           ─▶ pdkv serve-router ─▶ its health says SERVING (= every pool
                                              has a healthy node)

Every child runs in its own session (a terminal's Ctrl-C reaches only the launcher, which stops them in
order: router, nodes, store, redis) and, on Linux, dies with the launcher even if the launcher is killed
(``PR_SET_PDEATHSIG``), so nothing is orphaned.  Children's output goes to ``LOG_DIR/NAME.log``.

Once started, ``supervise`` (``pdkv up`` calls it twice a second) restarts a child that died, after a
backoff that doubles with each death (``RestartPolicy``), on the addresses its first run reported: a
restarted node is found again by the router at the address it already knows, a restarted store by the
nodes' remote tier.  The router fails over meanwhile.  A child that keeps dying (``max_deaths`` within
``window_s``) stops the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdkv import die_with_parent
from pdkv.launcher.process import (
    Process,
    free_port,
    pdkv_command,
    pump,
)
from pdkv.launcher.topology import (
    Topology,
    available_connectors,
    connector_stack,
)
from serving.health import wait_healthy
from serving.secrets import Secrets, own_folder

logger = logging.getLogger(__name__)


class Cluster:
    """A running topology.  ``start`` returns once the router is SERVING; ``stop`` ends every child."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        # Logs and the store's disk tier go to log_dir when given (kept), else to a folder removed at stop.
        self._own_dir = topology.log_dir is None
        self.run_dir = Path(topology.log_dir or tempfile.mkdtemp(prefix="pdkv-up-"))
        own_folder(self.run_dir, recursive=False)  # its logs, the disk tier's KV, --secure's credentials
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_dir.chmod(0o700)  # logs, the store's disk tier: the owner's only
        self.processes: list[Process] = []
        self.router: Process | None = None
        self.store_endpoint: str | None = None
        self.store_events = ""  # the store server's KV event endpoints, "PUB,REPLAY" (kv-aware only)
        self.restart_policy = topology.restart_policy
        self.secrets: Secrets | None = None
        self._stopping = False
        self._lock = threading.Lock()  # supervise() and stop() from different threads
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="pdkv-up-spawn")  # see launch

    # -- start --------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, topology: Topology) -> Cluster:
        cluster = cls(topology)
        try:
            cluster._start()
        except BaseException as exc:
            # A child that did not come up: the error names its log, which stays (nothing else does).
            cluster.stop(keep_logs=isinstance(exc, RuntimeError | TimeoutError))
            raise
        return cluster

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def router_address(self) -> str:
        assert self.router is not None
        return self.router.address

    @property
    def http_address(self) -> str | None:
        """HOST:PORT of the router's OpenAI-compatible API, or None when it is off."""
        assert self.router is not None
        value = self.router.info.get("http", "-")
        return None if value == "-" else value

    @property
    def prefill_nodes(self) -> list[Process]:
        return [p for p in self.processes if p.role == "prefill"]

    @property
    def decode_nodes(self) -> list[Process]:
        return [p for p in self.processes if p.role in ("decode", "colocated")]

    @property
    def tls(self) -> Any:
        """The cluster's ``serving.tls.TLSFolder`` (secure clusters), else None."""
        from serving.tls import TLSFolder

        return TLSFolder(self.secrets.tls_dir) if self.secrets is not None else None

    def client(self) -> Any:
        """A ``serving.client.GenerationClient`` of the router, with the API key and the CA when the
        cluster is secure."""
        from serving.client import GenerationClient

        tls = self.tls
        return GenerationClient(
            self.router_address,
            api_key=self.secrets.api_key if self.secrets is not None else None,
            credentials=tls.channel_credentials(client_cert=False) if tls is not None else None,
        )

    def _start(self) -> None:
        t = self.topology
        deadline = time.monotonic() + t.startup_timeout_s
        model = self._model_folder()
        roles = (
            ["prefill"] * t.num_prefill + ["decode"] * t.num_decode
            if t.mode == "disaggregated"
            else ["colocated"] * t.num_decode
        )
        if t.secure:
            names = ["kvstore", "router", *(f"{r}-{i}" for r in set(roles) for i in range(roles.count(r)))]
            self.secrets = Secrets.write(self.run_dir / "secrets", names, [t.host], t.cache_details)
        store_tiers = None
        if t.kv_store is not None:
            store_tiers = t.kv_store.replace("{run_dir}", str(self.run_dir))
            if t.redis:
                store_tiers += f",redis://127.0.0.1:{self._start_redis(deadline)}/0"
            store = self._spawn(
                "kvstore",
                "store",
                [
                    *pdkv_command(),
                    "kvstore",
                    "serve",
                    "--kv-store",
                    store_tiers,
                    "--bind",
                    f"tcp://{t.host}:0",
                    "--metrics-address",
                    t.metrics_address("kvstore"),
                    *(("--kv-events", f"tcp://{t.host}:0") if t.policy == "kv-aware" else ()),
                    *t.stop_args(),
                    *t.config_args(),
                ],
            )
            self._wait_ready([store], deadline)
            self.store_endpoint = store.address
            self.store_events = store.info.get("kv_events", "")
        node_store = f"cpu:64MiB,remote:{self.store_endpoint}" if self.store_endpoint else None
        known = available_connectors()
        nodes = []
        counts: dict[str, int] = {}
        for role in roles:
            i = counts[role] = counts.get(role, -1) + 1
            name = f"{role}-{i}"
            spec = t.kv_connector or connector_stack(role, t.mode, node_store, known)
            argv = [
                *pdkv_command(),
                f"serve-{role}",
                "--address",
                f"{t.host}:0",
                "--metrics-address",
                t.metrics_address(role, i),
                "--node-id",
                name,
                "--kv-connector",
                spec,
                "--model",
                model,
                *(("--kv-events", f"tcp://{t.host}:0") if t.policy == "kv-aware" else ()),
                *(("--mtls",) if t.secure else ()),
                *(("--threads", str(t.node_threads)) if t.node_threads is not None else ()),
                *t.lora_args(role),
                *t.model_args(),
                *t.stop_args(),
                "--grace-s",
                f"{t.grace_s:g}",
                *t.config_args(),
                *t.node_args,
            ]
            nodes.append(self._spawn(name, role, argv))
        self._wait_ready(nodes, deadline)
        decode = ",".join(p.address for p in self.decode_nodes)
        prefill = ",".join(p.address for p in self.prefill_nodes)
        keys = self.secrets.folder / "api-keys.toml" if self.secrets else t.api_keys_file
        argv = [
            *pdkv_command(),
            "serve-router",
            "--address",
            f"{t.host}:{t.router_port}",
            "--mode",
            t.mode,
            "--decode",
            decode,
            "--model",
            model,
            "--metrics-address",
            t.metrics_address("router"),
            "--http-address",
            "none" if t.http_port is None else f"{t.host}:{t.http_port}",
            "--policy",
            t.policy,
            *(("--kv-store-events", self.store_events) if self.store_events else ()),
            *(("--cache-details",) if t.cache_details and not t.secure else ()),
            *(("--api-keys-file", str(keys)) if keys is not None else ()),
            *t.lora_args("router"),
            *t.model_args(),
            *t.stop_args(),
            "--grace-s",
            f"{t.grace_s:g}",
            *t.config_args(),
            *t.router_args,
        ]
        if prefill:
            argv += ["--prefill", prefill]
        self.router = self._spawn("router", "router", argv)
        self._wait_ready([self.router], deadline)
        self.wait_serving(self.router, deadline)

    def _model_folder(self) -> str:
        if self.topology.model is not None:
            return str(Path(self.topology.model).expanduser())
        from engine.model.embedded import ensure_default_model

        return str(ensure_default_model())  # fetched once here, not raced by every node

    def _start_redis(self, deadline: float) -> int:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "--redis needs the redis-server binary on PATH (e.g. apt install redis-server)"
            )
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        redis = self._spawn("redis", "redis", argv)
        self._wait_ready([redis], deadline)
        return port

    def _spawn(self, name: str, role: str, argv: list[str]) -> Process:
        proc = Process(name, role, argv, self.run_dir / f"{name}.log")
        self.launch(proc)
        self.processes.append(proc)
        return proc

    def launch(self, proc: Process) -> None:
        """Start ``proc`` from the spawner thread: ``PR_SET_PDEATHSIG`` fires when the *thread* that
        forked a child exits, so a child started from a short-lived thread (a ``pdkv restart`` request)
        would be killed with it.  The spawner lives as long as the cluster."""
        self._spawner.submit(self._popen, proc).result()

    def _popen(self, proc: Process) -> None:
        env = {k: v for k, v in os.environ.items() if k not in self.topology.unset_env}
        env["PYTHONUNBUFFERED"] = "1"
        env[die_with_parent.ENV] = str(os.getpid())  # the child arms PR_SET_PDEATHSIG after exec
        if self.secrets is not None:
            env.update(self.secrets.env(proc.name))
        proc.ready.clear()
        proc.popen = subprocess.Popen(
            die_with_parent.command(proc.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=pump, args=(proc, proc.popen), name=f"log-{proc.name}", daemon=True).start()

    def _wait_ready(self, procs: Sequence[Process], deadline: float) -> None:
        for proc in procs:
            self.wait_started(proc, deadline)
            proc.pin_addresses()

    def wait_started(self, proc: Process, deadline: float) -> None:
        while not proc.ready.wait(0.05):
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited (code {proc.popen.poll() if proc.popen else '?'}) before it "
                    f"was ready; its log ({proc.log_path}):\n{proc.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{proc.name} was not ready within {self.topology.startup_timeout_s:.0f}s; its log "
                    f"({proc.log_path}):\n{proc.log_tail()}"
                )

    def wait_serving(self, proc: Process, deadline: float) -> None:
        try:
            wait_healthy(proc.address, timeout=max(0.1, deadline - time.monotonic()), tls=self.tls)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; router log ({proc.log_path}):\n{proc.log_tail()}") from None

    # -- supervise ----------------------------------------------------------------------------------------

    def supervise(self, now: float | None = None) -> str | None:
        """Restart the children that died, each after its backoff.  Returns why the cluster must stop (a
        child that keeps dying), else None.  Call it periodically (``run_until_signal`` does)."""
        now = time.monotonic() if now is None else now
        policy = self.restart_policy
        with self._lock:
            if self._stopping:
                return None
            for proc in self.processes:
                if proc.alive() or proc.planned:
                    continue
                if proc.restart_at is None:  # newly dead
                    code = proc.popen.poll() if proc.popen is not None else None
                    proc.deaths = [t for t in proc.deaths if now - t < policy.window_s] + [now]
                    if len(proc.deaths) >= policy.max_deaths:
                        return (
                            f"{proc.name} died {len(proc.deaths)} times within {policy.window_s:.0f}s (last "
                            f"exit code {code}); stopping. Its log ({proc.log_path}):\n{proc.log_tail()}"
                        )
                    delay = policy.delay(len(proc.deaths))
                    proc.restart_at = now + delay
                    logger.warning(
                        "%s exited (code %s); restarting it in %.1fs (restart %d). Its log ends:\n%s",
                        proc.name,
                        code,
                        delay,
                        proc.restarts + 1,
                        proc.log_tail(10),
                    )
                elif now >= proc.restart_at:
                    proc.restart_at = None
                    proc.restarts += 1
                    logger.warning("restarting %s: %s", proc.name, " ".join(proc.argv))
                    self.launch(proc)
        return None

    def watch(self, stop: threading.Event, interval_s: float = 0.5) -> str | None:
        """``supervise`` until ``stop`` is set (returns None) or a child keeps dying (returns why)."""
        while not stop.wait(interval_s):
            failure = self.supervise()
            if failure is not None:
                return failure
        return None

    @contextlib.contextmanager
    def planned_restart(self, proc: Process) -> Iterator[None]:
        """Marks ``proc`` as being replaced on purpose (``supervise`` leaves it alone meanwhile); raises
        ``RuntimeError`` while the cluster stops or when another restart of it runs."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the cluster is stopping")
            if proc.planned:
                raise RuntimeError(f"{proc.name} is already being restarted")
            proc.planned = True
        try:
            yield
        finally:
            proc.planned = False

    # -- stop ---------------------------------------------------------------------------------------------

    def kill(self, proc: Process, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one child (fault tests) and reap it."""
        if proc.popen is not None and proc.alive():
            proc.popen.send_signal(sig)
            proc.popen.wait(30)

    def stop(self, *, keep_logs: bool = False) -> None:
        """Router first (no new work), then nodes (in-flight calls get the grace period), then the store
        and Redis.  SIGTERM, then SIGKILL after the grace period.  The run folder pdkv up made goes, but
        with ``keep_logs`` its children's logs."""
        order = {"router": 0, "prefill": 1, "decode": 1, "colocated": 1, "store": 2, "redis": 3}
        with self._lock:
            self._stopping = True  # supervise() restarts nothing from here on
        for rank in sorted(set(order.values())):
            group = [p for p in self.processes if order.get(p.role, 1) == rank and p.alive()]
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    assert p.popen is not None
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                assert p.popen is not None
                try:
                    p.popen.wait(self.topology.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop on SIGTERM; killing it", p.name)
                    p.popen.kill()
                    p.popen.wait(10)
        self._spawner.shutdown(wait=False)
        if self._own_dir and keep_logs:
            for entry in self.run_dir.iterdir():  # secrets, sockets, the store's files: not the logs
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                elif entry.suffix != ".log":
                    entry.unlink(missing_ok=True)
        elif self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def describe(self) -> str:
        rows = [
            f"  {p.name:<12} pid {p.pid:<8} {p.address:<28} {p.info.get('metrics', '')}"
            for p in self.processes
        ]
        return "\n".join(rows)

    def metrics_addresses(self) -> dict[str, str]:
        """Where each child serves ``/metrics`` (HOST:PORT, by child name), as its ready line said."""
        return {p.name: p.info["metrics"] for p in self.processes if p.info.get("metrics", "-") != "-"}
