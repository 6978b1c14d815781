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
TORCH_SPEC="torch==2.13.0"
MAIN_SGLANG="0.5.23"
MAIN_VENV=".venv-test"

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1

log() { printf '[%s +%ss] %s\n' "${LOG_TAG:-venv}" "$SECONDS" "$*" >&2; }

# pip, quiet, without byte-compiling (that halves install time; Python
# compiles what the tests import on first use), and without the noise that
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

# Import shims for CPU-only SGLang venvs, written into the venv's
# site-packages and activated by a .pth file. They never shadow a working
# install: see the docstring.
write_shims() {
    local py="$1" sgl_kernel_stub="$2" site
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cat >"$site/_sglang_cpu_test_shims.py" <<'PYEOF'
"""Import shims for the CPU-only SGLang test venvs (written by scripts/test.sh).

torchvision: PyPI's torchvision wheel is a CUDA build whose _C.so cannot load
    against a CPU-only torch, and torchvision/_meta_registrations.py then
    fails on the missing torchvision::nms and ::qnms schemas. SGLang imports
    torchvision at module scope (sglang.srt.configs -> internvl_utils). When
    _C.so does not load, define those two schemas (without kernels) so the
    pure-Python parts of torchvision import; calling nms raises.
sgl_kernel (only where asked, for SGLang 0.5.8): memory_pool_host.py imports
    sgl_kernel.kvcacheio at module scope; the only sgl-kernel wheel is a CUDA
    build for another torch. When no sgl_kernel is installed, provide
    sgl_kernel.kvcacheio whose functions raise NotImplementedError. The
    package itself stays empty, so `from sgl_kernel import x` still fails.
"""
import importlib.abc
import importlib.machinery
import sys

_KVCACHEIO = "sgl_kernel.kvcacheio"


def _unavailable(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name}: sgl_kernel is a CPU test stub")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__cpu_test_stub__ = True
        if module.__name__ == _KVCACHEIO:

            def __getattr__(attr, _mod=module.__name__):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _unavailable(f"{_mod}.{attr}")

            module.__getattr__ = __getattr__


class _SglKernelStub(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a real sgl_kernel on sys.path wins."""

    def find_spec(self, name, path=None, target=None):
        if name in ("sgl_kernel", _KVCACHEIO):
            return importlib.machinery.ModuleSpec(
                name, _StubLoader(), is_package=(name == "sgl_kernel")
            )
        return None


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """First on sys.meta_path; acts once, on the first import of torchvision."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _prepare_torchvision()
        return None


def _prepare_torchvision():
    import glob
    import os

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    libs = [
        lib
        for loc in spec.submodule_search_locations
        for lib in glob.glob(os.path.join(loc, "_C*.so"))
    ]
    try:
        for lib in libs:
            torch.ops.load_library(lib)
        if libs:
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, op)
        except (AttributeError, RuntimeError):
            torch.library.define(
                f"torchvision::{op}",
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            )


def install(sgl_kernel_stub=False):
    sys.meta_path.insert(0, _TorchvisionHook())
    if sgl_kernel_stub:
        sys.meta_path.append(_SglKernelStub())
PYEOF
    printf 'import _sglang_cpu_test_shims; _sglang_cpu_test_shims.install(sgl_kernel_stub=%s)\n' \
        "$sgl_kernel_stub" >"$site/_sglang_cpu_test_shims.pth"
}

stamp_of() {
    local sglang="$1" req="$2"
    {
        printf '%s\n' "$ROOT" "$PYTHON" "$("$PYTHON" -c 'import sys; print(sys.version)')" \
            "$TORCH_SPEC" "sglang==$sglang"
        # This file defines the venvs.
        cat "$ROOT/scripts/_venv.sh" "$req" pyproject.toml
    } | sha256sum | cut -d' ' -f1
}

# ensure_venv DIR SGLANG_VERSION PIP_TARGET SGL_KERNEL_STUB
ensure_venv() {
    local venv="$1" sglang="$2" target="$3" sgl_kernel_stub="$4"
    local req="requirements/sglang-cpu-$sglang.txt" stamp py torch_before torch_after
    [ -f "$req" ] || { log "missing $req" >&2; return 1; }
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
    log "$venv: installing $TORCH_SPEC"
    pip_q "$py" install "$TORCH_SPEC"
    torch_before="$("$py" -W ignore -c 'import torch; print(torch.__version__)')"
    log "$venv: installing sglang==$sglang --no-deps and $req"
    pip_q "$py" install --no-deps "sglang==$sglang"
    pip_q "$py" install -r "$req"
    log "$venv: installing this repo ($target)"
    pip_q "$py" install -e "$target"
    torch_after="$("$py" -W ignore -c 'import torch; print(torch.__version__)')"
    if [ "$torch_before" != "$torch_after" ]; then
        log "$venv: torch changed from $torch_before to $torch_after during install" >&2
        return 1
    fi
    write_shims "$py" "$sgl_kernel_stub"
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
PYEOF
    printf '%s\n' "$stamp" >"$venv/.stamp"
    log "$venv: ready (torch $torch_after, $((SECONDS - t0))s)"
}

