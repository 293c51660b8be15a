"""deploy/grafana/ and deploy/prometheus/ as the tests read them: the dashboard's PromQL expressions and the
metric names they use, ``promtool``, and Prometheus' relabelling (to run the Kubernetes scrape config over
the rendered pods)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdkv-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus"

Obj = dict[str, Any]


def dashboard() -> Obj:
    return json.loads(DASHBOARD.read_text())


def panels(dash: Obj) -> Iterator[Obj]:
    """Every panel, those inside rows included."""
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dash: Obj) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def variable_metrics(dash: Obj) -> set[str]:
    """The metrics the template variables ask for their values (``label_values(METRIC, LABEL)``)."""
    names = set()
    for variable in dash["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            names |= set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", text))
    return names


# PromQL words that are not metric names: aggregation modifiers, vector matching, set operators.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
_KEYWORDS |= {"offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier left once strings, label matchers,
    ranges, label lists (``by (...)``, ``on (...)``) and numbers are gone, that is neither a function
    (followed by ``(``) nor a keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][-+]?\d+|ms|[smhdwy])?\b", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def substituted(expr: str) -> str:
    """``expr`` with Grafana's variables as a query would have them (every model, a 1m rate window)."""
    return expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")


# ---- promtool ---------------------------------------------------------------------------------------


def find_promtool() -> tuple[str | None, str]:
    """promtool's path (installing Debian's prometheus package where it is missing, as tests/deploy/kube.py
    does kubectl), or None and why."""
    path = shutil.which("promtool")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run(install, capture_output=True, timeout=600, env=env).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
                subprocess.run(install, capture_output=True, timeout=600, env=env)
        path = shutil.which("promtool")
    if path is None:
        return None, (
            "promtool is not installed and `apt-get install prometheus` could not install it: install "
            "Prometheus' promtool to check deploy/prometheus and the dashboard's queries"
        )
    return path, ""


# ---- Prometheus' relabelling ------------------------------------------------------------------------


def _expand(replacement: str, match: re.Match[str]) -> str:
    """Prometheus' ``$1`` / ``${1}`` / ``${name}`` in a replacement, from ``match``."""
    return re.sub(
        r"\$\{?(\w+)\}?",
        lambda m: match.group(int(m.group(1)) if m.group(1).isdigit() else m.group(1)) or "",
        replacement,
    )


def relabel(labels: dict[str, str], configs: list[Obj]) -> dict[str, str] | None:
    """``labels`` after ``configs`` (the ``replace``, ``keep`` and ``drop`` actions, regexes anchored as
    Prometheus anchors them), or None when the target is dropped."""
    out = dict(labels)
    for config in configs:
        action = config.get("action", "replace")
        value = config.get("separator", ";").join(out.get(s, "") for s in config.get("source_labels", []))
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if (action == "keep" and match is None) or (action == "drop" and match is not None):
            return None
        if action == "replace" and match is not None:
            result = _expand(str(config.get("replacement", "$1")), match)
            if result:
                out[config["target_label"]] = result
            else:
                out.pop(config["target_label"], None)
        elif action not in ("keep", "drop", "replace"):
            raise AssertionError(f"relabel action {action!r} is not simulated here")
    return out


def meta_label_name(text: str) -> str:
    """A Kubernetes label or annotation key as Prometheus' meta label suffix."""
    return re.sub(r"[^A-Za-z0-9_]", "_", text)
