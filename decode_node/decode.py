"""What "decode" means for the engine: continue a request a prefill node started, or run a whole one.

Continuing a prefill (the router passes the first token and the prefill node's transfer parameters)::

    prompt                  the client's prompt + [first token]
    max_tokens              the client's max_tokens - 1 (the first token counted against it)
    kv_transfer_params      the prefill node's params, untouched -> the connector pulls the prompt's KV
    prior_output_token_ids  (first token,) -> the output text starts with the first token's text and stop
                            strings see it, exactly as when one engine runs the whole request

Resuming a request whose decode node failed mid-stream (the router passes every token it already sent)::

    prompt                  the client's prompt + those tokens
    max_tokens              the client's max_tokens - their number
    prior_output_token_ids  those tokens -> the text and stop strings continue exactly as on one engine
                            (the router drops the part of the text the client already has)

Without a first token the request is an ordinary one (colocated mode): the node computes the prompt.
Without transfer parameters (the prefill node has no transfer connector) the node recomputes the prompt's
KV; the output is the same, only slower.

Seeded sampling counts output positions from the request's first token wherever it was sampled (the
prior tokens count), so a seeded request draws exactly what one engine would have drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.connector.params import KVTransferParams
from engine.driver import EngineRequest
from engine.sampling_params import SamplingParams
from serving.errors import invalid


def decode_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    cache_salt: str | None,
    first_token_id: int | None,
    kv_transfer_params: KVTransferParams | None,
    resume_output_token_ids: Sequence[int] = (),
) -> EngineRequest:
    if resume_output_token_ids:
        if first_token_id is not None or kv_transfer_params is not None:
            raise invalid(
                "resume_output_token_ids",
                "excludes first_token_id and kv_transfer_params (a resumed request computes its own KV)",
            )
        return _resume_request(request_id, prompt_token_ids, params, cache_salt, resume_output_token_ids)
    if first_token_id is None:
        if kv_transfer_params is not None:
            raise invalid("first_token_id", "is required with kv_transfer_params (the token Prefill sampled)")
        return EngineRequest(request_id, list(prompt_token_ids), params, cache_salt)
    if params.max_tokens < 2:
        raise invalid(
            "sampling.max_tokens",
            f"is {params.max_tokens}; continuing a prefill needs at least 2 (the first token was sampled "
            "by the prefill node)",
        )
    return EngineRequest(
        request_id=request_id,
        prompt=[*prompt_token_ids, first_token_id],
        sampling_params=dataclasses.replace(params, max_tokens=params.max_tokens - 1),
        cache_salt=cache_salt,
        kv_transfer_params=kv_transfer_params,
        prior_output_token_ids=(first_token_id,),
    )


def _resume_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    cache_salt: str | None,
    resumed: Sequence[int],
) -> EngineRequest:
    if params.max_tokens <= len(resumed):
        raise invalid(
            "resume_output_token_ids",
            f"holds {len(resumed)} tokens and max_tokens is {params.max_tokens}: nothing is left to generate",
        )
    return EngineRequest(
        request_id=request_id,
        prompt=[*prompt_token_ids, *resumed],
        sampling_params=dataclasses.replace(params, max_tokens=params.max_tokens - len(resumed)),
        cache_salt=cache_salt,
        prior_output_token_ids=tuple(resumed),
    )
