#!/usr/bin/env bash
# The main job: set up .venv, then generate text with the local engine on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdkv generate "${@:-The quick brown fox}"
