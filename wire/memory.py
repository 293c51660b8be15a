"""Keep freed CPU memory in the process instead of handing it back to the kernel after every op.

On CPU, each PyTorch op allocates its output with malloc.  glibc serves blocks above
``M_MMAP_THRESHOLD`` (128 KiB by default, adapting upwards only slowly) with a fresh ``mmap`` and
returns them with ``munmap`` on free, so every large activation of every layer of every step is
page-faulted in anew: measured on the bench model, that doubled the time of a 1k-token prefill.
``tune_malloc_for_tensors`` raises the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the trim
threshold well above it, so activations are recycled from the heap.  It is process-wide, which is why
the engine calls it only for a CPU device, and it is a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024**2  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1024**3
TOP_PAD = 64 * 1024**2

_done = False


def tune_malloc_for_tensors() -> bool:
    """Apply the settings once per process; True if glibc accepted them."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt; leaving the allocator as it is")
        return False
    ok = all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    _done = ok
    return ok
