"""``pdkv.v1.DecodeNode``: proto in, ``decode_request`` to the engine, its outputs streamed out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc

from decode_node.decode import decode_request
from engine.driver import EngineDriver
from engine.outputs import RequestOutput
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from serving import convert
from serving.calls import EngineCall
from serving.errors import CallRecorder, rpc_errors
from serving.lora import adapter_ref
from serving.signing import TransferSigner


class DecodeNodeServicer(node_pb2_grpc.DecodeNodeServicer):
    """``signer``: transfer params must be sealed by a prefill node of the cluster (a cluster secret is
    set); they are checked before the engine sees them, so nothing is pulled on unsealed params."""

    def __init__(
        self, driver: EngineDriver, calls: CallRecorder, signer: TransferSigner | None = None
    ) -> None:
        self.driver = driver
        self.calls = calls
        self.signer = signer

    def Decode(
        self, request: node_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[node_pb2.DecodeResponse]:
        with rpc_errors(context, self.calls, "Decode"):
            convert.known_fields_only(request)
            rid = convert.request_id(request.request_id)
            prompt = convert.token_ids(request.prompt_token_ids, "prompt_token_ids")
            salt = convert.cache_salt(request)
            first = request.first_token_id if request.HasField("first_token_id") else None
            params = request.kv_transfer_params
            if self.signer is not None:
                params = self.signer.open(params, rid, prompt, salt, first)
            engine_request = decode_request(
                rid,
                prompt,
                convert.sampling_params(request.sampling),
                salt,
                first,
                convert.transfer_params(params),
                list(request.resume_output_token_ids),
            )
            name, digest = adapter_ref(request)
            engine_request = dataclasses.replace(engine_request, adapter=name, adapter_digest=digest)
            carried = len(engine_request.prior_output_token_ids)
            for out in EngineCall(self.driver, engine_request, context).outputs():
                yield _response(rid, out, carried)


def _response(rid: str, out: RequestOutput, carried: int) -> node_pb2.DecodeResponse:
    msg = node_pb2.DecodeResponse(
        request_id=rid,
        token_ids=out.new_token_ids,
        text=out.new_text,
        logprobs=out.new_logprobs,
        top_logprobs=[convert.top_logprobs_proto(t) for t in out.new_top_logprobs],
        finished=out.finished,
        finish_reason=convert.finish_reason_proto(out.finish_reason),
        prompt=convert.prompt_usage(out, carried),
    )
    convert.set_stop_reason(msg, out.stop_reason)
    if out.prompt_logprobs is not None and out.prompt_top_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(
            convert.prompt_logprobs_proto(out.prompt_logprobs, out.prompt_top_logprobs)
        )
    return msg
