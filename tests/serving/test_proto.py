"""The API's .proto files: checked-in stubs are fresh, and a client built from the .proto files alone
(no pdkv import) can call the router, its health service and its reflection service."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdkv.launcher import Cluster

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_stubs_match_the_proto_files() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_stubs_are_not_a_top_level_proto_package() -> None:
    import pdkv_proto.pdkv.v1.generation_pb2 as generation_pb2

    assert generation_pb2.DESCRIPTOR.name == "pdkv/v1/generation.proto"
    assert not (ROOT / "proto" / "__init__.py").exists()
    with pytest.raises(ModuleNotFoundError):
        __import__("pdkv.v1")  # `pdkv` is the command line package; the stubs live in pdkv_proto


CLIENT = textwrap.dedent(
    """
    import json, pathlib, sys
    from grpc_tools import protoc
    import grpc_tools

    gen = pathlib.Path(sys.argv[1])
    proto_root, address = sys.argv[2], sys.argv[3]
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(proto_root)) for p in pathlib.Path(proto_root).glob("pdkv/v1/*.proto")]
    assert protoc.main(["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={gen}",
                        f"--grpc_python_out={gen}", *files]) == 0
    for pkg in (gen / "pdkv", gen / "pdkv" / "v1"):
        (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(gen))

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from pdkv.v1 import generation_pb2, generation_pb2_grpc, types_pb2

    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(
        text="Hello from a stand-alone client", sampling=types_pb2.SamplingParams(max_tokens=8))
    kinds, tokens, done = [], [], None
    for msg in stub.Generate(request, timeout=60):
        kinds.append(msg.WhichOneof("event"))
        if msg.HasField("delta"):
            tokens.extend(msg.delta.token_ids)
        else:
            done = msg.done
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    services = sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
    imported = sorted(m for m in sys.modules if m.split(".")[0] in
                      ("engine", "serving", "router", "pdkv_proto", "connectors", "kvstore"))
    print(json.dumps({
        "pdkv_file": sys.modules["pdkv"].__file__, "kinds": kinds, "tokens": tokens,
        "finish": types_pb2.FinishReason.Name(done.finish_reason), "prompt_tokens": done.usage.prompt_tokens,
        "health": health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
        "services": services, "imported": imported,
    }))
    """
)


def test_a_client_generated_from_the_proto_files_alone_can_generate(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    gen = tmp_path / "gen"
    gen.mkdir()
    result = subprocess.run(
        [sys.executable, "-I", str(script), str(gen), str(ROOT / "proto"), cluster.router_address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["pdkv_file"].startswith(str(gen))
    assert out["imported"] == []
    assert out["kinds"][-1] == "done" and set(out["kinds"][:-1]) == {"delta"}
    assert len(out["tokens"]) == 8 and out["finish"] == "FINISH_REASON_LENGTH"
    assert out["prompt_tokens"] > 0
    assert out["health"] == "SERVING"
    assert {"pdkv.v1.Generation", "grpc.health.v1.Health"} <= set(out["services"])


def test_nodes_answer_health_and_reflection(cluster: Cluster) -> None:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from serving.health import check

    for node in cluster.prefill_nodes + cluster.decode_nodes:
        service = "pdkv.v1.PrefillNode" if node.role == "prefill" else "pdkv.v1.DecodeNode"
        assert check(node.address, service=service) == "SERVING"
        assert check(node.address, service="pdkv.v1.Node") == "SERVING"
        with grpc.insecure_channel(node.address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {service, "pdkv.v1.Node", "grpc.health.v1.Health"} <= services


def test_health_watchers_hear_of_changes_only(cluster: Cluster) -> None:
    """The router and the nodes set their status every health round; grpcio's servicer told each
    ``Watch`` caller every time -- "SERVING" twice a second where the protocol sends one per change."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.health import HealthStatus

    for address in (cluster.router_address, cluster.decode_nodes[0].address):
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=2)
            statuses: list[int] = []
            with pytest.raises(grpc.RpcError) as info:
                for reply in watch:  # the router's health rounds are 0.5 s apart: three or four in 2 s
                    statuses.append(reply.status)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert statuses == [health_pb2.HealthCheckResponse.SERVING], address

    servicer, heard = HealthStatus(), list[health_pb2.HealthCheckResponse]()
    servicer._send_response_callbacks["x"] = [heard.append]  # what Watch registers
    for status in ("SERVING", "SERVING", "NOT_SERVING", "NOT_SERVING", "SERVING"):
        servicer.set("x", getattr(health_pb2.HealthCheckResponse, status))
    assert [h.status for h in heard] == [1, 2, 1]


def test_every_rpc_refuses_a_field_it_does_not_know(cluster: Cluster) -> None:
    """GetModelInfo and the adapter calls accepted a message carrying a newer client's field, which
    docs/api.md says every service refuses: a LoadAdapter flag, say, would be dropped.  (A node's Abort
    and Stats, which change no output, take what a newer router sends in a rolling upgrade.)"""
    import grpc

    unknown = bytes([0xB8, 0x3E, 0x01])  # field 999, a varint 1: no message of the API has it
    for address, method in (
        (cluster.router_address, "/pdkv.v1.Generation/GetModelInfo"),
        (cluster.router_address, "/pdkv.v1.Generation/UnloadAdapter"),
        (cluster.decode_nodes[0].address, "/pdkv.v1.Node/UnloadAdapter"),
    ):
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                call(unknown, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "#999: is not a field of this server's API" in (info.value.details() or ""), method


def _v1_list_services(address: str) -> list[str]:
    """ListServices over ``grpc.reflection.v1`` (the messages are v1alpha's, byte for byte the same)."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        [reply] = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    return [s.name for s in reply.list_services_response.service]


def test_reflection_v1_is_served_next_to_v1alpha(cluster: Cluster) -> None:
    """A v1-only tool (newer grpcurl) got UNIMPLEMENTED before."""
    names = set(_v1_list_services(cluster.router_address))
    assert {"pdkv.v1.Generation", "grpc.reflection.v1.ServerReflection"} <= names
    assert "grpc.reflection.v1alpha.ServerReflection" in names
    node = cluster.decode_nodes[0].address
    assert "pdkv.v1.Node" in set(_v1_list_services(node))


def test_get_model_info_says_what_a_client_needs(cluster: Cluster) -> None:
    import grpc

    from pdkv_proto.pdkv.v1 import generation_pb2, generation_pb2_grpc
    from tests.serving.helpers import pdkv_model
    from tests.tiny_models import TINY_PDKV_SPEC

    with grpc.insecure_channel(cluster.router_address) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=10
        )
    assert info.name == Path(pdkv_model()).name
    assert info.vocab_size == TINY_PDKV_SPEC["vocab"]
    assert info.context_length == 4096
    assert list(info.eos_token_ids) == [TINY_PDKV_SPEC["vocab"] - 1]
    assert info.block_size == 16
    assert info.has_chat_template is False  # make-model folders have none
    fields = set(info.sampling_fields)
    assert {"structured", "logit_bias", "top_logprobs", "presence_penalty", "min_tokens"} <= fields
    assert set(info.structured_kinds) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert info.tool_calls is False and info.tool_call_format == ""  # no chat template, no tools


def test_the_proto_files_name_packages_for_other_languages() -> None:
    for f in sorted((ROOT / "proto" / "pdkv" / "v1").glob("*.proto")):
        text = f.read_text()
        for option in ("go_package", "java_package", "csharp_namespace"):
            assert f"option {option} = " in text, f"{f.name} lacks {option}"
