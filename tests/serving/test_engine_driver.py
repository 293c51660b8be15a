"""``EngineDriver`` (engine/driver.py): one thread owns the engine; others submit, stream and abort."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engine.driver import (
    EngineDriver,
    EngineOverloaded,
    EngineRequest,
    EngineStopped,
    RequestStream,
)
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.snapshot import snapshot
from node.stall import StallWatch
from tests.serving.helpers import engine_idle, pdkv_model, wait_until

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "What is the answer? " * 4]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(pdkv_model(), device="cpu", num_blocks=128)


@pytest.fixture
def driver() -> Iterator[EngineDriver]:
    engine = LLMEngine(EngineConfig(model=pdkv_model(), device="cpu", num_blocks=128))
    d = EngineDriver(engine, max_num_requests=4).start()
    try:
        yield d
    finally:
        d.stop()


def drain(stream: RequestStream, timeout: float = 30.0) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        out = stream.get(timeout)
        assert out is not None, f"no output within {timeout}s"
        outs.append(out)
    return outs


def test_concurrent_submissions_match_offline_generation(driver: EngineDriver, reference: LLM) -> None:
    params = SamplingParams(max_tokens=12)
    expected = reference.generate(PROMPTS, params)
    results: dict[int, list[RequestOutput]] = {}

    def run(i: int) -> None:
        results[i] = drain(driver.submit(EngineRequest(f"r{i}", PROMPTS[i], params)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, exp in enumerate(expected):
        outs = results[i]
        assert [t for o in outs for t in o.new_token_ids] == exp.token_ids
        assert "".join(o.new_text for o in outs) == exp.text
        assert outs[-1].finish_reason == exp.finish_reason
    assert driver.num_requests == 0


def test_bad_input_raises_at_submit_and_frees_the_slot(driver: EngineDriver) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        driver.submit(EngineRequest("bad", [10**6], SamplingParams()))
    assert driver.num_requests == 0


def test_overload_is_refused(driver: EngineDriver) -> None:
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    streams = [driver.submit(EngineRequest(f"long{i}", PROMPTS[0], long)) for i in range(4)]
    with pytest.raises(EngineOverloaded, match="max_num_requests 4"):
        driver.submit(EngineRequest("one-too-many", PROMPTS[0], long))
    for s in streams:
        driver.abort(s.request_id)
    for s in streams:
        assert drain(s)[-1].finish_reason == "abort"
    assert driver.num_requests == 0


def test_abort_mid_stream_frees_every_block(driver: EngineDriver) -> None:
    stream = driver.submit(EngineRequest("a", PROMPTS[2], SamplingParams(max_tokens=400, ignore_eos=True)))
    first = stream.get(30)
    assert first is not None and first.new_token_ids
    driver.abort("a")
    assert drain(stream)[-1].finish_reason == "abort"
    snap = driver.call(lambda e: snapshot(e, check_integrity=True))
    assert snap.integrity_error == ""
    assert engine_idle(snap.stats.gauges)


def test_idle_driver_does_not_step(driver: EngineDriver) -> None:
    drain(driver.submit(EngineRequest("x", PROMPTS[1], SamplingParams(max_tokens=4))))
    steps = driver.call(lambda e: e.stats().counter("engine_steps"))
    # Nothing is pending: the loop blocks on its command queue instead of stepping (calls do not step).
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(
            lambda: driver.call(lambda e: e.stats().counter("engine_steps")) != steps,
            timeout=0.3,
            what="a step",
        )


def test_stop_ends_streams_and_refuses_new_requests() -> None:
    engine = LLMEngine(EngineConfig(model=pdkv_model(), device="cpu", num_blocks=64))
    d = EngineDriver(engine).start()
    stream = d.submit(EngineRequest("s", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)))
    d.stop()
    assert drain(stream)[-1].finish_reason == "abort"
    with pytest.raises(EngineStopped, match="shutting down"):
        d.submit(EngineRequest("late", PROMPTS[0], SamplingParams()))
    assert not d.alive


# -- prior output tokens: the decode node's view of a request a prefill node started --------------------


@pytest.mark.parametrize(
    "prompt, params",
    [
        (PROMPTS[0], SamplingParams(max_tokens=12)),
        (PROMPTS[2], SamplingParams(max_tokens=20, stop=(" a",))),
        ("Hello", SamplingParams(max_tokens=16, stop=("ll",), ignore_eos=True)),
    ],
)
def test_prior_output_tokens_continue_the_text_exactly(
    prompt: str, params: SamplingParams, reference: LLM
) -> None:
    """Prefill samples token 1; a second engine continues from prompt + [token 1] with the token as prior
    output: token ids and text are exactly the single engine's, stop strings included."""
    expected = reference.generate([prompt], params)[0]
    engine = reference.engine
    prompt_ids = engine.tokenizer.encode(prompt)
    first = expected.token_ids[0]
    if len(expected.token_ids) < 2:
        pytest.skip("the reference stopped at its first token")
    engine.add_request(
        "cont",
        [*prompt_ids, first],
        dataclasses.replace(params, max_tokens=params.max_tokens - 1),
        prior_output_token_ids=[first],
    )
    tokens, text, reason = [first], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.new_text
            reason = out.finish_reason if out.finished else reason
    assert tokens == expected.token_ids
    assert text == expected.text
    assert reason == expected.finish_reason


@pytest.mark.parametrize("num_prior", [1, 5])
def test_seeded_sampling_continues_after_prior_tokens_as_one_engine_would(
    num_prior: int, reference: LLM
) -> None:
    """Another engine sampled the first ``num_prior`` tokens (a prefill node's first token, or a decode
    node that died mid-stream); this one continues with the same seed and draws the same tokens."""
    params = SamplingParams(max_tokens=14, temperature=1.0, top_k=40, seed=1234, ignore_eos=True)
    expected = reference.generate([PROMPTS[0]], params)[0]
    engine = reference.engine
    prior = expected.token_ids[:num_prior]
    engine.add_request(
        "seeded",
        [*engine.tokenizer.encode(PROMPTS[0]), *prior],
        dataclasses.replace(params, max_tokens=params.max_tokens - num_prior),
        prior_output_token_ids=prior,
    )
    tokens = list(prior)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == expected.token_ids
    # The same tokens as a plain prompt (the draws count from 0 again) give another continuation: the
    # match above is the prior count at work, not a draw that ignores positions.
    engine.add_request(
        "as-prompt",
        [*engine.tokenizer.encode(PROMPTS[0]), *prior],
        dataclasses.replace(params, max_tokens=params.max_tokens - num_prior),
    )
    plain: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            plain += out.new_token_ids
    assert plain != expected.token_ids[num_prior:]


def test_prior_output_tokens_must_end_the_prompt(reference: LLM) -> None:
    with pytest.raises(ValueError, match="prior_output_token_ids must be the last tokens"):
        reference.engine.add_request("p", [1, 2, 3], SamplingParams(), prior_output_token_ids=[4])
    with pytest.raises(ValueError, match="prior_output_token_ids"):
        reference.engine.add_request("q", [4], SamplingParams(), prior_output_token_ids=[4])


def test_a_consumer_that_read_the_final_output_sees_the_request_finished() -> None:
    """The race behind the 30 s stall: the final output was enqueued before the stream was marked
    finished, so an RPC that read it and ended ran its done-callback on an "unfinished" request and
    aborted it -- reclaiming the p2p lease its decode node was about to pull."""
    import queue

    stream = RequestStream("r", num_prompt_tokens=3)
    seen: list[bool] = []

    class Probe(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, item: RequestOutput, block: bool = True, timeout: float | None = None) -> None:
            seen.append(stream.finished)  # what a consumer woken by this put would see
            super().put(item, block, timeout)

    stream._queue = Probe()
    stream.put(RequestOutput("r", [1], "a", [], finished=False))
    stream.put(RequestOutput("r", [2], "b", [], finished=True, finish_reason="length"))
    assert seen == [False, True]


class _EndedContext:
    """A gRPC context whose RPC already ended: add_callback refuses the callback (returns False)."""

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: object) -> bool:
        return False

    def is_active(self) -> bool:
        return False


def test_a_call_that_ended_before_its_callback_was_added_aborts_the_request(driver: EngineDriver) -> None:
    """A client that cancels at the first message: grpc's add_callback returns False and never runs the
    callback, so the request used to run on with nobody reading it."""
    from serving.calls import EngineCall

    request = EngineRequest("early-cancel", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    call = EngineCall(driver, request, _EndedContext())  # type: ignore[arg-type]
    outs = drain(call.stream)
    assert outs[-1].finish_reason == "abort"
    snap = driver.call(lambda e: snapshot(e, check_integrity=True))
    assert engine_idle(snap.stats.gauges)


def test_a_step_that_never_returns_makes_the_node_not_serving_and_says_where(
    driver: EngineDriver, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin's lookup blocked for good holds the engine thread: the node cannot interrupt it, but it
    stops serving (the router and health probes see it) and logs the frames it is stuck in; once the call
    returns, it serves again and the request completes."""
    release = threading.Event()
    books = driver.engine.scheduler.books
    lookup = books.connector.get_num_new_matched_tokens

    def blocked_lookup(request: Any, num_computed: int) -> tuple[int | None, bool]:
        release.wait(30)
        return lookup(request, num_computed)

    books.connector.get_num_new_matched_tokens = blocked_lookup  # type: ignore[method-assign]
    serving: list[bool] = []
    watch = StallWatch(driver, serving.append, stall_s=0.3)
    stream = driver.submit(EngineRequest("stuck", PROMPTS[0], SamplingParams(max_tokens=4)))
    try:
        with caplog.at_level(logging.ERROR, logger="node.stall"):
            wait_until(watch.check, timeout=10, what="the stall seen")
        assert serving == [False]
        assert "blocked_lookup" in caplog.text and "has not returned" in caplog.text
        assert watch.check() and serving == [False]  # said once
    finally:
        release.set()
    assert drain(stream)[-1].finish_reason == "length"
    wait_until(lambda: not watch.check(), timeout=10, what="serving again")
    assert serving == [False, True]


def test_a_scrape_during_a_long_step_answers_with_the_last_figures_and_their_age(
    driver: EngineDriver,
) -> None:
    """An outside probe: a 2500-token prompt's prefill step ran ~9 s on two cores, and the node's
    /metrics answered 503 after 5 s (its Stats alike) -- the gauges went missing when the node was
    busiest.  Now /metrics and Stats wait half a second, then answer with the last figures read, and say
    how old they are (``pdkv_node_stats_age_seconds``, NodeStats.stats_age_s)."""
    import time

    from node.config import NodeConfig
    from node.process import NodeRuntime, node_metrics
    from serving.health import HealthStatus
    from telemetry.exposition import RpcCounters

    node = NodeRuntime(NodeConfig("decode"), driver, RpcCounters(), HealthStatus())
    node.snapshot()  # what NodeRuntime.build reads first
    started, release = threading.Event(), threading.Event()

    def long_step(engine: LLMEngine) -> None:
        started.set()
        release.wait(30)

    threading.Thread(target=driver.call, args=(long_step,), kwargs={"timeout": 60}, daemon=True).start()
    assert started.wait(10)
    try:
        time.sleep(0.3)
        began = time.monotonic()
        families = {f.name: f for f in node_metrics(node)}
        assert time.monotonic() - began < 2.0  # not the 5 s a fresh read waits
        [age] = families["pdkv_node_stats_age_seconds"].samples
        assert age.value >= 0.3
        assert "pdkv_node_requests" in families and "pdkv_num_requests_running" in families
        snap, age_s = node.recent_snapshot()
        assert age_s >= 0.3 and snap.engine_id == driver.engine.config.engine_id
    finally:
        release.set()
    wait_until(lambda: node.recent_snapshot()[1] == 0.0, timeout=10, what="fresh figures again")


def test_a_drain_during_a_long_step_waits_it_out_instead_of_dying(driver: EngineDriver) -> None:
    """An outside probe: a prefill node restarted (SIGTERM) while 2000-token prompts prefilled on a loaded
    host exited 1 after 19 s -- its drain read the holds with a 5 s wait, and a longer step's TimeoutError
    ended the drain (and the process) with the prefills and held KV thrown away.  Now the drain keeps the
    last count through a long step and finishes once the step does; the totals line answers too."""
    import time

    from node.config import NodeConfig
    from node.process import STATS_TIMEOUT_S, NodeRuntime
    from serving.drain import Drain
    from serving.health import HealthStatus
    from telemetry.exposition import RpcCounters

    node = NodeRuntime(NodeConfig("prefill"), driver, RpcCounters(), HealthStatus())
    node.drainer = Drain("prefill-x", node.drain_progress, 60.0, poll_s=0.05, out=lambda line: None)
    started = threading.Event()
    step_s = STATS_TIMEOUT_S + 2.0  # longer than any read of the engine waits

    def long_step(engine: LLMEngine) -> None:
        started.set()
        time.sleep(step_s)

    threading.Thread(target=driver.call, args=(long_step,), kwargs={"timeout": 60}, daemon=True).start()
    assert started.wait(10)
    began = time.monotonic()
    during = node.drain_progress()  # raised TimeoutError when the step outlasted the read's wait
    assert not during.done and during.holds == 1  # unknown while the step runs: not done
    assert node.totals_line().endswith("totals: unknown (the engine is inside a step)")  # no figures yet
    assert time.monotonic() - began < step_s - 0.5, "both answered inside the step"
    report = node.drain()
    assert report.left.done and time.monotonic() - began < 30, report.summary()
    assert "totals: kv_load_failures 0, kv_hold_expiries 0" in node.totals_line()
