#!/usr/bin/env bash
# The main job: set up .venv, start the local cluster (KV store, a prefill node, a decode node, the
# router) on the embedded default model (SmolLM2-135M-Instruct), ask it one question through the router
# with the model's chat template, and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The chat-templated prompt spans several KV blocks, so the stats line shows the decode node pulling them
# from the prefill node (remote_prefill) instead of computing them.
exec .venv/bin/pdkv up --router-address 127.0.0.1:0 --http-port 0 --chat --max-tokens 64 --oneshot \
    "${*:-What is the capital of France?}"
