"""CURVE on the store server (wire/curve.py): forged puts and deletes from a peer without an
allow-listed key never reach the store; the cluster's own clients are served as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.auth
from kvtest import LAYOUT, NAMESPACE, Blocks, StoreServerProcess

from kvstore.config import RemoteTierConfig
from kvstore.tiers.remote import RemoteTier
from wire.codec import BlockCodec
from wire.curve import CurveKeys, write_curve_folder
from wire.store_protocol import Delete, Put

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def forged_put(blocks: Blocks) -> list[bytes]:
    """A well-formed put: valid headers and checksums over the blocks' payloads."""
    codec = BlockCodec(NAMESPACE, LAYOUT)
    headers = b"".join(codec.header_of(h, v) for h, v in zip(blocks.hashes, blocks.views, strict=True))
    return [Put(1, blocks.run(), LAYOUT).encode(), headers, *(bytes(v) for v in blocks.views)]


def answered(endpoint: str, frames: list[bytes], secure: Callable[[zmq.Socket], None] | None = None) -> bool:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secure is not None:
        secure(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        return bool(sock.poll(1500))
    finally:
        sock.close(0)
        ctx.term()


def test_a_peer_without_an_allowed_key_cannot_put_or_delete(
    store_server: Callable[..., StoreServerProcess],
    make_blocks: Callable[..., Blocks],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = write_curve_folder(tmp_path / "curve", ["node-0"])
    assert {oct(p.stat().st_mode & 0o777) for p in folder.rglob("*")} <= {"0o600", "0o700"}
    monkeypatch.setenv("PDKV_CURVE_DIR", str(folder))
    monkeypatch.setenv("PDKV_CURVE_NAME", "node-0")
    server = store_server("cpu:1MiB")  # inherits the environment: a CURVE server
    tier = RemoteTier(RemoteTierConfig(server.endpoint, timeout_s=1.0))  # node-0: allow-listed
    blocks = make_blocks(4)
    try:
        # A stranger without CURVE, then one with keys of its own and the server's public key.
        stranger_public, stranger_secret = zmq.curve_keypair()
        server_public = CurveKeys(folder, "node-0").server_public

        def with_own_keys(sock: zmq.Socket) -> None:
            sock.curve_publickey, sock.curve_secretkey = stranger_public, stranger_secret
            sock.curve_serverkey = server_public

        for secure in (None, with_own_keys):
            assert not answered(server.endpoint, forged_put(blocks), secure)
        assert tier.contains_prefix(blocks.run()) == 0  # nothing of the forged puts was stored
        assert tier.put(blocks.run(), blocks.units()).stored == 4  # the cluster's own client is served
        for secure in (None, with_own_keys):
            delete = [Delete(2, blocks.run()).encode()]
            assert not answered(server.endpoint, delete, secure)
        assert tier.contains_prefix(blocks.run()) == 4  # the stranger's deletes changed nothing
    finally:
        tier.close()


def test_a_curve_folder_missing_this_process_s_key_is_refused(tmp_path: Path) -> None:
    folder = write_curve_folder(tmp_path / "curve", ["node-0"])
    with pytest.raises(ValueError, match=r"clients/router\.key_secret is missing"):
        CurveKeys.from_env({"PDKV_CURVE_DIR": str(folder), "PDKV_CURVE_NAME": "router"})
    assert CurveKeys.from_env({}) is None
