"""Every ``pdkv`` command's options from a config file and the environment, under its command line.

    pdkv serve-router --config pdkv.toml --max-inflight 64

Precedence, highest first: the command line, then ``PDKV_<OPTION>`` environment variables (the long option
upper-cased, dashes as underscores: ``--max-num-seqs`` is ``$PDKV_MAX_NUM_SEQS``; an empty variable is
unset), then the config file, then the option's default.  The file (``--config FILE`` or ``$PDKV_CONFIG``)
is TOML (``.toml``) or YAML (``.yaml``, ``.yml``): one table per command, keys the command's long options
without their dashes (``max-num-seqs`` or ``max_num_seqs``), values as the option takes them (a flag
``true`` or ``false``, a repeatable option a list)::

    [up]            # pdkv up
    prefill = 2
    [router]        # pdkv serve-router, and pdkv up's router
    max-inflight = 128
    [node]          # every node: pdkv serve-prefill | serve-decode | serve-colocated, and pdkv up's
    num-blocks = 1024
    [prefill]       # prefill nodes only, over [node]; likewise [decode] and [colocated]
    max-num-batched-tokens = 4096
    [kvstore]       # pdkv kvstore serve, and pdkv up's store server
    max-blocks = 512
    [generate]      # any other command: its words joined by dashes ([kvstore-ping], [make-model])

One file configures a whole ``pdkv up`` cluster (it hands every child the file; each reads its own
tables) or a single process.  Whenever a command reads a file it checks all of it: an unknown table or
key, or a value the option refuses, is an error naming the file and the key before the command does
anything.  ``docs/config.md`` lists every option of every command with its variable.

This works on the ``argparse`` parsers the commands build (``cli.build_parser``): a value from the file or
the environment becomes the option's default, so the command line still overrides it, and is checked and
converted as the option would convert it.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_ENV = "PDKV_CONFIG"
# The tables a command reads, in order (a later one overrides an earlier one); any other command reads
# the table named after it.
SECTIONS: dict[str, tuple[str, ...]] = {
    "serve-router": ("router",),
    "serve-prefill": ("node", "prefill"),
    "serve-decode": ("node", "decode"),
    "serve-colocated": ("node", "colocated"),
    "kvstore serve": ("kvstore",),
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A config file or an environment variable that a command refuses; the message names where."""


def sections_of(command: str) -> tuple[str, ...]:
    """The tables ``command`` (its words: ``kvstore serve``) reads."""
    return SECTIONS.get(command, (command.replace(" ", "-"),))


def env_name(option: str) -> str:
    """``--max-num-seqs`` (or ``max-num-seqs``) -> ``PDKV_MAX_NUM_SEQS``."""
    return "PDKV_" + option.lstrip("-").replace("-", "_").upper()


def option_key(text: str) -> str:
    """A file's key or an option (``max_num_seqs``, ``--max-num-seqs``) as ``max-num-seqs``."""
    return text.lstrip("-").replace("_", "-")


# ---- the parsers ------------------------------------------------------------------------------------


def leaves(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(command, parser) of every command under ``parser``: the parsers without subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(words), parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaves(sub, (*words, name))


def options(leaf: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A command's settable options by long name without dashes (not ``--help``, not ``--config``)."""
    out = {}
    for action in leaf._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in ("help", "config"):
            out[option_key(longs[0])] = action
    return out


def command_of(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[str, Any, list[str]] | None:
    """The command ``argv`` names (its words, its parser, the arguments after it), or None."""
    words: list[str] = []
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return " ".join(words), parser, argv
        if not argv or argv[0] not in subs[0].choices:
            return None
        parser, words, argv = subs[0].choices[argv[0]], [*words, argv[0]], argv[1:]


def install(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on every command, and where else its options can be set (the epilog)."""
    for command, leaf in leaves(parser):
        tables = " then ".join(f"[{s}]" for s in sections_of(command))
        leaf.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help=f"options from a TOML or YAML file's {tables} table (or ${CONFIG_ENV}); docs/config.md",
        )
        names = list(options(leaf))
        example = next((n for n in names if "-" in n), names[0] if names else "option")
        note = (
            f"Every option can also be set in the --config file's {tables} table and as a PDKV_<OPTION> "
            f"environment variable (--{example}: ${env_name(example)}); the command line wins, then the "
            "environment, then the file."
        )
        leaf.epilog = f"{leaf.epilog}\n\n{note}" if leaf.epilog else note


# ---- values -----------------------------------------------------------------------------------------


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` (from a file: typed; from the environment: a string) as ``action`` stores it."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        flag = _boolean(value, where)
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    if isinstance(action, argparse._AppendAction):
        return [_scalar(action, v, where) for v in (value if isinstance(value, list) else [value])]
    if isinstance(action, argparse._StoreAction) and action.nargs is None:
        return _scalar(action, value, where)
    raise SettingsError(f"{where}: this option is for the command line only")


def _boolean(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
        return value.strip().lower() in _TRUE
    raise SettingsError(f"{where}: {value!r} is not true or false")


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    name = getattr(kind, "__name__", "value") if kind is not None else "string"
    if isinstance(value, bool | list | dict) or value is None:
        raise SettingsError(f"{where}: {value!r} is not a valid {name}")
    try:
        if kind is None:
            result: Any = str(value)
        elif kind is int and isinstance(value, float):
            raise ValueError
        elif kind in (int, float) and isinstance(value, int | float):
            result = kind(value)
        else:
            result = kind(str(value))  # type: ignore[operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise SettingsError(f"{where}: {value!r} is not a valid {name}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise SettingsError(f"{where}: {value!r} is not one of {choices}")
    return result


# ---- the file ---------------------------------------------------------------------------------------


def read_file(path: Path) -> dict[str, Any]:
    """The file's tables, unchecked; ``SettingsError`` when it cannot be read or parsed."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise SettingsError(f"config file {path}: name it .toml, .yaml or .yml (TOML or YAML)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot read it ({exc.strerror})") from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError: both say where
        raise SettingsError(f"config file {path}: not valid {suffix.lstrip('.').upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: a table of tables ([router], [node], ...) is expected")
    return data


def check_file(parser: argparse.ArgumentParser, path: Path, data: Mapping[str, Any]) -> None:
    """Every table and key of the file against the commands that read it."""
    readers: dict[str, list[tuple[str, argparse.ArgumentParser]]] = {}
    for command, leaf in leaves(parser):
        for section in sections_of(command):
            readers.setdefault(section, []).append((command, leaf))
    for section, table in data.items():
        if not isinstance(table, dict):
            raise SettingsError(
                f"config file {path}: {section} = {table!r} is not a table: keys go in a [table] of a command"
            )
        if section not in readers:
            hint = _did_you_mean(section, readers)
            raise SettingsError(f"config file {path}: unknown table [{section}]{hint}")
        spelled: dict[str, str] = {}
        for key, value in table.items():
            name = option_key(str(key))
            where = f"config file {path}: [{section}] {key}"
            if name in spelled:  # max-num-seqs and max_num_seqs: one option, two values
                raise SettingsError(f"{where}: the same option as {spelled[name]}, set twice: keep one")
            spelled[name] = str(key)
            for command, leaf in readers[section]:
                action = options(leaf).get(name)
                if action is None:
                    hint = _did_you_mean(name, options(leaf))
                    raise SettingsError(f"{where}: `pdkv {command}` has no option --{name}{hint}")
                convert(action, value, where)


def _did_you_mean(word: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(sorted(known))}"


# ---- one command ------------------------------------------------------------------------------------


@dataclass
class Applied:
    """What a command took from the file and the environment: where each option's value came from."""

    command: str
    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)  # dest -> value
    sources: dict[str, str] = field(default_factory=dict)  # dest -> "config file F: [t] key" | "$PDKV_X"

    def check(self, args: argparse.Namespace) -> None:
        """The parsed command read the file that was applied (an abbreviated ``--conf`` would not be)."""
        given = getattr(args, "config", None)
        if given and (self.path is None or Path(given).expanduser().resolve() != self.path):
            raise SettingsError(f"--config {given}: spell the option --config in full")

    def explain(self, message: str, args: argparse.Namespace) -> str:
        """``message`` (an error naming a setting, e.g. ``max_inflight must be ...``) prefixed with where the
        setting came from, when the file or the environment set it and the command line did not."""
        for dest, where in self.sources.items():
            named = re.search(rf"\b{re.escape(dest)}\b", message) is not None
            if named and getattr(args, dest, None) == self.values[dest]:
                return f"{where}: {message}"
        return message


def apply(parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str]) -> Applied | None:
    """Make the file's and the environment's values the defaults of the command ``argv`` names; None when
    it names none (argparse then says so).  Raises ``SettingsError`` before anything else happens."""
    found = command_of(parser, argv)
    if found is None:
        return None
    command, leaf, rest = found
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    given = pre.parse_known_args(rest)[0].config or environ.get(CONFIG_ENV) or None
    path = Path(given).expanduser().resolve() if given else None
    applied = Applied(command, path)
    if path is not None:
        leaf.set_defaults(config=str(path))  # the command sees the file it read, whichever named it
    opts = options(leaf)
    if path is not None:
        data = read_file(path)
        check_file(parser, path, data)
        for section in sections_of(command):
            for key, value in (data.get(section) or {}).items():
                action = opts[option_key(str(key))]
                where = f"config file {path}: [{section}] {key}"
                applied.values[action.dest] = convert(action, value, where)
                applied.sources[action.dest] = where
    for name, action in opts.items():
        variable = env_name(name)
        if environ.get(variable):
            applied.values[action.dest] = convert(action, environ[variable], f"${variable}")
            applied.sources[action.dest] = f"${variable}"
    leaf.set_defaults(**applied.values)
    for action in leaf._actions:
        if action.required and action.dest in applied.values:
            action.required = False  # the file or the environment gives it
    return applied


def env_variables(leaf: argparse.ArgumentParser) -> set[str]:
    """The environment variables a command reads: one per option, and ``$PDKV_CONFIG``."""
    return {env_name(name) for name in options(leaf)} | {CONFIG_ENV}


# ---- the reference ----------------------------------------------------------------------------------

DOC_BEGIN = "<!-- options:begin (python scripts/gen_config_doc.py writes this part) -->"
DOC_END = "<!-- options:end -->"
# --dtype's help says what auto picks on this machine's CPU; the page says it for any.
ANY_CPU = (
    "auto = bfloat16 on a CPU with avx512_bf16, amx_bf16 or avx512f/bw/vl (pdkv's native kernels) "
    "(float32 checkpoints stay float32), else float32"
)


def doc_reference(parser: argparse.ArgumentParser) -> str:
    """``reference`` as docs/config.md holds it: the same for every machine."""
    from engine.cpu_features import auto_cpu_dtype_note

    return reference(parser).replace(auto_cpu_dtype_note(), ANY_CPU)


def reference(parser: argparse.ArgumentParser) -> str:
    """Every command's options as markdown: the table each reads, each option's variable and default."""
    out = []
    for command, leaf in leaves(parser):
        tables = ", then ".join(f"`[{s}]`" for s in sections_of(command))
        out += [f"### `pdkv {command}`: {tables}", "", "| option | variable | default | what |"]
        out.append("| --- | --- | --- | --- |")
        for name, action in options(leaf).items():
            unset = action.default is None or action.default is False or action.default in ("", [])
            default = "" if unset else f"`{action.default}`"
            what = " ".join((action.help or "").split()).replace("%%", "%").replace("|", "\\|")
            if action.choices is not None:
                what += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
            out.append(f"| `--{name}` | `${env_name(name)}` | {default} | {what} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
