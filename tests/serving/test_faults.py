"""Faults with real processes: a decode node killed mid-stream (with and without another node to resume
on), prefill nodes killed before they answer and while they compute."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from pdkv.launcher import Cluster, Process, RestartPolicy, Topology
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import (
    NODE_ARGS,
    assert_node_idle,
    assert_usage_adds_up,
    metric,
    node_stats,
    pdkv_model,
    serving_node,
    start_cluster,
    wait_until,
)

LONG = SamplingParams(max_tokens=3000, ignore_eos=True)
# Outputs of the streams whose serving node is killed after a few tokens: long enough that the request is
# still running when the client, which may read seconds behind the node, has its first tokens (the tiny
# model decodes 300 tokens in well under a second; a 300-token stream once finished before the kill).
STREAM_TOKENS = 2000
LETTERS = StructuredOutput("regex", "[a-z ]{1,6000}")
PROMPT = "A prompt of a few blocks, so that the prefill node holds KV for the decode node. " * 3


def test_decode_node_killed_mid_stream() -> None:
    cluster = start_cluster(num_prefill=1, num_decode=1)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, LONG), timeout=60)
            deltas = 0
            with pytest.raises(grpc.RpcError) as info:
                for msg in call:
                    deltas += msg.HasField("delta")
                    if deltas == 3:
                        cluster.kill(cluster.decode_nodes[0])
            assert deltas >= 3
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode node" in info.value.details()
            # Whatever the prefill node still held for the dead decoder is freed (well within the lease).
            assert_node_idle(cluster.prefill_nodes[0].address, timeout=10)
            # The router stops routing to the dead node: the next request fails fast, saying why.
            with pytest.raises(grpc.RpcError) as again:
                client.generate(generate_request("Hello", SamplingParams(max_tokens=4)), timeout=30)
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy decode node" in again.value.details()
    finally:
        cluster.stop()


def test_prefill_nodes_killed_before_they_answer() -> None:
    # A long health interval: the router learns that a node died only from the failed call.
    cluster = start_cluster(
        num_prefill=2, num_decode=1, router_args=("--health-interval-s", "60", "--policy", "round-robin")
    )
    try:
        params = SamplingParams(max_tokens=6)
        with GenerationClient(cluster.router_address) as client:
            cluster.kill(cluster.prefill_nodes[0])
            for i in range(4):  # round-robin would send half of them to the dead node: all are retried
                out = client.generate(generate_request(f"{PROMPT} {i}", params), timeout=30)
                assert len(out.token_ids) == 6 and out.finish_reason == "length"
            cluster.kill(cluster.prefill_nodes[1])
            with pytest.raises(grpc.RpcError) as info:
                client.generate(generate_request(PROMPT, params), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefill" in info.value.details()
        assert_node_idle(cluster.decode_nodes[0].address)
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("mode", "params"),
    [
        ("disaggregated", SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)),
        (
            "colocated",
            SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=1.0, top_k=40, seed=5),
        ),
        # Under a constraint: the resumed node's matcher advances over the tokens already sent first.
        (
            "disaggregated",
            SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, structured=LETTERS),
        ),
    ],
    ids=["disaggregated", "colocated-seeded", "disaggregated-regex"],
)
def test_a_decode_node_killed_mid_stream_hands_the_request_to_another(
    mode: str, params: SamplingParams
) -> None:
    """The stream goes on on the other node, which resumes after the tokens the client already has: the
    client sees one uninterrupted output, greedy or seeded, token for token and character for character."""
    cluster = start_cluster(mode=mode, num_prefill=1 if mode == "disaggregated" else 0, num_decode=2)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, params), timeout=120)
            token_ids: list[int] = []
            text = ""
            killed: Process | None = None
            done = None
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    text += msg.delta.text
                    if killed is None and len(token_ids) >= 5:
                        killed = serving_node(cluster)
                        cluster.kill(killed)
                elif msg.HasField("done"):
                    done = msg.done
            assert killed is not None and done is not None
        # Usage speaks of the client's prompt and output, not of the resumed node's longer prompt.
        usage = done.usage
        assert usage.completion_tokens == len(token_ids)
        assert_usage_adds_up(usage)
        if mode == "disaggregated":  # the first decode node pulled the prompt's blocks before it died
            assert usage.cached.remote_prefill > 0
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([PROMPT], params)[0]
        assert token_ids == expected.token_ids
        assert text == expected.text
        if params.structured is not None:
            assert re.fullmatch(LETTERS.spec, text), text[:200]
        survivor = next(p for p in cluster.decode_nodes if p is not killed)
        assert_node_idle(survivor.address)
        assert metric(cluster.router.info["metrics"], "pdkv_router_decode_resumes_total") == 1
    finally:
        cluster.stop()


def test_a_frozen_decode_node_s_stream_goes_on_on_another() -> None:
    """An outside drill stopped (SIGSTOP) the decode node serving a stream: the router marked it down at
    once, but the stream waited, tokenless, for as long as the node stayed frozen (its connection open,
    no call failing) -- 61 s for a 60 s freeze, with another decode node idle.  Now a node that answers
    no health check for --reroute-after-s has its calls cancelled and resumed elsewhere: same tokens."""
    import os
    import signal
    import time

    params = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)
    cluster = start_cluster(num_prefill=1, num_decode=2, router_args=("--reroute-after-s", "3"))
    frozen: Process | None = None
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, params), timeout=120)
            token_ids: list[int] = []
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    if frozen is None and len(token_ids) >= 5:
                        frozen = serving_node(cluster)
                        os.kill(frozen.pid, signal.SIGSTOP)  # Cluster.kill would wait for it to exit
                        stopped_at = time.monotonic()
            assert frozen is not None
            waited = time.monotonic() - stopped_at
        assert waited < 30, f"the stream waited {waited:.0f} s for the frozen node"
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([PROMPT], params)[0]
        assert token_ids == expected.token_ids
        assert metric(cluster.router.info["metrics"], "pdkv_router_decode_resumes_total") == 1
    finally:
        if frozen is not None:
            os.kill(frozen.pid, signal.SIGCONT)
        cluster.stop()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_prefill_node_killed_while_it_computes_hands_the_request_to_another(fault: str) -> None:
    """Chunked prefill of 16 tokens a step makes a long prompt take many steps; the node computing it is
    killed (or frozen: SIGSTOP, its connection open) on the way, and the router runs the prefill again on
    the other node: the client sees one complete, exact output."""
    import os
    import signal

    prompt = PROMPT * 12
    params = SamplingParams(max_tokens=8)
    # Killed: the failing call tells the router (no health round in time).  Frozen: nothing fails; the
    # health rounds find it unanswering, and after --reroute-after-s its call is cancelled.
    rounds = ("--health-interval-s", "60") if fault == "killed" else ("--reroute-after-s", "3")
    cluster = start_cluster(
        num_prefill=2,
        num_decode=1,
        node_args=(*NODE_ARGS, "--max-num-batched-tokens", "16"),
        router_args=rounds,
    )
    victim: Process | None = None
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(prompt, params), timeout=120)

            def computing() -> Process | None:
                busy = [
                    p
                    for p in cluster.prefill_nodes
                    if node_stats(p.address, check_integrity=False).gauges["num_requests_running"]
                ]
                return busy[0] if busy else None

            victim = wait_until(
                computing, timeout=30, what="a prefill node to start computing", interval=0.01
            )
            assert node_stats(victim.address, check_integrity=False).num_requests == 1
            if fault == "killed":
                cluster.kill(victim)
            else:
                os.kill(victim.pid, signal.SIGSTOP)
            token_ids: list[int] = []
            text = ""
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    text += msg.delta.text
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([prompt], params)[0]
        assert token_ids == expected.token_ids and text == expected.text
        survivor = next(p for p in cluster.prefill_nodes if p is not victim)
        assert_node_idle(survivor.address)
        assert_node_idle(cluster.decode_nodes[0].address)
    finally:
        if fault == "frozen" and victim is not None:
            os.kill(victim.pid, signal.SIGCONT)
        cluster.stop()


def test_pdkv_up_restarts_a_dead_child_while_a_stream_in_flight_completes() -> None:
    """``pdkv up`` supervises: a decode node killed mid-stream is restarted on its address (the router
    finds it there again) while the stream goes on on the other node; nothing stops the cluster."""
    cluster = start_cluster(num_prefill=1, num_decode=2, restart_policy=RestartPolicy(backoff_s=0.2))
    stop = threading.Event()
    watcher = threading.Thread(target=cluster.watch, args=(stop, 0.1), daemon=True)
    watcher.start()
    try:
        params = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, params), timeout=120)
            token_ids: list[int] = []
            killed: Process | None = None
            first_pid = -1
            for msg in call:
                if msg.HasField("delta"):
                    token_ids += msg.delta.token_ids
                    if killed is None and len(token_ids) >= 5:
                        killed = serving_node(cluster)
                        first_pid, address = killed.pid, killed.address
                        cluster.kill(killed)
            assert killed is not None
            expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([PROMPT], params)[0]
            assert token_ids == expected.token_ids
            # Restarted, on the address the router knows, and serving again.
            wait_until(
                lambda: killed.alive() and killed.pid != first_pid and killed.ready.is_set(),
                timeout=60,
                what="the killed decode node to be restarted",
            )
            assert killed.address == address and killed.restarts == 1
            assert_node_idle(address, timeout=30)
            router_metrics = cluster.router.info["metrics"]

            def router_sees_it_up() -> bool:
                return metric(router_metrics, "pdkv_router_decode_node_up", node=address) == 1

            wait_until(router_sees_it_up, timeout=30, what="the router to see the restarted node up")
            out = client.generate(generate_request("Hello", SamplingParams(max_tokens=4)), timeout=30)
            assert len(out.token_ids) == 4
        assert "--- pdkv up: restart 1 ---" in killed.log_path.read_text()
    finally:
        stop.set()
        watcher.join(10)
        cluster.stop()


def test_a_child_that_keeps_dying_stops_the_cluster(tmp_path: Path) -> None:
    """Each death is restarted after a doubling backoff; ``max_deaths`` within the window end supervision
    with a message naming the child."""
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, max_deaths=3, window_s=60.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]
    cluster = Cluster(Topology(log_dir=tmp_path, restart_policy=policy))
    crash = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    proc = cluster._spawn("flaky", "store", crash)
    proc.popen.wait(30)
    now = 1000.0
    assert cluster.supervise(now) is None and proc.restart_at == now + 1.0  # dead: restart due in 1 s
    assert cluster.supervise(now + 0.5) is None and not proc.alive()  # not yet
    assert cluster.supervise(now + 1.0) is None and proc.restarts == 1  # restarted
    proc.popen.wait(30)
    assert cluster.supervise(now + 2.0) is None and proc.restart_at == now + 4.0  # second death: 2 s
    assert cluster.supervise(now + 4.0) is None and proc.restarts == 2
    proc.popen.wait(30)
    failure = cluster.supervise(now + 5.0)
    assert failure is not None and "flaky died 3 times within 60s" in failure and "boom" in failure
    log = proc.log_path.read_text()
    assert log.count("boom") == 3 and "--- pdkv up: restart 2 ---" in log
    cluster.stop()
    assert cluster.supervise(now + 100.0) is None  # stopped: nothing is restarted


def test_a_restart_listens_where_the_first_run_did() -> None:
    node = Process(
        "decode-0", "decode", ["pdkv", "--address", "127.0.0.1:0", "--metrics-address", "h:0"], Path("x")
    )
    node.info = {"address": "127.0.0.1:5001", "metrics": "127.0.0.1:5002"}
    node.pin_addresses()
    assert node.argv == ["pdkv", "--address", "127.0.0.1:5001", "--metrics-address", "127.0.0.1:5002"]
    store = Process(
        "kvstore",
        "store",
        ["pdkv", "--bind", "tcp://h:0", "--metrics-address", "h:0", "--kv-events", "tcp://h:0"],
        Path("x"),
    )
    store.info = {"address": "tcp://h:7000", "metrics": "h:7003", "kv_events": "tcp://h:7001,tcp://h:7002"}
    store.pin_addresses()
    assert store.argv == [
        "pdkv",
        "--bind",
        "tcp://h:7000",
        "--metrics-address",
        "h:7003",
        "--kv-events",
        "tcp://h:7001",
        "--kv-events-replay",
        "tcp://h:7002",
    ]
