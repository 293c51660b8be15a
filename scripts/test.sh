#!/usr/bin/env bash
# Set up .venv, then lint, type-check and run the test suite.  `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Integration tests start their own redis-server on a free port; install the binary where it is missing.
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)) \
            || echo "warning: could not install redis-server; redis tests will fail" >&2
    fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
