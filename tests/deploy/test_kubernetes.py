"""deploy/kubernetes/, offline (no cluster): every overlay renders with ``kubectl kustomize``; every object
is valid against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: no unknown fields); every
command is one the real ``pdkv`` parser takes, flag for flag; every container port, probe, Service and
dialled address meets a port the process listens on; ports and settings agree with
deploy/docker-compose.yml; the Secrets that deploy/kubernetes/secrets makes from ``pdkv secrets write``
give each process the credentials it loads; the hardening rules hold.  A planted bad manifest fails."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kube import (
    KUBERNETES,
    OVERLAYS,
    POD_IP,
    ROOT,
    Container,
    Obj,
    connector_children,
    container_port,
    containers,
    environment,
    find,
    find_kubectl,
    flag_problems,
    name_of,
    port_problems,
    process_of,
    quantity,
    render,
    selected,
    workloads,
)

COMPOSE = ROOT / "deploy" / "docker-compose.yml"
# The oldest schema kubernetes-validate ships that these objects target, and its newest.
SCHEMA_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())


@pytest.fixture(scope="module")
def kubectl() -> str:
    path, why = find_kubectl()
    if path is None:
        pytest.fail(why)
    return path


@pytest.fixture(scope="module")
def rendered(kubectl: str) -> dict[str, list[Obj]]:
    return {name: render(kubectl, KUBERNETES / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def by_component(objs: list[Obj]) -> dict[str, Container]:
    return {c.workload["metadata"]["name"]: c for c in containers(objs)}


# ---- rendering and schemas ------------------------------------------------------------------------


def test_every_overlay_renders_what_it_should(rendered: dict[str, list[Obj]]) -> None:
    expect = {
        "colocated": {"router", "kvstore", "colocated"},
        "disaggregated": {"router", "kvstore", "prefill", "decode"},
        "store-redis": {"router", "kvstore", "prefill", "decode", "redis"},
        "redis-cluster": {"router", "kvstore", "prefill", "decode"},
    }
    for overlay, objs in rendered.items():
        assert {w["metadata"]["name"] for w in workloads(objs)} == expect[overlay], overlay
        names = [name_of(o) for o in objs]
        assert len(names) == len(set(names)), f"{overlay}: duplicate objects"


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: dict[str, list[Obj]]) -> None:
    problems = []
    for overlay, objs in rendered.items():
        for obj in objs:
            for version in SCHEMA_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    where = ".".join(str(p) for p in exc.absolute_path)
                    problems.append(f"{overlay} {name_of(obj)} (k8s {version}) {where}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_schema_validation_catches_a_misspelled_field(rendered: dict[str, list[Obj]]) -> None:
    deployment = copy.deepcopy(find(rendered["disaggregated"], "Deployment", "prefill"))
    assert deployment is not None
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 50061}
    with pytest.raises(kubernetes_validate.ValidationError, match="grpcc"):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[-1], strict=True)


# ---- commands and ports ---------------------------------------------------------------------------


def test_every_flag_is_one_the_binary_takes(rendered: dict[str, list[Obj]]) -> None:
    problems = [f"{overlay}: {p}" for overlay, objs in rendered.items() for p in flag_problems(objs)]
    assert not problems, "\n".join(problems)
    for objs in rendered.values():
        for c in containers(objs):
            assert not any("$(" in a for a in c.argv), f"{c.label}: unresolved {c.argv}"


def test_every_port_and_probe_meets_a_listening_port(rendered: dict[str, list[Obj]]) -> None:
    problems = [f"{overlay}: {p}" for overlay, objs in rendered.items() for p in port_problems(objs)]
    assert not problems, "\n".join(problems)


def test_a_planted_bad_manifest_fails_the_checks(rendered: dict[str, list[Obj]]) -> None:
    good = rendered["disaggregated"]
    assert flag_problems(good) == [] and port_problems(good) == []

    def planted(change: Any) -> list[Obj]:
        objs = copy.deepcopy(good)
        change(
            {w["metadata"]["name"]: w["spec"]["template"]["spec"]["containers"][0] for w in workloads(objs)}
        )
        return objs

    # A probe on a port nothing listens on: the kubelet would restart a healthy node forever.
    def probe_elsewhere(c: dict[str, Obj]) -> None:
        c["prefill"]["livenessProbe"]["exec"]["command"][2] = "127.0.0.1:50062"

    problems = port_problems(planted(probe_elsewhere))
    assert any("prefill" in p and "livenessProbe" in p and "50062" in p for p in problems), problems

    def tcp_probe_elsewhere(c: dict[str, Obj]) -> None:
        c["router"]["livenessProbe"]["tcpSocket"]["port"] = 50052

    problems = port_problems(planted(tcp_probe_elsewhere))
    assert any("router" in p and "50052" in p for p in problems), problems

    # A flag the binary does not know, and an abbreviation argparse would let through.
    def unknown_flag(c: dict[str, Obj]) -> None:
        c["decode"]["command"] += ["--kv-transfer-timeout", "5"]

    problems = flag_problems(planted(unknown_flag))
    assert any("decode" in p and "--kv-transfer-timeout" in p for p in problems), problems

    def abbreviated(c: dict[str, Obj]) -> None:
        c["router"]["command"][c["router"]["command"].index("--grace-s")] = "--grace"

    problems = flag_problems(planted(abbreviated))
    assert any("'--grace' is not an option of `pdkv serve-router`" in p for p in problems), problems

    # The router dialling the nodes on a port they do not listen on.
    def wrong_node_port(c: dict[str, Obj]) -> None:
        c["router"]["command"] = [
            a.replace("$(PDKV_DECODE_NODES)", "decode:50072") for a in c["router"]["command"]
        ]

    problems = port_problems(planted(wrong_node_port))
    assert any("--decode decode:50072" in p for p in problems), problems


# ---- deploy/docker-compose.yml ----------------------------------------------------------------------


def test_ports_and_settings_agree_with_compose(
    rendered: dict[str, list[Obj]], compose: dict[str, Any]
) -> None:
    x = compose["x-config"]
    services = compose["services"]
    for overlay, objs in rendered.items():
        cs = by_component(objs)
        for name, c in cs.items():
            if c.is_pdkv and name in services:
                assert c.option("--metrics-address") == x[f"{name}_metrics"], c.label
            if name in services and c.is_pdkv:
                env = {k: str(v) for k, v in services[name]["environment"].items()}
                assert c.env["PDKV_CURVE_NAME"] == env["PDKV_CURVE_NAME"], c.label
                for key in ("PDKV_TLS_DIR", "PDKV_CURVE_DIR", "PDKV_CLUSTER_SECRET_FILE"):
                    assert c.env.get(key, env[key]) == env[key], f"{c.label}: {key}"
                assert c.option("--drain-timeout-s") == x["node_drain"], c.label
                if name != "kvstore":
                    assert c.option("--grace-s") == x["node_grace"], c.label
        router = cs["router"]
        assert router.option("--address") == x["router_listen"]
        assert router.option("--http-address") == x["router_http_listen"]
        assert router.option("--api-keys-file") == x["api_keys"]
        assert "--dns-discovery" in router.argv
        assert cs["kvstore"].option("--bind") == x["store_bind"]
        service_ports = {p["port"] for p in find(objs, "Service", "router")["spec"]["ports"]}  # type: ignore[index]
        assert service_ports == {int(p.rsplit(":", 1)[1]) for p in services["router"]["ports"]}
        if overlay == "colocated":
            assert router.option("--mode") == "colocated"
            continue
        assert router.option("--prefill") == x["prefill_nodes"]
        assert router.option("--decode") == x["decode_nodes"]
        for role in ("prefill", "decode"):
            assert cs[role].option("--address") == x[f"{role}_listen"]
            # The connector stack is compose's, with the pod's IP (downward API) as the advertised host.
            mine = json.loads(cs[role].option("--kv-connector") or "")
            theirs = json.loads(x[f"{role}_connector"].replace("{ip}", POD_IP))
            assert mine == theirs, role
    store_redis = by_component(rendered["store-redis"])
    assert store_redis["kvstore"].option("--kv-store") == x["store_tiers"]
    redis = store_redis["redis"]
    assert redis.argv == services["redis"]["command"]
    assert redis.spec["image"] == services["redis"]["image"]
    assert str(redis.spec["ports"][0]["containerPort"]) == x["redis_port"]


def test_every_process_serves_metrics_on_its_kind_s_documented_port(rendered: dict[str, list[Obj]]) -> None:
    """telemetry/ports.py's table: the --metrics-address, the container's metrics port and the pod's
    prometheus.io annotations (what deploy/prometheus/kubernetes.yml scrapes) all say it."""
    from telemetry.ports import METRICS_PORTS

    for overlay, objs in rendered.items():
        for name, c in by_component(objs).items():
            if not c.is_pdkv:
                continue
            want = METRICS_PORTS[name]
            assert c.option("--metrics-address") == f"0.0.0.0:{want}", f"{overlay} {c.label}"
            assert container_port(c, "metrics") == want, f"{overlay} {c.label}"
            annotations = c.workload["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true", f"{overlay} {c.label}"
            assert annotations["prometheus.io/port"] == str(want), f"{overlay} {c.label}"


def test_the_colocated_overlay_takes_the_colocated_nodes_default_port(rendered: dict[str, list[Obj]]) -> None:
    from node.config import DEFAULT_PORTS

    cs = by_component(rendered["colocated"])
    assert cs["router"].option("--decode") == f"colocated:{DEFAULT_PORTS['colocated']}"
    assert cs["router"].option("--prefill") == ""
    assert cs["colocated"].option("--address") == f"0.0.0.0:{DEFAULT_PORTS['colocated']}"


def test_the_redis_cluster_overlay_points_the_store_at_a_cluster(rendered: dict[str, list[Obj]]) -> None:
    process = process_of(by_component(rendered["redis-cluster"])["kvstore"])
    redis = [t for t in process.config.tiers if t.kind == "redis"]
    assert len(redis) == 1 and redis[0].cluster and redis[0].ttl_s
    assert find(rendered["redis-cluster"], "StatefulSet", "redis") is None


# ---- discovery, the advertised address, the model ---------------------------------------------------


def test_nodes_are_discovered_through_headless_services_and_advertise_their_pod_ip(
    rendered: dict[str, list[Obj]],
) -> None:
    for overlay, objs in rendered.items():
        for name, c in by_component(objs).items():
            process = process_of(c)
            if process.kind != "node":
                continue
            service = find(objs, "Service", name)
            assert service is not None and service["spec"]["clusterIP"] == "None", f"{overlay} {name}"
            assert service["spec"].get("publishNotReadyAddresses") is not True  # ready pods only
            for child in connector_children(process.config.engine.kv_connector):
                if child.name == "p2p":
                    ref = next(e for e in c.spec["env"] if e["name"] == "POD_IP")
                    assert ref["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                    assert child.options["advertise_host"] == POD_IP, f"{overlay} {name}"
            # One compute thread per requested core.
            assert process.config.threads == int(quantity(c.spec["resources"]["requests"]["cpu"]))


def test_the_model_comes_from_the_image_or_a_volume(kubectl: str, tmp_path: Path) -> None:
    """Default: the image's embedded model ($PDKV_MODEL empty); components/model-volume mounts the
    pdkv-models claim at /models, and pdkv-config's model names a file there."""
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                # kustomize takes relative paths only
                "resources": [os.path.relpath(KUBERNETES / "overlays" / "disaggregated", overlay)],
                "components": [os.path.relpath(KUBERNETES / "components" / "model-volume", overlay)],
                "configMapGenerator": [
                    {"name": "pdkv-config", "behavior": "merge", "literals": ["model=/models/my.gguf"]}
                ],
            }
        )
    )
    objs = render(kubectl, overlay)
    assert flag_problems(objs) == [] and port_problems(objs) == []
    for name, c in by_component(objs).items():
        mounts = {m["mountPath"]: m for m in c.spec["volumeMounts"]}
        if name == "kvstore":
            assert "/models" not in mounts and "PDKV_MODEL" not in c.env
            continue
        assert c.env["PDKV_MODEL"] == "/models/my.gguf" and mounts["/models"]["readOnly"], name
        volumes = {v["name"]: v for v in c.workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"] == "pdkv-models"
        assert process_of(c).args.model == "/models/my.gguf"  # type: ignore[union-attr]


def test_the_model_defaults_to_the_image(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        for c in containers(objs):
            if c.is_pdkv and c.workload["metadata"]["name"] != "kvstore":
                assert c.env["PDKV_MODEL"] == "", c.label  # the embedded model in the image's /cache
                mounts = [m["mountPath"] for m in c.spec["volumeMounts"]]
                assert "/cache" not in mounts, f"{c.label}: a volume on /cache would hide the model"


# ---- hardening --------------------------------------------------------------------------------------


def test_hardening(rendered: dict[str, list[Obj]]) -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    uid = int(dockerfile.split("--uid ", 1)[1].split()[0])
    for overlay, objs in rendered.items():
        budgets = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
        for w in workloads(objs):
            label = f"{overlay} {name_of(w)}"
            pod = w["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, label
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", label
            assert pod["automountServiceAccountToken"] is False, label
            assert pod["terminationGracePeriodSeconds"] >= 30, label
            covering = [b for b in budgets if w in selected(b, objs)]
            assert len(covering) == 1, f"{label}: {len(covering)} PodDisruptionBudgets"
            for spec in pod["containers"]:
                sc = spec["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, label
                assert sc["readOnlyRootFilesystem"] is True, label
                assert sc["capabilities"]["drop"] == ["ALL"], label
                assert {"cpu", "memory"} <= set(spec["resources"]["requests"]), label
                assert "memory" in spec["resources"]["limits"], label
                assert spec.get("readinessProbe") and spec.get("livenessProbe"), label
        for c in containers(objs):
            if not c.is_pdkv:
                continue
            pod = c.workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsUser"] == uid, c.label
            assert c.spec["image"] == "pdkv:latest", c.label
            # SIGTERM drains, then gives in-flight calls their grace: the orchestrator waits for both.
            drain = c.option("--drain-timeout-s")
            assert drain is not None, f"{c.label}: no --drain-timeout-s (the default 30s is not the plan)"
            grace = float(c.option("--grace-s") or 5)
            assert pod["terminationGracePeriodSeconds"] >= float(drain) + grace + 10, c.label
            assert "--insecure" not in c.argv, c.label


def test_budgets_leave_room_for_a_drain(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        for budget in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
            (w,) = selected(budget, objs)
            replicas = w["spec"]["replicas"]
            allowed = budget["spec"].get("maxUnavailable", replicas - budget["spec"].get("minAvailable", 0))
            assert 1 <= allowed < replicas or replicas == 1, name_of(budget)


def test_the_store_tiers_fit_their_volume_and_memory(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        c = by_component(objs)["kvstore"]
        config = process_of(c).config
        mounts = {m["mountPath"]: m["name"] for m in c.spec["volumeMounts"]}
        volumes = {v["name"]: v for v in c.workload["spec"]["template"]["spec"]["volumes"]}
        for tier in config.tiers:
            if tier.kind == "disk":
                mount = next(m for m in mounts if tier.path.startswith(m + "/"))
                assert tier.capacity_bytes <= quantity(volumes[mounts[mount]]["emptyDir"]["sizeLimit"])
            if tier.kind == "cpu":
                assert tier.capacity_bytes < quantity(c.spec["resources"]["requests"]["memory"])


# ---- secrets ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secrets(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """deploy/kubernetes/secrets rendered over a folder `pdkv secrets write` made: name -> key -> text."""
    import base64

    from pdkv.cli import main

    folder = tmp_path_factory.mktemp("secrets")
    (folder / "kustomization.yaml").write_text((KUBERNETES / "secrets" / "kustomization.yaml").read_text())
    assert main(["secrets", "write", str(folder / "pdkv-secrets"), "--hosts", "router"]) == 0
    objs = render(kubectl, folder)
    assert {o["kind"] for o in objs} == {"Secret"}
    return {
        o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()} for o in objs
    }


def test_secrets_are_not_committed() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/kubernetes/secrets/pdkv-secrets/api-key"], cwd=ROOT
    )
    assert ignored.returncode == 0, "deploy/kubernetes/secrets/pdkv-secrets/ must be git-ignored"


def mount_secrets(c: Container, secrets: dict[str, dict[str, str]], root: Path) -> dict[str, str]:
    """Lay out ``c``'s projected secret volumes under ``root`` as the kubelet would; the container's
    environment with its /secrets paths moved there."""
    volumes = {v["name"]: v for v in c.workload["spec"]["template"]["spec"]["volumes"]}
    moved: dict[str, str] = {}
    for mount in c.spec["volumeMounts"]:
        projected = volumes[mount["name"]].get("projected")
        if projected is None:
            continue
        assert mount["readOnly"] is True and projected["defaultMode"] == 0o440, c.label
        for source in projected["sources"]:
            secret = secrets[source["secret"]["name"]]
            for item in source["secret"]["items"]:
                assert item["key"] in secret, (
                    f"{c.label}: Secret {source['secret']['name']} has no {item['key']}"
                )
                path = root / item["path"]
                assert not path.exists(), (
                    f"{c.label}: two items at {item['path']} (the API server refuses it)"
                )
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(secret[item["key"]])
        moved[mount["mountPath"]] = str(root)
    env = dict(c.env)
    for key, value in env.items():
        for at, there in moved.items():
            if value.startswith(at + "/"):
                env[key] = there + value[len(at) :]
    return env


def test_each_process_finds_the_credentials_it_loads(
    rendered: dict[str, list[Obj]], secrets: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    import zmq.auth

    from connectors.p2p_options import P2POptions
    from router.auth import load_access
    from serving.signing import load_cluster_secret
    from serving.tls import TLSFolder
    from wire.curve import CurveKeys

    for overlay, objs in rendered.items():
        cs = {name: c for name, c in by_component(objs).items() if c.is_pdkv}
        processes = {name: process_of(c) for name, c in cs.items()}
        kinds = {
            name: {ch.name for ch in connector_children(p.config.engine.kv_connector)}
            for name, p in processes.items()
            if p.kind == "node"
        }
        for name, c in cs.items():
            root = tmp_path / overlay / name
            env = mount_secrets(c, secrets, root)
            process = processes[name]
            # TLS: the gRPC servers (mutual on the nodes), the router's client certificate, the probes'.
            if process.kind in ("router", "node"):
                tls = TLSFolder.from_option(None, env)
                assert tls is not None, c.label
                tls.server_credentials(mutual=process.kind == "node" and process.config.mtls)
                tls.need("client.pem", "client.key")
            else:
                assert "PDKV_TLS_DIR" not in env, f"{c.label}: the store speaks CURVE only"
            # CURVE: every process's own client key; the servers' key pair and allow-list.
            keys = CurveKeys.from_env(env)
            assert keys is not None, c.label
            keys.check()
            is_node = process.kind == "node"
            is_server = process.kind == "kvstore" or "p2p" in kinds.get(name, set())
            if is_server:
                _, secret = zmq.auth.load_certificate(keys.folder / "server.key_secret")
                assert secret is not None, c.label
                # The store's clients: itself (ping) and the nodes that offload to it; a block server's:
                # every p2p node.
                clients = (
                    {"kvstore"} | {n for n, k in kinds.items() if "offload" in k}
                    if process.kind == "kvstore"
                    else {n for n, k in kinds.items() if "p2p" in k}
                )
                allowed = {p.stem for p in (keys.folder / "clients").glob("*.key")}
                assert {cs[n].env["PDKV_CURVE_NAME"] for n in clients} <= allowed, c.label
            else:
                assert not (keys.folder / "server.key_secret").exists(), (
                    f"{c.label} holds a server key it needs not"
                )
            if process.kind in ("router", "node"):
                assert load_cluster_secret(None, env) is not None, c.label
            for child in connector_children(process.config.engine.kv_connector) if is_node else []:
                if child.name == "p2p":  # its wildcard bind is refused without CURVE in the environment
                    with environment(env):
                        P2POptions(**child.options)
            if process.kind == "router":  # --api-keys-file, a file of the secrets volume
                path = root / Path(process.config.api_keys_file).relative_to("/secrets")
                assert not load_access(str(path), environ={}).open, c.label
