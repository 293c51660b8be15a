"""Offline checks of rendered Kubernetes objects (deploy/kubernetes/): render with ``kubectl kustomize``,
resolve each container's command as the kubelet would ($(VAR) from its env: ConfigMaps, the downward
API), then check it against the real binaries -- every flag one the ``pdkv`` parser defines, every port a
process listens on.  Each ``*_problems`` function returns what is wrong, one line each (empty: nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import yaml

from kvstore.config import StoreConfig
from node.config import node_config_from_args
from pdkv import settings
from pdkv.cli import build_parser
from router.config import router_config_from_args
from wire.endpoints import parse_address

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("colocated", "disaggregated", "store-redis", "redis-cluster")
WORKLOADS = ("Deployment", "StatefulSet")
POD_IP = "10.244.1.7"  # what status.podIP stands for when a command is resolved
NODE_ROLES = {"serve-prefill": "prefill", "serve-decode": "decode", "serve-colocated": "colocated"}
KUSTOMIZE_MAJOR = 5  # components, labelSelector patches: kubectl >= 1.27 embeds kustomize v5

Obj = dict[str, Any]


# ---- kubectl ------------------------------------------------------------------------------------------


def find_kubectl() -> tuple[str | None, str]:
    """kubectl's path (installing Debian's kubernetes-client where it is missing, as scripts/test.sh does
    for redis-server), or None and why."""
    path = shutil.which("kubectl")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        install = ["apt-get", "install", "-y", "-q", "kubernetes-client"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run(install, capture_output=True, timeout=300).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
                subprocess.run(install, capture_output=True, timeout=300)
        path = shutil.which("kubectl")
    if path is None:
        return None, (
            "kubectl is not installed and `apt-get install kubernetes-client` could not install it: install "
            f"kubectl >= 1.27 (it embeds kustomize v{KUSTOMIZE_MAJOR}) to render deploy/kubernetes"
        )
    try:
        out = subprocess.run(
            [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
        ).stdout
        info = json.loads(out or "{}")
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
        return None, f"{path} version --client failed: {exc}"
    kustomize = str(info.get("kustomizeVersion") or "")
    match = re.match(r"v(\d+)", kustomize)
    if not match or int(match.group(1)) < KUSTOMIZE_MAJOR:
        client = info.get("clientVersion", {}).get("gitVersion", "?")
        return None, (
            f"{path} is kubectl {client} with kustomize {kustomize or 'v2 or older'}; deploy/kubernetes "
            f"needs kustomize v{KUSTOMIZE_MAJOR} (kubectl >= 1.27; Debian 12's kubernetes-client is 1.20): "
            "install a newer kubectl"
        )
    return path, ""


def render(kubectl: str, folder: Path) -> list[Obj]:
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {folder} failed:\n{done.stderr}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# ---- resolving what the kubelet would run ---------------------------------------------------------------


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def find(objs: list[Obj], kind: str, name: str) -> Obj | None:
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name), None)


def config_maps(objs: list[Obj]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data") or {} for o in objs if o["kind"] == "ConfigMap"}


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ is a literal $, others stay."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _quantity(text: str) -> float:
    """A Kubernetes quantity (cpu or bytes) as a number."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    suffixes["Ti"] = 2**40
    for suffix, scale in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def quantity(text: str | int | float) -> float:
    return _quantity(str(text))


def container_env(container: Obj, objs: list[Obj]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (secrets stand in as <secret:NAME/KEY>)."""
    maps = config_maps(objs)
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        name, source = entry["name"], entry.get("valueFrom")
        if source is None:
            env[name] = expand(str(entry.get("value", "")), env)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[name] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[name] = POD_IP if path == "status.podIP" else f"<{path}>"
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, _, resource = ref["resource"].partition(".")
            amount = quantity(container["resources"][kind][resource])
            env[name] = str(math.ceil(amount / quantity(ref.get("divisor", "1"))))
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = f"<secret:{ref['name']}/{ref['key']}>"
    return env


@dataclass
class Container:
    """One container of a workload, its command resolved."""

    workload: Obj
    spec: Obj
    env: dict[str, str]
    argv: list[str]

    @property
    def label(self) -> str:
        return f"{name_of(self.workload)} container {self.spec['name']}"

    @property
    def is_pdkv(self) -> bool:
        return bool(self.argv) and self.argv[0] == "pdkv"

    def option(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv else None


def containers(objs: list[Obj]) -> Iterator[Container]:
    for workload in workloads(objs):
        for spec in workload["spec"]["template"]["spec"]["containers"]:
            env = container_env(spec, objs)
            argv = [expand(str(a), env) for a in [*(spec.get("command") or []), *(spec.get("args") or [])]]
            yield Container(workload, spec, env, argv)


# ---- flags ------------------------------------------------------------------------------------------


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser that takes ``argv``'s options: down through the subcommands ``argv`` names."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or not argv or argv[0] not in subs[0].choices:
            return parser
        parser, argv = subs[0].choices[argv[0]], argv[1:]


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment as the container's (for options read from it, e.g. $PDKV_MODEL)."""
    mine = {k: v for k, v in os.environ.items() if not k.startswith("PDKV_")}
    with mock.patch.dict(os.environ, {**mine, **env}, clear=True):
        yield


def parse_pdkv(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[argparse.Namespace | None, list[str]]:
    """``pdkv ARGS`` in a container with environment ``env``: the parsed arguments, or None and why.
    Every option must be spelled out in full (argparse would take an abbreviation, which the next option
    added to the parser can break).  The container's ``PDKV_<OPTION>`` variables set options as ``pdkv``
    itself takes them (pdkv/settings.py): under the command line."""
    with environment(env or {}):
        parser = build_parser()
        try:
            settings.apply(parser, argv[1:], os.environ)
        except settings.SettingsError as exc:
            return None, [f"`{' '.join(argv[:3])} ...`: {exc}"]
    sub = _subparser(parser, argv[1:])
    known = {s for action in sub._actions for s in action.option_strings}
    problems = [
        f"{token.split('=')[0]!r} is not an option of `{sub.prog}`"
        for token in argv[1:]
        if token.startswith("-") and len(token) > 1 and token.split("=")[0] not in known
    ]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[1:])
    except SystemExit:
        return None, [*problems, f"`{' '.join(argv[:3])} ...` is refused: {err.getvalue().strip()}"]
    return (None if problems else args), problems


@dataclass
class Process:
    """What a container runs, as the binary understands its command line."""

    kind: str  # node, router, kvstore, redis, or ""
    args: argparse.Namespace | None = None
    config: Any = None
    listens: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def _port(address: str) -> int:
    return parse_address(address.removeprefix("tcp://"))[1]


def connector_children(spec: Any) -> list[Any]:
    """A connector config and, for ``multi``, its children (a flat list)."""
    if spec is None:
        return []
    if spec.name == "multi":
        from connectors.registry import KVConnectorConfig

        return [
            KVConnectorConfig(name=c["name"], options=c.get("options") or {})
            for c in spec.options["connectors"]
        ]
    return [spec]


def process_of(c: Container) -> Process:
    """Parse ``c``'s command with the real parser and config builders; what it would listen on."""
    if c.argv[:1] == ["redis-server"]:
        return Process("redis", listens={int(c.option("--port") or 6379)})
    if not c.is_pdkv:
        return Process("", problems=[f"{c.label}: cannot tell what {c.argv[:1]} is"])
    args, problems = parse_pdkv(c.argv, c.env)
    if args is None:
        return Process("", problems=[f"{c.label}: {p}" for p in problems])
    try:
        if args.command in NODE_ROLES:
            node = node_config_from_args(args, NODE_ROLES[args.command])
            listens = {_port(node.address)}
            listens |= {_port(node.metrics_address)} if node.metrics_address else set()
            for child in connector_children(node.engine.kv_connector):
                if child.name == "p2p" and "bind" in child.options:
                    listens.add(_port(child.options["bind"]))
            return Process("node", args, node, listens)
        if args.command == "serve-router":
            router = router_config_from_args(args)
            addresses = (router.address, router.http_address, router.metrics_address)
            return Process("router", args, router, {_port(a) for a in addresses if a})
        if args.command == "kvstore" and args.kvstore_command == "serve":
            store = StoreConfig.parse(args.kv_store)
            addresses = (args.bind, args.metrics_address, args.kv_events)
            return Process("kvstore", args, store, {_port(a) for a in addresses if a})
    except ValueError as exc:
        return Process("", args, problems=[f"{c.label}: {exc}"])
    return Process("", args, problems=[f"{c.label}: `pdkv {args.command}` is not a server"])


def flag_problems(objs: list[Obj]) -> list[str]:
    """Every pdkv command (containers and exec probes) parses, with options its parser defines."""
    problems: list[str] = []
    for c in containers(objs):
        problems += process_of(c).problems
        for probe, command in exec_probes(c):
            if command[:1] == ["pdkv"]:
                problems += [f"{c.label} {probe}: {p}" for p in parse_pdkv(command, c.env)[1]]
    return problems


# ---- ports ------------------------------------------------------------------------------------------


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def exec_probes(c: Container) -> Iterator[tuple[str, list[str]]]:
    for probe in PROBES:
        command = (c.spec.get(probe) or {}).get("exec", {}).get("command")
        if command:
            yield probe, [expand(str(a), c.env) for a in command]


def container_port(c: Container, port: int | str) -> int | None:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in c.spec.get("ports") or []}
    return named.get(port) if not port.isdigit() else int(port)


def probe_port(c: Container, probe: Obj) -> tuple[int | None, str]:
    """The port a probe checks and how (None: it names no port)."""
    for how in ("tcpSocket", "httpGet", "grpc"):
        if how in probe:
            return container_port(c, probe[how]["port"]), how
    command = [expand(str(a), c.env) for a in probe.get("exec", {}).get("command") or []]
    if command[:2] == ["pdkv", "health"]:
        host, port = parse_address(command[2])
        return (port if host in ("127.0.0.1", "localhost", "::1") else None), "pdkv health"
    if command[:3] == ["pdkv", "kvstore", "ping"]:
        return _port(command[command.index("--connect") + 1]), "pdkv kvstore ping"
    if command[:1] == ["redis-cli"]:
        return int(command[command.index("-p") + 1]) if "-p" in command else 6379, "redis-cli"
    return None, "exec"


def port_problems(objs: list[Obj]) -> list[str]:
    """Container ports and probes name ports the process listens on; every probe checks one; Services
    route to listening ports; and every address a process dials reaches a listening port through the
    Service it names."""
    problems: list[str] = []
    listening: dict[str, tuple[Container, set[int]]] = {}
    for c in containers(objs):
        process = process_of(c)
        listening[name_of(c.workload)] = (c, process.listens)
        for p in c.spec.get("ports") or []:
            if p["containerPort"] not in process.listens:
                problems.append(
                    f"{c.label}: port {p.get('name')} ({p['containerPort']}) is not one it listens on"
                )
        for probe_name in PROBES:
            probe = c.spec.get(probe_name)
            if probe is None:
                continue
            port, how = probe_port(c, probe)
            if port is None:
                problems.append(f"{c.label}: {probe_name} ({how}) checks no port of this container")
            elif port not in process.listens:
                problems.append(
                    f"{c.label}: {probe_name} ({how}) checks port {port}, which nothing listens on "
                    f"(it listens on {sorted(process.listens)})"
                )
    for service in (o for o in objs if o["kind"] == "Service"):
        problems += _service_problems(service, objs, listening)
    problems += _dial_problems(objs, listening)
    return problems


def selected(obj: Obj, objs: list[Obj]) -> list[Obj]:
    """The workloads whose pods a Service's (or a PodDisruptionBudget's) selector picks."""
    selector = obj["spec"].get("selector") or {}
    selector = selector.get("matchLabels", {}) if obj["kind"] == "PodDisruptionBudget" else selector
    return [
        w
        for w in workloads(objs)
        if selector and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def _service_problems(
    service: Obj, objs: list[Obj], listening: dict[str, tuple[Container, set[int]]]
) -> list[str]:
    targets = selected(service, objs)
    if not targets:
        return [f"{name_of(service)} selects no workload"]
    problems = []
    for p in service["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        for w in targets:
            c, listens = listening[name_of(w)]
            port = container_port(c, target)
            if port is None or port not in listens:
                problems.append(
                    f"{name_of(service)} port {p['port']} -> {target}: {name_of(w)} does not listen there"
                )
            elif service["spec"].get("clusterIP") == "None" and port != p["port"]:
                # Headless: clients reach the pods' IPs on the Service's port itself.
                problems.append(
                    f"{name_of(service)} (headless) port {p['port']} is not the pods' port {port}"
                )
    return problems


def _reaches(
    host: str, port: int, objs: list[Obj], listening: dict[str, tuple[Container, set[int]]], headless: bool
) -> str | None:
    """Why ``host:port`` (a Service name) reaches no listening port, or None when it does."""
    service = find(objs, "Service", host)
    if service is None:
        return f"no Service {host}"
    if headless and service["spec"].get("clusterIP") != "None":
        return f"Service {host} is not headless: DNS discovery would see one address"
    ports = {p["port"]: p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
    if port not in ports:
        return f"Service {host} has no port {port}"
    for w in selected(service, objs):
        c, listens = listening[name_of(w)]
        if container_port(c, ports[port]) not in listens:
            return f"{name_of(w)} behind Service {host} does not listen on {ports[port]}"
    return None


def _dial_problems(objs: list[Obj], listening: dict[str, tuple[Container, set[int]]]) -> list[str]:
    """The router's nodes, the nodes' store server and the store's Redis, where they are in the objects."""
    problems = []
    for c in containers(objs):
        process = process_of(c)
        dials: list[tuple[str, str, bool]] = []  # (what, address, needs a headless Service)
        if process.kind == "router":
            config = process.config
            dials += [("--prefill", a, config.dns_discovery) for a in config.prefill_nodes]
            dials += [("--decode", a, config.dns_discovery) for a in config.decode_nodes]
        elif process.kind == "node":
            for child in connector_children(process.config.engine.kv_connector):
                if child.name == "offload":
                    for tier in StoreConfig.parse(child.options["kv_store"]).tiers:
                        if tier.kind == "remote":
                            dials.append(("remote tier", tier.endpoint, False))  # type: ignore[union-attr]
        elif process.kind == "kvstore":
            for tier in process.config.tiers:
                if tier.kind == "redis":
                    host = urlsplit(tier.url).hostname or ""
                    # A Service of these objects, or a bare name that should be one; not an outside address.
                    if find(objs, "Service", host) is not None or "." not in host:
                        dials.append(("redis tier", f"{host}:{urlsplit(tier.url).port or 6379}", False))
        for what, address, headless in dials:
            host, port = parse_address(address.removeprefix("tcp://"))
            why = _reaches(host, port, objs, listening, headless)
            if why:
                problems.append(f"{c.label}: {what} {address}: {why}")
    return problems
