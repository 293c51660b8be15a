"""``EngineDriver``: one thread owns an ``LLMEngine``; server threads submit, abort and read streams.

The engine is not thread-safe, so exactly one thread touches it.  Everything else talks to that thread
through a command queue, and reads each request's outputs from the request's own ``RequestStream``::

    server thread                         driver thread (owns the engine)
    submit(EngineRequest) ── command ──▶  engine.add_request   (a ValueError travels back to submit)
    stream.get(timeout)   ◀── outputs ──  engine.step() -> RequestOutput -> the stream of its request
    abort(request_id)     ── command ──▶  engine.abort_request -> final output "abort" closes the stream
    call(fn)              ── command ──▶  fn(engine) on the driver thread (stats, integrity checks)

The loop never spins.  With requests running it steps back to back; with only connector work pending it
steps, then waits for a command for up to ``poll_interval_s`` (requests waiting: an async KV load or
lookup about to land, which a request's first token waits on) or ``held_poll_interval_s`` (only blocks
held for a remote reader, whose release is not urgent), so those hand-offs still advance; with nothing
pending it blocks until a command arrives.

Load shedding happens at ``submit``: a driver admits at most ``max_num_requests`` unfinished requests
and raises ``EngineOverloaded`` beyond that (the gRPC edge maps it to RESOURCE_EXHAUSTED).
This module is gRPC-free: the node servers (``serving/``) wrap it.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.connector.params import KVTransferParams
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


# How an EngineOverloaded's message begins: a caller that sees it (the router, over gRPC's
# RESOURCE_EXHAUSTED) knows the node is well, only full, and waits for room (serving/errors.py node_full).
NODE_FULL = "the node is full:"
# How an EngineDraining's message begins: the router waits for the node's return where it was the last of
# its kind (a planned restart), rather than failing requests.
NODE_DRAINING = "the node is draining"


class EngineOverloaded(RuntimeError):
    """The driver already holds ``max_num_requests`` unfinished requests."""


class EngineStopped(RuntimeError):
    """The driver is stopping (or its engine failed) and takes no more requests."""


class EngineDraining(EngineStopped):
    """The driver is draining: it finishes what it admitted and takes nothing new (``drain``)."""


@dataclass(frozen=True)
class EngineRequest:
    """One request for ``EngineDriver.submit``: the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt: str | Sequence[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    prior_output_token_ids: tuple[int, ...] = ()
    # The LoRA adapter by name, and the digest the caller expects it to have (None: any).
    adapter: str | None = None
    adapter_digest: bytes | None = None


class RequestStream:
    """The outputs of one request, in order, ending with one whose ``finished`` is True.

    Filled by the driver thread, read by one consumer thread.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        """The final output has been delivered (it may not have been read yet)."""
        return self._finished.is_set()

    def put(self, output: RequestOutput) -> None:
        # Finished before the output is visible: a consumer that read the final output (and ended its
        # RPC) must never see the request as unfinished, or its RPC's done-callback aborts a request
        # that finished -- which reclaims a p2p lease the decode node is about to pull.
        if output.finished:
            self._finished.set()
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, or None if none arrived within ``timeout`` seconds (None: wait forever)."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


@dataclass(frozen=True)
class _Submit:
    request: EngineRequest
    future: Future[RequestStream]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


_Command = _Submit | _Abort | _Call


class EngineDriver:
    """Runs ``engine``'s step loop on a thread of its own; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_num_requests: int = 256,
        poll_interval_s: float = 0.002,
        held_poll_interval_s: float = 0.05,
        name: str = "engine-driver",
        after_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        """``after_step`` runs on the driver thread after every step (e.g. publishing the step's KV
        events); it must not block."""
        if max_num_requests <= 0:
            raise ValueError(f"max_num_requests must be positive, got {max_num_requests}")
        if not 0 < poll_interval_s <= held_poll_interval_s:
            raise ValueError(
                f"poll intervals must satisfy 0 < poll_interval_s ({poll_interval_s}) <= "
                f"held_poll_interval_s ({held_poll_interval_s})"
            )
        self.engine = engine
        self.max_num_requests = max_num_requests
        self.poll_interval_s = poll_interval_s
        self.held_poll_interval_s = held_poll_interval_s
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # driver thread only
        self._lock = threading.Lock()
        self._num_admitted = 0  # unfinished requests submitted (under _lock)
        self._stopping = False
        self._draining = False
        self._error: str | None = None
        self._after_step = after_step
        self._step_started: float | None = None  # monotonic time the running step began; None between
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> EngineDriver:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The loop runs and takes requests (False once stopping or after the engine failed)."""
        return self._thread.is_alive() and not self._stopping and self._error is None

    @property
    def error(self) -> str | None:
        """Why the engine loop died, if it did."""
        return self._error

    def step_running_s(self) -> float:
        """How long the step now running has run (0 between steps): a step that never returns -- a
        connector call blocked for good -- shows here while nothing else moves."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def where(self) -> str:
        """The driver thread's innermost frames, as a traceback prints them (for a log line)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame, limit=6)) if frame is not None else "(not running)"

    @property
    def num_requests(self) -> int:
        """Unfinished requests submitted through this driver."""
        with self._lock:
            return self._num_admitted

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Take no new requests from now on (``submit`` raises ``EngineDraining``, which the gRPC edge
        answers UNAVAILABLE: the router sends the request to another node); the admitted ones run to
        their end, and blocks held for a remote reader stay until it pulls or releases them."""
        with self._lock:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort the unfinished ones (their streams end with "abort"), join the loop,
        and shut the engine's connectors down."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine driver did not stop within %.1fs", timeout)
            return
        self.engine.shutdown()

    # -- commands (any thread) ----------------------------------------------------------------------------

    def submit(self, request: EngineRequest, timeout: float | None = None) -> RequestStream:
        """Queue ``request``; returns its stream once the engine accepted it.

        Raises ValueError (bad input, naming the field), EngineOverloaded, EngineStopped, or TimeoutError
        if the engine thread did not answer within ``timeout`` seconds.
        """
        structured = request.sampling_params.structured
        if structured is not None:  # compiled here, on the caller's thread: the engine thread finds it cached
            self.engine.grammars.compile(structured)  # GrammarError (a ValueError) names what is wrong
        with self._lock:
            self._check_accepting()
            if self._num_admitted >= self.max_num_requests:
                raise EngineOverloaded(
                    f"{NODE_FULL} it already runs {self._num_admitted} requests (max_num_requests "
                    f"{self.max_num_requests}); retry later or send it to another node"
                )
            self._num_admitted += 1
        future: Future[RequestStream] = Future()
        self._commands.put(_Submit(request, future))
        try:
            return future.result(timeout)
        except TimeoutError:
            if not future.cancel():
                self.abort(request.request_id)  # admitted after all, but nobody reads it
            raise

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in any state (also blocks held for a remote reader).  Never blocks."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 5.0) -> T:
        """Run ``fn(engine)`` on the driver thread and return its result (or raise its exception)."""
        with self._lock:
            self._check_accepting(calls=True)  # a draining engine still answers (stats, integrity)
        future: Future[T] = Future()
        self._commands.put(_Call(fn, future))
        return future.result(timeout)

    def _check_accepting(self, *, calls: bool = False) -> None:
        if self._error is not None:
            raise EngineStopped(f"the engine failed: {self._error}")
        if self._stopping:
            raise EngineStopped("the node is shutting down")
        if self._draining and not calls:
            raise EngineDraining(f"{NODE_DRAINING} (a planned stop): send the request to another node")

    # -- the loop (driver thread) -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            logger.exception("engine loop failed; failing every request it held")
            self._error = repr(exc)
        finally:
            self._abort_all("error" if self._error else "abort")
            self._drain_after_stop()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            if engine.has_unfinished_requests() and self._has_runnable_work():
                command = self._next_command(block=False)
            elif engine.has_pending_work():
                command = self._next_command(timeout=self._pending_poll_s())
            else:
                command = self._next_command(block=True)
            while command is not _NONE:
                if command is None:
                    return
                self._execute(command)
                command = self._next_command(block=False)
            if engine.has_pending_work():
                self._step_started = time.monotonic()
                try:
                    outputs = engine.step()
                finally:
                    self._step_started = None
                self._route(outputs)
                if self._after_step is not None:
                    self._after_step(engine)

    def _has_runnable_work(self) -> bool:
        """Requests that computed last step.  Waiting ones were offered a place then: if they are still
        waiting (a connector lookup pending, no free blocks), stepping at once would only spin."""
        return bool(self.engine.scheduler.running)

    def _pending_poll_s(self) -> float:
        scheduler = self.engine.scheduler
        if scheduler.has_unfinished_requests():  # waiting or loading: a first token waits on it
            return self.poll_interval_s
        return self.held_poll_interval_s

    def _next_command(self, *, block: bool = True, timeout: float | None = None) -> Any:
        try:
            if timeout is not None:
                return self._commands.get(timeout=timeout)
            return self._commands.get(block=block)
        except queue.Empty:
            return _NONE

    def _execute(self, command: _Command) -> None:
        if isinstance(command, _Submit):
            self._admit(command)
        elif isinstance(command, _Abort):
            out = self.engine.abort_request(command.request_id)
            if out is not None:
                self._route([out])
        elif command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:
                command.future.set_exception(exc)

    def _admit(self, command: _Submit) -> None:
        """Add the request to the engine; the admission count drops again if it is not added."""
        if not command.future.set_running_or_notify_cancel():
            self._release_slot()
            return
        r = command.request
        try:
            request = self.engine.add_request(
                r.request_id,
                r.prompt,
                r.sampling_params,
                cache_salt=r.cache_salt,
                kv_transfer_params=r.kv_transfer_params,
                prior_output_token_ids=r.prior_output_token_ids,
                adapter=r.adapter,
                adapter_digest=r.adapter_digest,
            )
        except Exception as exc:
            self._release_slot()
            command.future.set_exception(exc)
            return
        stream = RequestStream(r.request_id, request.num_prompt_tokens)
        self._streams[r.request_id] = stream
        command.future.set_result(stream)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._release_slot()

    def _release_slot(self) -> None:
        with self._lock:
            self._num_admitted -= 1

    def _abort_all(self, reason: str) -> None:
        for rid in list(self._streams):
            try:
                out = self.engine.abort_request(rid)
            except Exception:  # the engine is broken: close the stream ourselves
                logger.exception("aborting %s failed", rid)
                out = None
            if out is None or not out.finished:
                out = RequestOutput(rid, [], "", [], True, finish_reason=reason, error=self._error)
            self._route([out])

    def _drain_after_stop(self) -> None:
        """Answer what is still queued so no caller waits forever on a stopped driver."""
        while True:
            command = self._next_command(block=False)
            if command is _NONE:
                return
            if isinstance(command, _Submit):
                self._release_slot()
            if isinstance(command, _Submit | _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineStopped(self._error or "the node is shutting down"))


class _Sentinel:
    pass


_NONE = _Sentinel()
