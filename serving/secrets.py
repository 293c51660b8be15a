"""The credentials of a secure cluster, in one folder: what ``pdkv up --secure`` and ``pdkv secrets write``
(compose's ``secrets`` service) create, and how each process finds its part of them (environment
variables naming files; no secret ever travels in argv)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex, token_urlsafe

from serving.tls import check_hosts, write_private

# What a folder of credentials holds: any of them there means the folder is a cluster's already; all of
# REQUIRED, a whole one (api-key is the clients' copy: an operator may keep it elsewhere).
ENTRIES = ("api-key", "api-keys.toml", "cluster-secret", "tls", "curve")
REQUIRED = ("api-keys.toml", "cluster-secret", "tls/ca.pem", "tls/server.key", "curve/server.key")


def credentials_in(folder: Path) -> list[str] | None:
    """None when ``folder`` holds no credentials; else what a whole folder has that it lacks ([]: whole)."""
    if not any((folder / name).exists() for name in ENTRIES):
        return None
    return [name for name in REQUIRED if not (folder / name).is_file()]


def own_folder(folder: Path, *, recursive: bool = True) -> None:
    """Refuse to write secrets where another user could read or replace them: a folder (or anything in
    it, when ``recursive``) this user does not own -- 0600 protects nothing in a file someone else owns
    -- or a path that is not a folder.  A missing folder is fine (it is made 0700)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ValueError(f"{folder} is not a folder (or is a symbolic link): give a folder of your own")
    if not folder.exists():
        return
    uid = os.geteuid()
    for path in (folder, *(folder.rglob("*") if recursive else ())):
        owner = path.lstat().st_uid
        if owner != uid:
            raise ValueError(
                f"{path} belongs to uid {owner}, not to this user ({uid}): credentials written there could "
                "be read or replaced by its owner; use a folder of your own"
            )


@dataclass(frozen=True)
class Secrets:
    """What ``pdkv up --secure`` writes into ``RUN_DIR/secrets`` and ``pdkv secrets write DIR`` into DIR
    (0700, every file 0600)::

    tls/            the cluster's CA certificate, server and client certificates (serving/tls.py)
    curve/          CURVE key pairs: the servers' and one per process (wire/curve.py)
    cluster-secret  seals transfer params (serving/signing.py)
    api-keys.toml   the router's keys file: one tenant, "default"
    api-key         that tenant's key, for clients
    """

    folder: Path
    api_key: str

    @property
    def tls_dir(self) -> Path:
        return self.folder / "tls"

    @classmethod
    def write(cls, folder: Path, names: Sequence[str], hosts: Sequence[str], cache_details: bool) -> Secrets:
        from serving.tls import write_tls_folder
        from wire.curve import write_curve_folder

        own_folder(folder)
        check_hosts(hosts)  # before anything is written: a half-written folder would look kept
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        write_tls_folder(folder / "tls", hosts)
        write_curve_folder(folder / "curve", list(names))
        key = f"sk-pdkv-{token_urlsafe(32)}"
        write_private(folder / "cluster-secret", token_hex(32) + "\n")
        write_private(folder / "api-key", key + "\n")
        details = "true" if cache_details else "false"
        # The router's file holds the key's digest, not the key (clients read api-key).
        digest = hashlib.sha256(key.encode()).hexdigest()
        write_private(
            folder / "api-keys.toml",
            f'[tenants.default]\nkey_sha256 = ["{digest}"]\ncache_details = {details}\n'
            "manage_adapters = true\n",  # the operator's own key: --allow-runtime-lora's loads
        )
        return cls(folder, key)

    def env(self, name: str) -> dict[str, str]:
        """What a child named ``name`` finds its credentials by (files, never argv)."""
        return {
            "PDKV_TLS_DIR": str(self.folder / "tls"),
            "PDKV_CURVE_DIR": str(self.folder / "curve"),
            "PDKV_CURVE_NAME": name,
            "PDKV_CLUSTER_SECRET_FILE": str(self.folder / "cluster-secret"),
        }
