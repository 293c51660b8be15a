"""The router's access rules against a real cluster: API keys (gRPC metadata and the HTTP header), the
tenant's cache salt decided server-side, cached-token details only where enabled, per-tenant limits, and
streams whose client reads nothing cut after the idle limit."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import msgpack
import pytest
import zmq

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdkv.launcher import Cluster
from pdkv_proto.pdkv.v1 import node_pb2, node_pb2_grpc
from serving import convert
from serving.client import GenerationClient, generate_request
from tests.serving.helpers import NODE_ARGS, assert_node_idle, metric, pdkv_model, start_cluster, wait_until

openai = pytest.importorskip("openai")

ACME = "sk-acme-0123456789abcdef"
GLOBEX = "sk-globex-0123456789abcdef"
INITECH = "sk-initech-0123456789abcdef"
PROMPT = "The tenants of this cluster share its nodes but never each other's cached prefixes. " * 3
SHORT = SamplingParams(max_tokens=4)
# Long enough that a client which never reads fills its flow-control window (bdp probing off).
LONG = SamplingParams(max_tokens=3000, ignore_eos=True)
NO_BDP = (("grpc.http2.bdp_probe", 0),)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(
        f"""
[tenants.acme]
keys = ["{ACME}"]
max_inflight = 2
cache_details = true

[tenants.globex]
keys = ["{GLOBEX}"]
cache_details = true

[tenants.initech]
keys = ["{INITECH}"]
"""
    )
    keys.chmod(0o600)
    secret = keys.parent / "cluster-secret"
    secret.write_bytes(b"the secret the prefill and decode nodes share")
    c = start_cluster(
        num_prefill=1,
        num_decode=1,
        node_args=(*NODE_ARGS, "--cluster-secret-file", str(secret)),
        cache_details=False,  # per tenant, from the keys file
        router_args=(
            "--api-keys-file",
            str(keys),
            "--max-inflight",
            "6",
            "--stream-idle-timeout-s",
            "2",
            "--max-tokens-limit",
            "3000",
        ),
    )
    try:
        yield c
    finally:
        c.stop()


def client(cluster: Cluster, key: str | None, **options: object) -> GenerationClient:
    return GenerationClient(cluster.router_address, api_key=key, **options)  # type: ignore[arg-type]


def router_metric(cluster: Cluster, name: str) -> float | None:
    assert cluster.router is not None
    return metric(cluster.router.info["metrics"], name)


@pytest.mark.parametrize("key", [None, "sk-not-a-key-of-anyone-here"])
def test_grpc_without_a_valid_key_is_unauthenticated(cluster: Cluster, key: str | None) -> None:
    with client(cluster, key) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(generate_request("Hello", SHORT), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in info.value.details()
    with client(cluster, ACME) as c:  # the accepted path still works
        assert len(c.generate(generate_request("Hello", SHORT), timeout=30).token_ids) == 4


def test_http_without_a_valid_key_is_401_shaped_as_openai_errors(cluster: Cluster) -> None:
    base = f"http://{cluster.http_address}/v1"
    # No header at all (raw), then a wrong key (the SDK raises its AuthenticationError on the 401).
    r = httpx.post(f"{base}/completions", json={"model": "x", "prompt": "Hello"}, timeout=30)
    assert r.status_code == 401
    # A body that is not a valid request: still 401, not a 400 describing what a request looks like.
    bad = httpx.post(f"{base}/completions", json={"bogus": 1}, timeout=30)
    assert bad.status_code == 401, bad.text
    assert r.json()["error"]["type"] == "authentication_error" and "API key" in r.json()["error"]["message"]
    with openai.OpenAI(base_url=base, api_key="sk-not-a-key-of-anyone-here", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError) as info:
            sdk.completions.create(model="pdkv-tiny", prompt="Hello", max_tokens=2)
        assert info.value.status_code == 401
        body = info.value.body
        assert isinstance(body, dict) and body["type"] == "authentication_error"
    with openai.OpenAI(base_url=base, api_key=GLOBEX, max_retries=0) as sdk:
        name = sdk.models.list().data[0].id
        r = sdk.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2


def test_a_tenant_cannot_reach_another_tenant_s_cached_prefix(cluster: Cluster) -> None:
    request = generate_request(PROMPT, SHORT)
    with client(cluster, ACME) as acme:
        acme.generate(request, timeout=30)
        again = acme.generate(request, timeout=30).usage
        assert again is not None and again.cached.local_prefix > 0  # the tenant's own prefix hits
    with client(cluster, GLOBEX) as globex:
        for salt in (None, "acme"):  # not even by sending acme's name as its salt
            usage = globex.generate(generate_request(PROMPT, SHORT, cache_salt=salt), timeout=30).usage
            assert usage is not None
            assert usage.cached.local_prefix == 0 and usage.cached.store == 0, usage
            assert usage.computed_prompt_tokens == usage.prompt_tokens


def test_cached_token_details_are_returned_only_where_enabled(cluster: Cluster) -> None:
    with client(cluster, INITECH) as c:
        c.generate(generate_request(PROMPT, SHORT), timeout=30)
        usage = c.generate(generate_request(PROMPT, SHORT), timeout=30).usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 4
    assert not usage.HasField("cached") and usage.computed_prompt_tokens == 0
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=INITECH, max_retries=0) as sdk:
        name = sdk.models.list().data[0].id
        r = sdk.completions.create(model=name, prompt=PROMPT, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is None
    assert "cached_tokens_by_source" not in (r.usage.model_extra or {}).get("pdkv", {})


def test_one_tenant_s_held_streams_do_not_stop_another_tenant(cluster: Cluster) -> None:
    with client(cluster, ACME) as acme, client(cluster, GLOBEX) as globex:
        held = [acme.stream(generate_request(PROMPT, LONG), timeout=60) for _ in range(2)]
        for call in held:
            next(iter(call))  # both in flight
        with pytest.raises(grpc.RpcError) as info:
            acme.generate(generate_request("Hello", SHORT), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'acme'" in info.value.details() and "limit is 2" in info.value.details()
        out = globex.generate(generate_request("Hello", SHORT), timeout=30)  # the other tenant is served
        assert len(out.token_ids) == 4
        for call in held:
            call.cancel()  # type: ignore[attr-defined]
    for node in (*cluster.prefill_nodes, *cluster.decode_nodes):
        assert_node_idle(node.address, timeout=30)


def test_a_stream_whose_client_reads_nothing_is_cut_and_its_request_aborted(cluster: Cluster) -> None:
    with client(cluster, ACME, options=NO_BDP) as stalled, client(cluster, ACME) as other:
        call = stalled.stream(generate_request(PROMPT, LONG), timeout=120)
        next(iter(call))  # started; never read again
        wait_until(
            lambda: router_metric(cluster, "pdkv_router_streams_cut_total") == 1,
            timeout=60,
            what="the router to cut the stalled stream",
            interval=0.2,
        )
        for node in (*cluster.prefill_nodes, *cluster.decode_nodes):
            assert_node_idle(node.address, timeout=30)  # its request was aborted, not left running
        assert len(other.generate(generate_request("Hello", SHORT), timeout=30).token_ids) == 4
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED


def test_sealed_transfer_params_carry_the_prompt_to_the_decode_node(cluster: Cluster) -> None:
    with client(cluster, ACME) as c:
        fresh = "A prompt no node has seen, whose KV only the prefill node computes. " * 3
        usage = c.generate(generate_request(fresh, SHORT), timeout=30).usage
    assert usage is not None and usage.cached.remote_prefill > 0  # the decode node pulled, not recomputed


def test_a_decode_call_with_params_no_prefill_node_sealed_is_refused(cluster: Cluster) -> None:
    """Straight to the decode node, past the router: params naming a producer of the caller's choosing
    are refused before any pull; so are a real prefill node's params replayed for another prompt."""
    ctx = zmq.Context()
    bait = ctx.socket(zmq.ROUTER)
    port = bait.bind_to_random_port("tcp://127.0.0.1")
    prompt = list(range(10, 90))
    sampling = convert.sampling_params_proto(SamplingParams(max_tokens=4))
    forged = msgpack.packb(
        {
            "do_remote_prefill": True,
            "engine_id": "evil",
            "kv_endpoint": f"tcp://127.0.0.1:{port}",
            "remote_request_id": "x",
            "block_ids": [1],
            "block_hashes": ["00" * 16],
            "num_tokens": 16,
        }
    )
    try:
        with grpc.insecure_channel(cluster.decode_nodes[0].address) as ch:
            decode = node_pb2_grpc.DecodeNodeStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                request = node_pb2.DecodeRequest(
                    request_id="forged",
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    first_token_id=1,
                    kv_transfer_params=forged,
                )
                list(decode.Decode(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not sealed by a prefill node" in info.value.details()
            assert bait.poll(500) == 0  # nothing came to pull from the bait
            with grpc.insecure_channel(cluster.prefill_nodes[0].address) as pch:
                prefill = node_pb2_grpc.PrefillNodeStub(pch)
                first = prefill.Prefill(
                    node_pb2.PrefillRequest(request_id="real", prompt_token_ids=prompt, sampling=sampling),
                    timeout=30,
                )
                try:
                    assert first.kv_transfer_params
                    replay = node_pb2.DecodeRequest(
                        request_id="real",
                        prompt_token_ids=[*prompt[:-1], 7],  # not the prompt they were sealed for
                        sampling=sampling,
                        first_token_id=first.first_token_id,
                        kv_transfer_params=first.kv_transfer_params,
                    )
                    with pytest.raises(grpc.RpcError) as info:
                        list(decode.Decode(replay, timeout=30))
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "does not match this request" in info.value.details()
                    replay.prompt_token_ids[:] = prompt  # the request they were sealed for: served
                    out = list(decode.Decode(replay, timeout=30))
                    assert out[-1].finished and out[-1].prompt.external_tokens > 0
                finally:
                    node_pb2_grpc.NodeStub(pch).Abort(node_pb2.AbortRequest(request_id="real"), timeout=10)
    finally:
        bait.close(0)
        ctx.term()
    for node in (*cluster.prefill_nodes, *cluster.decode_nodes):
        assert_node_idle(node.address, timeout=30)


def test_pdkv_up_secure_turns_everything_on_and_a_client_with_the_credentials_is_served() -> None:
    """``--secure``: TLS (mutual to the nodes), an API key, CURVE on the store and p2p, sealed transfer
    params -- and the accepted path still produces the same greedy output, with the prompt's KV pulled."""
    secure = start_cluster(num_prefill=1, num_decode=1, kv_store="cpu:64MiB", secure=True, cache_details=True)
    try:
        secrets, tls = secure.secrets, secure.tls
        assert secrets is not None and tls is not None
        modes = {oct(p.stat().st_mode & 0o777) for p in secrets.folder.rglob("*")}
        assert modes <= {"0o600", "0o700"}, modes
        assert "ca.key" not in {p.name for p in secrets.tls_dir.iterdir()}  # nobody can issue certificates
        assert "curve=on" in next(p for p in secure.processes if p.role == "store").ready_line
        creds = tls.channel_credentials(client_cert=False)
        params = SamplingParams(max_tokens=6)
        fresh = "What a secure cluster computes, it computes once and moves sealed. " * 3
        with GenerationClient(secure.router_address, api_key=secrets.api_key, credentials=creds) as c:
            out = c.generate(generate_request(fresh, params), timeout=60)
        expected = LLM(pdkv_model(), device="cpu", num_blocks=512).generate([fresh], params)[0]
        assert out.token_ids == expected.token_ids
        assert out.usage is not None and out.usage.cached.remote_prefill > 0  # p2p over CURVE, sealed
        # Without TLS, or without the key, the router does not serve.
        with GenerationClient(secure.router_address, api_key=secrets.api_key) as plain:
            with pytest.raises(grpc.RpcError) as info:
                plain.generate(generate_request("Hello", SHORT), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with GenerationClient(secure.router_address, credentials=creds) as keyless:
            with pytest.raises(grpc.RpcError) as info:
                keyless.generate(generate_request("Hello", SHORT), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The nodes serve only the router (mutual TLS): the CA alone does not get a client in.
        with (
            grpc.secure_channel(
                secure.decode_nodes[0].address,
                creds,
                options=[("grpc.ssl_target_name_override", "pdkv-server")],
            ) as ch,
            pytest.raises(grpc.RpcError),
        ):
            node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=5)
        r = httpx.get(
            f"https://{secure.http_address}/v1/models",
            headers={"Authorization": f"Bearer {secrets.api_key}"},
            verify=ssl.create_default_context(cafile=str(tls.ca_file)),
            timeout=10,
        )
        assert r.status_code == 200
    finally:
        secure.stop()


def test_a_node_refuses_a_wide_address_without_tls_unless_insecure(tmp_path: Path) -> None:
    from wire.endpoints import refuse_open_wide_bind

    for address in ("127.0.0.1:1", "localhost:1", "[::1]:1", "tcp://127.0.0.1:7600", "ipc:///tmp/x"):
        refuse_open_wide_bind(address, "gRPC", False, False, "TLS")
    for address in ("0.0.0.0:50061", "tcp://0.0.0.0:7600", "10.0.0.5:1", "127.0.0.1.nip.io:1", "127.corp:1"):
        with pytest.raises(ValueError, match="--insecure"):
            refuse_open_wide_bind(address, "gRPC", False, False, "TLS")
        refuse_open_wide_bind(address, "gRPC", True, False, "TLS")  # secured
        refuse_open_wide_bind(address, "gRPC", False, True, "TLS")  # told so

    def store_serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pdkv", "kvstore", "serve", "--kv-store", "cpu:1MiB", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "PDKV_CURVE_DIR"},
        )

    proc = store_serve("--bind", "tcp://0.0.0.0:0")
    assert proc.returncode != 0 and "refusing to serve the KV store on tcp://0.0.0.0:0" in proc.stderr
    # The events' replay socket too (an outside probe read a store's event history over 0.0.0.0, no CURVE)
    replay = store_serve(
        "--bind",
        "tcp://127.0.0.1:0",
        "--metrics-address",
        "none",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--kv-events-replay",
        "tcp://0.0.0.0:0",
    )
    assert replay.returncode != 0 and "refusing to serve KV events on tcp://0.0.0.0:0" in replay.stderr


def test_max_tokens_above_the_router_s_limit_is_refused_naming_it(cluster: Cluster) -> None:
    with client(cluster, ACME) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(generate_request("Hello", SamplingParams(max_tokens=3001)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens_limit 3000" in info.value.details()
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=ACME, max_retries=0) as sdk:
        name = sdk.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.completions.create(model=name, prompt="Hello", max_tokens=3001)
        assert "allows (3000)" in str(bad.value)


def test_garbage_grpc_bytes_are_logged_once_without_a_traceback(cluster: Cluster) -> None:
    assert cluster.router is not None
    with grpc.insecure_channel(cluster.router_address) as ch:
        call = ch.unary_unary("/pdkv.v1.Generation/GenerateUnary")
        for _ in range(20):
            with pytest.raises(grpc.RpcError):
                call(b"\xff\xff\xff\xff not a protobuf", timeout=10)
    log = cluster.router.log_path.read_text()
    # answered INVALID_ARGUMENT (serving/errors.py's UndecodableRequests), logged once a minute
    assert log.count("/pdkv.v1.Generation/GenerateUnary did not parse") == 1, log[-3000:]
    assert "Traceback" not in log


def test_pdkv_up_secure_refuses_keys_inherited_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The router reads $PDKV_API_KEYS beside its keys file: under --secure an inherited variable added
    tenants to the cluster's own key, silently (a probe got 200 with a stale dev key)."""
    from pdkv.cli import main

    monkeypatch.setenv("PDKV_API_KEYS", "sk-stale-dev-key=dev")
    assert main(["up", "--secure", "--metrics-ports", "none"]) == 2
    assert "PDKV_API_KEYS is set and --secure" in capsys.readouterr().err


def test_secrets_write_keeps_any_folder_of_credentials_and_refuses_other_users_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--keep kept only a folder with an api-key file: one whose clients' key was removed (the keys file
    holds digests) was overwritten, CA and all.  A folder another user owns is refused -- 0600 protects
    nothing in a file its owner can read; and a file where the folder should be is a clear error."""
    from pdkv.cli import main

    folder = tmp_path / "sec"
    assert main(["secrets", "write", str(folder)]) == 0
    (folder / "api-key").unlink()
    ca = (folder / "tls" / "ca.pem").read_bytes()
    assert main(["secrets", "write", str(folder), "--keep"]) == 0
    assert (folder / "tls" / "ca.pem").read_bytes() == ca and not (folder / "api-key").exists()
    assert main(["secrets", "write", str(folder)]) == 1  # without --keep: refused, not overwritten
    (folder / "cluster-secret").unlink()  # a write cut short: neither kept (broken) nor overwritten
    assert main(["secrets", "write", str(folder), "--keep"]) == 1
    assert "holds part of a cluster's credentials (no cluster-secret)" in capsys.readouterr().err
    assert (folder / "tls" / "ca.pem").read_bytes() == ca
    assert main(["secrets", "write", str(tmp_path / "hosts"), "--hosts", "router,a b"]) == 2
    assert "'a b' is neither an IP address nor a DNS name" in capsys.readouterr().err
    assert not (tmp_path / "hosts").exists()
    (tmp_path / "afile").write_text("x")
    assert main(["secrets", "write", str(tmp_path / "afile")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(theirs).st_uid + 1)  # as if another user made it
    assert main(["secrets", "write", str(theirs)]) == 2
    assert "not to this user" in capsys.readouterr().err
    assert not any(theirs.iterdir())
