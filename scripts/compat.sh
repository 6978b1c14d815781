#!/usr/bin/env bash
# Every SGLang release this package claims, each in a CPU virtual environment
# of its own (built once, reused while its stamp matches), checked by
# `python -m sglang_simm_dev.compat_probe` (the plugin route where the
# release has plugins, the dynamic route, MHA and MLA pools, v2 where it
# exists, every hybrid pool stack of sglang_simm_dev.hybrid_pools the
# release can build); writes docs/compatibility.md from the results.
#
#   scripts/compat.sh              every release from 0.5.8 to the newest on the index
#   scripts/compat.sh --ci         the oldest, the first with plugins and the newest
#   scripts/compat.sh 0.5.19 ...   only these (the table keeps earlier results)
#
# Venvs, logs and results live in .venv-compat/ (ignored by git); torch is
# installed there once and shared by every venv. Releases are checked one
# after another at low priority; a release that fails to build or to pass is
# a row in the table, and the exit status is 1 if any row failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_TAG=compat.sh
# shellcheck source=scripts/_venv.sh
. "$ROOT/scripts/_venv.sh"

OLDEST="0.5.8"
FIRST_WITH_PLUGINS="0.5.11"
COMPAT_DIR=".venv-compat"
mkdir -p "$COMPAT_DIR/results" "$COMPAT_DIR/logs"
pyver="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
export TORCH_LAYER="${TORCH_LAYER:-$ROOT/$COMPAT_DIR/_torch-py$pyver-${TORCH_SPEC#torch==}}"

all_releases() {
    # every release of 0.5.x from the oldest supported one, oldest first
    "$PYTHON" -m pip index versions sglang 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' \
        | "$PYTHON" -c '
import re, sys
def key(v):
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", v)
    return tuple(int(x or 0) for x in m.groups()) if m else None
oldest = key(sys.argv[1])
vs = sorted({v.strip() for v in sys.stdin if key(v.strip()) and oldest <= key(v.strip()) < (0, 6, 0, 0)}, key=key)
print("\n".join(vs))' "$OLDEST"
}

case "${1:-}" in
    --ci) releases=("$OLDEST" "$FIRST_WITH_PLUGINS" "$MAIN_SGLANG") ;;
    "") mapfile -t releases < <(all_releases)
        [ "${#releases[@]}" -gt 0 ] || { log "pip index versions sglang listed no release"; exit 1; } ;;
    *) releases=("$@") ;;
esac
log "releases: ${releases[*]}"

ensure_wheel "$PYTHON"
failed=0
for v in "${releases[@]}"; do
    venv="$COMPAT_DIR/sglang-$v"
    logf="$COMPAT_DIR/logs/$v.log"
    out="$COMPAT_DIR/results/$v.json"
    req="requirements/sglang-cpu-$v.txt"
    [ -f "$req" ] || req=derive
    stub=True
    [ "$v" = "$MAIN_SGLANG" ] && stub=False
    t0=$SECONDS
    status=passed
    if ! ensure_venv "$venv" "$v" "$ROOT/$WHEEL" "$stub" "$req" >"$logf" 2>&1 || ! install_wheel "$venv" >>"$logf" 2>&1; then
        status="venv build failed"
    else
        store_dir="$(mktemp -d /tmp/sglang-simm-compat-XXXXXX)"
        if ! SGLANG_SIMM_STORE_DIR="$store_dir" timeout 900 "$venv/bin/python" -W ignore \
                -m sglang_simm_dev.compat_probe >"$COMPAT_DIR/results/$v.probe" 2>>"$logf"; then
            status="probe failed"
        fi
        for pidfile in "$store_dir"/*.pid; do
            [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
        done
        rm -rf "$store_dir"
    fi
    "$PYTHON" scripts/_compat_table.py record "$v" "$status" "$COMPAT_DIR/results/$v.probe" "$logf" "$req" >"$out" || true
    verdict="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["result"])' "$out" 2>/dev/null || echo "?")"
    log "sglang $v: $verdict ($((SECONDS - t0))s, log $logf)"
    [ "$verdict" = pass ] || failed=1
done
# the table names every release (earlier rows kept, the rest "not run"), however few ran now
mapfile -t every < <(all_releases)
[ "${#every[@]}" -gt 0 ] || every=("${releases[@]}")
"$PYTHON" scripts/_compat_table.py render "$COMPAT_DIR/results" docs/compatibility.md "${every[@]}"
log "wrote docs/compatibility.md"
exit "$failed"
