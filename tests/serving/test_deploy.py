"""deploy/docker-compose.yml: it parses, every command is a real ``pdkv`` subcommand with valid options,
and every address agrees with the service it names (one x-config block defines them all)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.config import StoreConfig
from pdkv.cli import build_parser
from router.config import router_config_from_args
from serving.config import node_config_from_args, parse_address

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def port_of(address: str) -> int:
    return parse_address(address.removeprefix("tcp://"))[1]


def test_services_and_files(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"redis", "kvstore", "prefill", "decode", "router"}
    assert "x-config" in compose
    assert (ROOT / "deploy" / "Dockerfile").is_file()
    for name, service in compose["services"].items():
        assert "healthcheck" in service, f"{name} has no healthcheck"


def test_every_command_is_a_valid_pdkv_command(compose: dict[str, Any]) -> None:
    parser = build_parser()
    for name, service in compose["services"].items():
        command = service["command"]
        if name == "redis":
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
    cmd = {name: s[name]["command"] for name in s}
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
