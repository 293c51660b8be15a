"""``router/choices.py`` on its own: the later choices wait for the first one's first event and go where
it went; each choice is seeded ``seed + i``; a failing choice fails the request; every ``max_inflight``
slot is given back, also for choices never started."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from engine.sampling_params import SamplingParams
from router.admission import AdmittedRequest
from router.choices import Placement, choice_request, fork_choices, repeat_choice
from router.events import CallScope, Delta, Done, Event, Usage
from router.pipeline import Pipeline
from serving.errors import ServingError
from tests.router.fakes import OpenScope

NODE = object()
DECODE_NODE = object()


class _Runs:
    """A fake pipeline: records each choice's seed and placement; ``fail`` choices raise."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.fail = fail
        self.lock = threading.Lock()
        self.seeds: dict[int, int | None] = {}
        self.placements: dict[int, tuple[object, object]] = {}
        self.first_sent = threading.Event()
        self.first_decoding = threading.Event()
        self.held = 0  # slots taken and not given back
        self.started_before_first: list[int] = []

    def run(self, request: AdmittedRequest, scope: CallScope, placement: Placement) -> Iterator[Event]:
        with self.lock:
            i = len(self.seeds)
            self.seeds[i] = request.params.seed
            if i and not self.first_sent.is_set():
                self.started_before_first.append(i)
        try:
            # As the disaggregated pipeline does: the prefill node is chosen, the first token goes out,
            # and only then is the decode node chosen.
            prefill = placement.prefill_hint()
            if i == 0:
                placement.prefill = NODE  # type: ignore[assignment]
                self.first_sent.set()
            if request.params.seed is not None and request.params.seed - 10 in self.fail:
                raise ServingError(grpc.StatusCode.UNAVAILABLE, "node gone")
            scored = request.params.prompt_logprobs is not None
            yield Delta([1], "a", [], prompt_logprobs=[-1.0, -2.0] if scored else None)
            if i == 0:
                placement.decode = DECODE_NODE  # type: ignore[assignment]
                self.first_decoding.set()
            else:
                self.first_decoding.wait(5)
            with self.lock:
                self.placements[i] = (prefill, placement.decode_hint())
            yield Done("length", None, Usage(prompt_tokens=4, completion_tokens=1))
        finally:
            with self.lock:
                self.held -= 1

    def release(self, k: int) -> None:
        with self.lock:
            self.held -= k


def _request(n: int) -> AdmittedRequest:
    return AdmittedRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=1, seed=10), n=n)


def test_choices_follow_the_first_and_are_seeded_seed_plus_i() -> None:
    runs = _Runs()
    runs.held = 3
    events = list(fork_choices(_request(3), OpenScope(), runs.run, runs.release))
    assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1, 2]
    assert sorted(runs.seeds.values()) == [10, 11, 12]
    assert runs.started_before_first == []
    assert runs.placements[0] == (None, DECODE_NODE)
    # The later choices started when choice 0 had its prefill node but no decode node yet: they still
    # reach its decode node, whose cache will hold the prompt.
    assert all(runs.placements[i] == (NODE, DECODE_NODE) for i in (1, 2))
    assert runs.held == 0


def test_a_failing_choice_fails_the_request_and_every_slot_comes_back() -> None:
    runs = _Runs(fail=frozenset({2}))
    runs.held = 3
    with pytest.raises(ServingError, match="node gone"):
        list(fork_choices(_request(3), OpenScope(), runs.run, runs.release))
    for _ in range(100):  # the other choices' threads end on their own
        if runs.held == 0:
            break
        threading.Event().wait(0.01)
    assert runs.held == 0


def test_a_first_choice_failing_before_output_starts_no_other() -> None:
    runs = _Runs(fail=frozenset({0}))
    runs.held = 4
    with pytest.raises(ServingError):
        list(fork_choices(_request(4), OpenScope(), runs.run, runs.release))
    assert list(runs.seeds) == [0] and runs.held == 0


def test_choices_that_generate_nothing_score_the_prompt_once() -> None:
    """echo with max_tokens 0 and n > 1: every choice is the prompt's scores; one run serves them all."""
    runs = _Runs()
    runs.held = 3
    request = AdmittedRequest("r", [1, 2, 3], SamplingParams(max_tokens=0, prompt_logprobs=1, seed=10), n=3)
    events = list(repeat_choice(request, OpenScope(), runs.run, runs.release))
    assert list(runs.seeds.values()) == [10]  # one run, choice 0's
    assert [e.index for e in events] == [0, 1, 2, 0, 1, 2]
    assert [type(e) for e in events] == [Delta] * 3 + [Done] * 3
    assert runs.held == 0  # the two unused slots given back at once, choice 0's when it ended


def test_every_choice_s_first_delta_carries_the_prompt_s_scores_choice_0_computed() -> None:
    """An outside probe's find: with n > 1 and tokens to generate, prompt_logprobs reached choice 0 only
    (the proto promises them in each choice's first delta; echo and max_tokens 0 had them in all)."""
    runs = _Runs()
    runs.held = 3
    request = AdmittedRequest("r", [1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=1, seed=10), n=3)
    events = list(fork_choices(request, OpenScope(), runs.run, runs.release))
    firsts = {e.index: e for e in reversed(events) if isinstance(e, Delta)}
    assert sorted(firsts) == [0, 1, 2]
    assert all(firsts[i].prompt_logprobs == [-1.0, -2.0] for i in range(3))
    assert [choice_request(request, i).params.prompt_logprobs for i in range(3)] == [1, None, None]


def test_a_choice_without_a_seed_stays_unseeded() -> None:
    request = AdmittedRequest("r", [1], SamplingParams(max_tokens=1), n=2)
    assert choice_request(request, 1).params.seed is None and choice_request(request, 1).n == 1


def test_a_grpc_seed_past_2_63_keeps_choice_0_the_request_alone() -> None:
    seed = 2**63 + 5  # gRPC's seed is a uint64
    request = AdmittedRequest("r", [1], SamplingParams(max_tokens=1, seed=seed), n=2)
    assert choice_request(request, 0).params.seed == seed
    assert choice_request(request, 1).params.seed == seed + 1
    assert (
        choice_request(
            AdmittedRequest("r", [1], SamplingParams(max_tokens=1, seed=2**64 - 1), n=2), 1
        ).params.seed
        == 0
    )


def test_a_thread_that_cannot_start_leaves_no_slot_held(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _Runs()
    runs.held = 4
    real_start = threading.Thread.start
    calls = []

    def start(self: threading.Thread) -> None:
        calls.append(self.name)
        if len(calls) == 3:  # choice 2's thread: the router is out of threads
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError):
        list(fork_choices(_request(4), OpenScope(), runs.run, runs.release))
    for _ in range(100):
        if runs.held == 0:
            break
        threading.Event().wait(0.01)
    assert runs.held == 0


def test_more_choices_than_the_router_has_slots_is_refused_by_name_not_retried_for_ever() -> None:
    """A 429 would say "retry later", and every retry would get it again."""
    pipeline = Pipeline("colocated", None, SimpleNamespace(), lambda pool: None, max_inflight=2)  # type: ignore[arg-type]
    with pytest.raises(ServingError) as err:
        list(pipeline.generate(_request(3), OpenScope()))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "n: 3 choices take 3 slots; this router has 2"
    assert pipeline.inflight == 0


def test_an_incomplete_output_says_retry_only_where_a_retry_may_succeed() -> None:
    """An outside probe: a request the engine failed for good (its KV could never fit) ended with
    "the output is incomplete (2 tokens sent), retry the request" -- and failed the same way each retry."""
    import grpc

    from router.client_stream import Sent as _Sent
    from router.client_stream import gave_up as _gave_up

    sent = _Sent([5, 6])
    assert _gave_up(sent, "down", grpc.StatusCode.UNAVAILABLE, streamed=True).endswith(
        "(2 tokens sent), retry the request"
    )
    assert _gave_up(sent, "cut", grpc.StatusCode.CANCELLED, streamed=True).endswith("retry the request")
    failed = _gave_up(sent, "the engine failed", grpc.StatusCode.INTERNAL, streamed=True)
    assert failed == "the engine failed; the output is incomplete (2 tokens sent)"
    assert _gave_up(_Sent(), "down", grpc.StatusCode.UNAVAILABLE, streamed=True) == "down"
    # Another probe: a non-streamed call got "(8 tokens sent)" with no token in its reply.  A client that
    # reads the output whole is told none is returned, and to retry where a retry may succeed.
    whole = _gave_up(sent, "down", grpc.StatusCode.UNAVAILABLE, streamed=False)
    assert whole == "down; no output is returned, retry the request"
    assert (
        _gave_up(sent, "failed", grpc.StatusCode.INTERNAL, streamed=False) == "failed; no output is returned"
    )


def test_the_admitted_request_says_whether_the_client_streams(tmp_path: Path) -> None:
    """What ``gave_up`` is told: the OpenAI API's ``stream``, and which gRPC method the call came by."""
    from pdkv_proto.pdkv.v1 import generation_pb2
    from router.admission import Admission
    from router.auth import OPEN, Caller
    from router.openai_requests import completion_request
    from router.openai_schema import CompletionRequest
    from router.servicer import GenerationServicer
    from router.tokenizer import load_model
    from tests.gguf_models import write_gguf
    from tests.tiny_models import pdkv_tiny_model_dir

    model = load_model(write_gguf(pdkv_tiny_model_dir(), tmp_path / "tiny.gguf", qtype="F32"))
    admission, caller = Admission(model), Caller(OPEN, "peer:test", 8, cache_details=False)
    for stream in (True, False):
        body = CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", "stream": stream})
        assert admission.admit(completion_request(body, model), caller).streamed is stream
    servicer: Any = SimpleNamespace(admission=admission)
    request = generation_pb2.GenerateRequest(text="hi")
    assert GenerationServicer._admitted(servicer, request, caller, streamed=True).streamed
    assert not GenerationServicer._admitted(servicer, request, caller, streamed=False).streamed
