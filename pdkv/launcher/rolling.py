"""Planned restarts of a running ``Cluster`` (``pdkv restart``), and ``pdkv up``'s main loop.

``RollingRestarts.restart(NAME)`` replaces one child gracefully: SIGTERM (it drains:
``serving/drain.py``), wait for its exit, start it again on the same addresses, wait until it is ready --
and, for a node, until the router routes to it again, so that a rolling restart never leaves a pool
empty.  ``run_until_signal`` serves these over the control socket (``pdkv/launcher/control.py``) while
it supervises the cluster.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from pdkv.launcher.cluster import Cluster
from pdkv.launcher.control import ControlServer
from pdkv.launcher.process import Process
from serving.health import wait_healthy

# The order ``restart("all")`` replaces children in (the router is listed, never taken by "all").
ORDER = {"prefill": 0, "decode": 1, "colocated": 1, "store": 2, "router": 3}


class RollingRestarts:
    """What the control socket drives: ``restartable`` and ``restart`` over one cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def restartable(self) -> list[str]:
        """The children ``restart`` takes, in the order ``restart("all")`` replaces them."""
        procs = sorted((p for p in self.cluster.processes if p.role in ORDER), key=lambda p: ORDER[p.role])
        return [p.name for p in procs]

    def restart(self, name: str, out: Callable[[str], None] = print) -> None:
        """Replace child ``name`` gracefully (see the module).  ``all``: every node, then the store, one at
        a time (not the router: its clients would see refusals).  Raises ``ValueError`` for an unknown
        name, ``RuntimeError`` when the child does not come back."""
        if name == "all":
            for each in self.restartable():
                if each != "router":
                    self.restart(each, out)
            return
        procs = {p.name: p for p in self.cluster.processes if p.role != "redis"}
        proc = procs.get(name)
        if proc is None:
            raise ValueError(f"no child named {name!r}; choose one of {', '.join(self.restartable())} or all")
        with self.cluster.planned_restart(proc):
            self._replace(proc, out)

    def _replace(self, proc: Process, out: Callable[[str], None]) -> None:
        cluster, t = self.cluster, self.cluster.topology
        start = time.monotonic()
        if proc.alive():
            assert proc.popen is not None
            out(f"{proc.name}: SIGTERM (drains for at most {t.drain_timeout_s:g}s)")
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(t.stop_timeout_s)
            except subprocess.TimeoutExpired:
                out(f"{proc.name}: did not exit within {t.stop_timeout_s:g}s; killing it")
                proc.popen.kill()
                proc.popen.wait(10)
        code = proc.popen.poll() if proc.popen else "?"
        out(f"{proc.name}: exited (code {code}) after {time.monotonic() - start:.1f}s")
        proc.restart_at = None
        proc.restarts += 1
        cluster.launch(proc)
        deadline = time.monotonic() + t.startup_timeout_s
        cluster.wait_started(proc, deadline)
        if proc.role in ("prefill", "decode", "colocated"):
            self._wait_routed(proc, deadline)
        elif proc.role == "router":
            cluster.wait_serving(proc, deadline)
        out(f"{proc.name}: back on {proc.address} after {time.monotonic() - start:.1f}s")

    def _wait_routed(self, proc: Process, deadline: float) -> None:
        """Until the router's health rounds find ``proc`` up again (its /metrics says so; without metrics,
        two rounds of the router's default interval after the node itself says SERVING)."""
        cluster = self.cluster
        wait_healthy(proc.address, timeout=max(0.1, deadline - time.monotonic()), tls=cluster.tls)
        metrics = cluster.router.info.get("metrics", "-") if cluster.router is not None else "-"
        if metrics in ("", "-"):
            time.sleep(2.0)
            return
        family, label = f"pdkv_router_{proc.role}_node_up{{", f'node="{proc.address}"'
        while time.monotonic() < deadline:
            url = f"http://{metrics}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2.0) as response:
                for line in response.read().decode().splitlines():
                    up = line.rsplit(" ", 1)[-1] in ("1.0", "1")
                    if line.startswith(family) and label in line and up:
                        return
            time.sleep(0.1)
        raise RuntimeError(f"the router did not route to {proc.name} ({proc.address}) again in time")


def run_until_signal(cluster: Cluster, on_ready: Callable[[Cluster], None]) -> int:
    """Call ``on_ready``, then supervise the children (a dead one is restarted) until SIGINT/SIGTERM, or
    until a child keeps dying (rc 1); stop everything.  Serves ``pdkv restart`` on the control socket."""
    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    control: ControlServer | None = None
    try:
        control = ControlServer(RollingRestarts(cluster)).start()
        on_ready(cluster)
        print(
            f"pdkv up: control socket {control.path} (pdkv restart NAME replaces one child gracefully)",
            file=sys.stderr,
            flush=True,
        )
        failure = cluster.watch(stop)
        if failure is not None:
            print(f"pdkv up: {failure}", file=sys.stderr)
            return 1
        return 0
    finally:
        if control is not None:
            control.close()
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
