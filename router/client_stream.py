"""A client call's decode phase as the pipeline relays it: what reached the client, why a node's stream
ended, and how the router says it gave up (``router/pipeline.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from engine.hashing import HashNamespace
from pdkv_proto.pdkv.v1 import types_pb2
from router.admission import AdmittedRequest
from router.choices import Placement
from router.events import CallScope, Cancellation, Usage
from router.node_messages import relay_prompt_sources

# A node failing so (or cancelling a call as it stops) is skipped; a decode node's stream is resumed.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def node_failed(code: grpc.StatusCode, cancellation: Cancellation) -> bool:
    """The node failed, another may serve: RETRYABLE, or a CANCELLED the router did not ask for."""
    return code in RETRYABLE or (code == grpc.StatusCode.CANCELLED and not cancellation.cancelled)


@dataclass
class Sent:
    """What reached the client so far: every token id, how many characters of text, and the model (the
    namespace of the node) that made them, once known (``router/candidates.py``)."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    model: HashNamespace | None = None


@dataclass
class ClientStream:
    """One client call's decode phase: what it asked, how long it may take, what it has been sent."""

    request: AdmittedRequest
    scope: CallScope
    cancellation: Cancellation
    usage: Usage
    start: float
    sent: Sent
    placement: Placement
    prompt_recorded: bool = False  # usage holds the prompt figures of the first node that saw the prompt
    prefilled: bool = False  # a prefill node computed the prompt (else the decode node did)

    def record_prompt(self, prompt: types_pb2.PromptUsage) -> None:
        """Relay a decode (or colocated) node's figures of the client's prompt: where it computed the
        prompt, where each token came from; after a prefill, its external tokens are the ones it received."""
        if self.prefilled:
            self.usage.remote_prefill = prompt.external_tokens
        else:
            relay_prompt_sources(self.usage, prompt)
        self.prompt_recorded = True


class Interrupted(Exception):
    """A node failed with a retryable status (or ended its stream early) while the client still waits."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def gave_up(sent: Sent, why: str, code: grpc.StatusCode, *, streamed: bool) -> str:
    """``why``, and where output had reached a streaming client (``streamed``), that it is incomplete --
    with "retry" only where a retry may succeed (a node down or busy), not after the engine refused or
    failed the request.  A client that reads the output whole got none of it: no count is given (an
    outside probe's non-streamed call was told "8 tokens sent" with no token in the reply)."""
    retry = ", retry the request" if code in (*RETRYABLE, grpc.StatusCode.CANCELLED) else ""
    if not sent.token_ids:
        return why
    if not streamed:
        return f"{why}; no output is returned{retry}"
    return f"{why}; the output is incomplete ({len(sent.token_ids)} tokens sent){retry}"
