"""The serving pieces without processes: conversion, configs, status mapping, phases, node selection."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import msgpack
import pytest

from connectors.registry import KVConnectorConfig
from decode_node.decode import decode_request
from engine.connector.params import KVTransferParams, RemoteDecode, RemotePrefill, encode_transfer_params
from engine.driver import EngineOverloaded, EngineStopped
from engine.engine_config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from node.config import NodeConfig, parse_connector_spec
from pdkv.launcher import Topology, connector_stack
from pdkv.launcher.process import parse_ready
from pdkv_proto.pdkv.v1 import types_pb2
from prefill_node.prefill import prefill_request, prefill_result
from router.config import RouterConfig
from router.nodes import NodeHandle
from router.policy import LeastLoaded, RoundRobin, RoutingInfo
from serving import convert
from serving.errors import ServingError, status_for
from wire.layout import BlockLayout

# -- conversion -------------------------------------------------------------------------------------------


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=4, stop=("x",), logprobs=True
    )
    assert convert.sampling_params(convert.sampling_params_proto(params)) == params
    assert convert.sampling_params(types_pb2.SamplingParams()) == SamplingParams()  # unset = defaults


def test_bad_sampling_params_name_the_field() -> None:
    with pytest.raises(ServingError) as info:
        convert.sampling_params(types_pb2.SamplingParams(top_p=1.5))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("sampling.top_p")


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        (
            types_pb2.StructuredOutput(json_object=False),
            "sampling.structured.json_object: false asks for nothing",
        ),
        (types_pb2.StructuredOutput(), "sampling.structured: names no constraint"),
    ],
)
def test_a_structured_output_that_asks_for_nothing_is_refused_naming_it(structured: Any, says: str) -> None:
    """An outside probe's find: json_object false ran the JSON constraint, an empty message none -- each
    accepted; now refused.  True still constrains."""
    with pytest.raises(ServingError, match=f"^{says}"):
        convert.sampling_params(types_pb2.SamplingParams(structured=structured))
    on = convert.sampling_params(
        types_pb2.SamplingParams(structured=types_pb2.StructuredOutput(json_object=True))
    )
    assert on.structured is not None and on.structured.kind == "json_object"


def test_transfer_params_travel_losslessly() -> None:
    remote = RemotePrefill(
        engine_id="prefill-0",
        kv_endpoint="tcp://127.0.0.1:5601",
        remote_request_id="r",
        block_ids=(1, 2**40),
        block_hashes=(b"\xab" * 32, b"\x00\xff" * 8),
        num_tokens=32,
        lease_s=30.0,
        layout=BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32"),
        namespace_id="ns",
    )
    for params in (remote, RemoteDecode(), None):
        assert convert.transfer_params(encode_transfer_params(params)) == params
    assert encode_transfer_params(None) == b""
    for raw, why in [
        (b"\xc1garbage", "not a msgpack map"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"k": 1}), "'do_remote_decode' or 'do_remote_prefill'"),
        (msgpack.packb({"do_remote_decode": True, "x": 1}), "takes no other key"),
        (msgpack.packb({**remote.to_map(), "lease_s": 0}), "'lease_s'"),
        (msgpack.packb({**remote.to_map(), "layout": {"num_layers": 2}}), "'layout'"),
    ]:
        with pytest.raises(ServingError, match=f"kv_transfer_params.*{why}"):
            convert.transfer_params(raw)


def test_status_mapping() -> None:
    assert status_for(ValueError("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(EngineOverloaded("x"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(EngineStopped("x"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_for(RuntimeError("boom"))[0] == grpc.StatusCode.INTERNAL


REMOTE = RemotePrefill(
    "p", "tcp://127.0.0.1:1", "r", (), (), 0, 1.0, BlockLayout(1, 1, 8, 16, "float32"), "ns"
)


# -- the two phases ---------------------------------------------------------------------------------------


def output(
    tokens: list[int], reason: str, *, prompt: int = 10, params: KVTransferParams | None = None
) -> RequestOutput:
    return RequestOutput(
        "r", tokens, "t", [], True, finish_reason=reason, num_prompt_tokens=prompt, kv_transfer_params=params
    )


def test_prefill_is_a_one_token_request_kept_for_a_decode_node() -> None:
    req = prefill_request("r", [1, 2, 3], SamplingParams(max_tokens=9, stop=("x",)), "salt", 100)
    assert req.sampling_params.max_tokens == 1 and req.sampling_params.stop == ("x",)
    assert req.kv_transfer_params == RemoteDecode() and req.cache_salt == "salt"


@pytest.mark.parametrize(
    "max_tokens, prompt_len, max_model_len",
    [(1, 3, 100), (9, 99, 100), (9, 100, 100)],
    ids=["one-token", "context-full-after-first", "context-full"],
)
def test_prefill_asks_for_no_remote_decode_when_decode_would_have_nothing_to_do(
    max_tokens: int, prompt_len: int, max_model_len: int
) -> None:
    """The hand-off is decided once, before the engine runs: nothing is leased for a decode that will
    not come (the prefill node used to lease, then release at once)."""
    req = prefill_request("r", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), None, max_model_len)
    assert req.kv_transfer_params is None and req.sampling_params.max_tokens == 1


@pytest.mark.parametrize(
    "reason, max_tokens, prompt, ends, client_reason",
    [
        ("length", 9, 10, False, None),  # the usual case: decode continues
        ("stop", 9, 10, True, "stop"),  # EOS or a stop on the first token
        ("length", 1, 10, True, "length"),  # the client asked for one token
        ("length", 9, 99, True, "length"),  # prompt + 1 fills max_model_len 100
    ],
)
def test_prefill_result(
    reason: str, max_tokens: int, prompt: int, ends: bool, client_reason: str | None
) -> None:
    result = prefill_result(
        output([5], reason, prompt=prompt, params=REMOTE), SamplingParams(max_tokens=max_tokens), 100
    )
    assert result.ends_here is ends and result.finish_reason == client_reason
    assert result.first_token_id == 5
    assert result.text == ("t" if ends else "")
    assert result.kv_transfer_params == (None if ends else REMOTE)


def test_decode_continues_with_the_first_token() -> None:
    params = REMOTE
    req = decode_request("r", [1, 2, 3], SamplingParams(max_tokens=5), None, 7, params)
    assert list(req.prompt) == [1, 2, 3, 7] and req.prior_output_token_ids == (7,)
    assert req.sampling_params.max_tokens == 4 and req.kv_transfer_params is params
    whole = decode_request("r", [1, 2, 3], SamplingParams(max_tokens=5), None, None, None)
    assert list(whole.prompt) == [1, 2, 3] and whole.sampling_params.max_tokens == 5
    with pytest.raises(ServingError, match=r"sampling\.max_tokens"):
        decode_request("r", [1], SamplingParams(max_tokens=1), None, 7, None)
    with pytest.raises(ServingError, match="first_token_id"):
        decode_request("r", [1], SamplingParams(), None, None, params)


def test_decode_resumes_after_the_tokens_the_client_has() -> None:
    req = decode_request("r", [1, 2, 3], SamplingParams(max_tokens=6), None, None, None, [7, 8, 9])
    assert list(req.prompt) == [1, 2, 3, 7, 8, 9] and req.prior_output_token_ids == (7, 8, 9)
    assert req.sampling_params.max_tokens == 3 and req.kv_transfer_params is None
    with pytest.raises(ServingError, match="nothing is left to generate"):
        decode_request("r", [1], SamplingParams(max_tokens=3), None, None, None, [7, 8, 9])
    with pytest.raises(ServingError, match="resume_output_token_ids: excludes"):
        decode_request("r", [1], SamplingParams(max_tokens=9), None, 7, None, [7, 8])
    with pytest.raises(ServingError, match="resume_output_token_ids: excludes"):
        decode_request("r", [1], SamplingParams(max_tokens=9), None, None, {"k": 1}, [7, 8])


# -- configuration ----------------------------------------------------------------------------------------


def test_connector_spec_forms(tmp_path: object) -> None:
    assert parse_connector_spec("none") is None
    assert parse_connector_spec("p2p") == KVConnectorConfig("p2p")
    spec = parse_connector_spec('{"name": "p2p", "options": {"advertise_host": "{ip}", "lease_s": 5}}')
    assert spec is not None and spec.options["lease_s"] == 5 and "{ip}" not in spec.options["advertise_host"]
    with pytest.raises(ValueError, match="unknown key 'option'"):
        parse_connector_spec('{"name": "p2p", "option": {}}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_connector_spec("{nope")


def test_configs_validate_at_construction() -> None:
    with pytest.raises(ValueError, match="role 'both' is unknown"):
        NodeConfig(role="both")
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        NodeConfig(role="decode", threads=0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        NodeConfig(role="prefill", address="nowhere")
    # An outside probe's find: --lora under the base model's name started (requests naming it ran the base)
    with pytest.raises(ValueError, match="'m' is the base model's name"):
        NodeConfig(role="decode", served_model_name="m", engine=EngineConfig(loras=(("m", "/a"),)))
    NodeConfig(role="decode", served_model_name="m", engine=EngineConfig(loras=(("a", "/a"),)))
    with pytest.raises(ValueError, match="needs at least one prefill node"):
        RouterConfig(decode_nodes=("127.0.0.1:1",))
    with pytest.raises(ValueError, match="drop --prefill"):
        RouterConfig(mode="colocated", prefill_nodes=("127.0.0.1:1",), decode_nodes=("127.0.0.1:2",))
    with pytest.raises(ValueError, match="--prefill must be at least 1"):
        Topology(num_prefill=0)
    with pytest.raises(ValueError, match="node_threads must be at least 1"):
        Topology(node_threads=0)
    with pytest.raises(ValueError, match="list the redis tier in the file"):  # was "@f.toml,redis://..."
        Topology(kv_store="@store.toml", redis=True)


def test_metrics_ports_are_the_documented_ones_node_i_on_base_plus_i() -> None:
    from telemetry.ports import METRICS_PORTS, NODES_PER_KIND, metrics_port

    fixed = Topology(metrics_ports="fixed", num_prefill=2, num_decode=3)
    assert fixed.metrics_address("router") == "127.0.0.1:9400"
    assert fixed.metrics_address("kvstore") == "127.0.0.1:9401"
    assert fixed.metrics_address("prefill", 1) == "127.0.0.1:9411"
    assert fixed.metrics_address("decode", 2) == "127.0.0.1:9432"
    assert fixed.metrics_address("colocated", 0) == "127.0.0.1:9450"
    assert Topology().metrics_address("prefill", 1) == "127.0.0.1:0"  # any: the tests' default
    assert Topology(metrics_ports="none").metrics_address("router") == "none"
    # No two processes of one host share a port, however many nodes of each kind it runs.
    ports = [
        metrics_port(k, i) for k in METRICS_PORTS for i in range(1 if k in ("router", "kvstore") else 20)
    ]
    assert len(ports) == len(set(ports))
    with pytest.raises(ValueError, match="room for 20"):
        metrics_port("prefill", NODES_PER_KIND)
    with pytest.raises(ValueError, match="--metrics-ports any"):
        Topology(metrics_ports="fixed", num_decode=NODES_PER_KIND + 1)
    with pytest.raises(ValueError, match="metrics_ports 'random' is unknown"):
        Topology(metrics_ports="random")


def test_the_command_line_defaults_are_the_documented_metrics_ports() -> None:
    from pdkv.cli import build_parser
    from telemetry.ports import METRICS_PORTS

    parser = build_parser()
    for argv, kind in (
        (["serve-router"], "router"),
        (["serve-prefill"], "prefill"),
        (["serve-decode"], "decode"),
        (["serve-colocated"], "colocated"),
        (["kvstore", "serve", "--kv-store", "cpu:1MiB"], "kvstore"),
    ):
        assert parser.parse_args(argv).metrics_address == f"127.0.0.1:{METRICS_PORTS[kind]}", kind


def test_connector_stack_follows_what_is_registered() -> None:
    both = connector_stack("prefill", "disaggregated", "cpu:1GiB", {"offload", "p2p"})
    assert '"multi"' in both and '"offload"' in both and '"p2p"' in both
    assert connector_stack("decode", "disaggregated", "cpu:1GiB", {"offload", "p2p"}).startswith(
        '{"name": "p2p"'
    )
    assert '"offload"' in connector_stack("colocated", "colocated", "cpu:1GiB", {"offload", "p2p"})
    assert connector_stack("colocated", "colocated", None, {"p2p"}) == "none"


def test_ready_lines_parse() -> None:
    info = parse_ready("pdkv node: serving on 127.0.0.1:5 role=decode metrics=127.0.0.1:6 kv_endpoint=-\n")
    assert info == {"address": "127.0.0.1:5", "role": "decode", "metrics": "127.0.0.1:6", "kv_endpoint": "-"}
    assert parse_ready("some log line") is None


# -- node selection ---------------------------------------------------------------------------------------


def test_round_robin_and_least_loaded() -> None:
    nodes = [NodeHandle(f"127.0.0.1:{p}", "x") for p in (3, 1, 2)]
    info = RoutingInfo("r", [1, 2, 3])
    try:
        rr = RoundRobin()
        assert [rr.choose(nodes, info).address for _ in range(4)] == [
            "127.0.0.1:1",
            "127.0.0.1:2",
            "127.0.0.1:3",
            "127.0.0.1:1",
        ]
        ll = LeastLoaded()
        with nodes[1].busy(), nodes[2].busy():
            assert ll.choose(nodes, info) is nodes[0]
            with nodes[0].busy(), nodes[0].busy():
                assert ll.choose(nodes, info) in (nodes[1], nodes[2])
    finally:
        for n in nodes:
            n.close()


def test_a_streaming_call_the_client_cancels_is_counted_cancelled() -> None:
    """grpcio closes a cancelled stream's generator (GeneratorExit, not an Exception): the call was counted
    nowhere -- neither OK nor an error -- so a node's rpcs_total missed every cancelled Decode."""
    from serving.errors import rpc_errors
    from telemetry.exposition import RpcCounters

    calls = RpcCounters()

    def stream() -> Iterator[int]:
        with rpc_errors(None, calls, "Decode"):  # type: ignore[arg-type]  # no abort on this path
            yield 1
            yield 2

    whole = stream()
    assert list(whole) == [1, 2]
    cut = stream()
    assert next(cut) == 1
    cut.close()
    families = {f.name: f for f in calls.families("pdkv_node")}
    samples = {tuple(s.labels.values()): s.value for s in families["pdkv_node_rpcs"].samples}
    assert samples == {("Decode", "OK"): 1.0, ("Decode", "CANCELLED"): 1.0}


def test_a_call_that_ends_at_its_deadline_by_the_client_s_clock_is_deadline_exceeded() -> None:
    """The client's deadline passes a little before the server's (which starts when the call arrives):
    its cancel at its deadline was counted CANCELLED."""
    from types import SimpleNamespace

    from serving.errors import _why_closed

    def closed(remaining: float | None) -> grpc.StatusCode:
        return _why_closed(SimpleNamespace(time_remaining=lambda: remaining))  # type: ignore[arg-type]

    assert closed(0.0) == closed(0.02) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert closed(2.0) == closed(None) == grpc.StatusCode.CANCELLED


def test_a_stream_whose_deadline_passed_is_counted_deadline_exceeded_not_cancelled() -> None:
    """grpcio closes the generator alike for a client's cancel and a passed deadline; the client sees
    DEADLINE_EXCEEDED for the second, and rpcs_total had counted it CANCELLED."""
    import time
    from concurrent import futures

    from serving.errors import rpc_errors
    from telemetry.exposition import RpcCounters

    calls = RpcCounters()

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with rpc_errors(context, calls, "Generate"):
            for _ in range(100):
                time.sleep(0.05)
                yield b"x"

    def waits(request: bytes, context: grpc.ServicerContext) -> bytes:
        # The router waiting on a node when the deadline passes: its call is cancelled, and the pipeline
        # raises CANCELLED -- counted by why the call ended.
        with rpc_errors(context, calls, "Unary"):
            while context.time_remaining() > 0:
                time.sleep(0.05)
            raise ServingError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        raise AssertionError("unreachable")

    methods = {
        "G": grpc.unary_stream_rpc_method_handler(stream),
        "U": grpc.unary_unary_rpc_method_handler(waits),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.S/G")
            with pytest.raises(grpc.RpcError) as info:
                list(call(b"", timeout=0.3))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            cancelled = call(b"")
            next(cancelled)
            cancelled.cancel()
            with pytest.raises(grpc.RpcError):
                channel.unary_unary("/t.S/U")(b"", timeout=0.3)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                families = {f.name: f for f in calls.families("pdkv_node")}
                samples = {tuple(s.labels.values()): s.value for s in families["pdkv_node_rpcs"].samples}
                if len(samples) == 3:
                    break
                time.sleep(0.05)
    finally:
        server.stop(0)
    assert samples == {
        ("Generate", "DEADLINE_EXCEEDED"): 1.0,
        ("Generate", "CANCELLED"): 1.0,
        ("Unary", "DEADLINE_EXCEEDED"): 1.0,
    }


def test_the_help_pages_print_percent_signs_once_and_name_only_real_commands() -> None:
    """argparse %-formats ``help=`` strings but an epilog only where it names %(prog): the top page had
    printed "1%%", and named a ``serve-node`` command that does not exist."""
    import argparse
    import re

    from pdkv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pages = {"pdkv": parser.format_help()} | {name: p.format_help() for name, p in sub.choices.items()}
    for name, page in pages.items():
        assert "%%" not in page, name
        for command in re.findall(r"\bserve-[a-z]+", page):
            assert command in sub.choices, (name, command)


def test_the_cli_says_when_the_router_hides_cached_tokens_instead_of_printing_zeros() -> None:
    """An outside probe's find: pdkv generate --server printed cached_tokens=local=0,store=0,remote=0 for
    a request served from cache, because the router hid the details (they are off by default there)."""
    from pdkv_proto.pdkv.v1 import generation_pb2
    from serving.client import cached_summary

    hidden = generation_pb2.Usage(prompt_tokens=40)
    assert cached_summary(hidden) == "cached(not shown: cache details are off)"
    shown = generation_pb2.Usage(prompt_tokens=40, cached=generation_pb2.CachedTokens(local_prefix=32))
    assert cached_summary(shown) == "cached(local=32, store=0, remote_prefill=0)"
    assert cached_summary(None) == "cached(?)"
