"""``pdkv.v1.Generation``: proto in -> the neutral request -> admission (``router/admission.py``) -> the
pipeline; the pipeline's events out as proto."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from engine import structured
from engine.hashing import MAX_CACHE_SALT_LEN
from engine.tokenizer import Tokenizer
from pdkv_proto.pdkv.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from router.adapters import RouterAdapters
from router.admission import (
    Admission,
    AdmittedRequest,
    ChatPrompt,
    ChatTurn,
    FieldNames,
    GenerationRequest,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from router.auth import Access, Caller
from router.events import Delta, Done, Usage, total_usage
from router.nodes import NodePool, numerics
from router.pipeline import Pipeline
from router.streams import StreamWatch
from router.tokenizer import RouterModel
from router.tool_calls import ToolCall, ToolChoice, ToolFields, ToolSpec
from router.tool_parser import ToolParser
from serving import convert
from serving.errors import CallRecorder, ServingError, invalid, rpc_errors


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        pipeline: Pipeline,
        model: RouterModel,
        calls: CallRecorder,
        pools: tuple[NodePool, ...] = (),
        access: Access | None = None,
        streams: StreamWatch | None = None,
        *,
        admission: Admission | None = None,
    ) -> None:
        """``admission``: the router's one admission path, shared with the HTTP API (default: this
        model's, without a max_tokens_limit)."""
        self.access = access if access is not None else Access()
        self.streams = streams
        self.pipeline = pipeline
        self.model = model
        self.tokenizer: Tokenizer = model.tokenizer
        self.admission = admission if admission is not None else Admission(model)
        self.calls = calls
        self.pools = pools

    def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> generation_pb2.ModelInfo:
        with rpc_errors(context, self.calls, "GetModelInfo"):
            self._caller(context)
            convert.known_fields_only(request)
            m = self.model
            block_size = next(
                (n.namespace.block_size for p in self.pools for n in p.nodes() if n.namespace is not None), 0
            )
            dtype, deterministic = numerics(n for p in self.pools for n in p.nodes())
            adapters = self.admission.adapters
            return generation_pb2.ModelInfo(
                name=m.name,
                vocab_size=m.vocab_size,
                context_length=self.admission.context_length,
                eos_token_ids=list(m.eos_token_ids),
                block_size=block_size,
                has_chat_template=self.tokenizer.chat_template is not None,
                end_of_turn_token_ids=list(self.tokenizer.end_of_turn_token_ids),
                sampling_fields=sorted(types_pb2.SamplingParams.DESCRIPTOR.fields_by_name),
                structured_kinds=list(structured.KINDS),
                max_n=self.admission.max_n,
                tool_calls=self.admission.tool_format is not None,
                tool_call_format=self.admission.tool_format or "",
                dtype=dtype,
                deterministic=deterministic,
                adapters=adapters.info() if adapters is not None else [],
                max_lora_rank=max((n.max_lora_rank for p in self.pools for n in p.nodes()), default=0),
            )
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def LoadAdapter(self, request: types_pb2.LoadAdapterRequest, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, self.calls, "LoadAdapter"):
            self._caller(context).may_manage_adapters()
            convert.known_fields_only(request)
            return self._adapters().load(request.name, request.path)
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def UnloadAdapter(self, request: types_pb2.UnloadAdapterRequest, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, self.calls, "UnloadAdapter"):
            self._caller(context).may_manage_adapters()
            convert.known_fields_only(request)
            self._adapters().unload(request.name)
            return types_pb2.UnloadAdapterResponse()
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def _adapters(self) -> RouterAdapters:
        if self.admission.adapters is None:
            raise ServingError(grpc.StatusCode.FAILED_PRECONDITION, "this router serves no adapters")
        return self.admission.adapters

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateResponse]:
        with rpc_errors(context, self.calls, "Generate"), self._call(context) as caller:
            admitted = self._admitted(request, caller, streamed=True)
            rid = admitted.request_id
            # A client that stops reading holds its send here: past the idle limit, the call is cut
            # (and its request aborted on the nodes) instead of holding a slot for ever.
            watch = self.streams.watch(context.cancel) if self.streams is not None else None
            text: dict[int, list[str]] = {}  # each choice's reply, for its tool calls at the end
            try:
                for event in self.pipeline.generate(admitted, context):
                    if isinstance(event, Delta):
                        text.setdefault(event.index, []).append(event.text)
                        delta = generation_pb2.TokenDelta(
                            token_ids=event.token_ids,
                            text=event.text,
                            logprobs=event.logprobs,
                            top_logprobs=[convert.top_logprobs_proto(t) for t in event.top_logprobs],
                        )
                        if event.prompt_logprobs is not None:
                            delta.prompt_logprobs.CopyFrom(_prompt_logprobs(event))
                        msg = generation_pb2.GenerateResponse(request_id=rid, delta=delta, index=event.index)
                    else:
                        reply = "".join(text.pop(event.index, []))
                        done = _completion(event, caller.cache_details, admitted.tools, reply)
                        msg = generation_pb2.GenerateResponse(request_id=rid, done=done, index=event.index)
                    if watch is not None:
                        watch.sending()
                    yield msg
                    if watch is not None:
                        watch.sent()
            finally:
                if watch is not None:
                    watch.close()

    def GenerateUnary(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GenerateResult:
        with rpc_errors(context, self.calls, "GenerateUnary"), self._call(context) as caller:
            admitted = self._admitted(request, caller, streamed=False)
            choices = [generation_pb2.Choice(index=i) for i in range(admitted.n)]
            usages: list[Usage] = [Usage()] * admitted.n
            for event in self.pipeline.generate(admitted, context):
                choice = choices[event.index]
                if isinstance(event, Delta):
                    choice.token_ids.extend(event.token_ids)
                    choice.text += event.text
                    choice.logprobs.extend(event.logprobs)
                    choice.top_logprobs.extend(convert.top_logprobs_proto(t) for t in event.top_logprobs)
                    if event.prompt_logprobs is not None:
                        choice.prompt_logprobs.CopyFrom(_prompt_logprobs(event))
                else:
                    choice.done.CopyFrom(
                        _completion(event, caller.cache_details, admitted.tools, choice.text)
                    )
                    usages[event.index] = event.usage
            first = choices[0]
            result = generation_pb2.GenerateResult(
                request_id=admitted.request_id,
                token_ids=first.token_ids,
                text=first.text,
                logprobs=first.logprobs,
                top_logprobs=first.top_logprobs,
                done=first.done,
                choices=choices,
            )
            if first.HasField("prompt_logprobs"):
                result.prompt_logprobs.CopyFrom(first.prompt_logprobs)
            result.done.usage.CopyFrom(_usage(total_usage(usages), caller.cache_details))
            return result
        raise AssertionError("unreachable: rpc_errors aborts the call")

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        """Who calls (UNAUTHENTICATED without a valid API key where keys are required)."""
        authorization = next(
            (str(v) for k, v in context.invocation_metadata() or () if k == "authorization"), None
        )
        return self.access.authenticate(authorization, context.peer())

    @contextmanager
    def _call(self, context: grpc.ServicerContext) -> Iterator[Caller]:
        """The caller, counted against its limit while the call runs."""
        caller = self._caller(context)
        with self.access.admitted(caller):
            yield caller

    def _admitted(
        self, request: generation_pb2.GenerateRequest, caller: Caller, *, streamed: bool
    ) -> AdmittedRequest:
        """Proto -> the neutral request -> the one admission path (``streamed``: the streaming RPC)."""
        return self.admission.admit(dataclasses.replace(generation_request(request), stream=streamed), caller)


# How this front end names a request's fields in INVALID_ARGUMENT.
FIELDS = FieldNames(
    text="prompt.text",
    messages="prompt.messages",
    token_ids="prompt.token_ids.ids",
    token_id="prompt.token_ids.ids[{i}]",
    sampling="sampling.",
    tools=ToolFields(
        tools="prompt.messages.tools",
        tool="prompt.messages.tools[{i}]",
        tool_choice="prompt.messages.tool_choice",
        message="prompt.messages.messages[{i}]",
        tool_call="prompt.messages.messages[{i}].tool_calls[{j}]",
        tool_call_function="prompt.messages.messages[{i}].tool_calls[{j}]",
    ),
)
_MODES: dict[int, ToolChoice | None] = {
    generation_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: None,
    generation_pb2.TOOL_CHOICE_MODE_NONE: ToolChoice("none"),
    generation_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoice("auto"),
    generation_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoice("required"),
}


def generation_request(request: generation_pb2.GenerateRequest) -> GenerationRequest:
    """A ``GenerateRequest`` as the neutral request (nothing is checked here that admission checks)."""
    convert.known_fields_only(request)  # a field this build does not know is refused, never dropped
    rid = convert.request_id(request.request_id) if request.request_id else f"req-{uuid.uuid4().hex}"
    prompt: Prompt
    which = request.WhichOneof("prompt")
    if which == "text":
        prompt = TextPrompt(request.text)
    elif which == "messages":
        prompt = chat_prompt(request.messages)
    elif which == "token_ids":
        prompt = TokenPrompt(tuple(request.token_ids.ids))
    else:
        raise invalid("prompt", "set text, token_ids or messages")
    return GenerationRequest(
        request_id=rid,
        prompt=prompt,
        fields=FIELDS,
        sampling=convert.sampling_options(request.sampling),
        cache_salt=_client_salt(request),
        n=request.n or 1,
        adapter=(request.adapter or None) if request.HasField("adapter") else None,
    )


def _client_salt(request: generation_pb2.GenerateRequest) -> str | None:
    """The client's salt, at most MAX_CACHE_SALT_LEN characters as over HTTP (a megabyte salt failed past
    the prefill as a decode outage).  The nodes take what the router forwards: the tenant's tag too."""
    salt = convert.cache_salt(request)
    if salt is not None and len(salt) > MAX_CACHE_SALT_LEN:
        raise invalid("cache_salt", f"must be at most {MAX_CACHE_SALT_LEN} characters, got {len(salt)}")
    return salt


def _prompt_logprobs(delta: Delta) -> types_pb2.PromptLogprobs:
    msg = types_pb2.PromptLogprobs(logprobs=delta.prompt_logprobs or [])
    msg.top_logprobs.extend(convert.top_logprobs_proto(t) for t in delta.prompt_top_logprobs)
    return msg


def chat_prompt(msg: generation_pb2.ChatMessages) -> ChatPrompt:
    """A conversation, its tools and tool choice as the neutral prompt (admission checks them)."""
    turns = tuple(
        ChatTurn(
            m.role,
            m.content,
            m.name if m.HasField("name") else None,
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id if m.HasField("tool_call_id") else None,
        )
        for m in msg.messages
    )
    choice: ToolChoice | None = None
    which = msg.tool_choice.WhichOneof("choice")
    if which == "function":
        choice = ToolChoice("function", msg.tool_choice.function)
    elif which == "mode":
        if msg.tool_choice.mode not in _MODES:
            raise invalid(
                "prompt.messages.tool_choice.mode", f"{msg.tool_choice.mode} is not a ToolChoiceMode"
            )
        choice = _MODES[msg.tool_choice.mode]
    return ChatPrompt(
        turns,
        tools=tuple(ToolSpec(t.name, t.description, t.parameters, t.strict) for t in msg.tools),
        tool_choice=choice,
        parallel_tool_calls=msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True,
    )


def _completion(
    done: Done, cache_details: bool, tools: ToolParser | None = None, text: str = ""
) -> generation_pb2.Completion:
    """The request's end; with ``tools``, the calls parsed from the reply's ``text`` and what is left."""
    reason = done.finish_reason
    msg = generation_pb2.Completion(usage=_usage(done.usage, cache_details))
    convert.set_stop_reason(msg, done.stop_reason)
    if tools is not None:
        reply = tools.parse(text)
        msg.tool_calls.extend(
            generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in reply.calls
        )
        msg.content = reply.content or ""
        if reply.calls and reason == "stop":
            reason = "tool_calls"
    msg.finish_reason = convert.finish_reason_proto(reason)
    return msg


def _usage(u: Usage, cache_details: bool) -> generation_pb2.Usage:
    """The client's usage; where the operator did not enable cache details, ``cached`` is absent and
    ``computed_prompt_tokens`` 0 (they would tell a client what else is cached)."""
    msg = generation_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        time_to_first_token_s=u.time_to_first_token_s,
        total_time_s=u.total_time_s,
    )
    if cache_details:
        msg.cached.CopyFrom(
            generation_pb2.CachedTokens(
                local_prefix=u.local_prefix, store=u.store, remote_prefill=u.remote_prefill
            )
        )
        msg.computed_prompt_tokens = u.computed_prompt_tokens
    return msg
