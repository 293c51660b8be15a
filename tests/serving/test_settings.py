"""Every command's options from a config file (TOML or YAML) and ``PDKV_<OPTION>`` variables, under the
command line (pdkv/settings.py): precedence, types, and the errors that name the file and the key before
anything starts -- ``pdkv up``'s children's settings included.  No process is started here; the
pdkv up run with a file is tests/serving/test_cli.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdkv import settings
from pdkv.cli import build_parser, main
from pdkv.settings import SettingsError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    """``argv`` as ``pdkv`` parses it, with ``env`` as the environment."""
    parser = build_parser()
    applied = settings.apply(parser, argv, env or {})
    args = parser.parse_args(argv)
    if applied is not None:
        applied.check(args)
    return args


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``pdkv ARGV`` exits 2; its error line."""
    assert main(argv) == 2
    return capsys.readouterr().err.strip()


ROUTER = ["serve-router", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"]


# ---- precedence and values --------------------------------------------------------------------------


def test_the_command_line_wins_then_the_environment_then_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "pdkv.toml", "[router]\nmax-inflight = 10\nmax_n = 4\ngrace-s = 2\n")
    assert parse(ROUTER).max_inflight == 256  # the default
    args = parse([*ROUTER, "--config", str(config)])
    assert (args.max_inflight, args.max_n, args.grace_s) == (10, 4, 2.0)  # an int where a float goes
    args = parse([*ROUTER, "--config", str(config)], {"PDKV_MAX_INFLIGHT": "20"})
    assert (args.max_inflight, args.max_n) == (20, 4)
    args = parse([*ROUTER, "--config", str(config), "--max-inflight", "30"], {"PDKV_MAX_INFLIGHT": "20"})
    assert args.max_inflight == 30
    # $PDKV_CONFIG names the file when --config does not; an empty variable is unset.
    assert parse(ROUTER, {"PDKV_CONFIG": str(config), "PDKV_MAX_N": ""}).max_n == 4


def test_yaml_flags_and_lists_and_a_required_option(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "pdkv.yaml",
        "router:\n  cache-details: true\n  dns_discovery: yes\n"
        "generate:\n  stop: [END, STOP]\n  max-tokens: 3\n"
        "kvstore:\n  kv-store: cpu:1MiB\n",
    )
    args = parse([*ROUTER, "--config", str(config)])
    assert args.cache_details is True and args.dns_discovery is True
    assert parse([*ROUTER, "--config", str(config)], {"PDKV_CACHE_DETAILS": "0"}).cache_details is False
    args = parse(["generate", "hello", "--config", str(config)])
    assert args.stop == ["END", "STOP"] and args.max_tokens == 3
    # --kv-store is required on the command line unless the file (or $PDKV_KV_STORE) gives it.
    assert parse(["kvstore", "serve", "--config", str(config)]).kv_store == "cpu:1MiB"
    assert parse(["kvstore", "serve"], {"PDKV_KV_STORE": "cpu:2MiB"}).kv_store == "cpu:2MiB"


def test_a_node_reads_node_then_its_role(tmp_path: Path) -> None:
    config = write(tmp_path, "pdkv.toml", "[node]\nnum-blocks = 64\nseed = 1\n[prefill]\nnum-blocks = 128\n")
    prefill = parse(["serve-prefill", "--config", str(config)])
    decode = parse(["serve-decode", "--config", str(config)])
    assert (prefill.num_blocks, prefill.seed) == (128, 1)
    assert (decode.num_blocks, decode.seed) == (64, 1)


def test_every_command_takes_config_and_names_its_variables() -> None:
    parser = build_parser()
    commands = dict(settings.leaves(parser))
    assert {"up", "serve-router", "serve-prefill", "kvstore serve", "kvstore ping", "generate"} <= set(
        commands
    )
    for command, leaf in commands.items():
        assert "--config" in leaf._option_string_actions, command
        assert "PDKV_<OPTION>" in (leaf.epilog or ""), command
    assert settings.env_name("--max-num-seqs") == "PDKV_MAX_NUM_SEQS"


def test_the_reference_lists_every_option_of_every_command_with_its_variable() -> None:
    """docs/config.md's generated part (python scripts/gen_config_doc.py) is current."""
    text = (DOCS / "config.md").read_text()
    begin, end = text.index(settings.DOC_BEGIN), text.index(settings.DOC_END)
    documented: dict[str, str] = {}
    for part in text[begin:end].split("\n### ")[1:]:
        documented[part.split("`")[1].removeprefix("pdkv ")] = part
    commands = dict(settings.leaves(build_parser()))
    assert set(documented) == set(commands), "run python scripts/gen_config_doc.py"
    for command, leaf in commands.items():
        tables = settings.sections_of(command)
        assert all(f"`[{t}]`" in documented[command].split("\n")[0] for t in tables), command
        rows = [line for line in documented[command].splitlines() if line.startswith("| `--")]
        listed = {row.split("`")[1].removeprefix("--"): row.split("`")[3] for row in rows}
        want = {name: f"${settings.env_name(name)}" for name in settings.options(leaf)}
        assert listed == want, f"{command}: run python scripts/gen_config_doc.py"
    # and every help text as the parsers say it now (a changed help went stale here once)
    assert (
        text[begin + len(settings.DOC_BEGIN) : end].strip() == settings.doc_reference(build_parser()).strip()
    ), "run python scripts/gen_config_doc.py"


# ---- errors that name the file and the key ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("a.toml", "[routr]\nmax-inflight = 1\n", "unknown table [routr] (did you mean 'router'?)"),
        ("b.toml", "[router]\nmax-inflite = 1\n", "[router] max-inflite: `pdkv serve-router` has no option "
         "--max-inflite (did you mean 'max-inflight'?)"),
        ("c.yaml", "node:\n  num_blocks: many\n", "[node] num_blocks: 'many' is not a valid int"),
        ("d.toml", "[router]\npolicy = \"fastest\"\n",
         "[router] policy: 'fastest' is not one of round-robin"),
        ("e.toml", "[router]\ninsecure = \"maybe\"\n", "[router] insecure: 'maybe' is not true or false"),
        ("f.toml", "[node]\nnum-blocks = 1.5\n", "[node] num-blocks: 1.5 is not a valid int"),
        ("g.toml", "max-inflight = 3\n", "max-inflight = 3 is not a table"),
        ("h.toml", "[router\n", "not valid TOML"),
        ("i.yaml", "router: [1, 2\n", "not valid YAML"),
        ("j.json", "{}", "name it .toml, .yaml or .yml"),
        ("k.toml", "[kvstore-ping]\nconfig = \"x.toml\"\n", "`pdkv kvstore ping` has no option --config"),
        ("l.toml", "[node]\nmax-num-seqs = 8\nmax_num_seqs = 16\n",
         "[node] max_num_seqs: the same option as max-num-seqs, set twice"),  # 16 won, unsaid
        ("m.toml", "[node]\nnum-blocks = true\n", "[node] num-blocks: True is not a valid int"),  # "a int"
    ],
)  # fmt: skip
def test_a_bad_file_is_an_error_naming_the_file_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, says: str
) -> None:
    config = write(tmp_path, name, text)
    # Any command that reads the file checks all of it: here the health check, before it dials anything.
    err = fails(["health", "127.0.0.1:1", "--config", str(config)], capsys)
    assert err.startswith(f"pdkv: error: config file {config}: ") and says in err, err


def test_a_missing_file_and_a_bad_variable_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = fails(["health", "127.0.0.1:1", "--config", str(tmp_path / "none.toml")], capsys)
    assert f"config file {tmp_path / 'none.toml'}: cannot read it" in err
    with pytest.raises(SettingsError, match=r"\$PDKV_MAX_NUM_SEQS: 'abc' is not a valid int"):
        parse(["serve-decode"], {"PDKV_MAX_NUM_SEQS": "abc"})
    with pytest.raises(SettingsError, match=r"\$PDKV_MTLS: 'sure' is not true or false"):
        parse(["serve-decode"], {"PDKV_MTLS": "sure"})


def test_an_abbreviated_config_option_is_refused_not_ignored(tmp_path: Path) -> None:
    config = write(tmp_path, "pdkv.toml", "[router]\nmax-inflight = 10\n")
    with pytest.raises(SettingsError, match="spell the option --config in full"):
        parse([*ROUTER, "--conf", str(config)])


def test_a_setting_the_server_s_config_refuses_names_where_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built before the server starts (its ``check``): the router's config, a node's (before its model
    loads), the store's tiers."""
    config = write(tmp_path, "pdkv.toml", "[router]\nmax-inflight = 0\n[node]\nmax-num-seqs = 0\n")
    err = fails([*ROUTER, "--config", str(config)], capsys)
    assert err == (
        f"pdkv serve-router: error: config file {config}: [router] max-inflight: max_inflight must be a "
        "positive integer, got 0"
    )
    err = fails(["serve-prefill", "--config", str(config)], capsys)
    assert f"config file {config}: [node] max-num-seqs: max_num_seqs must be positive" in err
    # The command line's own value is the command line's: no file is blamed.
    err = fails([*ROUTER, "--max-inflight", "0"], capsys)
    assert err == "pdkv serve-router: error: max_inflight must be a positive integer, got 0"
    monkeypatch.setenv("PDKV_HEALTH_INTERVAL_MS", "-1")
    err = fails(["kvstore", "serve", "--kv-store", "cpu:1MiB"], capsys)
    assert err == "pdkv kvstore: error: $PDKV_HEALTH_INTERVAL_MS: health_interval_ms must be positive, got -1"


# ---- pdkv up ------------------------------------------------------------------------------------------


def up_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``pdkv up ARGV`` exits 2 before it starts anything (it says "starting" when it does)."""
    assert main(["up", "--metrics-ports", "any", *argv]) == 2
    err = capsys.readouterr().err
    assert "pdkv up: starting" not in err
    return err.strip()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[router]\npolicy = \"kv-aware\"\n", "[router] policy: pdkv up sets this itself (from its --policy: "
         "set policy in [up])"),
        ("[prefill]\naddress = \"127.0.0.1:5\"\n",
         "[prefill] address: pdkv up sets this itself (it picks it)"),
        ("[kvstore]\nkv-store = \"cpu:1MiB\"\n", "[kvstore] kv-store: pdkv up sets this itself (from its "
         "--kv-store: set kv-store in [up])"),
        ("[router]\nmax-inflight = 0\n", "pdkv up's router: config file {path}: [router] max-inflight: "
         "max_inflight must be a positive integer, got 0"),
        ("[decode]\nblock-size = 0\n", "pdkv up's decode nodes: config file {path}: [decode] block-size: "
         "block_size must be"),
        ("[kvstore]\nmax-blocks = \"lots\"\n",
         "config file {path}: [kvstore] max-blocks: 'lots' is not a valid int"),
        ("[up]\nprefill = \"two\"\n", "config file {path}: [up] prefill: 'two' is not a valid int"),
    ],
)  # fmt: skip
def test_pdkv_up_refuses_a_child_s_bad_setting_before_it_starts_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    config = write(tmp_path, "cluster.toml", text)
    err = up_fails(["--config", str(config)], capsys)
    assert says.format(path=config) in err, err


def test_pdkv_up_checks_what_its_children_inherit_but_not_its_own_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDKV_MAX_NUM_SEQS", "0")  # a node's variable: every node inherits it
    err = up_fails([], capsys)
    assert "pdkv up's prefill nodes: $PDKV_MAX_NUM_SEQS: max_num_seqs must be positive" in err
    args = parse(["up"])
    # pdkv up's own ($PDKV_PREFILL: a count) are not the children's ($PDKV_PREFILL: the router's nodes).
    assert {"PDKV_PREFILL", "PDKV_DECODE", "PDKV_MODEL", "PDKV_CONFIG"} <= set(args.unset_env)
    assert "PDKV_MAX_NUM_SEQS" not in args.unset_env and "PDKV_TLS_DIR" not in args.unset_env


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--node-args", "--num-blokcs 64"], {}, "prefill nodes: unrecognized arguments: --num-blokcs 64"),
        (["--node-args", "--threads lots"], {}, "pdkv up's prefill nodes: argument --threads: invalid"),
        (["--node-args", "--num-blocks 0"], {}, "pdkv up's prefill nodes: num_blocks"),
        (["--node-args", "--served-model-name 'a"], {}, "--node-args \"--served-model-name 'a\": No closing"),
        # from the file: a key whose name the message contains is not blamed ("prefill" in "prefill nodes")
        ([], {"PDKV_THREADS": "0"}, "pdkv up: error: pdkv up's prefill nodes: $PDKV_THREADS: threads"),
    ],
)  # fmt: skip
def test_pdkv_up_checks_node_args_and_names_only_the_setting_at_fault(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    says: str,
) -> None:
    """An outside operator: a typo in --node-args started the store and the nodes, then pdkv up died with
    a traceback; and $PDKV_THREADS=0 was reported as "[up] prefill: ..." because the file set prefill."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = write(tmp_path, "cluster.toml", "[up]\nprefill = 1\n")
    err = up_fails(["--config", str(config), *argv], capsys)
    assert says in err and "[up] prefill" not in err and "Traceback" not in err, err


def test_pdkv_up_passes_the_model_settings_and_the_file_to_its_children(tmp_path: Path) -> None:
    from pdkv.launcher import Topology

    config = write(tmp_path, "cluster.toml", "[node]\nnum-blocks = 64\n")
    t = Topology(served_model_name="smol", max_model_len=512, config_file=config)
    assert t.model_args() == ("--served-model-name", "smol", "--max-model-len", "512")
    assert t.config_args() == ("--config", str(config))
    with pytest.raises(ValueError, match="--api-keys-file and --secure"):
        Topology(secure=True, api_keys_file=tmp_path / "keys.toml")
    assert parse(["up", "--config", str(config)]).config == str(config)


def test_the_documented_cluster_file_passes_pdkv_up_s_checks(tmp_path: Path) -> None:
    """docs/config.md's example put grace-s in [node], which pdkv up sets itself: the file an operator
    copies from the docs was refused.  The example, as written there, passes every check pdkv up runs
    before it starts anything."""
    import re

    from pdkv import settings
    from pdkv.cli import build_parser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    example = re.search(r"```toml\n# cluster.toml: pdkv up --config cluster.toml\n(.*?)```", doc, re.S)
    assert example is not None
    (tmp_path / "keys.toml").write_text('[tenants.a]\nkey_sha256 = ["' + "0" * 64 + '"]\n')
    config = write(tmp_path, "cluster.toml", example.group(1))
    argv = ["up", "--config", str(config)]
    parser = build_parser()
    applied = settings.apply(parser, argv, {})
    args = parser.parse_args(argv)
    assert applied is not None
    applied.check(args)
    args.check(args)  # the children's settings, as pdkv up checks them before starting any


def test_pdkv_up_refuses_prefill_nodes_in_colocated_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """An outside probe's find: --mode colocated --prefill 3 started one colocated node, --prefill dropped
    without a word."""
    err = up_fails(["--mode", "colocated", "--prefill", "3", "--kv-store", "none"], capsys)
    assert "--prefill: colocated nodes prefill and decode; give their number with --decode" in err


def test_pdkv_up_refuses_its_prefill_variable_in_colocated_mode_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDKV_PREFILL", "2")
    err = up_fails(["--mode", "colocated", "--kv-store", "none"], capsys)
    assert err.startswith("pdkv up: error: $PDKV_PREFILL: --prefill: colocated nodes prefill and decode")
