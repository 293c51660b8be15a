"""LoRA adapters through real processes: the router, prefill and decode nodes (and a colocated node),
the store server.  Greedy outputs under each adapter equal peft's on every path (disaggregated,
colocated, a prefix hit, a load from the store, a resumed stream); an adapter's KV is never another's
or the base model's; unknown adapters are 404 / NOT_FOUND; adapters load and unload at run time."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from pdkv.launcher import Cluster, Process, RollingRestarts
from pdkv_proto.pdkv.v1 import generation_pb2, node_pb2, node_pb2_grpc, types_pb2
from serving.client import Completion, GenerationClient, generate_request
from tests.serving.helpers import (
    HF_NODE_ARGS,
    assert_node_idle,
    hf_model,
    serving_node,
    start_cluster,
    wait_until,
)
from tests.tiny_adapters import peft_adapter_dir, peft_greedy
from tests.tiny_models import random_prompts, tiny_model_dir

BASE = "llama"
NEW = 10
PROMPT = random_prompts([35], seed=2)[0]  # no near-tie under the base model or these adapters
GREEDY = SamplingParams(max_tokens=NEW)
F32_ARGS = (*HF_NODE_ARGS, "--dtype", "float32")


def _adapters() -> tuple[tuple[str, str], ...]:
    return (("A", str(peft_adapter_dir(BASE, "r16"))), ("B", str(peft_adapter_dir(BASE, "all_linear"))))


def _cluster(**options: object) -> Cluster:
    options.setdefault("loras", _adapters())
    return start_cluster(model=hf_model(), node_args=F32_ARGS, **options)  # type: ignore[arg-type]


def _run(client: GenerationClient, adapter: str | None) -> Completion:
    return client.generate(generate_request(PROMPT, GREEDY, adapter=adapter), timeout=60)


def _reference(adapter: str | None) -> list[int]:
    folder = dict(_adapters()).get(adapter) if adapter is not None else None
    return peft_greedy(BASE, None if folder is None else Path(folder), [PROMPT], NEW)[0].token_ids


def _usage(result: Completion) -> generation_pb2.Usage:
    assert result.usage is not None
    return result.usage


def _cached(result: Completion) -> int:
    c = _usage(result).cached
    return c.local_prefix + c.store


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_outputs_under_adapters_equal_peft_and_no_adapter_hits_anothers_kv(mode: str) -> None:
    """Two prefill nodes in turn (round-robin): the second run of a prompt under A finds A's blocks in
    the store (the first ran on the other node); B and the base model find nothing of A's, anywhere."""
    two = {"num_prefill": 2, "policy": "round-robin"} if mode == "disaggregated" else {"num_decode": 2}
    cluster = _cluster(mode=mode, kv_store="cpu:64MiB", **two)
    try:
        with GenerationClient(cluster.router_address) as client:
            first = _run(client, "A")
            assert first.token_ids == _reference("A")
            assert _cached(first) == 0
            again = _run(client, "A")  # the other node: A's blocks come from the store
            assert again.token_ids == _reference("A")
            assert _usage(again).cached.store > 0, again.usage
            third = _run(client, "A")  # back on the first node: a local prefix hit
            assert _usage(third).cached.local_prefix > 0, third.usage
            assert third.token_ids == _reference("A")
            if mode == "disaggregated":  # the decode node pulled A's prompt KV, never recomputed it
                assert _usage(first).cached.remote_prefill > 0, first.usage
            # Both nodes hold A's blocks now, and so does the store: B on one, the base on the other,
            # find none of them.
            for other in ("B", None):
                result = _run(client, other)
                assert result.token_ids == _reference(other), other
                assert _cached(result) == 0, (other, result.usage)
            assert _cached(_run(client, "B")) > 0  # B's own blocks are B's to hit
        for p in [*cluster.prefill_nodes, *cluster.decode_nodes]:
            assert_node_idle(p.address)
    finally:
        cluster.stop()


def _openai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)


def test_clients_name_adapters_as_models_and_unknown_ones_are_404_and_not_found() -> None:
    cluster = _cluster(num_prefill=1, num_decode=1, kv_store=None)
    try:
        with _openai(cluster) as sdk:
            models = {m.id: m for m in sdk.models.list().data}
            base = next(iter(models))
            assert set(models) == {base, "A", "B"}
            assert models["A"].model_extra is not None and models["A"].model_extra["parent"] == base
            prompt_text = "".join(chr(t) for t in PROMPT if 32 <= t < 127)[:20] or "hello"
            plain = sdk.completions.create(model=base, prompt=prompt_text, max_tokens=NEW, temperature=0)
            under_a = sdk.completions.create(model="A", prompt=prompt_text, max_tokens=NEW, temperature=0)
            assert plain.choices[0].text != under_a.choices[0].text  # the adapter is applied
            with pytest.raises(openai.NotFoundError, match="'nope' is not served"):
                sdk.completions.create(model="nope", prompt="hi", max_tokens=2)
            # Without the run-time switch, loading is refused (and the server keeps serving).
            with pytest.raises(openai.BadRequestError, match="allow-runtime-lora"):
                sdk.post("/load_lora_adapter", body={"lora_name": "C", "lora_path": "/x"}, cast_to=object)
            assert sdk.completions.create(model="A", prompt="hi", max_tokens=2).choices
        with GenerationClient(cluster.router_address) as client:
            info = client.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert {a.name for a in info.adapters} == {"A", "B"} and info.max_lora_rank == 16
            assert all(len(a.digest) == 32 for a in info.adapters)
            with pytest.raises(grpc.RpcError) as refused:
                _run(client, "nope")
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'nope' is not served" in (refused.value.details() or "")
            assert _run(client, "B").token_ids == _reference("B")
    finally:
        cluster.stop()


def test_an_adapter_whose_files_changed_is_refused_as_server_state(tmp_path: Path) -> None:
    """An adapter dropped from memory (--max-cpu-loras 1) whose files then changed: its requests are
    FAILED_PRECONDITION over gRPC and 409 over HTTP (nothing the client could fix), the message names no
    server path; the other adapter and the base model serve on."""
    three = (*_adapters(), ("C", str(peft_adapter_dir(BASE, "r4"))))
    folders = {n: shutil.copytree(f, tmp_path / n) for n, f in three}
    cluster = start_cluster(
        mode="colocated",
        model=hf_model(),
        node_args=(*F32_ARGS, "--max-loras", "1", "--max-cpu-loras", "1"),
        loras=tuple((n, str(f)) for n, f in folders.items()),
    )
    try:
        with GenerationClient(cluster.router_address) as client:
            assert _run(client, "A").token_ids == _reference("A")
            assert _run(client, "B").token_ids == _reference("B")
            assert len(_run(client, "C").token_ids) == NEW  # A, in no slot now, leaves memory
            weights = "adapter_model.safetensors"
            shutil.copy(peft_adapter_dir(BASE, "r16", seed=3) / weights, Path(folders["A"]) / weights)
            with pytest.raises(grpc.RpcError) as refused:
                _run(client, "A")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
            details = refused.value.details() or ""
            assert "changed since it was loaded" in details and str(tmp_path) not in details
            with _openai(cluster) as sdk, pytest.raises(openai.ConflictError, match="changed since"):
                sdk.completions.create(model="A", prompt="hi", max_tokens=2)
            raw = httpx.post(
                f"http://{cluster.http_address}/v1/completions",
                json={"model": "A", "prompt": "hi", "max_tokens": 2},
                timeout=60,
            )
            assert raw.status_code == 409 and raw.headers["x-should-retry"] == "false"  # the SDK's retries
            assert _run(client, "B").token_ids == _reference("B")
            assert _run(client, None).token_ids == _reference(None)
    finally:
        cluster.stop()


def test_adapters_load_and_unload_at_run_time_on_every_node() -> None:
    cluster = _cluster(num_prefill=1, num_decode=1, kv_store=None, loras=(), allow_runtime_lora=True)
    folder = str(peft_adapter_dir(BASE, "rslora"))
    try:
        with _openai(cluster) as sdk, GenerationClient(cluster.router_address) as client:
            loaded = sdk.post(
                "/load_lora_adapter", body={"lora_name": "C", "lora_path": folder}, cast_to=httpx.Response
            )
            assert loaded.status_code == 200, loaded.text
            for node in [*cluster.prefill_nodes, *cluster.decode_nodes]:
                assert [a.name for a in _stats(node).adapters] == ["C"]
            expected = peft_greedy(BASE, Path(folder), [PROMPT], NEW)[0].token_ids
            assert _run(client, "C").token_ids == expected
            # A node restarted (it serves only its --lora adapters) is given C again by the router.
            RollingRestarts(cluster).restart("decode-0", lambda line: None)
            decode = cluster.decode_nodes[0]
            wait_until(lambda: [a.name for a in _stats(decode).adapters] == ["C"], timeout=30, what="C back")
            wait_until(lambda: _run(client, "C").token_ids == expected, timeout=30, what="C served again")
            # A folder the engine cannot serve: 400 naming why, and nothing is served under the name.
            bad = httpx.post(
                f"http://{cluster.http_address}/v1/load_lora_adapter",
                json={"lora_name": "D", "lora_path": str(peft_adapter_dir("llama_hd32", "r4"))},
                timeout=60,
            )
            assert bad.status_code == 400 and "another model" in bad.json()["error"]["message"]
            assert bad.json()["error"]["param"] == "lora_path"
            # What an outside probe found accepted and dropped, or wrong: each refused naming the field.
            base = sdk.models.list().data[0].id
            for body, param, says in (
                (
                    {"lora_name": "C", "lora_path": folder, "load_inplace": False},
                    "lora_name",
                    "already loaded",
                ),
                ({"lora_name": base, "lora_path": folder}, "lora_name", "the base model's name"),
                ({"lora_name": "a b", "lora_path": folder}, "lora_name", "without spaces"),
                ({"lora_name": "E", "lora_path": folder, "load_inplace": "no"}, "load_inplace", "boolean"),
            ):
                r = httpx.post(f"http://{cluster.http_address}/v1/load_lora_adapter", json=body, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
                assert says in r.json()["error"]["message"], r.text
            r = httpx.post(
                f"http://{cluster.http_address}/v1/unload_lora_adapter",
                json={"lora_name": "C", "lora_int_id": 5},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id", r.text
            assert [m.id for m in sdk.models.list().data] == [base, "C"]
            # the answer names the adapter that served it (as vLLM's does)
            assert sdk.completions.create(model="C", prompt="hi", max_tokens=2).model == "C"
            # Unloading while a stream runs under it: the stream finishes, new requests are refused.
            long = SamplingParams(max_tokens=150, ignore_eos=True)
            call = client.stream(generate_request(PROMPT, long, adapter="C"), timeout=120)
            tokens: list[int] = []
            for msg in call:
                if msg.HasField("delta"):
                    tokens += msg.delta.token_ids
                    if len(tokens) >= 3 and "C" in [a.name for a in _stats(cluster.decode_nodes[0]).adapters]:
                        sdk.post("/unload_lora_adapter", body={"lora_name": "C"}, cast_to=httpx.Response)
            assert len(tokens) == 150
            with pytest.raises(grpc.RpcError) as gone:
                _run(client, "C")
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(openai.NotFoundError):
                sdk.completions.create(model="C", prompt="hi", max_tokens=2)
        for node in [*cluster.prefill_nodes, *cluster.decode_nodes]:
            assert_node_idle(node.address)
    finally:
        cluster.stop()


@pytest.mark.parametrize("change", ["replaced", "unloaded"])
def test_requests_admitted_before_an_adapter_changes_finish_on_its_old_weights(change: str) -> None:
    """An outside probe through P/D: a request's parts that reach the nodes after a replace or an unload
    -- its decode phase, the choices after the first (the router sends them once choice 0 has its first
    token) -- failed ("no healthy decode node serves adapter A@..."; "adapter 'A' is not loaded"), where
    docs/lora.md promises that admitted requests finish on the old weights.  Greedy, so every choice is
    the old adapter's output."""
    cluster = _cluster(num_prefill=1, num_decode=1, kv_store=None, loras=(), allow_runtime_lora=True)
    old, new = (str(peft_adapter_dir(BASE, name)) for name in ("r16", "all_linear"))
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    try:
        with _openai(cluster) as sdk, GenerationClient(cluster.router_address) as client:
            sdk.post("/load_lora_adapter", body={"lora_name": "A", "lora_path": old}, cast_to=httpx.Response)
            msg = generate_request(PROMPT, long, adapter="A")
            msg.n = 3
            choices: dict[int, list[int]] = {0: [], 1: [], 2: []}
            changed = False
            for reply in client.stream(msg, timeout=120):
                if reply.HasField("delta"):
                    choices[reply.index] += reply.delta.token_ids
                    if not changed:  # the first token: the other parts may or may not have reached
                        # the nodes yet (the router starts them as choice 0's first token arrives); the
                        # deterministic checks are tests/engine/test_lora.py's and test_lora_routing.py's
                        body = {"lora_name": "A"} | ({"lora_path": new} if change == "replaced" else {})
                        path = "/load_lora_adapter" if change == "replaced" else "/unload_lora_adapter"
                        done = sdk.post(path, body=body, cast_to=httpx.Response)
                        assert done.status_code == 200, done.text
                        changed = True
            expected = peft_greedy(BASE, Path(old), [PROMPT], long.max_tokens)[0].token_ids
            assert choices == {0: expected, 1: expected, 2: expected}
            if change == "replaced":  # new requests: the new weights
                assert _run(client, "A").token_ids == peft_greedy(BASE, Path(new), [PROMPT], NEW)[0].token_ids
            else:
                with pytest.raises(grpc.RpcError) as gone:
                    _run(client, "A")
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        for node in [*cluster.prefill_nodes, *cluster.decode_nodes]:
            assert_node_idle(node.address)
    finally:
        cluster.stop()


def _stats(node: Process) -> node_pb2.NodeStats:
    with grpc.insecure_channel(node.address) as channel:
        return node_pb2_grpc.NodeStub(channel).Stats(node_pb2.StatsRequest(), timeout=10)


def test_a_decode_node_without_the_adapter_is_never_given_its_requests() -> None:
    """The prefill node serves D (loaded on it alone), no decode node does: the request is refused by
    name rather than decoded on the base model; a node asked for other weights under a name refuses."""
    cluster = _cluster(num_prefill=1, num_decode=1, kv_store=None, loras=(), allow_runtime_lora=True)
    folder = str(peft_adapter_dir(BASE, "r4"))
    try:
        prefill = cluster.prefill_nodes[0]
        with grpc.insecure_channel(prefill.address) as channel:
            info = node_pb2_grpc.NodeStub(channel).LoadAdapter(
                types_pb2.LoadAdapterRequest(name="D", path=folder), timeout=30
            )
        assert len(info.digest) == 32
        with GenerationClient(cluster.router_address) as client:

            def refusal() -> grpc.RpcError | None:
                try:
                    _run(client, "D")
                except grpc.RpcError as exc:
                    return exc if exc.code() == grpc.StatusCode.UNAVAILABLE else None
                raise AssertionError("a request for D ran, but no decode node serves D")

            # NOT_FOUND until the router's health round has seen D on the prefill node, then this:
            refused = wait_until(refusal, timeout=20, what="the router to see D on the prefill node")
            assert "no healthy decode node serves adapter D" in (refused.details() or "")
            assert _run(client, None).token_ids == _reference(None)  # and the server keeps serving
        decode = cluster.decode_nodes[0]
        with grpc.insecure_channel(decode.address) as channel:
            node_pb2_grpc.NodeStub(channel).LoadAdapter(
                types_pb2.LoadAdapterRequest(name="D", path=str(peft_adapter_dir(BASE, "r4", seed=5))),
                timeout=30,
            )
            msg = node_pb2.DecodeRequest(request_id="mismatch", prompt_token_ids=PROMPT)
            msg.sampling.max_tokens = 4
            msg.adapter.name, msg.adapter.digest = "D", info.digest
            with pytest.raises(grpc.RpcError) as other:
                list(node_pb2_grpc.DecodeNodeStub(channel).Decode(msg, timeout=30))
        assert other.value.code() == grpc.StatusCode.NOT_FOUND
        assert "load the same files on every node" in (other.value.details() or "")
    finally:
        cluster.stop()


def test_a_stream_under_an_adapter_resumes_on_another_decode_node_with_the_same_tokens() -> None:
    # 2000 tokens, on the tiny model's long-context twin: the client may read seconds behind the node, and
    # a 200-token stream once finished before its 5th token reached the test (no node left to kill).  float32
    # here: the resume's prefill and the decode steps sum differently; the narrowest top-2 margin of these
    # 2000 tokens is 1.9e-4 in logprob (measured 2026-12-06), far above float32's differences
    loras = (("A", str(peft_adapter_dir("llama_long", "r16"))),)
    cluster = start_cluster(
        model=str(tiny_model_dir("llama_long")),
        node_args=(*F32_ARGS, "--num-blocks", "1024"),  # the last --num-blocks wins
        loras=loras,
        num_prefill=1,
        num_decode=2,
    )
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    try:
        with GenerationClient(cluster.router_address) as client:
            call = client.stream(generate_request(PROMPT, long, adapter="A"), timeout=180)
            tokens: list[int] = []
            killed: Process | None = None
            for msg in call:
                if msg.HasField("delta"):
                    tokens += msg.delta.token_ids
                    if killed is None and len(tokens) >= 5:
                        killed = serving_node(cluster)
                        cluster.kill(killed)
            assert killed is not None
        local = LLM(
            tiny_model_dir("llama_long"),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_blocks=1024,
            loras=loras,
        )
        [expected] = local.generate([PROMPT], long, adapters="A")
        assert len(tokens) == 2000
        assert tokens == expected.token_ids
        survivor = next(p for p in cluster.decode_nodes if p is not killed)
        assert_node_idle(survivor.address)
    finally:
        cluster.stop()
