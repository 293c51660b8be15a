"""deploy/grafana/ and deploy/prometheus/, offline: the dashboard is a Grafana dashboard whose queries all
parse (``promtool``) and name pdkv metrics only; the scrape configs are valid and reach every process on
its kind's documented metrics port (telemetry/ports.py) -- compose's by service name, ``pdkv up``'s on
base + i, Kubernetes' by the rendered pods' annotations, run through Prometheus' relabelling.  That every
metric the dashboard names is exported by a real process is tests/serving/test_observability.py's."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from telemetry.ports import METRICS_PORTS, metrics_port
from tests.deploy.kube import KUBERNETES, OVERLAYS, containers, find_kubectl, render
from tests.deploy.monitoring import (
    PROMETHEUS,
    ROOT,
    dashboard,
    expressions,
    find_promtool,
    meta_label_name,
    metric_names,
    panels,
    relabel,
    substituted,
    variable_metrics,
)

COMPOSE = ROOT / "deploy" / "docker-compose.yml"
GRAFANA = ROOT / "deploy" / "grafana"


@pytest.fixture(scope="module")
def promtool() -> str:
    path, why = find_promtool()
    if path is None:
        pytest.fail(why)
    return path


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((PROMETHEUS / name).read_text())


# ---- the dashboard ----------------------------------------------------------------------------------


def test_metric_names_are_read_out_of_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, job) (rate(pdkv_a_bucket{x="y", z=~"$v"}[$__rate_interval])))'
        " / ignoring (source) group_left sum(pdkv_b offset 5m) and on(x) pdkv_c + 1e-3 * max(pdkv_d:rate5m)"
    )
    assert metric_names(expr) == {"pdkv_a_bucket", "pdkv_b", "pdkv_c", "pdkv_d:rate5m"}
    assert metric_names('sum(rate(pdkv_e_total{code!="OK"}[5m])) > bool 0') == {"pdkv_e_total"}


def test_the_dashboard_is_a_grafana_dashboard_over_a_prometheus_variable() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variable_metrics(dash) == {"pdkv_router_inflight_requests"}
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels(dash):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"] == panel["datasource"] and target["expr"], panel["title"]
    # One row per part of the list, and every panel under a row.
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert dash["panels"][0]["type"] == "row" and len(rows) == 6, rows


def test_the_dashboard_charts_what_operators_ask_for() -> None:
    """Latency quantiles, tokens/s, running/waiting, KV usage, hit ratio by source and tier, load and
    transfer seconds, store tier hits, router node health and resumes."""
    used = {name for _, expr in expressions(dashboard()) for name in metric_names(expr)}
    for name in (
        "pdkv_router_time_to_first_token_seconds_bucket",
        "pdkv_router_e2e_request_latency_seconds_bucket",
        "pdkv_router_inter_token_latency_seconds_bucket",
        "pdkv_router_request_generation_tokens_sum",
        "pdkv_router_request_prompt_tokens_bucket",
        "pdkv_num_requests_running",
        "pdkv_num_requests_waiting",
        "pdkv_kv_cache_usage_perc",
        "pdkv_prompt_tokens_total",
        "pdkv_connector_store_remote_lookup_hits_total",
        "pdkv_kvstore_tier_lookup_hits_total",
        "pdkv_kv_load_seconds_bucket",
        "pdkv_kv_transfer_seconds_bucket",
        "pdkv_request_prefill_time_seconds_bucket",
        "pdkv_request_decode_time_seconds_bucket",
        "pdkv_router_prefill_node_up",
        "pdkv_router_decode_node_up",
        "pdkv_router_colocated_node_up",
        "pdkv_router_decode_resumes_total",
    ):
        assert name in used, name
    assert all(name.startswith("pdkv_") for name in used), sorted(used)


def test_every_dashboard_query_parses(promtool: str, tmp_path: Path) -> None:
    """Each query as a recording rule: ``promtool check rules`` parses its PromQL."""
    exprs = expressions(dashboard())
    rules = {
        "groups": [
            {
                "name": "pdkv-dashboard",
                "rules": [
                    {"record": f"pdkv:dashboard:{i}", "expr": substituted(e)}
                    for i, (_, e) in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(exprs)} rules found" in done.stdout
    # A broken query fails the same check.
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x", "expr": "sum(rate(x[1m])"}]}]})
    )
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


# ---- compose and pdkv up ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prometheus.yml", "pdkv-up.yml"])
def test_the_scrape_configs_are_valid(promtool: str, name: str) -> None:
    done = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS / name)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_s_prometheus_scrapes_every_service_on_its_metrics_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    jobs = {job["job_name"]: job for job in load("prometheus.yml")["scrape_configs"]}
    scraped = set()
    for name in ("router", "kvstore", "prefill", "decode"):
        (sd,) = jobs[f"pdkv-{name}"]["dns_sd_configs"]
        # Docker's DNS answers a service name with every replica's address.
        assert sd["names"] == [name] and sd["type"] == "A", name
        assert sd["port"] == METRICS_PORTS[name], name
        command = services[name]["command"]
        assert command[command.index("--metrics-address") + 1] == f"0.0.0.0:{sd['port']}", name
        scraped.add(name)
    assert set(jobs) == {f"pdkv-{name}" for name in scraped}


def test_compose_runs_prometheus_and_grafana_with_these_files(compose: dict[str, Any]) -> None:
    s = compose["services"]
    for name in ("prometheus", "grafana"):
        assert s[name]["profiles"] == ["monitoring"], f"{name} runs only when asked for"
        assert all(p.startswith("${PDKV_ROUTER_HOST:-127.0.0.1}:") for p in s[name]["ports"]), name
        for volume in s[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE.parent / source).exists(), volume
            else:
                assert source in compose["volumes"], volume
    config = s["prometheus"]["command"][0].removeprefix("--config.file=")
    assert "./prometheus/prometheus.yml:" + config + ":ro" in s["prometheus"]["volumes"]
    # Grafana's data source is that Prometheus; its dashboard provider reads the mounted dashboard.
    (source,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == f"http://prometheus:{s['prometheus']['ports'][0].rsplit(':', 1)[1]}"
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/pdkv.yml").read_text())["providers"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in s["grafana"]["volumes"]}
    assert mounts[f"{provider['options']['path']}/pdkv-dashboard.json"] == "./grafana/pdkv-dashboard.json"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


def test_pdkv_up_s_prometheus_scrapes_the_fixed_ports() -> None:
    jobs = {job["job_name"]: job for job in load("pdkv-up.yml")["scrape_configs"]}
    assert set(jobs) == {f"pdkv-{kind}" for kind in METRICS_PORTS}
    for kind in METRICS_PORTS:
        (static,) = jobs[f"pdkv-{kind}"]["static_configs"]
        count = len(static["targets"])
        assert static["targets"] == [f"127.0.0.1:{metrics_port(kind, i)}" for i in range(count)], kind


# ---- Kubernetes ---------------------------------------------------------------------------------------


def test_the_kubernetes_scrape_config_finds_every_pdkv_pod_on_its_metrics_port() -> None:
    """Prometheus' pod discovery over each overlay's rendered pods, then the config's relabelling: every
    pdkv process is scraped on its pod IP and its kind's port, as job pdkv-<component>; Redis is not."""
    kubectl, why = find_kubectl()
    if kubectl is None:
        pytest.fail(why)
    (job,) = load("kubernetes.yml")["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["pdkv"]  # docs/deploy.md's namespace
    for overlay in OVERLAYS:
        for c in containers(render(kubectl, KUBERNETES / "overlays" / overlay)):
            meta = c.workload["spec"]["template"]["metadata"]
            component = meta["labels"]["app.kubernetes.io/component"]
            labels = {
                "__address__": f"10.1.2.3:{c.spec['ports'][0]['containerPort']}",
                "__meta_kubernetes_namespace": "pdkv",
                "__meta_kubernetes_pod_name": f"{component}-abc",
                "__meta_kubernetes_pod_ip": "10.1.2.3",
            }
            for key, value in meta["labels"].items():
                labels[f"__meta_kubernetes_pod_label_{meta_label_name(key)}"] = value
            for key, value in (meta.get("annotations") or {}).items():
                labels[f"__meta_kubernetes_pod_annotation_{meta_label_name(key)}"] = value
            target = relabel(labels, job["relabel_configs"])
            if not c.is_pdkv:
                assert target is None, f"{overlay} {c.label} is scraped"
                continue
            assert target is not None, f"{overlay} {c.label} is not scraped"
            assert target["__address__"] == f"10.1.2.3:{METRICS_PORTS[component]}", f"{overlay} {c.label}"
            assert target["job"] == f"pdkv-{component}" and target["pod"] == f"{component}-abc"
