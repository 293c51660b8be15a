"""What "prefill" means for the engine: a one-token request whose KV is kept for a remote decoder.

The router sends the client's own sampling parameters; here the request becomes::

    prompt                  the client's prompt token ids
    max_tokens              1 (the decode node samples the rest)
    kv_transfer_params      RemoteDecode()   -> the connector holds the blocks under a lease

The hand-off is decided here, once: a request asks for a remote decode only when a decode node will have
tokens to produce (the client's ``max_tokens`` is over 1 and the context has room past the first token),
and the connector leases its blocks only when the first token did not stop it (``connectors/p2p.py``
leases a request capped at its one token, not one that met EOS or a stop token).  When the engine
finishes it, its final ``RequestOutput.kv_transfer_params`` (from the connector) say where the KV is held;
they travel to the decode node untouched, and the decode node's ``release`` ends the lease.  The one case
decided after the lease: a first token that completes a stop *string* (the output processor sees text
after the scheduler finished the request); the servicer releases that lease at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.connector.params import KVTransferParams, RemoteDecode
from engine.driver import EngineRequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, TopLogprobs


def prefill_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    cache_salt: str | None,
    max_model_len: int,
) -> EngineRequest:
    decode_follows = params.max_tokens > 1 and len(prompt_token_ids) + 1 < max_model_len
    return EngineRequest(
        request_id=request_id,
        prompt=list(prompt_token_ids),
        sampling_params=dataclasses.replace(params, max_tokens=min(params.max_tokens, 1)),  # 0: score only
        cache_salt=cache_salt,
        kv_transfer_params=RemoteDecode() if decode_follows else None,
    )


@dataclass(frozen=True)
class PrefillResult:
    """The first token, whether the request ended with it, and where its KV waits for a decode node."""

    output: RequestOutput  # the engine's final output of the one-token request
    ends_here: bool
    finish_reason: str | None  # the client-visible reason when ends_here

    @property
    def first_token_id(self) -> int | None:
        """None only for a request of no output token (max_tokens 0: its prompt scored)."""
        return self.output.new_token_ids[0] if self.output.new_token_ids else None

    @property
    def first_logprob(self) -> float | None:
        return self.output.new_logprobs[0] if self.output.new_logprobs else None

    @property
    def first_top_logprobs(self) -> TopLogprobs | None:
        return self.output.new_top_logprobs[0] if self.output.new_top_logprobs else None

    @property
    def text(self) -> str:
        """The first token's text when the request ends here; otherwise the decode node emits it (its
        detokenizer is primed with the token, so the text continues exactly as on one engine)."""
        return self.output.new_text if self.ends_here else ""

    @property
    def kv_transfer_params(self) -> KVTransferParams | None:
        return None if self.ends_here else self.output.kv_transfer_params


def prefill_result(output: RequestOutput, params: SamplingParams, max_model_len: int) -> PrefillResult:
    """Interpret the finished one-token request against the client's ``params``."""
    assert output.finished, f"prefill output unfinished: {output}"
    if params.max_tokens == 0:  # the prompt scored (prompt_logprobs): nothing to generate
        return PrefillResult(output, True, "length")
    assert output.new_token_ids, f"prefill output without a token: {output}"
    full_context = output.num_prompt_tokens + 1 >= max_model_len
    if output.finish_reason == "stop":
        return PrefillResult(output, True, "stop")
    if params.max_tokens == 1 or full_context:
        return PrefillResult(output, True, "length")
    return PrefillResult(output, False, None)
