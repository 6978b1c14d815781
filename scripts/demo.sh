#!/usr/bin/env bash
# The main job: a real SGLang server (python -m sglang.launch_server) on the
# CPU with this plugin as HiCache's L3 tier on the local store (no GPU, no
# cluster): time to first token of a shared system prompt from scratch, from
# the device, the host tier and L3, every answer checked against a fresh
# computation. A few minutes on 2 cores, most of it the server's start.
#
#   scripts/demo.sh                          the server demo (sglang-simm-dev demo --server)
#   scripts/demo.sh [sglang-simm-dev demo options...]
#
#   scripts/demo.sh --server --json out.json the server demo, numbers written too
#   scripts/demo.sh --model llama3-8b        no server: SGLang's own controller on real-model pages
#   scripts/demo.sh --model deepseek-v3      an MLA model
#   scripts/demo.sh --model tiny-hybrid      a hybrid (Mamba) model through v2
#   scripts/demo.sh --direct                 call the backend directly
#   scripts/demo.sh --json demo.json         also write the numbers
#   scripts/demo.sh --manager HOST:PORT      the same against a real SiMM cluster
#   scripts/demo.sh --list-models            the geometry presets
#
# It builds (once, a few minutes) or reuses the same .venv-test that
# scripts/test.sh uses (scripts/_venv.sh), installs this checkout into it
# (the plugin and dev/, the instruments' project, both editable), and runs
# `sglang-simm-dev demo`: the demo is not part of the sglang-simm wheel.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_TAG=demo.sh
# shellcheck source=scripts/_venv.sh
. "$ROOT/scripts/_venv.sh"

ensure_venv "$MAIN_VENV" "$MAIN_SGLANG" ".[cli]" False
py="$ROOT/$MAIN_VENV/bin/python"
# this checkout, as it is now (scripts/test.sh may have left a built wheel there)
pip_q "$py" install --no-deps -e . -e ./dev
rm -f "$MAIN_VENV/.wheel-hash"  # it no longer holds the built wheel: scripts/test.sh reinstalls it
[ "$#" -gt 0 ] || set -- --server
log "sglang-simm-dev demo $*"
exec "$ROOT/$MAIN_VENV/bin/sglang-simm-dev" demo "$@"
