"""A child of ``pdkv up`` dies with the launcher, however the launcher dies (Linux).

The launcher (pdkv/launcher/cluster.py) starts each child with ``PDKV_DIE_WITH_PARENT`` set to its own
pid; the child, first thing in ``python -m pdkv``, asks the kernel for SIGKILL when its parent -- the
launcher's spawner thread -- exits (``PR_SET_PDEATHSIG``), and exits at once if the launcher is already
gone (its parent is another process then).  The child arms this itself rather than through
``subprocess``'s ``preexec_fn``: that runs Python between fork and exec in a process with threads, where
gRPC's fork handlers ran too and a restarted node aborted before exec (abseil's mutex check) in a
rolling-restart drill; without ``preexec_fn`` the launcher's ``Popen`` forks without running them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

ENV = "PDKV_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def arm_from_env() -> None:
    """Where ``PDKV_DIE_WITH_PARENT`` names this process's parent: die with it.  The variable is removed,
    so processes this one starts do not inherit the rule."""
    parent = os.environ.pop(ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != parent:  # the launcher died before the rule was armed
        os._exit(1)
