"""A small client of ``pdkv.v1.Generation``: what ``pdkv generate --server``, the benchmark and the tests
use to talk to a router."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams, TopLogprobs
from pdkv_proto.pdkv.v1 import generation_pb2, generation_pb2_grpc
from serving import convert


@dataclass
class Completion:
    """One finished request as the client saw it; times are measured on the client."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: generation_pb2.Usage | None = None
    time_to_first_token_s: float | None = None
    # Arrival time (seconds after the call started) of every message that carried tokens.
    token_times_s: list[float] = field(default_factory=list)
    total_time_s: float = 0.0


def generate_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
    params: SamplingParams | None = None,
    *,
    request_id: str = "",
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> generation_pb2.GenerateRequest:
    """``prompt``: raw text, token ids, or chat messages (``{"role": ..., "content": ...}`` dicts);
    ``adapter``: a LoRA adapter the server serves, by name (None: the base model)."""
    msg = generation_pb2.GenerateRequest(
        request_id=request_id, sampling=convert.sampling_params_proto(params or SamplingParams())
    )
    if isinstance(prompt, str):
        msg.text = prompt
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        for m in prompt:
            assert isinstance(m, Mapping)
            msg.messages.messages.add(role=m["role"], content=m["content"])
    else:
        msg.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if cache_salt is not None:
        msg.cache_salt = cache_salt
    if adapter is not None:
        msg.adapter = adapter
    return msg


def cached_summary(usage: generation_pb2.Usage | None) -> str:
    """The usage's cached tokens by source, as the CLI prints them -- or that the router hides them (cache
    details off: zeros would say nothing was cached)."""
    if usage is None:
        return "cached(?)"
    if not usage.HasField("cached"):
        return "cached(not shown: cache details are off)"
    c = usage.cached
    return f"cached(local={c.local_prefix}, store={c.store}, remote_prefill={c.remote_prefill})"


class GenerationClient:
    """``api_key``: sent as ``authorization: Bearer KEY`` on every call (a router with API keys needs
    it); ``credentials``: TLS (``serving.tls.channel_credentials``), else a plain channel."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.address = address
        # a long prompt's scores (prompt_logprobs) come in one message, over gRPC's default 4 MiB from
        # about 32k tokens on: take up to 256 MiB unless the caller says otherwise
        if not any(key == "grpc.max_receive_message_length" for key, _ in options):
            options = [*options, ("grpc.max_receive_message_length", 256 * 1024 * 1024)]
        self.channel = (
            grpc.secure_channel(address, credentials, options=list(options))
            if credentials is not None
            else grpc.insecure_channel(address, options=list(options))
        )
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(
        self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """The raw response stream (cancel it by closing the iterator's call: ``.cancel()``)."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]

    def generate(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        on_delta: Callable[[generation_pb2.TokenDelta], None] | None = None,
    ) -> Completion:
        """Run one request to completion; ``on_delta(TokenDelta)`` is called for each delta as it arrives.
        Raises ``grpc.RpcError`` with the router's status on failure."""
        start = time.perf_counter()
        out = Completion()
        for msg in self.stream(request, timeout=timeout):
            out.request_id = msg.request_id
            now = time.perf_counter() - start
            if msg.HasField("delta"):
                if msg.delta.token_ids:
                    out.token_times_s.append(now)
                    if out.time_to_first_token_s is None:
                        out.time_to_first_token_s = now
                out.token_ids.extend(msg.delta.token_ids)
                out.text += msg.delta.text
                out.logprobs.extend(msg.delta.logprobs)
                out.top_logprobs.extend(convert.top_logprobs(t) for t in msg.delta.top_logprobs)
                if on_delta is not None:
                    on_delta(msg.delta)
            else:
                out.finish_reason = convert.finish_reason(msg.done.finish_reason)
                out.stop_reason = convert.stop_reason(msg.done)
                out.usage = msg.done.usage
        out.total_time_s = time.perf_counter() - start
        return out
