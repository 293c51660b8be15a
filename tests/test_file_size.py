"""No source file outside ``tests/`` and ``bench/`` grows past 450 lines: a longer one holds more than one
responsibility, and is split by responsibility (``docs/architecture.md`` names each part)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 450
# Not ours to split: tests and benchmarks (scenario tables), generated stubs, the environment.
EXEMPT = {"tests", "bench", "pdkv_proto", ".venv", ".git", "build", "examples"}


def test_no_source_file_is_over_450_lines() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in EXEMPT or any(part.startswith(".") for part in rel.parts):
            continue
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"over {MAX_LINES} lines (split them by responsibility):\n" + "\n".join(long)
