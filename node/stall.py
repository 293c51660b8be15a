"""The node's watch on its engine loop: a step that has not returned for ``stall_s`` (a connector call
blocked for good, a deadlocked plugin) makes the node NOT_SERVING -- the router sends new requests
elsewhere and an orchestrator's health probe sees it -- and logs where the loop is stuck, once; should the
step return after all, the node serves again.

The engine cannot be interrupted mid-call (a blocked call holds its thread), so this is what a node can do
about it: say so, loudly, and stop taking work.  Every step of a healthy node returns in well under a
second to a few seconds (one prefill chunk), so the default is far above any real step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.driver import EngineDriver

logger = logging.getLogger(__name__)

# A step running this long is stuck, not slow (the longest real step: one prefill chunk, seconds).
STALL_S = 120.0


class StallWatch:
    def __init__(
        self, driver: EngineDriver, set_serving: Callable[[bool], None], stall_s: float = STALL_S
    ) -> None:
        self.driver = driver
        self.set_serving = set_serving
        self.stall_s = stall_s
        self.stalled = False

    def check(self) -> bool:
        """Look once (the node's supervision loop calls this every half second); True while stalled."""
        running = self.driver.step_running_s()
        if not self.stalled and running > self.stall_s:
            self.stalled = True
            self.set_serving(False)
            logger.error(
                "the engine's step has not returned for %.0fs (stall limit %gs): NOT_SERVING until it "
                "does. The engine thread is at:\n%s",
                running,
                self.stall_s,
                self.driver.where(),
            )
        elif self.stalled and running <= self.stall_s:
            self.stalled = False
            self.set_serving(True)
            logger.warning("the engine's stalled step returned; serving again")
        return self.stalled
