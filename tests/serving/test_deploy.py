"""deploy/docker-compose.yml: it parses, every command is a real ``pdkv`` subcommand with valid options,
every address agrees with the service it names (one x-config block defines them all), and the
hardening rules hold: no service listens wide with its security off, grace periods, a non-root image,
a root .dockerignore, bounded Redis, unhurried health checks, the router published on a chosen host."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.config import StoreConfig
from node.config import node_config_from_args
from pdkv.cli import build_parser
from router.config import router_config_from_args
from wire.endpoints import parse_address

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def port_of(address: str) -> int:
    return parse_address(address.removeprefix("tcp://"))[1]


PDKV_SERVICES = ("kvstore", "prefill", "decode", "router")


def test_services_and_files(compose: dict[str, Any]) -> None:
    pdkv = {"secrets", "redis", "kvstore", "prefill", "decode", "router"}
    assert set(compose["services"]) == pdkv | {"prometheus", "grafana"}  # monitoring: tests/deploy
    assert "x-config" in compose
    assert (ROOT / "deploy" / "Dockerfile").is_file()
    for name, service in compose["services"].items():
        if name != "secrets":  # a one-shot job
            assert "healthcheck" in service, f"{name} has no healthcheck"


def test_the_image_copies_every_installed_package() -> None:
    """The Dockerfile copies each package by name before ``pip install .``: one it misses installs an image
    whose ``pdkv`` cannot import (wire/, telemetry/, node/ and planner/ once were)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = {pattern.rstrip("*") for pattern in include}
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk <= installed, f"packages pyproject.toml does not install: {sorted(on_disk - installed)}"
    copies = [
        line.split()[1:]
        for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    ]
    copied = {src for *sources, _ in copies for src in sources}
    assert installed <= copied, f"packages the image does not copy: {sorted(installed - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied  # pip reads both
    ignored = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for src in copied:
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), f"{src} is .dockerignore'd"


def test_every_command_is_a_valid_pdkv_command(compose: dict[str, Any]) -> None:
    parser = build_parser()
    for name, service in compose["services"].items():
        if name in ("redis", "prometheus", "grafana"):
            continue
        command = service["command"]
        if name == "secrets":
            assert command[:3] == ["pdkv", "secrets", "write"] and "--keep" in command
            parser.parse_args(command[1:])
            continue
        assert command[0] == "pdkv", name
        args = parser.parse_args(command[1:])
        if name in ("prefill", "decode"):
            config = node_config_from_args(args, name)  # validates the engine and the connector spec
            assert config.engine.kv_connector is not None
        elif name == "router":
            config = router_config_from_args(args)
            assert config.dns_discovery  # nodes scale: one router node per replica
        else:
            StoreConfig.parse(args.kv_store)
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        if test[1] == "pdkv":
            parser.parse_args(test[2:])


def test_addresses_and_ports_agree(compose: dict[str, Any]) -> None:
    s = compose["services"]
    cmd = {name: s[name].get("command", []) for name in s}
    listen = {name: port_of(option(cmd[name], "--address")) for name in ("prefill", "decode", "router")}
    # The router dials the node services by name on the ports they listen on.
    for flag, target in (("--prefill", "prefill"), ("--decode", "decode")):
        host, port = parse_address(option(cmd["router"], flag))
        assert (host, port) == (target, listen[target])
    # Health checks ask the service's own port; the router's published port is its listening port.
    for name in ("prefill", "decode", "router"):
        assert port_of(s[name]["healthcheck"]["test"][3]) == listen[name]
    published = s["router"]["ports"][0].split(":")
    assert int(published[-1]) == listen["router"]
    # The nodes' store tier dials the store server's port; the store's redis tier dials redis' port.
    store_port = port_of(option(cmd["kvstore"], "--bind"))
    assert port_of(option(s["kvstore"]["healthcheck"]["test"], "--connect")) == store_port
    prefill = node_config_from_args(build_parser().parse_args(cmd["prefill"][1:]), "prefill")
    children = prefill.engine.kv_connector.options["connectors"]  # type: ignore[union-attr]
    offload = next(c for c in children if c["name"] == "offload")
    assert f"remote:tcp://kvstore:{store_port}" in offload["options"]["kv_store"]
    redis_port = option(cmd["redis"], "--port")
    assert f"redis://redis:{redis_port}/" in option(cmd["kvstore"], "--kv-store")
    assert redis_port in s["redis"]["healthcheck"]["test"]
    # The disk tier sits on a named volume.
    disk = next(t for t in option(cmd["kvstore"], "--kv-store").split(",") if t.startswith("disk:"))
    mounts = {v.split(":")[1]: v.split(":")[0] for v in s["kvstore"]["volumes"]}
    assert any(disk.split(":")[1].startswith(path) for path in mounts)
    assert set(mounts.values()) <= set(compose["volumes"])


def test_every_service_serves_metrics_on_its_kind_s_documented_port(compose: dict[str, Any]) -> None:
    from telemetry.ports import METRICS_PORTS

    x, s = compose["x-config"], compose["services"]
    for name in PDKV_SERVICES:
        assert option(s[name]["command"], "--metrics-address") == x[f"{name}_metrics"], name
        assert x[f"{name}_metrics"] == f"0.0.0.0:{METRICS_PORTS[name]}", name


def test_start_order_waits_for_health(compose: dict[str, Any]) -> None:
    s = compose["services"]
    for name, needs in (
        ("kvstore", "redis"),
        ("prefill", "kvstore"),
        ("decode", "kvstore"),
        ("router", "prefill"),
    ):
        assert s[name]["depends_on"][needs]["condition"] == "service_healthy"
    assert s["router"]["depends_on"]["decode"]["condition"] == "service_healthy"


def env_of(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_no_service_listens_wide_with_its_security_off(compose: dict[str, Any]) -> None:
    """Every pdkv service binds 0.0.0.0 inside its container, so each must have its security on: TLS
    (mutual) on the nodes, TLS and API keys on the router, CURVE on the store; nothing says --insecure."""
    from wire.endpoints import refuse_open_wide_bind

    parser = build_parser()
    s = compose["services"]
    secrets_volume = "pdkv-secrets:/secrets:ro"
    for name in PDKV_SERVICES:
        command, env = s[name]["command"], env_of(s[name])
        assert "--insecure" not in command, name
        assert secrets_volume in s[name]["volumes"], f"{name} does not mount the secrets read-only"
        assert env["PDKV_CURVE_DIR"].startswith("/secrets/") and env["PDKV_CURVE_NAME"], name
        assert env["PDKV_TLS_DIR"].startswith("/secrets/") and env["PDKV_CLUSTER_SECRET_FILE"], name
        args = parser.parse_args(command[1:])
        if name in ("prefill", "decode"):
            config = node_config_from_args(args, name)
            assert config.mtls, f"{name}: the nodes serve the router only (--mtls)"
            refuse_open_wide_bind(config.address, name, bool(env["PDKV_TLS_DIR"]), config.insecure, "TLS")
        elif name == "router":
            rc = router_config_from_args(args)
            assert rc.api_keys_file.startswith("/secrets/")
            refuse_open_wide_bind(rc.address, name, bool(env["PDKV_TLS_DIR"]), rc.insecure, "TLS")
        else:
            refuse_open_wide_bind(args.bind, name, bool(env["PDKV_CURVE_DIR"]), args.insecure, "CURVE")
        with pytest.raises(ValueError, match="--insecure"):  # the same command with security off
            refuse_open_wide_bind("0.0.0.0:1", name, False, False, "security")
    assert s["secrets"]["volumes"] == ["pdkv-secrets:/secrets"]  # the only writer
    for name in PDKV_SERVICES:
        assert s[name]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"


def test_hardening(compose: dict[str, Any]) -> None:
    s = compose["services"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore and "tests" in ignore
    parser = build_parser()
    for name in PDKV_SERVICES:
        grace = s[name]["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) >= 10, name
        # The drain, then in-flight calls' grace, within Docker's before its SIGKILL.
        args = parser.parse_args(s[name]["command"][1:])
        assert args.drain_timeout_s + getattr(args, "grace_s", 0.0) < int(grace[:-1]), name
    for name, service in s.items():
        if "healthcheck" in service:
            interval = service["healthcheck"]["interval"]
            assert 15 <= int(interval.rstrip("s")) <= 30, f"{name}: health checks every {interval}"
    redis = s["redis"]["command"]
    assert "--maxmemory" in redis and option(redis, "--maxmemory-policy").startswith("allkeys-")
    store = StoreConfig.parse(option(s["kvstore"]["command"], "--kv-store"))
    assert any(getattr(t, "ttl_s", None) for t in store.tiers), "the redis tier needs a TTL"
    for port in s["router"]["ports"]:
        assert port.startswith("${PDKV_ROUTER_HOST:-127.0.0.1}:"), port  # not every interface
    for name in ("prefill", "decode"):
        assert "ports" not in s[name]
    # One variable picks the model for every service: no --model edits.
    assert compose["x-env"]["PDKV_MODEL"] == "${PDKV_MODEL:-}"
    for name in PDKV_SERVICES:
        assert "--model" not in s[name]["command"]
        assert env_of(s[name])["PDKV_MODEL"] == "${PDKV_MODEL:-}"
        assert any(v.endswith(":/models:ro") for v in s[name]["volumes"]) or name == "kvstore"
