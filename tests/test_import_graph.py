"""The house imports one way.

- Between modules: no module of ours imports (at any level: top, in a function, under TYPE_CHECKING) a
  module that imports it back, directly or through others.
- Between top-level packages: every import of one package by another is allowed by the table in
  ``docs/architecture.md`` ("Package edges"), and no two packages import each other, even through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LEAF = "(leaf"
EVERY = "every package above"


def _allow_list(text: str) -> dict[str, set[str]]:
    """package -> the packages it may import, from the table between the package-edges markers."""
    body = text.split("<!-- package-edges:begin -->", 1)[1].split("<!-- package-edges:end -->", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        package, rule = cells[0].strip("`"), cells[1]
        if rule.startswith(LEAF):
            allowed[package] = set()
        elif rule.startswith(EVERY):
            allowed[package] = set(allowed)  # the rows above it
        else:
            allowed[package] = set(re.findall(r"`([a-z_]+)`", rule))
    return allowed


ALLOWED = _allow_list(ARCHITECTURE.read_text(encoding="utf-8"))
PACKAGES = tuple(ALLOWED)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # "from pkg import submodule" imports the submodule, not the package
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_violations(
    module_graph: dict[str, set[str]], allowed: dict[str, set[str]]
) -> list[tuple[str, str]]:
    """(importing module, imported module) pairs whose packages' edge the table does not allow."""
    bad = []
    for src, targets in sorted(module_graph.items()):
        src_pkg = src.split(".")[0]
        for dst in sorted(targets):
            dst_pkg = dst.split(".")[0]
            if dst_pkg != src_pkg and dst_pkg not in allowed[src_pkg]:
                bad.append((src, dst))
    return bad


def _package_graph(module_graph: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, targets in module_graph.items():
        edges = graph.setdefault(src.split(".")[0], set())
        edges.update(t.split(".")[0] for t in targets)
    return {pkg: edges - {pkg} for pkg, edges in graph.items()}


def _module_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(f, modules) - {m} for m, f in modules.items()}


def test_no_import_circles() -> None:
    assert _cycles(_module_graph()) == []


def _check_packages(graph: dict[str, set[str]]) -> None:
    bad = _package_violations(graph, ALLOWED)
    assert not bad, "imports docs/architecture.md's package edges do not allow:\n" + "\n".join(
        f"  {src} imports {dst}" for src, dst in bad
    )
    cycles = _cycles(_package_graph(graph))
    assert not cycles, f"packages that import each other: {cycles}"


def test_packages_import_only_what_the_architecture_allows() -> None:
    _check_packages(_module_graph())


def test_every_package_is_in_the_table() -> None:
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert ours <= set(ALLOWED), f"add a row to the package-edges table for {sorted(ours - set(ALLOWED))}"
    assert ALLOWED["engine"] == {"wire", "telemetry"} and ALLOWED["wire"] == ALLOWED["telemetry"] == set()


def test_the_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_planted_engine_to_connectors_import_fails(tmp_path: Path) -> None:
    """An engine module importing a connector, lazily inside a function or under TYPE_CHECKING, is found."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from connectors.registry import KVConnectorConfig\n"
        "def build():\n"
        "    import connectors.offload\n",
        encoding="utf-8",
    )
    modules = _modules()
    graph = _module_graph()
    graph["engine.planted"] = _imports(planted, modules)
    assert (
        set(_package_violations(graph, ALLOWED)) - set(_package_violations(_module_graph(), ALLOWED))
    ) == {("engine.planted", "connectors.offload"), ("engine.planted", "connectors.registry")}
    with pytest.raises(AssertionError, match=r"engine\.planted imports connectors\.offload"):
        _check_packages(graph)


def test_the_table_is_read_as_written() -> None:
    table = (
        "<!-- package-edges:begin -->\n| package | may import |\n| --- | --- |\n"
        "| `a` | (leaf) |\n| `b` | `a` |\n| `c` | every package above |\n<!-- package-edges:end -->"
    )
    assert _allow_list(table) == {"a": set(), "b": {"a"}, "c": {"a", "b"}}
