"""Running one check: under a watchdog that fails a connector call blocking past its deadline (and a
whole check past ``CHECK_DEADLINE_S``), naming the call and where it waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from connectors.testing.items import (
    BOUNDED_CALLS,
    ConformanceError,
)
from connectors.testing.spy import CLOCK
from connectors.testing.target import ConformanceTarget

CHECK_DEADLINE_S = 300.0


def run_check(
    check: Callable[[ConformanceTarget, Path], None], target: ConformanceTarget, shared: Path
) -> None:
    """Run ``check`` under the kit's watchdog: a connector call that blocks past the target's
    ``call_deadline_s`` fails the check with the call's name (the blocked thread is abandoned: the run
    goes on).  The suite runs every check this way."""
    box: dict[str, BaseException] = {}

    def work() -> None:
        try:
            check(target, shared)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, name=f"pdkv-conformance-{check.__name__}", daemon=True)
    run = CLOCK.new_run()
    started = last = time.monotonic()
    thread.start()
    while thread.is_alive():
        thread.join(0.02)
        now = time.monotonic()
        if now - last > 1.0:  # the watcher was not scheduled for a while: nor was the call
            CLOCK.pardon(now - last - 0.02)
        last = now
        running = CLOCK.longest(run)
        if running is not None and running[1] > target.call_deadline_s:
            name, seconds, blocked = running
            where = _stack_of(blocked)
            CLOCK.forget(blocked)
            raise ConformanceError(
                BOUNDED_CALLS,
                f"{name} has not returned after {seconds:.1f}s (call_deadline_s is "
                f"{target.call_deadline_s:g}s): connector calls run inside the engine's step, so one that "
                "waits on its backend stalls every request; bound it (a timeout) or do the work on a "
                f"thread of your own and report it later.  Where it waits:\n{where}",
            )
        if time.monotonic() - started > CHECK_DEADLINE_S:
            raise ConformanceError(BOUNDED_CALLS, f"the check did not end within {CHECK_DEADLINE_S:g}s")
    if "error" in box:
        raise box["error"]


def _stack_of(thread_id: int) -> str:
    """The innermost frames of a thread, for the message of a call that blocks."""
    import sys
    import traceback

    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "  (the thread has ended)"
    return "".join(traceback.format_stack(frame)[-6:])


def run_with_deadline(work: Callable[[], None], deadline_s: float, item: str, what: str) -> None:
    # A daemon thread: if a call hangs on the backend, the check still ends (the thread is abandoned).
    thread = threading.Thread(target=work, name="pdkv-conformance-unreachable", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise ConformanceError(
            item,
            f"with the backend unreachable, {what} did not finish within {deadline_s:g}s: some call waited "
            "on the backend without a bound (a backend that does not answer in time counts as zero hits)",
        )
