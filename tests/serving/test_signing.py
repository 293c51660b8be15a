"""Sealed transfer params (serving/signing.py): what opens, and what is refused before any pull."""

from __future__ import annotations

import grpc
import msgpack
import pytest

from serving.errors import ServingError
from serving.signing import TransferSigner, load_cluster_secret

SECRET = b"a cluster secret of some length"
PARAMS = msgpack.packb({"do_remote_prefill": True, "kv_endpoint": "tcp://10.0.0.5:5601"})
PROMPT = [5, 6, 7, 8]


def sealed(**changes: object) -> bytes:
    args: dict[str, object] = {"request_id": "pdkv-1", "prompt_token_ids": PROMPT, "cache_salt": None}
    args.update(changes)
    return TransferSigner(SECRET).seal(PARAMS, first_token_id=3, now=1000.0, **args)  # type: ignore[arg-type]


def test_a_seal_opens_for_exactly_its_request() -> None:
    signer = TransferSigner(SECRET)
    assert signer.open(sealed(), "pdkv-1", PROMPT, None, 3, now=1001.0) == PARAMS
    assert signer.seal(b"", "pdkv-1", PROMPT, None, 3) == b""  # no params, nothing to seal


@pytest.mark.parametrize(
    ("raw", "args", "why"),
    [
        (PARAMS, ("pdkv-1", PROMPT, None, 3), "are not sealed"),  # unsealed params naming any producer
        (b"\xc1garbage", ("pdkv-1", PROMPT, None, 3), "are not sealed"),
        (sealed(), ("pdkv-2", PROMPT, None, 3), "does not match"),  # another request
        (sealed(), ("pdkv-1", [5, 6, 7, 9], None, 3), "does not match"),  # another prompt
        (sealed(), ("pdkv-1", PROMPT, "tenant-b", 3), "does not match"),  # another tenant's salt
        (sealed(), ("pdkv-1", PROMPT, None, 4), "does not match"),  # another first token
        (sealed(), ("pdkv-1", PROMPT, None, None), "need the first_token_id"),
    ],
)
def test_a_seal_that_does_not_vouch_for_the_request_is_refused(raw: bytes, args: tuple, why: str) -> None:
    with pytest.raises(ServingError) as info:
        TransferSigner(SECRET).open(raw, *args, now=1001.0)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and why in info.value.message


def test_another_secret_or_an_expired_seal_is_refused() -> None:
    with pytest.raises(ServingError, match="does not match"):
        TransferSigner(b"another secret, just as long").open(sealed(), "pdkv-1", PROMPT, None, 3, now=1001.0)
    with pytest.raises(ServingError, match="expired"):
        TransferSigner(SECRET).open(sealed(), "pdkv-1", PROMPT, None, 3, now=1000.0 + 601)
    tampered = msgpack.unpackb(sealed())
    tampered["params"] = msgpack.packb({"do_remote_prefill": True, "kv_endpoint": "tcp://evil:1"})
    with pytest.raises(ServingError, match="does not match"):
        TransferSigner(SECRET).open(msgpack.packb(tampered), "pdkv-1", PROMPT, None, 3, now=1001.0)


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_cluster_secret(str(path), environ={}) == SECRET
    assert load_cluster_secret(None, environ={"PDKV_CLUSTER_SECRET_FILE": str(path)}) == SECRET
    assert load_cluster_secret(None, environ={"PDKV_CLUSTER_SECRET": "x" * 20}) == b"x" * 20
    assert load_cluster_secret(None, environ={}) is None
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_secret(None, environ={"PDKV_CLUSTER_SECRET": "short"})
    with pytest.raises(ValueError, match="cannot be read"):
        load_cluster_secret(str(tmp_path / "absent"), environ={})
