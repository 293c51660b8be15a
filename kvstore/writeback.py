"""The write-down queue: bounded, never blocks the caller, runs jobs on one background thread.

``offer(job)`` enqueues or, when the queue is full, refuses at once (the caller counts the drop): a slow
lower tier costs lower-tier hit rate, never engine latency.  Jobs are plain callables that must not raise;
one that does is logged and the thread carries on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class WriteQueue:
    def __init__(self, depth: int, name: str = "kvstore-writer") -> None:
        self.depth = depth
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._name = name
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped_jobs = 0

    def offer(self, job: Job) -> bool:
        """Enqueue ``job``; ``False`` (and nothing queued) when the queue is full."""
        self._ensure_thread()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped_jobs += 1
            return False
        return True

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job has run; ``False`` if that took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._queue.all_tasks_done.wait(left):
                    return self._queue.unfinished_tasks == 0
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Run what is queued (up to ``timeout_s``), then stop the thread."""
        drained = self.drain(timeout_s)
        if self._thread is not None:
            # When the queue is still full the thread is left to finish: it is a daemon.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            if drained:
                self._thread.join(timeout_s)
        return drained

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception:
                logger.exception("kvstore write-down job failed")
            finally:
                self._queue.task_done()
