"""Every child of ``pdkv up`` dies with the launcher (pdkv/die_with_parent.py): armed after exec, by
the wrapper the launcher starts each child through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdkv.die_with_parent import ENV, command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# a program that knows nothing of the rule (as redis-server): its pid and what it inherited of the variable
CHILD = "import os, time\nprint(os.getpid(), os.environ.get('PDKV_DIE_WITH_PARENT', '-'), flush=True)\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its new parent) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_child_dies_when_its_launcher_is_killed() -> None:
    # a middle process plays the launcher: it starts the child with the variable set to its own pid
    argv = command([sys.executable, "-c", CHILD + "time.sleep(120)\n"])
    middle = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, {ENV}=str(os.getpid()))\n"
        f"c = subprocess.Popen({argv!r}, env=env, stdout=subprocess.PIPE, text=True)\n"
        "print(c.pid, c.stdout.readline().strip(), flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        popen_pid, pid_text, inherited = launcher.stdout.readline().split()
        child = int(pid_text)
        assert child == int(popen_pid), "the wrapper execs the program in its own place"
        assert inherited == "-", "the variable is gone once armed: the program and its children lack it"
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)  # no handler runs: only the kernel can take the child down
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its launcher"
    finally:
        launcher.kill()


def test_a_child_whose_launcher_is_already_gone_exits_at_once() -> None:
    # the variable names a process that is not the child's parent: the launcher died before arming
    env = dict(os.environ, **{ENV: str(os.getpid() + 1_000_000)})
    argv = command([sys.executable, "-c", CHILD])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stdout == "", "the program never ran"


def test_without_the_variable_the_program_just_runs() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run(command([sys.executable, "-c", CHILD]), env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split()[1] == "-"
