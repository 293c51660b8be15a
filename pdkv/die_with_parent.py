"""A child of ``pdkv up`` dies with the launcher, however the launcher dies (Linux).

The launcher (pdkv/launcher/cluster.py) starts every child -- nodes, store, router, redis-server alike --
as ``python -m pdkv.die_with_parent ARGV...`` with ``PDKV_DIE_WITH_PARENT`` set to its own pid: this
module asks the kernel for SIGKILL when its parent, the launcher's spawner thread, exits
(``PR_SET_PDEATHSIG``, which survives the exec), exits at once if the launcher is already gone (its
parent is another process then), and execs ARGV in its place (same pid).  It is armed here, after exec,
rather than through ``subprocess``'s ``preexec_fn``: that runs Python between fork and exec in a process
with threads, where gRPC's fork handlers ran too and a restarted node aborted before exec (abseil's
mutex check) in a rolling-restart drill; without ``preexec_fn`` the launcher's ``Popen`` forks without
running them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence

ENV = "PDKV_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def command(argv: Sequence[str]) -> list[str]:
    """``argv`` run through this module: armed, then exec'd."""
    return [sys.executable, "-m", "pdkv.die_with_parent", *argv]


def arm_from_env() -> None:
    """Where ``PDKV_DIE_WITH_PARENT`` names this process's parent: die with it.  The variable is removed,
    so the program exec'd next and the processes it starts do not inherit the rule."""
    parent = os.environ.pop(ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != parent:  # the launcher died before the rule was armed
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m pdkv.die_with_parent PROGRAM [ARGS...]")
    arm_from_env()
    os.execvp(sys.argv[1], sys.argv[1:])
