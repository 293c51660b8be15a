"""The node messages of one admitted request, built in one place.

    PrefillRequest   the prompt and the client's sampling parameters (disaggregated: phase 1)
    DecodeRequest    the same, and what this call of the decode phase carries:
                       nothing                      colocated: the node runs the whole request
                       first token + transfer params after a prefill (also when retried on another node)
                       resume_output_token_ids      resumed after a node failed mid-stream

What every message shares -- request id, prompt, sampling, cache salt -- is set by ``_shared`` only, so a
field of the admitted request reaches every node the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import grpc

from engine.sampling_params import TopLogprobs
from pdkv_proto.pdkv.v1 import node_pb2, types_pb2
from router.admission import AdmittedRequest
from router.events import Usage
from serving import convert

_Message = TypeVar("_Message", node_pb2.PrefillRequest, node_pb2.DecodeRequest)


def prefill_message(request: AdmittedRequest) -> node_pb2.PrefillRequest:
    return _shared(node_pb2.PrefillRequest(), request)


def decode_message(
    request: AdmittedRequest,
    *,
    prefilled: node_pb2.PrefillResponse | None = None,
    resume_output_token_ids: Sequence[int] = (),
) -> node_pb2.DecodeRequest:
    """``prefilled``: the prefill node's answer (its first token and transfer params, byte for byte);
    ``resume_output_token_ids``: every token the client already has (the node computes their KV)."""
    assert prefilled is None or not resume_output_token_ids, "a resumed request carries no prefill"
    msg = _shared(node_pb2.DecodeRequest(), request)
    if prefilled is not None or resume_output_token_ids:
        # The prompt's scores came with the prefill (or reached the client before the node failed): this
        # node need not compute the prompt whole for them.
        msg.sampling.ClearField("prompt_logprobs")
    if resume_output_token_ids:
        msg.resume_output_token_ids.extend(resume_output_token_ids)
    elif prefilled is not None:
        msg.first_token_id = prefilled.first_token_id
        msg.kv_transfer_params = prefilled.kv_transfer_params
    return msg


def carried_tokens(msg: node_pb2.DecodeRequest) -> list[int]:
    """The output tokens a Decode message hands the node (which the client already has)."""
    if msg.resume_output_token_ids:
        return list(msg.resume_output_token_ids)
    return [msg.first_token_id] if msg.HasField("first_token_id") else []


def _shared(msg: _Message, request: AdmittedRequest) -> _Message:
    msg.request_id = request.request_id
    msg.prompt_token_ids.extend(request.prompt_token_ids)
    msg.sampling.CopyFrom(convert.sampling_params_proto(request.params))
    if request.cache_salt is not None:
        msg.cache_salt = request.cache_salt
    if request.adapter is not None:
        msg.adapter.name, msg.adapter.digest = request.adapter.name, request.adapter.digest
    return msg


def relay_prompt_sources(usage: Usage, prompt: types_pb2.PromptUsage) -> None:
    """The node that computed the prompt says where its KV came from; the router relays it (the node
    computes usage, once: ``serving/convert.py``'s ``prompt_usage``).  The accounting, on every path:

        local_prefix + store + computed_prompt_tokens == prompt_tokens

    ``remote_prefill`` is not a fourth source: those tokens were computed (or loaded) by the prefill node
    and are counted there; it says how many of them the decode node received instead of recomputing."""
    usage.local_prefix = prompt.local_prefix_tokens
    usage.store = prompt.external_tokens
    usage.computed_prompt_tokens = prompt.computed_tokens


def prompt_scores(
    msg: node_pb2.PrefillResponse | node_pb2.DecodeResponse,
) -> tuple[list[float] | None, list[TopLogprobs]]:
    """A node message's prompt scores (None: it carries none)."""
    if not msg.HasField("prompt_logprobs"):
        return None, []
    return convert.prompt_logprobs(msg.prompt_logprobs)


def rpc_code_details(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)
