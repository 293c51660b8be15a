"""The two-phase call behind ``Generate``: prefill on one node, decode on another, one stream out.

    disaggregated:  choose prefill node ──Prefill──▶ first token + kv_transfer_params
                    (fails before answering: mark it down, try the next node)
                    yield the first token ──▶ choose decode node ──Decode(stream)──▶ yield each delta
                    (only nodes of one model pair: router/candidates.py; where no prefill node runs a
                    decode node's model, the request runs as in colocated mode)
    colocated:      choose a node ──Decode(stream, whole request)──▶ yield each delta

A decode (or colocated) node that fails with a retryable status -- before its first message or in the
middle of the stream -- is marked down and the request goes on on another node, up to ``decode_attempts``
nodes in all.  When nothing new reached the client, the same call is sent again (in disaggregated mode
with the prefill node's transfer parameters: it may still hold the prompt's KV).  Otherwise the request is
*resumed*: the new node gets every token the client already has (``resume_output_token_ids``), computes
(or loads from its KV store) their KV and samples on from there; the router drops the part of its text
the client already has.  The output is what one node would have produced: greedy, and seeded sampling too
(the seed counts output positions from the request's first token, wherever it was sampled).

Cancellation: every downstream call registers with the request's ``Cancellation``; when the client's
call ends early (cancel, deadline) it cancels them, and gRPC carries the cancel to the nodes, whose
engines abort the request.  Deadlines: every downstream call gets the client's remaining time.

Once Prefill returned, the prefill node holds the prompt's KV for a decode node (under a lease).  The
decode engine that consumes it ends that hold (it releases the lease after reading it, or unread when it
had every block); the router sends the prefill node an ``Abort`` only when the decode phase failed or the
client left, when no decode engine may ever end it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from engine.metrics import SPECS
from pdkv_proto.pdkv.v1 import node_pb2
from router import candidates
from router.admission import AdmittedRequest
from router.choices import Placement, run_choices
from router.client_stream import ClientStream, Interrupted, Sent, gave_up, node_failed
from router.events import CallScope, Cancellation, Delta, Done, Event, Usage, observed
from router.node_messages import (
    carried_tokens,
    decode_message,
    prefill_message,
    prompt_scores,
    relay_prompt_sources,
    rpc_code_details,
)
from router.nodes import NodeHandle, NodePool
from router.policy import NodeSelector
from router.room import FULL_WAIT_S, RoomWait
from serving import convert
from serving.calls import time_remaining
from serving.errors import ServingError, invalid, node_draining, node_full
from telemetry.latency import REQUEST_LATENCIES, REQUEST_LENGTHS, LatencyTracker
from telemetry.metrics import Histogram

logger = logging.getLogger(__name__)


class Pipeline:
    """Runs client requests over the pools in ``mode`` ("disaggregated" or "colocated");
    ``new_selector(pool)`` makes the node-selection policy of each pool."""

    def __init__(
        self,
        mode: str,
        prefill_pool: NodePool | None,
        decode_pool: NodePool,
        new_selector: Callable[[NodePool], NodeSelector],
        *,
        prefill_attempts: int = 2,
        decode_attempts: int = 2,
        max_inflight: int = 256,
    ) -> None:
        assert mode == "colocated" or prefill_pool is not None, "disaggregated mode needs a prefill pool"
        self.mode = mode
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        # One selector per pool: a round-robin turn taken in one pool must not skip a node in the other.
        self._selectors = {
            id(pool): new_selector(pool) for pool in (prefill_pool, decode_pool) if pool is not None
        }
        self.prefill_attempts = prefill_attempts
        self.decode_attempts = decode_attempts
        self.max_inflight = max_inflight
        self.pairing = candidates.Pairing()

        self.resumed = 0  # requests continued on another decode node after output had reached the client
        self.run_whole = 0  # disaggregated requests run whole on a decode node (router/candidates.py)
        # As the client sees them (engine/metrics.py names; exported as pdkv_router_*).
        names = (*REQUEST_LATENCIES, *REQUEST_LENGTHS)
        self.latency = LatencyTracker({name: Histogram(SPECS[name]) for name in names})
        self._inflight = 0
        self._draining = False
        self._lock = threading.Lock()

    @property
    def inflight(self) -> int:
        """Client calls in flight."""
        return self._inflight

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Admit nothing from now on (UNAVAILABLE: a client retries on another router); the calls in
        flight run to their end (``serving/drain.py``)."""
        with self._lock:
            self._draining = True

    def generate(self, request: AdmittedRequest, scope: CallScope) -> Iterator[Event]:
        """The request's deltas, then one ``Done`` -- per choice, each event carrying its choice's
        ``index`` when ``request.n`` > 1 (``router/choices.py``).  Raises ``ServingError`` with the status
        to return.  ``request`` passed admission (``router/admission.py``: max_tokens_limit and max_n
        included).  Every choice counts against ``max_inflight``: each is a sequence in a batch."""
        self._admit(request.n)
        latency = self.latency.start(time.perf_counter())
        if request.n > 1:
            yield from observed(
                latency, request.n, run_choices(request, scope, self._run_choice, self._release)
            )
            return
        try:
            yield from observed(latency, 1, self._run(request, scope, Placement()))
        finally:
            self._release()

    def _run_choice(
        self, request: AdmittedRequest, scope: CallScope, placement: Placement
    ) -> Iterator[Event]:
        try:
            yield from self._run(request, scope, placement)
        finally:
            self._release()

    def _run(self, request: AdmittedRequest, scope: CallScope, placement: Placement) -> Iterator[Event]:
        # Nodes see an id of the router's making: the client's id is echoed back to the client only, never
        # used as an engine request id or a lease id (another client could collide with it, or abort it).
        request = dataclasses.replace(request, request_id=f"pdkv-{uuid.uuid4().hex}")
        cancellation = Cancellation(scope)
        run = self._disaggregated if self.mode == "disaggregated" else self._colocated
        yield from run(request, scope, cancellation, time.perf_counter(), placement)
        cancellation.finish()

    def _admit(self, n: int = 1) -> None:
        with self._lock:
            if self._draining:
                raise ServingError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the router is draining (a planned stop): retry on another router",
                )
            if n > self.max_inflight:  # never admissible: a retry would get the same answer
                raise invalid("n", f"{n} choices take {n} slots; this router has {self.max_inflight}")
            if self._inflight + n > self.max_inflight:
                raise ServingError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the router already serves {self._inflight} requests "
                    f"(max_inflight {self.max_inflight}); retry later",
                )
            self._inflight += n

    def _release(self, n: int = 1) -> None:
        with self._lock:
            self._inflight -= n

    # -- disaggregated ------------------------------------------------------------------------------------

    def _disaggregated(
        self,
        request: AdmittedRequest,
        scope: CallScope,
        cancellation: Cancellation,
        start: float,
        placement: Placement,
    ) -> Iterator[Event]:
        assert self.prefill_pool is not None
        plan = self.pairing.plan(self.prefill_pool, self.decode_pool, request)
        try:
            prefill_node, first = self._prefill(
                request, prefill_message(request), scope, cancellation, placement, plan
            )
        except candidates.Unpaired:  # no prefill node (left) runs a decode node's model: run it whole
            with self._lock:
                self.run_whole += 1
            yield from self._colocated(request, scope, cancellation, start, placement)
            return
        # From here the prefill node holds the KV for a decode node: free it if the client goes away.
        cancellation.on_cancel(lambda: prefill_node.abort_async(request.request_id))
        usage = Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=1,
            time_to_first_token_s=time.perf_counter() - start,
        )
        relay_prompt_sources(usage, first.prompt)
        scored, alternatives = prompt_scores(first)
        if not first.HasField("first_token_id"):  # max_tokens 0: the prompt scored, nothing generated
            usage.completion_tokens = 0
            yield Delta([], "", [], [], prompt_logprobs=scored, prompt_top_logprobs=alternatives)
            usage.total_time_s = time.perf_counter() - start
            yield Done(convert.finish_reason(first.finish_reason), None, usage)
            return
        yield Delta(
            [first.first_token_id],
            first.text,
            [first.first_logprob] if first.HasField("first_logprob") else [],
            [convert.top_logprobs(first.first_top_logprobs)] if first.HasField("first_top_logprobs") else [],
            prompt_logprobs=scored,
            prompt_top_logprobs=alternatives,
        )
        if first.finished:
            usage.total_time_s = time.perf_counter() - start
            yield Done(convert.finish_reason(first.finish_reason), convert.stop_reason(first), usage)
            return
        decode_msg = decode_message(request, prefilled=first)
        sent = Sent([first.first_token_id], len(first.text), prefill_node.namespace)
        completed = False
        try:
            yield from self._decode(
                ClientStream(request, scope, cancellation, usage, start, sent, placement, prefilled=True),
                decode_msg,
            )
            completed = True
        finally:
            # A completed decode's engine released the hold (read, or unread when it had every block);
            # only a failure or a client that left may leave it with no owner: then, and only then, Abort.
            if not completed:
                prefill_node.abort_async(request.request_id)

    def _prefill(
        self,
        request: AdmittedRequest,
        msg: node_pb2.PrefillRequest,
        scope: CallScope,
        cancellation: Cancellation,
        placement: Placement,
        plan: candidates.PrefillPlan,
    ) -> tuple[NodeHandle, node_pb2.PrefillResponse]:
        """The prefill node that answered, and its answer; ``Unpaired`` where ``plan`` runs the request
        whole or no healthy prefill node of its models is left."""
        assert self.prefill_pool is not None
        if plan.whole:
            raise candidates.Unpaired("no prefill node runs a decode node's model")
        tried: list[NodeHandle] = []
        errors: list[str] = []
        room = RoomWait(self.prefill_pool.kind, scope, cancellation)
        while len(errors) < self.prefill_attempts:
            node = candidates.choose(
                self._selectors[id(self.prefill_pool)],
                self.prefill_pool,
                request,
                tried,
                errors=errors,
                prefer=placement.prefill_hint(),
                room=room,
                models=plan.models,
                whose="the decode nodes",
            )
            placement.prefill = node
            tried.append(node)
            future = node.prefill.Prefill.future(msg, timeout=time_remaining(scope))
            cancellation.on_cancel(future.cancel)
            try:
                with node.busy(future.cancel, request.adapter):
                    return node, future.result()
            except grpc.FutureCancelledError as exc:
                if cancellation.cancelled or not scope.is_active():
                    raise ServingError(grpc.StatusCode.CANCELLED, "the client cancelled the request") from exc
                errors.append(f"{node.address}: CANCELLED by the router (it stopped answering)")
                continue  # the node stopped answering (NodePool.reroute_unreachable): another one
            except grpc.RpcError as exc:
                code, details = rpc_code_details(exc)
                if node_full(code, details):
                    room.note_full(node)  # well, only busy: tried again once no other node is left
                    continue
                if node_draining(code, details):  # a planned stop: another node, or its return
                    node.mark_down(details)
                    continue
                if not node_failed(code, cancellation) or not scope.is_active():
                    raise ServingError(code, f"prefill node {node.address}: {details}") from exc
                if code == grpc.StatusCode.UNAVAILABLE:
                    node.mark_down(details)
                errors.append(f"{node.address}: {code.name} {details}")
            finally:
                cancellation.off(future.cancel)  # a request that waits for room tries many times
        raise ServingError(
            grpc.StatusCode.UNAVAILABLE,
            f"prefill failed on {len(tried)} node(s) ({'; '.join(errors)}); retry later",
        )

    # -- colocated ----------------------------------------------------------------------------------------

    def _colocated(
        self,
        request: AdmittedRequest,
        scope: CallScope,
        cancellation: Cancellation,
        start: float,
        placement: Placement,
    ) -> Iterator[Event]:
        usage = Usage(prompt_tokens=len(request.prompt_token_ids))
        client = ClientStream(request, scope, cancellation, usage, start, Sent(), placement)
        yield from self._decode(client, decode_message(request))

    # -- shared -------------------------------------------------------------------------------------------

    def _decode(self, client: ClientStream, msg: node_pb2.DecodeRequest) -> Iterator[Event]:
        """Stream ``msg`` from a decode node; when a node fails on the way, go on on another one."""
        request, sent, kind = client.request, client.sent, self.decode_pool.kind
        tried: list[NodeHandle] = []
        errors: list[str] = []
        # one wait for both phases: what the prefill's took is gone from the decode's
        left = FULL_WAIT_S - (time.perf_counter() - client.start)
        room = RoomWait(kind, client.scope, client.cancellation, max(0.0, left))
        while True:
            try:
                node = candidates.choose(
                    self._selectors[id(self.decode_pool)],
                    self.decode_pool,
                    request,
                    tried,
                    errors=errors,
                    prefer=client.placement.decode_hint(),
                    room=room,
                    models=None if sent.model is None else {sent.model},
                    whose=f"the node that made its first {len(sent.token_ids)} token(s)",
                )
                client.placement.decode = node
            except ServingError as exc:
                if not errors and not sent.token_ids:
                    raise
                raise ServingError(
                    exc.code, gave_up(sent, exc.message, exc.code, streamed=request.streamed)
                ) from None
            tried.append(node)
            carried = carried_tokens(msg)
            try:
                yield from self._relay(client, node, msg)
                return
            except Interrupted as failed:
                if node_full(failed.code, failed.details):  # refused before its first token: no resume
                    room.note_full(node)
                    continue
                if node_draining(failed.code, failed.details):  # also before its first token
                    continue
                errors.append(f"{node.address}: {failed.code.name} {failed.details}")
                if len(errors) >= self.decode_attempts:
                    raise ServingError(
                        failed.code,
                        gave_up(
                            sent,
                            f"{kind} node {node.address}: {failed.details}",
                            failed.code,
                            streamed=request.streamed,
                        ),
                    ) from None
            if sent.token_ids != carried:  # the client got more than the message carries: resume after it
                msg = decode_message(request, resume_output_token_ids=sent.token_ids)
                with self._lock:
                    self.resumed += 1
                logger.warning(
                    "request %s: decode node %s failed after %d tokens (%s); resuming if a node is up",
                    request.request_id,
                    node.address,
                    len(sent.token_ids),
                    errors[-1],
                )

    def _relay(self, client: ClientStream, node: NodeHandle, msg: node_pb2.DecodeRequest) -> Iterator[Event]:
        """Stream ``node``'s Decode as deltas, then Done; record what reached the client in ``client.sent``.

        A retryable failure while the client still waits raises ``Interrupted``.  The node re-emits the
        text of the output tokens the message carries (``sent.chars`` of it already reached the client),
        which is dropped here."""
        stream = node.decode.Decode(msg, timeout=time_remaining(client.scope))
        client.cancellation.on_cancel(stream.cancel)
        try:
            yield from self._relay_stream(client, node, msg, stream)
        finally:
            client.cancellation.off(stream.cancel)  # a request that waits for room tries many times

    def _relay_stream(
        self, client: ClientStream, node: NodeHandle, msg: node_pb2.DecodeRequest, stream: Any
    ) -> Iterator[Event]:
        scope, usage, sent, kind = client.scope, client.usage, client.sent, self.decode_pool.kind
        last: node_pb2.DecodeResponse | None = None
        skip = sent.chars
        with node.busy(stream.cancel, client.request.adapter):
            try:
                for last in stream:
                    if not client.prompt_recorded and not msg.resume_output_token_ids:
                        client.record_prompt(last.prompt)  # the client's prompt, as the node saw it
                    text = last.text
                    if skip:
                        cut = min(skip, len(text))
                        text, skip = text[cut:], skip - cut
                    if last.token_ids and usage.time_to_first_token_s == 0.0:
                        usage.time_to_first_token_s = time.perf_counter() - client.start
                    usage.completion_tokens += len(last.token_ids)
                    scored, alternatives = prompt_scores(last)
                    if last.token_ids or text or scored is not None:
                        if last.token_ids and sent.model is None:
                            sent.model = node.namespace  # a resume continues only on its model
                        sent.token_ids.extend(last.token_ids)
                        sent.chars += len(text)
                        top = [convert.top_logprobs(t) for t in last.top_logprobs]
                        yield Delta(
                            list(last.token_ids),
                            text,
                            list(last.logprobs),
                            top,
                            prompt_logprobs=scored,
                            prompt_top_logprobs=alternatives,
                        )
            except grpc.RpcError as exc:
                code, details = rpc_code_details(exc)
                if client.cancellation.cancelled:
                    raise ServingError(grpc.StatusCode.CANCELLED, "the client cancelled the request") from exc
                if code == grpc.StatusCode.UNAVAILABLE:
                    node.mark_down(details)
                if node_failed(code, client.cancellation) and scope.is_active():
                    raise Interrupted(code, details) from exc
                raise ServingError(
                    code,
                    gave_up(
                        sent, f"{kind} node {node.address}: {details}", code, streamed=client.request.streamed
                    ),
                ) from exc
        if last is None or not last.finished:
            if scope.is_active():
                raise Interrupted(grpc.StatusCode.UNAVAILABLE, "it ended the stream early")
            raise ServingError(
                grpc.StatusCode.UNAVAILABLE,
                f"{kind} node {node.address} ended the stream early",
            )
        if not client.prompt_recorded:  # only resumed nodes answered (their prompt has the resumed tokens)
            client.record_prompt(last.prompt)
        usage.total_time_s = time.perf_counter() - client.start
        yield Done(convert.finish_reason(last.finish_reason), convert.stop_reason(last), usage)
