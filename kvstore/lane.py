"""A lane: one daemon thread that runs one tier's calls of one kind, so the caller can stop waiting.

A tier that hangs (a dead NFS mount, a DNS lookup without a timeout, a Lua script stuck on a busy server)
must not hang the engine.  Its calls run on a lane; the caller waits on the future with its deadline and,
past it, *abandons* the call: the caller returns (a miss), the lane thread finishes the call whenever the
backend lets it, and ``on_late`` disposes of the late result.  Until then the lane is ``stuck``, and new
calls are refused at once instead of queueing behind the hung one.

Lane threads are daemons: a call that never returns does not keep the process alive at exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._abandoned: Future[Any] | None = None
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"lane {self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put((fn, future))
        return future

    def stuck(self) -> bool:
        """True while a call this lane's caller gave up on is still running."""
        abandoned = self._abandoned
        return abandoned is not None and not abandoned.done()

    def abandon(self, future: Future[Any], on_late: Callable[[Any], None] | None = None) -> None:
        """The caller stops waiting for ``future``; ``on_late(result)`` runs when it completes."""
        self._abandoned = future
        if on_late is not None:

            def dispose(done: Future[Any]) -> None:
                if done.exception() is None:
                    on_late(done.result())

            future.add_done_callback(dispose)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread after the calls already queued; wait for it up to ``timeout_s``."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            if not self.stuck():
                thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the waiting caller, which counts and logs it
                future.set_exception(exc)
            else:
                future.set_result(result)
