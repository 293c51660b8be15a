"""What the pipeline and its front ends exchange: the events a request yields to its client (``Delta``,
then ``Done`` with the ``Usage``), what the pipeline needs from the client's call (``CallScope``: a gRPC
context is one, ``router.http_scope.HttpCallScope`` the other), and the hooks run when that call ends
early (``Cancellation``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling_params import TopLogprobs
from telemetry.latency import RequestLatency

logger = logging.getLogger(__name__)


class CallScope(Protocol):
    """What the pipeline needs from the client's call (``grpc.ServicerContext`` has it)."""

    def time_remaining(self) -> float | None: ...
    def add_callback(self, callback: Callable[[], None]) -> bool: ...
    def is_active(self) -> bool: ...


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    # One per token when the client asked for top_logprobs: the most likely tokens there.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    index: int = 0  # the choice (of the request's n) this belongs to
    # In the first delta, when the request scores its prompt (SamplingParams.prompt_logprobs): one per
    # prompt position from the second, and their alternatives (empty when it asked for none).  Such a
    # delta may have no tokens (max_tokens 0).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    local_prefix: int = 0
    store: int = 0
    remote_prefill: int = 0
    computed_prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0


@dataclass(frozen=True)
class Done:
    finish_reason: str | None
    stop_reason: int | str | None
    usage: Usage  # this choice's: its completion tokens, the request's prompt
    index: int = 0  # the choice (of the request's n) this ends


def total_usage(usages: list[Usage]) -> Usage:
    """The request's usage over its choices: the prompt once (as the first choice's node saw it: the one
    that computed it), completion tokens summed, the first token at the earliest, the end at the latest."""
    first = usages[0]
    return dataclasses.replace(
        first,
        completion_tokens=sum(u.completion_tokens for u in usages),
        time_to_first_token_s=min(u.time_to_first_token_s for u in usages),
        total_time_s=max(u.total_time_s for u in usages),
    )


Event = Delta | Done


class Cancellation:
    """Hooks run once if the client's call ends before the pipeline finished (cancel or deadline)."""

    def __init__(self, scope: CallScope) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self._done = False
        self.cancelled = False
        if not scope.add_callback(self._fire):  # the call already ended: it was cancelled
            self.cancelled = True

    def on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        hook()  # already cancelled: run it now

    def off(self, hook: Callable[[], None]) -> None:
        """``hook`` is no longer wanted (its call ended): a request that tries many nodes keeps no list."""
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)

    def finish(self) -> None:
        with self._lock:
            self._done = True

    def _fire(self) -> None:
        with self._lock:
            if self._done or self.cancelled:
                return
            self.cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("cancel hook failed")


def observed(latency: RequestLatency, n: int, events: Iterator[Event]) -> Iterator[Event]:
    """``events`` as they are, told to the request's latency clock on the way (the client's view): its
    first token, each choice's gaps, and -- once every one of its ``n`` choices is done -- its end, its
    prompt once and its choices' tokens summed, as the client is billed (``total_usage``)."""
    done, prompt, generated = 0, 0, 0
    for event in events:
        now = time.perf_counter()
        if isinstance(event, Done):
            done += 1
            prompt = prompt or event.usage.prompt_tokens
            generated += event.usage.completion_tokens
            if done == n:
                latency.finish(now, prompt_tokens=prompt, generation_tokens=generated)
        elif event.token_ids:
            latency.tokens(len(event.token_ids), now, event.index)
        yield event
