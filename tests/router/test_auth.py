"""API keys -> tenants (router/auth.py): the keys file and environment, the salts, the admission books."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from router.auth import Access, Tenant, key_digest, load_access
from serving.errors import ServingError

KEY = "sk-test-0123456789abcdef"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_keys_file_maps_keys_and_digests_to_tenants(tmp_path: Path) -> None:
    other = "sk-other-0123456789abcdef"
    path = write(
        tmp_path,
        f'[tenants.acme]\nkeys = ["{KEY}"]\nmax_inflight = 3\ncache_details = true\n'
        f'[tenants.globex]\nkey_sha256 = ["{key_digest(other)}"]\n',
    )
    access = load_access(path, environ={}, client_max_inflight=7)
    assert not access.open and access.tenants == ["acme", "globex"]
    acme = access.authenticate(f"Bearer {KEY}")
    assert (acme.tenant.name, acme.max_inflight, acme.cache_details) == ("acme", 3, True)
    globex = access.authenticate(f"bearer  {other} ")
    assert (globex.tenant.name, globex.max_inflight, globex.cache_details) == ("globex", 7, False)
    # adapter loads and unloads: only a tenant given manage_adapters (and the open router's one)
    with pytest.raises(ServingError, match="'globex' may not load or unload adapters") as denied:
        globex.may_manage_adapters()
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    ops = load_access(
        write(tmp_path, f'[tenants.ops]\nkeys = ["{KEY}"]\nmanage_adapters = true\n'), environ={}
    )
    ops.authenticate(f"Bearer {KEY}").may_manage_adapters()
    load_access(None, environ={}).authenticate(None).may_manage_adapters()


def test_keys_from_the_environment(tmp_path: Path) -> None:
    access = load_access(None, environ={"PDKV_API_KEYS": f"{KEY}=acme, sk-b-0123456789abcdefgh=b"})
    assert access.tenants == ["acme", "b"]
    file_env = load_access(
        None, environ={"PDKV_API_KEYS_FILE": write(tmp_path, f'[tenants.x]\nkeys=["{KEY}"]')}
    )
    assert file_env.tenants == ["x"]
    assert load_access(None, environ={}).open


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not toml [", "not valid TOML"),
        ("[other]\n", "names no [tenants.NAME] table"),
        ('[tenants.acme]\nkeys = ["short"]\n', "at least 16 printable characters"),
        ('[tenants."a/b"]\nkeys = ["sk-test-0123456789abcdef"]\n', "tenant name 'a/b'"),
        ("[tenants.acme]\n", "needs keys = [...] or key_sha256"),
        ('[tenants.acme]\nkeys = ["sk-test-0123456789abcdef"]\nmax_inflight = 0\n', "max_inflight"),
        ('[tenants.acme]\nkeys = ["sk-test-0123456789abcdef"]\nlimit = 3\n', "unknown field(s) limit"),
        ('[tenants.acme]\nkeys = ["sk-test-0123456789abcdef"]\nmanage_adapters = 1\n', "manage_adapters"),
        ('[tenants.acme]\nkey_sha256 = ["abc"]\n', "not a sha256 hex digest"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match="keys") as info:
        load_access(write(tmp_path, text), environ={})
    assert message in str(info.value)


def test_a_missing_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        load_access(str(tmp_path / "absent.toml"), environ={})


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer ", "Bearer sk-wrong-0123456789abcdef"])
def test_a_call_without_a_valid_key_is_unauthenticated(header: str | None) -> None:
    access = Access({key_digest(KEY): Tenant("acme")})
    with pytest.raises(ServingError) as info:
        access.authenticate(header)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_tenant_decides_the_salt() -> None:
    assert Tenant("acme").salt(None) == "acme"
    assert Tenant("acme").salt("team-1") == "acme/team-1"
    assert Tenant("globex").salt("acme") == "globex/acme"  # another tenant's name gets nobody its cache
    open_caller = Access().authenticate(None, "ipv4:127.0.0.1:5000")
    assert open_caller.salt("anything") == "anything" and open_caller.client == "peer:ipv4:127.0.0.1:5000"


def test_admission_counts_per_client_and_releases() -> None:
    access = Access({key_digest(KEY): Tenant("acme", max_inflight=2)})
    caller = access.authenticate(f"Bearer {KEY}")
    with access.admitted(caller), access.admitted(caller):
        assert access.inflight(caller.client) == 2
        with pytest.raises(ServingError) as info, access.admitted(caller):
            pass
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 2" in info.value.message
    assert access.inflight(caller.client) == 0


def test_a_key_listed_twice_is_refused(tmp_path: Path) -> None:
    text = f'[tenants.a]\nkeys = ["{KEY}"]\n[tenants.b]\nkey_sha256 = ["{key_digest(KEY)}"]\n'
    with pytest.raises(ValueError, match="listed twice"):
        load_access(write(tmp_path, text), environ={})


def test_with_a_cluster_secret_the_tenant_part_of_the_salt_is_keyed(tmp_path: Path) -> None:
    """Whoever sees block hashes (KV events) cannot recompute them for a guessed prompt of a tenant whose
    name they know: the salt's tenant part is an HMAC of the cluster secret."""
    path = write(tmp_path, f'[tenants.acme]\nkeys = ["{KEY}"]\n')
    keyed = load_access(path, environ={}, cluster_secret=b"a cluster secret of some length")
    salt = keyed.authenticate(f"Bearer {KEY}").salt("team")
    assert salt is not None and salt.startswith("acme-") and salt.endswith("/team") and len(salt) > 40
    other = load_access(path, environ={}, cluster_secret=b"another secret of the same size")
    assert other.authenticate(f"Bearer {KEY}").salt("team") != salt
    assert load_access(path, environ={}).authenticate(f"Bearer {KEY}").salt("team") == "acme/team"


def test_the_cluster_s_own_key_from_secrets_write_may_manage_adapters(tmp_path: Path) -> None:
    """A review's find: pdkv up --secure --allow-runtime-lora refused its own operator's loads (403) once
    loads needed manage_adapters: the one tenant secrets write makes has it."""
    from serving.secrets import Secrets

    secrets = Secrets.write(tmp_path / "s", ["router", "node"], ["localhost"], cache_details=False)
    access = load_access(str(tmp_path / "s" / "api-keys.toml"), environ={})
    caller = access.authenticate(f"Bearer {secrets.api_key}")
    assert caller.tenant.name == "default" and not caller.cache_details
    caller.may_manage_adapters()
