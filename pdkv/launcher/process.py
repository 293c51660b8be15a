"""One child process of ``pdkv up``: its command, its log, and the ready line that says where it listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import cli as kvstore_cli
from node import config as node_config
from router import config as router_config

NODE_READY = node_config.READY_PREFIX
ROUTER_READY = router_config.READY_PREFIX
STORE_READY = kvstore_cli.READY_PREFIX
REDIS_READY = "Ready to accept connections"


# Where a restarted child listens: flag -> the ready-line field that says where its first run listened.
PINNED_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "router": (("--address", "address"), ("--http-address", "http"), ("--metrics-address", "metrics")),
    "prefill": (("--address", "address"), ("--metrics-address", "metrics")),
    "decode": (("--address", "address"), ("--metrics-address", "metrics")),
    "colocated": (("--address", "address"), ("--metrics-address", "metrics")),
    "store": (
        ("--bind", "address"),
        ("--metrics-address", "metrics"),
        ("--kv-events", "kv_events:0"),
        ("--kv-events-replay", "kv_events:1"),
    ),
}


@dataclass
class Process:
    """One child: its name, role, command and what its ready line said."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[str] | None = None
    ready_line: str = ""
    info: dict[str, str] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the policy's window
    restart_at: float | None = None  # set while it is dead and waits for its restart
    planned: bool = False  # a planned restart (Cluster.restart) owns it: supervise() leaves it alone

    @property
    def address(self) -> str:
        """Where it serves (HOST:PORT, or a ZeroMQ endpoint for the store)."""
        return self.info.get("address", "")

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else -1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def pin_addresses(self) -> None:
        """Rewrite the command so that a restart listens where this run does (its ready line says)."""
        for flag, key in PINNED_FLAGS.get(self.role, ()):
            name, _, index = key.partition(":")
            value = self.info.get(name, "-")
            if index:
                parts = value.split(",")
                value = parts[int(index)] if len(parts) > int(index) else "-"
            if value in ("", "-"):
                continue
            if flag in self.argv:
                self.argv[self.argv.index(flag) + 1] = value
            elif index == "1" and "--kv-events" in self.argv:  # a flag the first run did not need
                self.argv += [flag, value]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pdkv_command() -> list[str]:
    return [sys.executable, "-m", "pdkv"]


def pump(proc: Process, popen: subprocess.Popen[str]) -> None:
    """Copy a child's output to its log (a restart appends to it); parse its ready line."""
    assert popen.stdout is not None
    mode = os.O_APPEND if proc.restarts else os.O_TRUNC
    fd = os.open(proc.log_path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    with open(fd, "w", encoding="utf-8") as log:
        if proc.restarts:
            log.write(f"--- pdkv up: restart {proc.restarts} ---\n")
        for line in popen.stdout:
            log.write(line)
            log.flush()
            if not proc.ready.is_set():
                info = parse_ready(line)
                if info is not None:
                    proc.ready_line = line.strip()
                    proc.info = info
                    proc.ready.set()


def parse_ready(line: str) -> dict[str, str] | None:
    """``pdkv node: serving on HOST:PORT k=v ...`` (and the router's, the store's, redis') -> fields."""
    for prefix in (NODE_READY, ROUTER_READY, STORE_READY):
        if line.startswith(prefix):
            address, *rest = line[len(prefix) :].split()
            info = {"address": address}
            for item in rest:
                key, _, value = item.partition("=")
                info[key] = value
            return info
    if REDIS_READY in line:
        return {"address": ""}
    return None
