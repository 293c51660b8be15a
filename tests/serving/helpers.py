"""Helpers for the serving tests: clusters of real processes on loopback, node stats, waits.

Every wait polls a condition against a deadline (``wait_until``); nothing sleeps and hopes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grpc

from pdkv.launcher import Cluster, Process, Topology
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from tests.tiny_models import pdkv_tiny_model_dir, tiny_model_dir

T = TypeVar("T")

# Small pools so "every block is free again" is cheap to check; small enough models to start fast.
NODE_ARGS = ("--num-blocks", "512", "--device", "cpu", "--log-level", "INFO")
HF_NODE_ARGS = ("--num-blocks", "256", "--block-size", "4", "--device", "cpu", "--log-level", "INFO")


def pdkv_model() -> str:
    """A make-model checkpoint with a real BPE tokenizer (text prompts, stop strings)."""
    return str(pdkv_tiny_model_dir())


def hf_model() -> str:
    """The transformers-written tiny Llama of tests/tiny_models.py (vocab 320, 256 positions)."""
    return str(tiny_model_dir("llama"))


def start_cluster(**options: Any) -> Cluster:
    options.setdefault("model", pdkv_model())
    options.setdefault("kv_store", None)
    options.setdefault("node_args", NODE_ARGS)
    options.setdefault("startup_timeout_s", 120.0)
    options.setdefault("grace_s", 2.0)
    return Cluster.start(Topology(**options))


def node_stats(address: str, *, check_integrity: bool = True) -> node_pb2.NodeStats:
    with grpc.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        return stub.Stats(node_pb2.StatsRequest(check_integrity=check_integrity), timeout=10)


def metric(address: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` (``..._total`` for a counter) whose labels include ``labels`` in
    the /metrics at ``address`` (HOST:PORT), or None.  Parsed, not matched as text: every node and router
    sample carries ``model_name`` besides its own labels."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        body = response.read().decode()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    return None


def wait_until(predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    last: T = predicate()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = predicate()
    return last


def engine_idle(gauges: Mapping[str, float]) -> bool:
    """Nothing running, waiting, loading or held, and every KV block free (gauges by declared key)."""
    busy = ("num_requests_running", "num_requests_waiting", "num_requests_loading", "num_requests_held")
    return (
        not any(gauges.get(k, 0.0) for k in busy)
        and gauges["kv_cache_free_blocks"] == gauges["kv_cache_blocks"]
    )


def assert_node_idle(address: str, *, timeout: float = 10.0) -> node_pb2.NodeStats:
    """Wait until the node holds nothing: no request, every block free, the books balance."""

    def idle() -> node_pb2.NodeStats | None:
        s = node_stats(address)
        ok = s.num_requests == 0 and s.integrity_ok and engine_idle(s.gauges)
        return s if ok else None

    try:
        return wait_until(idle, timeout=timeout, what=f"node {address} to be idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stats: {node_stats(address)}") from None


def assert_usage_adds_up(usage: object) -> None:
    """The accounting every path keeps (generation.proto's Usage): local + store + computed == prompt;
    remote_prefill counts tokens the prefill node computed, so it is never more than those."""
    u: Any = usage
    assert u is not None
    c = u.cached
    assert c.local_prefix + c.store + u.computed_prompt_tokens == u.prompt_tokens, u
    assert c.remote_prefill <= u.prompt_tokens, u


def serving_node(cluster: Cluster) -> Process:
    """The decode (or colocated) node running the one request in flight."""
    busy = [
        p
        for p in cluster.decode_nodes
        if node_stats(p.address, check_integrity=False).gauges["num_requests_running"]
    ]
    assert len(busy) == 1, (
        f"exactly one node should be running the request, {len(busy)} are (finished already?)"
    )
    return busy[0]
