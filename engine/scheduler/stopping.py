"""When a sampled token ends a request: a stop token, EOS, a complete (or broken) constraint, the output's
length or the model's context.  The scheduler asks once per sampled token."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def stop_status(request: Request, token: int, max_model_len: int | None) -> RequestStatus | None:
    """The finished status ``token`` (just appended) ends ``request`` with, or None: it goes on."""
    params = request.sampling_params
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    verdict = request.matcher.step(token, request.eos_token_id) if request.matcher is not None else None
    if verdict is not None:  # the constraint is complete ("stop"), or the token broke it ("error")
        request.error = verdict if verdict != "stop" else None
        return RequestStatus.FINISHED_STOPPED if verdict == "stop" else RequestStatus.FINISHED_ERROR
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if max_model_len is not None and request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
