"""Every metric the Grafana dashboard (deploy/grafana/pdkv-dashboard.json) names is exported by a process
of a real cluster, and the processes' /metrics say what docs/metrics.md says: the store server serves
/metrics under ``pdkv up``'s launcher too, and node and router series carry ``model_name``.

Two clusters, so that each query has a process that answers it: a disaggregated one (router, two prefill
nodes, one decode node, a store server; round-robin, so that a prompt computed on one prefill node is
loaded from the store by the other, and pulled by the decode node) and a colocated one (its router's
pool is ``colocated``).  Nothing is timed: every wait is a condition with a deadline."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from serving.client import generate_request
from tests.deploy.monitoring import dashboard, expressions, metric_names, variable_metrics
from tests.serving.helpers import pdkv_model, start_cluster, wait_until

# Long enough for several full blocks (16 tokens each): they are what the store and p2p move.
PROMPT = "The store keeps every full block of this prompt, and the other prefill node loads them. " * 4
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def scrape(address: str) -> list[Sample]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        body = response.read().decode()
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def scrape_all(cluster: Cluster) -> dict[str, list[Sample]]:
    """Every child's samples, by child name (the store server's included)."""
    return {name: scrape(address) for name, address in cluster.metrics_addresses().items()}


def value(samples: list[Sample], name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def drive_disaggregated(cluster: Cluster) -> None:
    """One prompt, computed by one prefill node and saved to the store; then twice more, so that the
    other prefill node (round-robin) looks it up in its tiers and loads it from the store server."""
    with cluster.client() as client:
        client.generate(generate_request(PROMPT, PARAMS), timeout=60)
        store = cluster.metrics_addresses()["kvstore"]
        wait_until(
            lambda: value(scrape(store), "pdkv_kvstore_tier_stored_blocks_total") > 0,
            timeout=30,
            what="the store server to hold the prompt's blocks",
        )
        for _ in range(2):
            client.generate(generate_request(PROMPT, PARAMS), timeout=60)
    # The same once over HTTP, and one refusal: HTTP calls count in the router's rpcs_total too.
    model = Path(pdkv_model()).name
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "n": 2}
    assert http_post(cluster, body) == 200
    assert http_post(cluster, {"model": model, "prompt": PROMPT, "best_of": 2}) == 400


def http_post(cluster: Cluster, body: dict[str, object]) -> int:
    request = urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def exported() -> Iterator[dict[str, dict[str, list[Sample]]]]:
    """Samples by cluster ("disaggregated", "colocated"), then by child."""
    out: dict[str, dict[str, list[Sample]]] = {}
    cluster = start_cluster(num_prefill=2, num_decode=1, kv_store="cpu:64MiB", policy="round-robin")
    try:
        drive_disaggregated(cluster)
        out["disaggregated"] = scrape_all(cluster)
    finally:
        cluster.stop()
    cluster = start_cluster(mode="colocated", num_prefill=0, num_decode=1)
    try:
        with cluster.client() as client:
            client.generate(generate_request(PROMPT, PARAMS), timeout=60)
        out["colocated"] = scrape_all(cluster)
    finally:
        cluster.stop()
    yield out


def test_every_metric_the_dashboard_names_is_exported(exported: dict[str, dict[str, list[Sample]]]) -> None:
    names = {s.name for children in exported.values() for samples in children.values() for s in samples}
    dash = dashboard()
    missing = sorted(
        f"{name} (panel {title!r})"
        for title, expr in expressions(dash)
        for name in metric_names(expr) - names
    )
    missing += sorted(f"{name} (a template variable)" for name in variable_metrics(dash) - names)
    assert not missing, "the dashboard names metrics no process exports:\n" + "\n".join(missing)


def test_the_check_finds_a_name_nobody_exports(exported: dict[str, dict[str, list[Sample]]]) -> None:
    names = {s.name for children in exported.values() for samples in children.values() for s in samples}
    assert metric_names("sum(rate(pdkv_router_decode_resumes_total[1m]))") <= names
    assert not metric_names("sum(rate(pdkv_router_decode_resume_total[1m]))") <= names  # a typo


def test_every_process_serves_metrics_and_engines_and_routers_name_their_model(
    exported: dict[str, dict[str, list[Sample]]],
) -> None:
    model = Path(pdkv_model()).name  # a folder: its name, as the router calls it in the HTTP API
    children = exported["disaggregated"]
    assert set(children) == {"kvstore", "prefill-0", "prefill-1", "decode-0", "router"}
    assert set(exported["colocated"]) == {"colocated-0", "router"}
    for cluster in exported.values():
        for name, samples in cluster.items():
            labels = {s.labels.get("model_name") for s in samples}
            # The store keeps blocks of any model: its series carry none.
            assert labels == ({None} if name == "kvstore" else {model}), name
    router = children["router"]
    # The router's histograms count each request once, its prompt once and its choices' tokens summed, as
    # the client was billed (the HTTP request has n=2: it counted twice, its prompt twice).
    assert value(router, "pdkv_router_request_prompt_tokens_count") == 4
    assert value(router, "pdkv_router_e2e_request_latency_seconds_count") == 4
    assert value(router, "pdkv_router_time_to_first_token_seconds_count") == 4
    assert value(router, "pdkv_router_request_generation_tokens_sum") == (3 + 2) * PARAMS.max_tokens
    calls = {
        (s.labels["method"], s.labels["code"]): s.value for s in router if s.name == "pdkv_router_rpcs_total"
    }
    assert calls[("Generate", "OK")] == 3 or calls[("GenerateUnary", "OK")] == 3, calls
    assert (
        calls[("POST /v1/completions", "OK")] == 1
        and calls[("POST /v1/completions", "INVALID_ARGUMENT")] == 1
    )
    # A decode node decodes (more than one token): it has decode times; a prefill node's one token none.
    assert value(children["decode-0"], "pdkv_request_decode_time_seconds_count") == 5  # a choice each
    assert value(children["prefill-0"], "pdkv_request_decode_time_seconds_count") == 0
    assert value(children["prefill-0"], "pdkv_request_prefill_time_seconds_count") >= 1
