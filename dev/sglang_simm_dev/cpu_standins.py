"""Stand-ins for CUDA-only kernels and wheels, so that real SGLang runs on a CPU.

For the test venvs, the end-to-end tests and the CPU server demo only: the
backend never imports this module, and nothing here is used in serving on a
GPU. Every stand-in names the SGLang (or torchvision) function it replaces
and the SGLang releases it was checked against.

Two groups, each installed by one function:

``install_import_shims(sgl_kernel_stub=...)``
    What the test venvs run at every interpreter start (a one-line ``.pth``
    file written by ``scripts/_venv.sh``): wheels SGLang imports at module
    scope that cannot load on a CPU.

    * torchvision's CUDA op schemas (``_TorchvisionHook``);
    * ``sgl_kernel.kvcacheio``, for SGLang 0.5.8/0.5.11 only (``_SglKernelFinder``).

``install_server_standins()``
    What every process of a CPU SGLang server runs (``sitecustomize.py`` in
    the folder :func:`write_sitecustomize` makes, which the launcher in
    ``sglang_server.py`` puts on ``PYTHONPATH``), on top of the import shims:

    * ``sgl_kernel``'s CPU ops that SGLang imports at module scope with
      ``SGLANG_USE_CPU_ENGINE=1`` (``assign_req_to_token_pool_cpu``,
      ``copy_all_layer_kv_cache_cpu``), in pure torch;
    * ``HostKVCache.__init__`` with ``pin_memory=False`` (``_no_pinning``);
    * the MHA host pool's device<->host copies (``load_to_device_per_layer``,
      ``backup_from_device_all_layer`` of ``MHATokenToKVPoolHost``) as plain
      torch index copies, for page_first, page_first_direct and page_head.
      (No MLA stand-in: SGLang's CPU path cannot run a DeepSeek-style model
      with ``torch_native`` attention, so there is nothing to copy for.)

Both install import hooks only: importing this module or calling an
``install_*`` function imports neither torch nor SGLang, and a stand-in acts
when SGLang imports the module it replaces a part of. The server stand-ins
act only where CUDA is absent (``torch.cuda.is_available()`` is False when
the patched module is imported), and ``sgl_kernel`` stand-ins never shadow an
installed ``sgl_kernel``: their finder comes last on ``sys.meta_path``.
"""

from __future__ import annotations

# Only what the interpreter has already loaded at start-up: this module is
# imported at every start of a test venv's interpreter. (importlib.abc would
# pull in importlib.resources and tempfile; the import system needs no ABCs.)
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Callable

#: The SGLang releases the server stand-ins were checked against.
SERVER_STANDINS_CHECKED = ("0.5.23",)

_KVCACHEIO = "sgl_kernel.kvcacheio"


def _cuda_absent() -> bool:
    import torch  # already imported by SGLang whenever this is asked

    return not torch.cuda.is_available()


# -- sgl_kernel ------------------------------------------------------------------


def _unavailable(name: str) -> Callable:
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name}: no CPU stand-in (sglang_simm_dev.cpu_standins)")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Stands in for ``sgl_kernel.assign_req_to_token_pool_cpu`` (the CPU build
    of sgl-kernel), which SGLang 0.5.23's ``mem_cache/allocation.py`` imports
    at module scope on a CPU and calls from ``assign_req_to_token_pool_func``.

    Same semantics as SGLang's Triton ``assign_req_to_token_pool``: request
    ``i`` gets ``out_cache_loc`` entries, taken in order, written to
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``.
    """
    del pool_len  # the row length; implied by req_to_token here
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + n]
        taken += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Stands in for ``sgl_kernel.copy_all_layer_kv_cache_cpu`` (the CPU build
    of sgl-kernel), which SGLang 0.5.23's ``kernels/ops/kvcache/cache_move.py``
    imports at module scope on a CPU; ``copy_all_layer_kv_cache_func`` calls it
    for ``move_kv_cache`` (speculative decoding, page moves).

    Same semantics as SGLang's Triton ``copy_all_layer_kv_cache_tiled``: in
    every buffer ``b`` (base ``data_ptrs[b]``, ``strides[b]`` bytes a row),
    row ``tgt_loc[j]`` becomes a copy of row ``src_loc[j]``; safe in place
    (all source rows are read before any is written).
    """
    import ctypes

    import torch

    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(max(int(tgt.max()), int(src.max()))) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_char * (rows * stride)).from_address(base)
        table = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        table[tgt] = table[src]


#: The CPU ops of sgl-kernel that SGLang imports at module scope with
#: SGLANG_USE_CPU_ENGINE=1 (0.5.23), by name.
_CPU_OPS: dict[str, Callable] = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}


#: Speculative-decoding ops of sgl-kernel's CPU build that SGLang 0.5.23
#: imports at module scope on a CPU (``kernels/ops/speculative/``); the
#: servers run here never decode speculatively, so these raise if called.
_CPU_OPS_UNAVAILABLE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


class _SglKernelLoader:
    def __init__(self, finder: _SglKernelFinder) -> None:
        self._finder = finder

    def create_module(self, spec):
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__cpu_standin__ = True
        if module.__name__ == _KVCACHEIO:
            # Every name resolves, and raises when called: SGLang 0.5.8 only
            # imports these names at module scope; the CPU never calls them.
            def __getattr__(attr, _mod=module.__name__):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _unavailable(f"{_mod}.{attr}")

            module.__getattr__ = __getattr__
        elif self._finder.cpu_ops:
            # Only the ops that have a stand-in: `from sgl_kernel import x`
            # for any other name still fails, so SGLang's own fallbacks for a
            # missing kernel stay in force.
            module.__dict__.update(_CPU_OPS)
            for name in _CPU_OPS_UNAVAILABLE:
                setattr(module, name, _unavailable(f"sgl_kernel.{name}"))


class _SglKernelFinder:
    """Serves ``sgl_kernel`` (and ``sgl_kernel.kvcacheio`` where asked) when no
    real one is installed: it is last on ``sys.meta_path``, after the
    finder that would find an installed ``sgl_kernel``."""

    def __init__(self) -> None:
        self.kvcacheio = False
        self.cpu_ops = False

    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" and (self.kvcacheio or (self.cpu_ops and _cuda_absent())):
            return importlib.machinery.ModuleSpec(name, _SglKernelLoader(self), is_package=True)
        if name == _KVCACHEIO and self.kvcacheio:
            return importlib.machinery.ModuleSpec(name, _SglKernelLoader(self))
        return None


def _sgl_kernel_finder() -> _SglKernelFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _SglKernelFinder):
            return finder
    finder = _SglKernelFinder()
    sys.meta_path.append(finder)
    return finder


# -- torchvision -----------------------------------------------------------------


class _TorchvisionHook:
    """Stands in for the op registration of torchvision's ``_C`` extension.

    PyPI's torchvision wheel is a CUDA build whose ``_C.so`` cannot load
    against a CPU-only torch, and ``torchvision/_meta_registrations.py`` then
    fails on the missing ``torchvision::nms`` and ``::qnms`` schemas. SGLang
    imports torchvision at module scope (``sglang.srt.configs`` ->
    ``internvl_utils``; checked on 0.5.8, 0.5.11, 0.5.23). When ``_C.so`` does
    not load, define those two schemas (without kernels) so the pure-Python
    parts of torchvision import; calling ``nms`` raises.

    First on ``sys.meta_path``; acts once, on the first import of torchvision.
    """

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _prepare_torchvision()
        return None


def _prepare_torchvision() -> None:
    import glob

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    libs = [lib for loc in spec.submodule_search_locations for lib in glob.glob(os.path.join(loc, "_C*.so"))]
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


def install_import_shims(sgl_kernel_stub: bool = False) -> None:
    """The import shims of the CPU test venvs (see the module docstring).

    ``sgl_kernel_stub``: also serve ``sgl_kernel.kvcacheio`` (functions that
    raise) when no ``sgl_kernel`` is installed: SGLang 0.5.8's
    ``memory_pool_host.py`` imports it at module scope, and the only
    sgl-kernel wheel is a CUDA build for another torch. The package itself
    stays empty, so ``from sgl_kernel import x`` still fails. Idempotent.
    """
    if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path) and "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _TorchvisionHook())
    if sgl_kernel_stub:
        _sgl_kernel_finder().kvcacheio = True


# -- patches applied when SGLang imports a module ----------------------------------


class _PatchingLoader:
    """Runs the real loader, then the patch."""

    def __init__(self, loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(self._patch, module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


class _PatchOnImport:
    """First on ``sys.meta_path``: finds the named modules with the finders
    after it, and patches each once it has executed."""

    def __init__(self) -> None:
        self.patches: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _apply(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    if not _cuda_absent():
        return
    patch(module)


def _patch_on_import(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    hook = next((f for f in sys.meta_path if isinstance(f, _PatchOnImport)), None)
    if hook is None:
        hook = _PatchOnImport()
        sys.meta_path.insert(0, hook)
    for name, patch in patches.items():
        if name in hook.patches:
            continue
        hook.patches[name] = patch
        module = sys.modules.get(name)
        if module is not None:  # imported before the hook: patch it now
            _apply(patch, module)


# -- host pools --------------------------------------------------------------------


def _no_pinning(base: ModuleType) -> None:
    """Stands in for the pinning in ``HostKVCache.__init__``
    (``sglang.srt.mem_cache.pool_host.base``, SGLang 0.5.23): with
    ``pin_memory=True`` the host pool registers its buffer with
    ``cudaHostRegister``, which needs CUDA. The pool is built with
    ``pin_memory=False`` instead (plain pageable memory; the CPU device
    pool copies from it directly)."""
    cls = base.HostKVCache
    if getattr(cls.__init__, "__cpu_standin__", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    __init__.__cpu_standin__ = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__


def host_token_index(layout: str, page_size: int, host_indices, layer: int) -> tuple:
    """The index into a host pool buffer that selects the rows of
    ``host_indices`` (token slots) at ``layer``, for each host layout.

    Buffer shapes, from SGLang 0.5.23's ``MHATokenToKVPoolHost.init_kv_buffer``
    (K and V each): ``page_first`` (tokens, layers, heads, dim),
    ``page_first_direct`` (pages, layers, page, heads, dim), ``page_head``
    (pages, heads, page, layers, dim). Indexing with the result gives
    (len(host_indices), heads, dim). ``layer_first`` is left out: this
    backend refuses it, so no server here runs it.
    """
    if layout == "page_first":
        return (host_indices, layer)
    if layout == "page_first_direct":
        return (host_indices // page_size, layer, host_indices % page_size)
    if layout == "page_head":
        # advanced indices on both sides of the slice: the token axis comes first
        return (host_indices // page_size, slice(None), host_indices % page_size, layer)
    raise ValueError(f"cpu stand-in: host layout {layout!r} is not supported")


def _mha_transfers(mha: ModuleType) -> None:
    """Stands in for ``MHATokenToKVPoolHost.load_to_device_per_layer`` and
    ``backup_from_device_all_layer`` (``sglang.srt.mem_cache.pool_host.mha``,
    SGLang 0.5.23): on a CPU they reach for ``sgl_kernel.kvcacheio``'s
    ``transfer_kv_*`` CUDA kernels, which SGLang imports only on CUDA/ROCm.
    Plain torch index copies between the device pool's per-layer K/V tensors
    and the host buffer, for the layouts of :func:`host_token_index`, with
    either io backend (``kernel``, ``direct``: the bytes moved are the same)."""
    cls = mha.MHATokenToKVPoolHost
    if getattr(cls.load_to_device_per_layer, "__cpu_standin__", False):
        return

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        index = host_token_index(self.layout, self.page_size, host_indices, layer_id)
        self.device_k_buffers[layer_id][device_indices] = self.k_buffer[index]
        self.device_v_buffers[layer_id][device_indices] = self.v_buffer[index]

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        for layer in range(self.layer_num):
            index = host_token_index(self.layout, self.page_size, host_indices, layer)
            self.k_buffer[index] = self.device_k_buffers[layer][device_indices]
            self.v_buffer[index] = self.device_v_buffers[layer][device_indices]

    for fn in (load_to_device_per_layer, backup_from_device_all_layer):
        fn.__cpu_standin__ = True
        fn.__wrapped__ = getattr(cls, fn.__name__)
        setattr(cls, fn.__name__, fn)


_SERVER_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _no_pinning,
    "sglang.srt.mem_cache.pool_host.mha": _mha_transfers,
}


def install_server_standins() -> None:
    """The stand-ins every process of a CPU SGLang server needs (see the
    module docstring), on top of :func:`install_import_shims`. Import hooks
    only; idempotent."""
    install_import_shims()
    _sgl_kernel_finder().cpu_ops = True
    _patch_on_import(_SERVER_PATCHES)


# -- sitecustomize ---------------------------------------------------------------

_SITECUSTOMIZE = '''\
"""CPU stand-ins for every process of a CPU SGLang server (written by
sglang_simm_dev.cpu_standins.write_sitecustomize; this folder is put on
PYTHONPATH by the launcher, so SGLang's spawned scheduler runs it too)."""
from sglang_simm_dev import cpu_standins as _standins, faults as _faults

_standins.install_server_standins()
_faults.install_from_env()  # SGLANG_SIMM_FAULTS: a faulty network in front of the local store
_standins.chain_sitecustomize(__file__)
'''


def write_sitecustomize(folder: str | os.PathLike) -> str:
    """Write ``sitecustomize.py`` into ``folder`` (created) and return the
    folder, to be put first on ``PYTHONPATH`` of a CPU SGLang server."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_SITECUSTOMIZE)
    return folder


def chain_sitecustomize(ours: str) -> None:
    """Run the ``sitecustomize`` ours shadows (a distribution's own), if any."""
    here = os.path.dirname(os.path.abspath(ours))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    module = module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        import logging

        logging.getLogger(__name__).exception("the shadowed sitecustomize (%s) failed", spec.origin)
