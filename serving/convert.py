"""Proto <-> domain objects: sampling parameters, finish and stop reasons, prompt usage, transfer params.

Everything the servicers need to translate lives here, so a servicer reads as "convert, call, convert".
Validation failures raise ``ServingError(INVALID_ARGUMENT)`` naming the field as the client spells it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from engine.connector.params import (
    KVTransferParams,
    TransferParamsError,
    decode_transfer_params,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, TopLogprobs
from engine.structured import StructuredOutput
from pdkv_proto.pdkv.v1 import types_pb2
from serving.errors import ServingError, invalid

MAX_REQUEST_ID_LEN = 256

_FINISH_TO_PROTO: dict[str, types_pb2.FinishReason] = {
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "tool_calls": types_pb2.FINISH_REASON_TOOL_CALLS,  # the router's, to its clients only
}
_FINISH_FROM_PROTO: dict[int, str] = {int(v): k for k, v in _FINISH_TO_PROTO.items()}


def known_fields_only(msg: Message, where: str = "") -> None:
    """Refuse a message carrying fields this build's ``.proto`` does not have (a newer client's): protobuf
    would keep them aside and the request would run without them -- a field accepted and dropped.
    INVALID_ARGUMENT names the field by its number and where it sits, as the router names the fields it
    checks (a member of a oneof under the oneof's name: ``prompt.messages.messages[0].#50``)."""
    from google.protobuf import unknown_fields

    unknown = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
    known = msg.DESCRIPTOR.fields_by_number
    for number in unknown:  # a map entry carrying an unknown field lands whole among its parent's
        if number in known:
            raise invalid(
                f"{where}{known[number].name}",
                "holds what this server's API does not have there (a map entry with a newer field, or the "
                "wrong wire type); the request is refused rather than run without it",
            )
    if unknown:
        raise invalid(
            f"{where}#{unknown[0]}",
            "is not a field of this server's API (a newer .proto?); it could change the output, so the "
            "request is refused rather than run without it",
        )
    for descriptor, value in msg.ListFields():
        if descriptor.message_type is None:
            continue
        # a member of a oneof as the router's errors name it: under the oneof (prompt.messages.messages[0]);
        # proto3's `optional` fields sit in synthetic oneofs, named "_" + the field
        oneof = descriptor.containing_oneof
        under = f"{oneof.name}." if oneof is not None and not oneof.name.startswith("_") else ""
        name = f"{where}{under}{descriptor.name}"
        if descriptor.is_repeated:
            for i, item in enumerate(value):
                if isinstance(item, Message):
                    known_fields_only(item, f"{name}[{i}].")
        else:
            known_fields_only(value, f"{name}.")


def sampling_options(msg: types_pb2.SamplingParams, field: str = "sampling") -> dict[str, Any]:
    """The fields ``msg`` sets, by ``SamplingParams``'s names (the proto's fields share them, so a new
    sampling field needs no line here): every plain field, an ``optional`` one only when set."""
    options: dict[str, Any] = {}
    for name, proto_field in msg.DESCRIPTOR.fields_by_name.items():
        if proto_field.has_presence and not msg.HasField(name):
            continue  # unset: the default of whoever builds SamplingParams
        value = getattr(msg, name)
        if name == "structured":
            try:
                options[name] = structured_output(value)
            except ValueError as exc:  # its message starts with the field's name
                raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}.{exc}") from None
        elif proto_field.message_type is not None and proto_field.message_type.GetOptions().map_entry:
            options[name] = dict(value)  # a map (logit_bias): token id -> value
        else:
            options[name] = tuple(value) if proto_field.is_repeated else value
    return options


def sampling_params(msg: types_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """``SamplingParams`` from its proto; unset optional fields take the engine's defaults."""
    try:
        return SamplingParams(**sampling_options(msg, field))
    except ValueError as exc:  # the message starts with the field's name
        raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}.{exc}") from exc


def sampling_params_proto(params: SamplingParams) -> types_pb2.SamplingParams:
    """The proto of ``params``: every field by its name (None leaves an ``optional`` one unset)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    values["logit_bias"] = dict(params.logit_bias)  # sorted pairs -> the proto's map
    values["structured"] = structured_proto(params.structured) if params.structured is not None else None
    return types_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})


def request_id(value: str, field: str = "request_id") -> str:
    if not value:
        raise invalid(field, "must be a non-empty string")
    if len(value) > MAX_REQUEST_ID_LEN or not value.isprintable():
        raise invalid(field, f"must be at most {MAX_REQUEST_ID_LEN} printable characters")
    return value


def cache_salt(msg: Any, field: str = "cache_salt") -> str | None:
    """The optional ``cache_salt`` of a request message: None when unset; empty is refused."""
    if not msg.HasField("cache_salt"):
        return None
    if not msg.cache_salt:
        raise invalid(field, "must be non-empty when set (leave it unset for no salt)")
    return str(msg.cache_salt)


def token_ids(values: Any, field: str) -> list[int]:
    ids = list(values)
    if not ids:
        raise invalid(field, "is empty: a prompt needs at least one token")
    return ids


def finish_reason_proto(reason: str | None) -> types_pb2.FinishReason:
    return _FINISH_TO_PROTO.get(reason or "", types_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason(value: types_pb2.FinishReason | int) -> str | None:
    return _FINISH_FROM_PROTO.get(int(value))


def set_stop_reason(msg: Any, stop_reason: int | str | None) -> None:
    """Fill a message's ``oneof stop_reason`` (stop_token_id | stop_string)."""
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason


def stop_reason(msg: Any) -> int | str | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


def prompt_usage(out: RequestOutput, carried: int = 0) -> types_pb2.PromptUsage:
    """Where the KV of the client's prompt came from on this node: the one place a request's prompt usage
    is computed (the router relays it).  ``carried``: the output tokens the node was handed as part of
    its prompt (the first token after a prefill, the tokens of a resumed request) -- not the client's
    prompt, so the figures are cut to it::

        local_prefix_tokens + external_tokens + computed_tokens == prompt_tokens   (the client's prompt)
    """
    n = out.num_prompt_tokens - carried
    local = min(out.num_cached_tokens, n)
    external = min(out.num_external_tokens, n - local)
    return types_pb2.PromptUsage(
        prompt_tokens=n,
        local_prefix_tokens=local,
        external_tokens=external,
        computed_tokens=n - local - external,
    )


def transfer_params(raw: bytes, field: str = "kv_transfer_params") -> KVTransferParams | None:
    """The transfer parameters a node was sent (``engine/connector/params.py``: their one wire form);
    anything else is INVALID_ARGUMENT naming the field."""
    try:
        return decode_transfer_params(raw)
    except TransferParamsError as exc:
        raise invalid(field, f"{exc}; pass PrefillResponse's bytes untouched") from exc


def top_logprobs_proto(top: TopLogprobs) -> types_pb2.TopLogprobs:
    """One position's alternatives as the proto carries them (ids and values, most likely first)."""
    return types_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def prompt_logprobs_proto(
    logprobs: Sequence[float | None], tops: Sequence[TopLogprobs]
) -> types_pb2.PromptLogprobs:
    """The prompt's scores as the proto carries them: from the second position (the first has none)."""
    msg = types_pb2.PromptLogprobs(logprobs=[lp for lp in logprobs[1:] if lp is not None])
    if any(tops[1:]):
        msg.top_logprobs.extend(top_logprobs_proto(t) for t in tops[1:])
    return msg


def prompt_logprobs(msg: types_pb2.PromptLogprobs) -> tuple[list[float], list[TopLogprobs]]:
    """A ``PromptLogprobs`` message's scores (from the prompt's second position) and alternatives."""
    return list(msg.logprobs), [top_logprobs(t) for t in msg.top_logprobs]


def top_logprobs(msg: types_pb2.TopLogprobs) -> TopLogprobs:
    return tuple(zip(msg.token_ids, msg.logprobs, strict=True))


def structured_output(msg: types_pb2.StructuredOutput) -> StructuredOutput:
    """The constraint a ``StructuredOutput`` message names; a message that names none, or asks for
    ``json_object: false``, is refused (``ValueError`` naming the field): it would be accepted and do
    nothing."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: names no constraint (set one of its fields, or leave it unset)")
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError(
                "structured.json_object: false asks for nothing (set it true, or leave structured unset)"
            )
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput.choice(list(msg.choice.choices))
    return StructuredOutput(kind, getattr(msg, kind))


def structured_proto(spec: StructuredOutput) -> types_pb2.StructuredOutput:
    if spec.kind == "json_object":
        return types_pb2.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return types_pb2.StructuredOutput(choice=types_pb2.ChoiceList(choices=json.loads(spec.spec)))
    msg = types_pb2.StructuredOutput()
    setattr(msg, spec.kind, spec.spec)  # json_schema, regex or grammar: a string field of that name
    return msg
