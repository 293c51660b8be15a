"""The connector registry: built-ins by name (imported lazily), entry-point plugins, ``module:Class``
paths, and errors that name what is wrong -- an unknown name, a name defined twice, a bad option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import connectors.registry as registry
from connectors.base import ConnectorContext, ConnectorOptionsError, KVConnectorBase, KVConnectorRole
from connectors.multi import MultiConnector
from connectors.registry import (
    ConnectorNotFoundError,
    KVConnectorConfig,
    create_connector,
    discover,
    discover_entries,
    resolve,
)
from connectors.shared_dir import SharedDirConnector
from engine.connector.null import NullConnector
from engine.kv_cache import KVCacheSpec
from pdkv.cli import main
from tests.factories import NS4

CONTEXT = ConnectorContext(NS4, KVCacheSpec(8, 2, 4, 2, 16, torch.float32))


def plugin(name: str, value: str, dist: str) -> Any:
    """What ``importlib.metadata.entry_points`` yields, as far as the registry reads it."""
    return SimpleNamespace(name=name, value=value, dist=SimpleNamespace(name=dist))


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: Any) -> None:
    def entry_points(*, group: str) -> list[Any]:
        assert group == "pdkv.kv_connectors"
        return list(eps)

    monkeypatch.setattr(registry, "entry_points", entry_points)


def build(name: str, options: dict[str, Any] | None = None) -> KVConnectorBase:
    return create_connector(KVConnectorConfig(name, options or {}), KVConnectorRole.SCHEDULER, CONTEXT)


def test_builtins_resolve_by_name() -> None:
    assert resolve("null") is NullConnector
    assert resolve("shared-dir") is SharedDirConnector
    assert resolve("multi") is MultiConnector
    builtins = [e for e in discover_entries() if e.origin == "built-in"]
    assert [e.name for e in builtins][:3] == ["null", "shared-dir", "multi"]


def test_importing_the_registry_imports_no_connector() -> None:
    code = (
        "import sys, connectors.registry as r; r.discover(); "
        "print(sorted(m for m in sys.modules if m.startswith('connectors.') or m in ('torch', 'kvstore')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['connectors.registry']"  # the contract it names is the engine's


def test_a_module_class_path_needs_no_registration() -> None:
    assert resolve("connectors.shared_dir:SharedDirConnector") is SharedDirConnector
    assert isinstance(build("engine.connector.null:NullConnector"), NullConnector)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module:Thing", "cannot import connector module 'no_such_module'"),
        ("engine.connector.null:Nothing", "module 'engine.connector.null' has no attribute 'Nothing'"),
        ("connectors.registry:KVConnectorConfig", "is not a subclass of connectors.base.KVConnectorBase"),
        ("engine.connector.null:", "must look like 'package.module:Class'"),
    ],
)
def test_a_bad_path_says_what_is_wrong(path: str, message: str) -> None:
    with pytest.raises(ConnectorNotFoundError, match=message):
        resolve(path)


def test_an_unknown_name_lists_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, plugin("redis-store", "acme_kv.redis:RedisConnector", "acme-kv"))
    with pytest.raises(ConnectorNotFoundError) as info:
        resolve("shared_dir")
    message = str(info.value)
    assert message.startswith("unknown kv connector 'shared_dir'; known: ")
    for name in ("multi", "null", "redis-store", "shared-dir"):
        assert name in message
    assert "package.module:Class" in message


def test_entry_point_plugins_are_listed_with_their_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(
        monkeypatch,
        plugin("zeta", "zeta_kv:Zeta", "zeta-kv"),
        plugin("alpha", "alpha_kv.conn:Alpha", "alpha-kv"),
        plugin("alpha", "alpha_kv.conn:Alpha", "alpha-kv"),  # one distribution seen twice on sys.path
    )
    plugins = [(e.name, e.target, e.origin) for e in discover_entries() if e.origin != "built-in"]
    assert plugins == [("alpha", "alpha_kv.conn:Alpha", "alpha-kv"), ("zeta", "zeta_kv:Zeta", "zeta-kv")]
    assert discover()["zeta"] == "zeta_kv:Zeta"


def test_a_name_defined_by_two_entry_points_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(
        monkeypatch, plugin("store", "one_kv:Store", "one-kv"), plugin("store", "two_kv:Store", "two-kv")
    )
    with pytest.raises(
        ValueError, match=r"'store' is defined twice: one_kv:Store \(one-kv\) and two_kv:Store"
    ):
        discover()
    with pytest.raises(ValueError, match="defined twice"):
        resolve("null")  # the registry is unusable until the clash is resolved: no silent winner


def test_a_plugin_may_not_take_a_builtin_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, plugin("shared-dir", "evil_kv:SharedDir", "evil-kv"))
    with pytest.raises(ValueError, match=r"'shared-dir' is defined twice: .*\(built-in\).*evil-kv"):
        discover()


def test_pdkv_connectors_list(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_entry_points(monkeypatch, plugin("acme", "acme_kv.conn:AcmeConnector", "acme-kv"))
    assert main(["connectors", "list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["NAME", "TARGET", "ORIGIN"]
    assert ["null", "engine.connector.null:NullConnector", "built-in"] in rows
    assert rows[-1] == ["acme", "acme_kv.conn:AcmeConnector", "acme-kv"]
    assert main(["connectors", "list", "--json"]) == 0
    assert '"origin": "acme-kv"' in capsys.readouterr().out


def test_pdkv_connectors_list_reports_a_clash(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_entry_points(monkeypatch, plugin("null", "other:Null", "other-kv"))
    assert main(["connectors", "list"]) == 2
    assert "'null' is defined twice" in capsys.readouterr().err


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        KVConnectorConfig("")
    with pytest.raises(ValueError, match="options must be a mapping"):
        KVConnectorConfig("shared-dir", ["path"])  # type: ignore[arg-type]


def test_options_are_validated_by_the_connector_naming_the_bad_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConnectorOptionsError, match=r"'shared-dir': unknown option 'paht'; known options: path"
    ):
        build("shared-dir", {"paht": str(tmp_path)})
    with pytest.raises(ValueError, match="option 'path' must name a directory"):
        build("shared-dir", {})
    with pytest.raises(ConnectorOptionsError, match="'null' takes no options"):
        build("null", {"path": str(tmp_path)})
    assert isinstance(build("shared-dir", {"path": str(tmp_path)}), SharedDirConnector)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({}, ConnectorOptionsError, "'connectors' must list at least one connector"),
        ({"connectors": []}, ConnectorOptionsError, "must list at least one connector"),
        ({"conectors": []}, ConnectorOptionsError, "unknown option 'conectors'; known options: connectors"),
        (
            {"connectors": [{"nam": "null"}]},
            ConnectorOptionsError,
            r"connectors\[0\] must be a mapping with a 'name'",
        ),
        ({"connectors": ["null"]}, ConnectorOptionsError, r"connectors\[0\] must be a mapping"),
        (
            {"connectors": [{"name": "null"}, {"name": "null", "opts": {}}]},
            ConnectorOptionsError,
            r"connectors\[1\] has unknown key 'opts'",
        ),
        ({"connectors": [{"name": "no-such"}]}, ConnectorNotFoundError, "unknown kv connector 'no-such'"),
        (
            {"connectors": [{"name": "shared-dir", "options": {"paht": "x"}}]},
            ConnectorOptionsError,
            "'shared-dir': unknown option 'paht'",
        ),
    ],
)
def test_multi_option_errors(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build("multi", options)


def test_multi_builds_its_children(tmp_path: Path) -> None:
    multi = build(
        "multi",
        {"connectors": [{"name": "shared-dir", "options": {"path": str(tmp_path)}}, {"name": "null"}]},
    )
    assert isinstance(multi, MultiConnector)
    assert [type(c) for c in multi.children] == [SharedDirConnector, NullConnector]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('raise RuntimeError("plugin config missing")', "RuntimeError: plugin config missing"),
        ("def broken(:\n    pass", "SyntaxError: "),
    ],
)
def test_a_plugin_module_that_fails_while_importing_is_one_line_naming_it(
    tmp_path: Path, source: str, message: str
) -> None:
    """An outside plugin whose module raised at import (anything but ImportError) printed a 25-line
    traceback from ``pdkv serve-colocated``; now the same one-line error as a missing module."""
    (tmp_path / "failing_plugin.py").write_text(source + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "serve-colocated", "--address", "127.0.0.1:0",
         "--metrics-address", "none", "--kv-connector", "failing_plugin:X"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in run.stderr, run.stderr
    assert "connector module 'failing_plugin' failed while importing" in run.stderr and message in run.stderr
