#!/usr/bin/env bash
# The test command: builds CPU-only virtual environments with real SGLang
# releases, installs the built wheel into each, then runs pytest.
#
#   scripts/test.sh [pytest args...]          everything (what CI runs)
#   scripts/test.sh --fast [pytest args...]   unit and contract tests on the
#                                             in-process local store: no SGLang
#                                             servers, no store processes of
#                                             the store's own tests, no other
#                                             venvs, no wheel (runs src/)
#
# .venv-test             sglang 0.5.23 (the main target), this repo and
#                        dev/ (the instruments: CPU stand-ins, demo, bench)
#                        with its [test] extra; pytest runs here.
# .venv-sglang-<v>       older releases, for the compat probes
#                        (tests/test_compat.py); their pythons are named in
#                        SGLANG_SIMM_COMPAT_PYTHONS (space-separated).
#
# scripts/_venv.sh builds and reuses the venvs; the wheel is built once per
# tree content and installed into a venv only when that venv lacks it. The
# tiers are markers (pyproject.toml), given to tests by file in
# tests/suite.py. Every SGLang release: scripts/compat.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_TAG=test.sh
# shellcheck source=scripts/_venv.sh
. "$ROOT/scripts/_venv.sh"

#: what --fast leaves out (markers, see pyproject.toml)
FAST_MARKERS="not e2e and not host and not server and not slow and not real"

fast=0
if [ "${1:-}" = --fast ]; then
    fast=1
    shift
fi

# 0.5.8: the oldest supported release (dynamic route only); 0.5.11: the first
# with plugin entry points. Both need the sgl_kernel import shim.
COMPAT_SGLANGS=("0.5.8" "0.5.11")

# The suite spreads over pytest-xdist workers, one per core up to 4
# (SGLANG_SIMM_TEST_WORKERS overrides; -n 0 in the arguments runs in this
# process), a file at a time, so a file's shared servers or setup are built
# once; the longest files go first (FIRST in tests/suite.py). Most of a
# run is SGLang importing itself in servers, which a single pytest process
# leaves a core idle beside.
workers="${SGLANG_SIMM_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$workers" -gt 4 ] && workers=4
spread=(-n "$workers" --dist loadfile --no-loadscope-reorder)  # our order: FIRST

ensure_venv "$MAIN_VENV" "$MAIN_SGLANG" ".[cli]" False
if [ "$fast" = 1 ]; then
    log "pytest -m '$FAST_MARKERS' ${spread[*]} $* (this tree's src/ first on the path)"
    PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" exec "$ROOT/$MAIN_VENV/bin/python" -m pytest -m "$FAST_MARKERS" "${spread[@]}" "$@"
fi

# Every venv runs this repo as an operator gets it: the built wheel (over the
# main venv's editable install; the compat venvs only ever hold the wheel).
ensure_wheel "$ROOT/$MAIN_VENV/bin/python"
compat_pythons=()
for v in "${COMPAT_SGLANGS[@]}"; do
    ensure_venv ".venv-sglang-$v" "$v" "$ROOT/$WHEEL" True
    compat_pythons+=("$ROOT/.venv-sglang-$v/bin/python")
done
export SGLANG_SIMM_COMPAT_PYTHONS="${compat_pythons[*]}"
for venv in "$MAIN_VENV" "${COMPAT_SGLANGS[@]/#/.venv-sglang-}"; do
    install_wheel "$venv"
done
export SGLANG_SIMM_WHEEL="$ROOT/$WHEEL"

log "pytest ${spread[*]} $*"
exec "$ROOT/$MAIN_VENV/bin/python" -m pytest "${spread[@]}" "$@"
