"""ZeroMQ CURVE on the KV paths: the store server and the p2p block servers accept only allow-listed
clients, and their clients check that they reach the cluster's server.

A cluster's CURVE folder (``$PDKV_CURVE_DIR``; ``pdkv up --secure`` writes one, 0700, files 0600)::

    server.key, server.key_secret       the key pair every pdkv ZeroMQ server of the cluster uses
    clients/NAME.key                    the allow-list: public keys of the clients that may connect
    clients/NAME.key_secret             each client's key pair (a process uses ``$PDKV_CURVE_NAME``'s)

File formats are pyzmq's (``zmq.auth.create_certificates``).  Removing ``clients/NAME.key`` and
restarting the servers revokes that client.  A peer without an allow-listed key never completes the
handshake: none of its messages reaches the server (the ZAP handler logs the refusal).

Servers set a ZAP domain and, where libzmq has it, ``ZAP_ENFORCE_DOMAIN``: should the context's ZAP
handler be gone, handshakes fail instead of admitting any key.  The KV events sockets (a node's and the
store's, and the router's subscriptions) use the same folder.

Every socket reads the folder from the environment when it is made, so the store server, the remote
tier and the p2p connector need no key material in their command lines or connector specs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)


CURVE_DIR_ENV = "PDKV_CURVE_DIR"
ZAP_DOMAIN = "pdkv"
CURVE_NAME_ENV = "PDKV_CURVE_NAME"
SERVER = "server"
CLIENTS = "clients"


@dataclass(frozen=True)
class CurveKeys:
    """One process's view of the cluster's CURVE folder."""

    folder: Path
    name: str  # this process's client identity (clients/NAME.key_secret)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CurveKeys | None:
        env = os.environ if environ is None else environ
        folder = env.get(CURVE_DIR_ENV)
        if not folder:
            return None
        keys = cls(Path(folder), env.get(CURVE_NAME_ENV) or "default")
        keys.check()
        return keys

    def check(self) -> None:
        """Refuse a folder that lacks what this process needs, naming the file."""
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; pyzmq's wheels do")
        for path in (self.folder / f"{SERVER}.key", self._client_secret_path()):
            if not path.is_file():
                raise ValueError(f"${CURVE_DIR_ENV}: {path} is missing (pdkv up --secure writes the folder)")

    def _client_secret_path(self) -> Path:
        return self.folder / CLIENTS / f"{self.name}.key_secret"

    @property
    def server_public(self) -> bytes:
        public, _ = zmq.auth.load_certificate(self.folder / f"{SERVER}.key")
        return public

    def secure_server(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (not yet bound) a CURVE server that admits allow-listed clients only -- and none
        at all should its context's ZAP handler be gone (libzmq would otherwise accept any key)."""
        public, secret = zmq.auth.load_certificate(self.folder / f"{SERVER}.key_secret")
        if secret is None:
            raise ValueError(f"{self.folder / SERVER}.key_secret holds no secret key")
        _authenticator(sock.context, self.folder / CLIENTS)
        sock.zap_domain = ZAP_DOMAIN.encode()
        if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of the cluster's servers."""
        public, secret = zmq.auth.load_certificate(self._client_secret_path())
        if secret is None:
            raise ValueError(f"{self._client_secret_path()} holds no secret key")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = self.server_public


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def _authenticator(context: zmq.Context[Any], allow: Path) -> ThreadAuthenticator:
    """One ZAP handler per context (ZeroMQ asks the context's handler about every CURVE handshake)."""
    with _lock:
        auth = _authenticators.get(id(context))
        if auth is None:
            auth = ThreadAuthenticator(context, log=logging.getLogger("pdkv.zap"))
            auth.start()
            _authenticators[id(context)] = auth
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(allow))
        return auth


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Before ``context.term()``: stop its ZAP handler, if it has one."""
    with _lock:
        auth = _authenticators.pop(id(context), None)
    if auth is not None:
        auth.stop()


def server_socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A server socket, CURVE-secured when ``$PDKV_CURVE_DIR`` is set."""
    sock = context.socket(kind)
    keys = CurveKeys.from_env()
    if keys is not None:
        keys.secure_server(sock)
    return sock


def client_socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A client socket, CURVE-secured when ``$PDKV_CURVE_DIR`` is set."""
    sock = context.socket(kind)
    keys = CurveKeys.from_env()
    if keys is not None:
        keys.secure_client(sock)
    return sock


def write_curve_folder(folder: Path, clients: list[str]) -> Path:
    """Write a cluster's CURVE folder: the server key pair and one key pair per client name."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / CLIENTS).mkdir(mode=0o700, exist_ok=True)
    zmq.auth.create_certificates(str(folder), SERVER)
    for name in clients:
        zmq.auth.create_certificates(str(folder / CLIENTS), name)
    for path in folder.rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    return folder
