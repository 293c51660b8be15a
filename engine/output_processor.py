"""From sampled tokens to text: incremental detokenization and stop strings, per request.

For each request update the scheduler produced, the processor appends the new tokens' text and looks for
the request's stop strings in the part of the text that could hold a new match.  A match cuts the text
exactly before the stop string and finishes the request through ``Scheduler.finish_request`` (the
scheduler owns every lifecycle change).  Until a request finishes, the last ``len(longest stop) - 1``
characters are held back from the deltas, since they may turn out to be the start of a stop string.

The token that ended a request by EOS or a stop token id contributes no text.

A request can arrive with output tokens another engine already sampled (a prefill node's first token,
now the last tokens of its prompt here): ``add_request(request, prior_output_token_ids)`` primes the
detokenizer and the stop-string search with them, so the text continues exactly as if this engine had
sampled them.  Their text has not been streamed yet: it is emitted with the request's first delta.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import TopLogprobs
from engine.scheduler import RequestUpdate, Scheduler
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    stops: tuple[str, ...]
    max_stop_len: int
    text: str = ""
    num_emitted_chars: int = 0
    num_searched_chars: int = 0  # stop strings cannot start before num_searched_chars - max_stop_len + 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prior_output_token_ids: Sequence[int] = ()) -> None:
        """Track ``request``; ``prior_output_token_ids`` were sampled elsewhere (see the module docstring)."""
        params = request.sampling_params
        state = _RequestState(
            request=request,
            detokenizer=self.tokenizer.stream(skip_special_tokens=params.skip_special_tokens),
            stops=params.stop,
            max_stop_len=max((len(s) for s in params.stop), default=0),
        )
        for token in prior_output_token_ids:
            state.text += state.detokenizer.push(token)
        self._states[request.request_id] = state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def request(self, request_id: str) -> Request | None:
        """The request object of an unfinished request (the scheduler forgets errored ones first)."""
        state = self._states.get(request_id)
        return state.request if state is not None else None

    def process(self, updates: Iterable[RequestUpdate], scheduler: Scheduler) -> list[RequestOutput]:
        outputs = []
        for update in updates:
            state = self._states.get(update.request_id)
            if state is None:
                continue
            outputs.append(self._process_one(state, update, scheduler))
        return outputs

    def _process_one(
        self, state: _RequestState, update: RequestUpdate, scheduler: Scheduler
    ) -> RequestOutput:
        finished, reason, stop_reason = update.finished, update.finish_reason, update.stop_reason
        stopped_by_token = finished and reason == "stop"
        new_ids = update.new_token_ids
        text_ids = new_ids[:-1] if stopped_by_token else new_ids
        for token in text_ids:
            state.text += state.detokenizer.push(token)
        if finished:
            state.text += state.detokenizer.flush()  # bytes of an incomplete character, if any
        if state.stops:
            match = self._find_stop(state)
            if match is not None:
                cut, stop = match
                state.text = state.text[:cut]
                if not finished:
                    scheduler.finish_request(
                        update.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop
                    )
                finished, reason, stop_reason = True, "stop", stop
        return self._emit(
            state,
            new_ids,
            update.new_logprobs,
            finished,
            reason,
            stop_reason,
            update.error,
            update.new_top_logprobs,
            (update.prompt_logprobs, update.prompt_top_logprobs),
        )

    @staticmethod
    def _find_stop(state: _RequestState) -> tuple[int, str] | None:
        """The earliest stop string in the text not searched yet: (where it starts, which one)."""
        start = max(0, state.num_searched_chars - state.max_stop_len + 1)
        state.num_searched_chars = len(state.text)
        best: tuple[int, str] | None = None
        for stop in state.stops:
            i = state.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _emit(
        self,
        state: _RequestState,
        new_ids: list[int],
        new_logprobs: list[float],
        finished: bool,
        reason: str | None,
        stop_reason: int | str | None,
        error: str | None,
        new_top_logprobs: list[TopLogprobs] | None = None,
        prompt: tuple[list[float | None] | None, list[TopLogprobs] | None] = (None, None),
    ) -> RequestOutput:
        hold_back = 0 if finished else max(0, state.max_stop_len - 1)
        end = max(state.num_emitted_chars, len(state.text) - hold_back)
        delta = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = end
        request = state.request
        if finished:
            del self._states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_ids),
            new_text=delta,
            new_logprobs=list(new_logprobs),
            new_top_logprobs=list(new_top_logprobs or ()),
            finished=finished,
            finish_reason=reason,
            stop_reason=stop_reason,
            error=error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_external_tokens=request.num_external_computed_tokens,
            kv_transfer_params=request.finished_kv_transfer_params if finished else None,
            prompt_logprobs=prompt[0],
            prompt_top_logprobs=prompt[1],
        )

    def finish(self, request_id: str, reason: str, *, error: str | None = None) -> RequestOutput | None:
        """Close a request that ended outside an update (aborted, failed): the text so far, then done."""
        state = self._states.get(request_id)
        if state is None:
            return None
        return self._emit(state, [], [], True, reason, None, error)
