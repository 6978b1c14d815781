#!/usr/bin/env bash
# The test command: builds CPU-only virtual environments with real SGLang
# releases, installs the built wheel into each, then runs pytest.
#
#   scripts/test.sh [pytest args...]
#
# .venv-test             sglang 0.5.23 (the main target) with the [test]
#                        extra; pytest runs here.
# .venv-sglang-<v>       older releases, for subprocess checks; their pythons
#                        are named in SGLANG_SIMM_COMPAT_PYTHONS (space-separated).
#
# scripts/_venv.sh builds and reuses the venvs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_TAG=test.sh
# shellcheck source=scripts/_venv.sh
. "$ROOT/scripts/_venv.sh"

# 0.5.8: the oldest supported release (dynamic route only); 0.5.11: the first
# with plugin entry points. Both need the sgl_kernel import shim.
COMPAT_SGLANGS=("0.5.8" "0.5.11")

ensure_venv "$MAIN_VENV" "$MAIN_SGLANG" ".[test]" False
compat_pythons=()
for v in "${COMPAT_SGLANGS[@]}"; do
    ensure_venv ".venv-sglang-$v" "$v" "." True
    compat_pythons+=("$ROOT/.venv-sglang-$v/bin/python")
done
export SGLANG_SIMM_COMPAT_PYTHONS="${compat_pythons[*]}"

# Every venv then runs this repo as an operator gets it: the built wheel,
# installed over the editable install, on every run (so never stale).
log "building the wheel"
rm -rf dist
pip_q "$ROOT/$MAIN_VENV/bin/python" wheel --no-deps -w dist .
wheel=(dist/sglang_simm-*.whl)
for py in "$ROOT/$MAIN_VENV/bin/python" "${compat_pythons[@]}"; do
    pip_q "$py" install --no-deps --force-reinstall "${wheel[0]}"
done
export SGLANG_SIMM_WHEEL="$ROOT/${wheel[0]}"

log "pytest $*"
exec "$ROOT/$MAIN_VENV/bin/python" -m pytest "$@"
