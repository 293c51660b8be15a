"""TLS on gRPC (and the router's HTTP API) from one cluster TLS folder.

The folder (``--tls-dir DIR`` or ``$PDKV_TLS_DIR``; ``pdkv up --secure`` writes one, 0700, files 0600)::

    ca.pem                      the cluster's CA certificate: what clients and the router trust
    server.pem, server.key      the certificate every pdkv server presents (its names: the cluster's hosts)
    client.pem, client.key      the router's client certificate, for mutual TLS with the nodes

The CA's own key is not kept there (``write_tls_folder`` leaves it out), so a process holding the folder
cannot issue certificates.  Mutual TLS (``--mtls`` on the nodes): a node then serves only clients whose
certificate the CA signed, i.e. the router.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

TLS_DIR_ENV = "PDKV_TLS_DIR"
CA, SERVER, CLIENT = "ca", "server", "client"
# A name every server certificate of the folder carries: cluster-internal channels (router -> nodes) check
# it, so a node reached by IP (DNS discovery, a restarted container) needs no certificate of its own --
# any certificate the cluster's CA signed for a pdkv server will do, and no other.
CLUSTER_NAME = "pdkv-server"


@dataclass(frozen=True)
class TLSFolder:
    path: Path

    @classmethod
    def from_option(cls, value: str | None, environ: dict[str, str] | None = None) -> TLSFolder | None:
        """``--tls-dir`` (else ``$PDKV_TLS_DIR``) -> the folder, checked; None when neither is set."""
        env = os.environ if environ is None else environ
        text = value or env.get(TLS_DIR_ENV) or ""
        if not text:
            return None
        folder = cls(Path(text))
        folder.need(f"{CA}.pem")
        return folder

    def need(self, *names: str) -> None:
        for name in names:
            if not (self.path / name).is_file():
                raise ValueError(f"the TLS folder {self.path} has no {name} (pdkv up --secure writes one)")

    def _read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    @property
    def ca_file(self) -> Path:
        return self.path / f"{CA}.pem"

    @property
    def server_cert_file(self) -> Path:
        return self.path / f"{SERVER}.pem"

    @property
    def server_key_file(self) -> Path:
        return self.path / f"{SERVER}.key"

    def server_credentials(self, *, mutual: bool = False) -> grpc.ServerCredentials:
        """The server's certificate; ``mutual``: clients must present one the CA signed."""
        self.need(f"{SERVER}.pem", f"{SERVER}.key")
        pair = [(self._read(f"{SERVER}.key"), self._read(f"{SERVER}.pem"))]
        if not mutual:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(
            pair, root_certificates=self._read(f"{CA}.pem"), require_client_auth=True
        )

    def channel_credentials(self, *, client_cert: bool = True) -> grpc.ChannelCredentials:
        """Trust the cluster's CA; present the client certificate when the folder has one."""
        has_client = (self.path / f"{CLIENT}.pem").is_file() and (self.path / f"{CLIENT}.key").is_file()
        if client_cert and has_client:
            return grpc.ssl_channel_credentials(
                root_certificates=self._read(f"{CA}.pem"),
                private_key=self._read(f"{CLIENT}.key"),
                certificate_chain=self._read(f"{CLIENT}.pem"),
            )
        return grpc.ssl_channel_credentials(root_certificates=self._read(f"{CA}.pem"))


def channel(
    address: str, tls: TLSFolder | None, options: Sequence[tuple[str, object]] = (), *, internal: bool = True
) -> grpc.Channel:
    """A channel to a pdkv server: TLS when ``tls`` is set, plain otherwise.  ``internal``: the server is
    one of the cluster's (checked by ``CLUSTER_NAME``, not by the address's host name)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    opts = [*options, ("grpc.ssl_target_name_override", CLUSTER_NAME)] if internal else list(options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


def add_port(server: grpc.Server, address: str, tls: TLSFolder | None, *, mutual: bool = False) -> int:
    """Bind ``server`` to ``address`` (TLS when ``tls`` is set); the port bound (0: failed -- grpcio
    returns 0 or raises RuntimeError, by version)."""
    try:
        if tls is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, tls.server_credentials(mutual=mutual)))
    except RuntimeError:  # "Failed to bind to address ...": in use, or not this machine's
        return 0


# A host name a certificate can carry: dot-separated labels of letters, digits and inner hyphens, an
# optional leading wildcard label.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*\.?")


def check_hosts(hosts: Sequence[str]) -> None:
    """Each host an IP address or a DNS name: a certificate for "a b" or "1.2.3.4/24" names nothing."""
    for host in hosts:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _DNS_NAME.fullmatch(host):
                raise ValueError(
                    f"host {host!r} is neither an IP address nor a DNS name (letters, digits, '-', '.', "
                    "a leading '*.')"
                ) from None


def write_tls_folder(folder: Path, hosts: Sequence[str], *, days: int = 365) -> TLSFolder:
    """A fresh CA, a server certificate for ``hosts`` (names or IPs; localhost and loopback always) and a
    client certificate, written 0600 into ``folder`` (0700).  The CA key is discarded."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    check_hosts(hosts)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdkv cluster CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def issue(name: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdkv {name}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        write_private(folder / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        write_private(
            folder / f"{name}.key",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys([CLUSTER_NAME, "localhost", "127.0.0.1", "::1", *hosts]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    write_private(folder / f"{CA}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    issue(SERVER, ExtendedKeyUsageOID.SERVER_AUTH, sans)
    issue(CLIENT, ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("pdkv-router")])
    return TLSFolder(folder)


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path``, readable by the owner only (0600, even if the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_TRUNC
    with open(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
