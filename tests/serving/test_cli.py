"""``pdkv up`` as a user runs it: prints where the router listens, serves ``pdkv health`` and
``pdkv generate --server``, and stops every child on SIGTERM (no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from tests.serving.helpers import pdkv_model, wait_until

PDKV = [sys.executable, "-m", "pdkv"]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def printed_metrics(lines: list[str]) -> dict[str, str]:
    """``pdkv up: metrics of NAME on URL`` lines -> {NAME: URL}."""
    return {l.split()[4]: l.split()[6] for l in list(lines) if l.startswith("pdkv up: metrics of ")}


def test_pdkv_up_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [
            *PDKV,
            "up",
            "--router-address",
            "127.0.0.1:0",
            "--kv-store",
            "none",
            "--model",
            pdkv_model(),
            "--node-args",
            "--num-blocks 256 --device cpu",
            "--metrics-ports",
            "any",  # free ports: another cluster may run on this host (the default is the fixed ones)
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        line = wait_until(
            lambda: (
                next((l for l in lines if "router listening on" in l), None)
                or (up.poll() is not None and "exited")
            ),
            timeout=120,
            what="pdkv up to print the router's address",
        )
        assert line != "exited", up.stderr.read() if up.stderr else ""
        address = line.rsplit(" ", 1)[1].strip()
        every = {"router", "prefill-0", "decode-0"}
        metrics = wait_until(
            lambda: (m := printed_metrics(lines)).keys() == every and m,
            timeout=10,
            what="pdkv up to print every metrics address",
        )
        with urllib.request.urlopen(metrics["router"], timeout=10) as response:
            assert 'model_name="' in response.read().decode()
        children = children_of(up.pid)
        assert len(children) == 3  # prefill, decode, router (no store: --kv-store none)

        health = subprocess.run([*PDKV, "health", address], capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING"
        gen = subprocess.run(
            [*PDKV, "generate", "--server", address, "--max-tokens", "5", "Hello"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gen.returncode == 0, gen.stderr
        assert "output_tokens=5" in gen.stderr and "finish_reason=length" in gen.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        wait_until(lambda: not any(alive(pid) for pid in children), timeout=10, what="every child to exit")
        down = subprocess.run(
            [*PDKV, "health", address, "--timeout", "1"], capture_output=True, text=True, timeout=60
        )
        assert down.returncode == 1 and down.stdout.startswith("UNREACHABLE")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
