"""``pdkv.v1.PrefillNode``: proto in, ``prefill_request`` to the engine, proto out."""

from __future__ import annotations

import dataclasses

import grpc

from engine.connector.params import encode_transfer_params
from engine.driver import EngineDriver
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from prefill_node.prefill import PrefillResult, prefill_request, prefill_result
from serving import convert
from serving.calls import EngineCall
from serving.errors import CallRecorder, rpc_errors
from serving.lora import adapter_ref
from serving.signing import TransferSigner


class PrefillNodeServicer(node_pb2_grpc.PrefillNodeServicer):
    """``signer``: seals the transfer params for the decode node (a cluster secret is set)."""

    def __init__(
        self, driver: EngineDriver, calls: CallRecorder, signer: TransferSigner | None = None
    ) -> None:
        self.driver = driver
        self.calls = calls
        self.signer = signer

    def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> node_pb2.PrefillResponse:
        with rpc_errors(context, self.calls, "Prefill"):
            convert.known_fields_only(request)
            rid = convert.request_id(request.request_id)
            params = convert.sampling_params(request.sampling)
            prompt = convert.token_ids(request.prompt_token_ids, "prompt_token_ids")
            salt = convert.cache_salt(request)
            max_len = self.driver.engine.max_model_len
            name, digest = adapter_ref(request)
            engine_request = prefill_request(rid, prompt, params, salt, max_len)
            engine_request = dataclasses.replace(engine_request, adapter=name, adapter_digest=digest)
            call = EngineCall(self.driver, engine_request, context)
            final = list(call.outputs())[-1]
            result = prefill_result(final, params, max_len)
            if result.ends_here and final.kv_transfer_params is not None:
                # Leased, then stopped by a stop string in the first token's text: no decode node comes.
                self.driver.abort(rid)
            response = _response(rid, result)
            if self.signer is not None and result.first_token_id is not None:
                response.kv_transfer_params = self.signer.seal(
                    response.kv_transfer_params, rid, prompt, salt, result.first_token_id
                )
            return response
        raise AssertionError("unreachable: rpc_errors aborts the call")


def _response(rid: str, result: PrefillResult) -> node_pb2.PrefillResponse:
    response = node_pb2.PrefillResponse(
        request_id=rid,
        first_token_id=result.first_token_id,  # None (unset) when max_tokens is 0
        finished=result.ends_here,
        finish_reason=convert.finish_reason_proto(result.finish_reason),
        text=result.text,
        prompt=convert.prompt_usage(result.output),
        kv_transfer_params=encode_transfer_params(result.kv_transfer_params),
    )
    if result.first_logprob is not None:
        response.first_logprob = result.first_logprob
    if result.first_top_logprobs is not None:
        response.first_top_logprobs.CopyFrom(convert.top_logprobs_proto(result.first_top_logprobs))
    if result.ends_here:
        convert.set_stop_reason(response, result.output.stop_reason)
    scores = result.output
    if scores.prompt_logprobs is not None and scores.prompt_top_logprobs is not None:
        response.prompt_logprobs.CopyFrom(
            convert.prompt_logprobs_proto(scores.prompt_logprobs, scores.prompt_top_logprobs)
        )
    return response
