# Shared by scripts/test.sh and scripts/demo.sh (sourced, not run): CPU-only
# virtual environments with a real SGLang release and this repo.
#
# SGLang is installed --no-deps: its full dependency set pulls GPU-only wheels.
# requirements/sglang-cpu-<version>.txt lists what its HiCache modules need on
# a CPU. A venv is reused while its stamp (a hash of this file, the
# requirement file and pyproject.toml) still matches; otherwise it is rebuilt.
#
# Expects ROOT (the repo) and the current directory to be ROOT.

PYTHON="${PYTHON:-python3}"
# torch's CPU build, by its local version: PyPI's torch==2.13.0 for Linux is the
# CUDA build with several GB of GPU libraries. PyTorch's CPU index serves
# 2.13.0+cpu (pip also takes it from a local wheel folder its config names).
TORCH_SPEC="torch==2.13.0+cpu"
TORCH_INDEX="${SGLANG_SIMM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
MAIN_SGLANG="0.5.23"
MAIN_VENV=".venv-test"

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1

log() { printf '[%s +%ss] %s\n' "${LOG_TAG:-venv}" "$SECONDS" "$*" >&2; }

# pip, quiet, without byte-compiling (compile_tree does it once, in
# parallel, after a venv's last install), and without the noise that
# installing SGLang --no-deps causes (pip lists every SGLang dependency left
# out) or that unreachable local index folders in a pip config cause. Full
# output when pip fails.
pip_q() {
    local py="$1" out rc=0 extra=(-q)
    shift
    [ "$1" = install ] && extra+=(--no-compile)
    out="$("$py" -m pip "$@" "${extra[@]}" 2>&1)" || rc=$?
    if [ "$rc" -ne 0 ]; then
        printf '%s\n' "$out" >&2
        log "pip $* failed (exit $rc)" >&2
        return "$rc"
    fi
    printf '%s\n' "$out" | grep -vE \
        -e "^sglang [^ ]+ requires " \
        -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "is ignored: it is neither a file nor a directory" \
        -e '^$' || true
}

# Import shims for CPU-only SGLang venvs: a one-line .pth file that calls
# sglang_simm_dev.cpu_standins.install_import_shims() at every interpreter
# start (import hooks only; they never shadow a working install, see that
# module). Quiet while the dev package is not importable (mid-reinstall).
# The interpreter reads .pth files in name order: this one's name sorts after
# the editable installs' (_editable_impl_sglang_simm_dev.pth puts dev/ on the
# path), which it needs.
write_shims() {
    local py="$1" sgl_kernel_stub="$2" site
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -f "$site/_sglang_cpu_test_shims.py"
    printf 'import sys; exec("try:\\n from sglang_simm_dev.cpu_standins import install_import_shims\\nexcept ImportError:\\n pass\\nelse:\\n install_import_shims(sgl_kernel_stub=%s)")\n' \
        "$sgl_kernel_stub" >"$site/_sglang_cpu_test_shims.pth"
}

stamp_of() {
    local sglang="$1" req="$2"
    {
        printf '%s\n' "$ROOT" "$PYTHON" "$("$PYTHON" -c 'import sys; print(sys.version)')" \
            "$TORCH_SPEC" "sglang==$sglang"
        # This file defines the venvs.
        cat "$ROOT/scripts/_venv.sh" "$req" pyproject.toml dev/pyproject.toml
    } | sha256sum | cut -d' ' -f1
}

# compile_tree PYTHON DIR...: byte-compile once, on every core. Without it
# each process compiles every module it imports, and where
# PYTHONDONTWRITEBYTECODE=1 is set (as on some CI machines) it does so on
# every start: an SGLang scheduler then spends 24 s of CPU importing instead
# of 11 (measured), and a test run starts a dozen SGLang processes.
compile_tree() {
    local py="$1"
    shift
    # Its status is not checked, as pip does not check it: packages ship files
    # for newer Pythons that are never imported (torch's py312_intrinsics.py).
    "$py" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
}

# torch installed once into DIR (pip --target) and shared by every venv built
# while TORCH_LAYER=DIR is set, through a .pth file: scripts/compat.sh builds
# a venv per SGLang release, and a copy of torch each would cost ~1 GB and a
# minute apiece. pip sees torch there as installed.
ensure_torch_layer() {
    local layer="$1"
    [ -f "$layer/.done" ] && return 0
    log "installing $TORCH_SPEC once into $layer (shared by the compat venvs)"
    rm -rf "$layer"
    pip_q "$PYTHON" install --target "$layer" "$TORCH_SPEC"
    compile_tree "$PYTHON" "$layer"
    touch "$layer/.done"
}

# ensure_venv DIR SGLANG_VERSION PIP_TARGET SGL_KERNEL_STUB [REQUIREMENTS]
# PIP_TARGET: what of this repo to install (".", ".[cli]", editable, with the
# instruments of dev/ and its test extra; or the wheel from ensure_wheel, for
# venvs that only ever run the built wheel, with dev/ beside it, no extras).
# dev/ (sglang_simm_dev: the CPU stand-ins, the demo, the bench, the compat
# probe) is always an editable install: it is never part of the wheel.
# REQUIREMENTS: requirements/sglang-cpu-<version>.txt by default; "derive":
# the nearest older file with SGLang's own pins (scripts/_compat_reqs.py),
# for releases that have no file of their own.
ensure_venv() {
    local venv="$1" sglang="$2" target="$3" sgl_kernel_stub="$4"
    local req="${5:-requirements/sglang-cpu-$sglang.txt}" stamp py torch_before torch_after
    if [ "$req" = derive ]; then
        req="scripts/_compat_reqs.py"  # the stamp then covers the rule that derives them
    else
        [ -f "$req" ] || { log "missing $req" >&2; return 1; }
    fi
    stamp="$(stamp_of "$sglang" "$req")"
    py="$ROOT/$venv/bin/python"
    if [ -x "$py" ] && [ "$(cat "$venv/.stamp" 2>/dev/null || true)" = "$stamp" ] \
        && "$py" -c 'import sys' 2>/dev/null; then
        log "$venv: up to date (sglang $sglang)"
        return 0
    fi
    local t0=$SECONDS
    log "$venv: building (sglang $sglang, $TORCH_SPEC)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    local torch_source=()
    if [ -n "${TORCH_LAYER:-}" ]; then
        ensure_torch_layer "$TORCH_LAYER"
        "$py" -c 'import sysconfig, sys; open(sysconfig.get_paths()["purelib"] + "/_shared_torch.pth", "w").write(sys.argv[1] + "\n")' "$TORCH_LAYER"
    elif "$PYTHON" - "$TORCH_INDEX" <<'PYEOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
PYEOF
        torch_source=(--extra-index-url "$TORCH_INDEX")
        log "$venv: installing $TORCH_SPEC (PyTorch's CPU index $TORCH_INDEX, or the configured indexes)"
    else
        log "$venv: $TORCH_INDEX does not answer; installing $TORCH_SPEC from the configured indexes"
    fi
    [ -n "${TORCH_LAYER:-}" ] || pip_q "$py" install "${torch_source[@]}" "$TORCH_SPEC"
    torch_before="$("$py" -W ignore -c 'import torch; print(torch.__version__)')"
    log "$venv: installing sglang==$sglang --no-deps and $req"
    pip_q "$py" install --no-deps "sglang==$sglang"
    if [ "$req" = scripts/_compat_reqs.py ]; then
        pip_q "$py" install packaging
        "$py" scripts/_compat_reqs.py requirements >"$venv/requirements-derived.txt"
        req="$venv/requirements-derived.txt"
    fi
    pip_q "$py" install -r "$req"
    log "$venv: installing this repo ($target)"
    if [ "${target%.whl}" != "$target" ]; then
        pip_q "$py" install --no-deps "$target"  # a built wheel: no build step per venv
        wheel_deps "$py" "$target"
        printf '%s\n' "$(cat dist/.tree-hash)" >"$venv/.wheel-hash"
        pip_q "$py" install --no-deps -e "$ROOT/dev"
    else
        pip_q "$py" install -e "$target" -e "$ROOT/dev[test]"
    fi
    torch_after="$("$py" -W ignore -c 'import torch; print(torch.__version__)')"
    if [ "$torch_before" != "$torch_after" ]; then
        log "$venv: torch changed from $torch_before to $torch_after during install" >&2
        return 1
    fi
    write_shims "$py" "$sgl_kernel_stub"
    log "$venv: byte-compiling site-packages"
    compile_tree "$py" "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    log "$venv: checking SGLang's HiCache modules import"
    "$py" -W ignore - <<'PYEOF'
import importlib

def first(*names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not name.startswith(str(e.name)):
                raise
    raise ModuleNotFoundError(f"none of {names}")

for name in (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.managers.cache_controller",
):
    importlib.import_module(name)
first("sglang.srt.mem_cache.pool_host", "sglang.srt.mem_cache.memory_pool_host")
first("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector")
import sglang_simm  # noqa: F401
import sglang_simm_dev.cpu_standins  # noqa: F401
PYEOF
    printf '%s\n' "$stamp" >"$venv/.stamp"
    log "$venv: ready (torch $torch_after, $((SECONDS - t0))s)"
}


# The wheel of this tree, built once per tree content: dist/ keeps it with the
# hash of what goes into it, and a venv gets it (over its editable install)
# only when it does not hold that build yet. Sets WHEEL.
tree_hash() {
    find src pyproject.toml README.md LICENSE -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

ensure_wheel() {
    local py="$1" hash
    hash="$(tree_hash)"
    WHEEL="$(ls dist/sglang_simm-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$WHEEL" ] || [ "$(cat dist/.tree-hash 2>/dev/null || true)" != "$hash" ]; then
        log "building the wheel"
        rm -rf dist
        pip_q "$py" wheel --no-deps -w dist .
        printf '%s\n' "$hash" >dist/.tree-hash
        WHEEL="$(ls dist/sglang_simm-*.whl | head -1)"
    else
        log "the wheel is up to date ($WHEEL)"
    fi
}

# wheel_deps PY WHEEL: the wheel's own dependencies that PY's venv lacks (a
# venv built before the wheel declared them); its torch stays as it is.
wheel_deps() {
    local torch
    torch="$("$1" -W ignore -c 'import torch; print(torch.__version__)')"
    pip_q "$1" install "$2" "torch==$torch"
}

# install_wheel VENV: the wheel from ensure_wheel, unless VENV has it already.
install_wheel() {
    local venv="$1" hash
    hash="$(cat dist/.tree-hash)"
    [ "$(cat "$venv/.wheel-hash" 2>/dev/null || true)" = "$hash" ] && return 0
    pip_q "$ROOT/$venv/bin/python" install --no-deps --force-reinstall "$ROOT/$WHEEL"
    wheel_deps "$ROOT/$venv/bin/python" "$ROOT/$WHEEL"
    compile_tree "$ROOT/$venv/bin/python" "$("$ROOT/$venv/bin/python" -c 'import sglang_simm, os; print(os.path.dirname(sglang_simm.__file__))')"
    printf '%s\n' "$hash" >"$venv/.wheel-hash"
}
