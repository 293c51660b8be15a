"""Host memory backed by 2 MB pages where the kernel grants them.

Transparent huge pages are opt-in on most hosts (``madvise`` in /sys/kernel/mm/transparent_hugepage/
enabled): a large tensor from torch's allocator lies on 4 KB pages, and a kernel that reads it in pieces
scattered over hundreds of MB -- a decode batch's KV blocks, a step's ~120 weight matrices -- takes a TLB
miss every 4 KB.  ``huge_page_buffer`` asks for 2 MB pages before the first touch (the advice binds only
pages faulted in after it), then touches every page, as ``torch.zeros`` would, so that no first write in
a timed step pays for a fault and the zeroing of 2 MB.  With the kernel's usual defrag setting
(``madvise``) an advised fault compacts memory when no free 2 MB page is at hand: on a long-running,
fragmented host a node with a cache of many GB may take seconds longer to start; it gets 4 KB pages
where compaction finds none.
"""

from __future__ import annotations

import contextlib
import mmap

import torch


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of ``nbytes`` on its own anonymous mapping, advised ``MADV_HUGEPAGE``
    (where the platform has it) before any page is touched.  The tensor keeps the mapping alive."""
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # EINVAL from a kernel built without transparent huge pages: 4 KB pages then
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
    tensor.zero_()  # fault every page in now (already zero: the write is what allocates them)
    return tensor
