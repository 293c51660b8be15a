"""``pdkv up``'s control socket: how ``pdkv restart NAME`` asks a running launcher to replace a child.

    ${XDG_RUNTIME_DIR:-/tmp}/pdkv-UID/up-PID.sock      a Unix socket; its folder is 0700 and ours

One request per connection, one line: ``restart NAME`` (a child's name, or ``all``) or ``list``.  The
answer streams progress lines; the last one is ``ok`` or ``error: WHY``.  Restarts run one at a time
(a second request waits for the first), so a rolling restart never takes two nodes down at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Restartable(Protocol):
    """What the control socket needs of a cluster (``pdkv.launcher.cluster.Cluster``)."""

    def restartable(self) -> list[str]: ...
    def restart(self, name: str, out: Callable[[str], None]) -> None: ...


OK = "ok"
ERROR = "error: "


def control_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"pdkv-{os.getuid()}"


def socket_path(pid: int | None = None) -> Path:
    return control_dir() / f"up-{os.getpid() if pid is None else pid}.sock"


def running_launchers() -> list[Path]:
    """The control sockets of this user's running ``pdkv up`` launchers (stale ones are skipped)."""
    folder = control_dir()
    if not _private(folder):
        return []
    found = []
    for path in sorted(folder.glob("up-*.sock")):
        pid = path.stem.removeprefix("up-")
        if pid.isdigit() and _alive(int(pid)):
            found.append(path)
    return found


class ControlServer:
    """Serves the control socket of ``cluster`` on a daemon thread until ``close``."""

    def __init__(self, cluster: Restartable, path: Path | None = None) -> None:
        self.cluster = cluster
        self.path = path or socket_path()
        self._serial = threading.Lock()
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder):
            raise PermissionError(f"{folder} must be a folder of ours that only we can open (mode 0700)")
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a launcher with our pid that died without cleaning up
        control = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(4096).decode("utf-8", "replace").strip()

                def out(text: str) -> None:
                    with contextlib.suppress(OSError):
                        self.wfile.write(f"{text}\n".encode())
                        self.wfile.flush()

                control.serve(line, out)

        self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        self._server.daemon_threads = True
        self.path.chmod(0o600)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pdkv-up-control", daemon=True
        )

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def serve(self, line: str, out: Callable[[str], None]) -> None:
        command, _, arg = line.partition(" ")
        try:
            if command == "list":
                for name in self.cluster.restartable():
                    out(name)
            elif command == "restart" and arg.strip():
                with self._serial:
                    self.cluster.restart(arg.strip(), out)
            else:
                raise ValueError(f"unknown request {line!r}: say 'restart NAME' or 'list'")
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
            out(f"{ERROR}{exc}")
            return
        out(OK)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def send(path: Path, line: str, out: Callable[[str], None], timeout_s: float = 900.0) -> bool:
    """Send one request to the launcher at ``path``; relay its progress lines; True when it said ok."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(f"{line}\n".encode())
        with sock.makefile("r", encoding="utf-8") as answer:
            last = ""
            for row in answer:
                last = row.rstrip("\n")
                if last != OK:
                    out(last)
    return last == OK


def _private(folder: Path) -> bool:
    try:
        st = folder.stat()
    except FileNotFoundError:
        return False
    return st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
