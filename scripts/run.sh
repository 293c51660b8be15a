#!/usr/bin/env bash
# The main job: set up .venv, start the local cluster (KV store, a prefill node, a decode node, the
# router) on the embedded default model, generate once through the router, and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The default prompt spans several KV blocks, so the stats line shows the decode node pulling them from
# the prefill node (remote_prefill) instead of computing them.
exec .venv/bin/pdkv up --router-address 127.0.0.1:0 --oneshot \
    "${*:-The quick brown fox jumps over the lazy dog, and then the dog chases the fox around the barn.}"
