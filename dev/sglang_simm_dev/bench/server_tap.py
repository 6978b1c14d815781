"""Per-operation timing of any L3 backend inside a real SGLang server.

SGLang's own storage histograms (``sglang:prefetch_bandwidth`` and kin) are
filled by each backend with its own arithmetic, in buckets of 0.1 / 0.5 / 1 /
5 / 10 / 50 / 100 GB/s, with the page count and the bandwidth of one
operation in two unrelated histograms; the ``file`` backend fills none, and
Mooncake counts its K and V objects as pages on writes and only the K half
of the bytes on reads (``get_ksize_per_token``). None of that tells which
batch size is slow. So the bench also times every L3 batch the same way for
every backend, at the controller: the function that moves one batch (at
most 128 pages) between the host pool and the backend, zero-copy
(``batch_get_v1`` / ``batch_set_v1``: ours, Mooncake) or generic
(``batch_get`` / ``batch_set`` plus the copy into the pool: ``file``). Per
batch: its wall time, pages asked, pages that succeeded, the page size in
bytes. One JSON line per batch goes to ``$SGLANG_SIMM_BENCH_TAP/<pid>.jsonl``.

The hook is a ``sitecustomize.py`` (``write_tap``) on the server's
``PYTHONPATH`` after the CPU stand-ins' one, which runs it. It patches
``HiCacheController`` (the hybrid controller inherits these functions) when
SGLang imports its module, so nothing of SGLang is imported early. It never
raises into SGLang: a failing write loses that line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

#: the environment variable naming the folder the servers' lines go to
TAP_ENV = "SGLANG_SIMM_BENCH_TAP"

#: the module whose controller is wrapped
CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"

# The tap module is loaded from its file, not imported as
# ``sglang_simm_dev.bench.server_tap``: the bench package imports torch and
# SGLang, which a server must not do this early.
_SITECUSTOMIZE = '''\
"""Times every L3 batch_get_v1 / batch_set_v1 of this SGLang server (written
by sglang_simm_dev.bench.server_tap.write_tap; see that module)."""
import os as _os

if _os.environ.get({env!r}):
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location("_sglang_simm_bench_tap", {path!r})
    _tap = _util.module_from_spec(_spec)
    _sys.modules[_spec.name] = _tap
    _spec.loader.exec_module(_tap)
    _tap.install()
    _tap.chain_after(__file__)
'''


def write_tap(folder: str | os.PathLike) -> str:
    """Write the tap's ``sitecustomize.py`` into ``folder`` (created); returns
    the folder, for ``ServerConfig.pythonpath``."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_SITECUSTOMIZE.format(env=TAP_ENV, path=os.path.abspath(__file__)))
    return folder


def chain_after(ours: str) -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` after this folder (a
    distribution's own); the ones before it already ran."""
    import importlib.machinery
    import sys
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(ours))
    paths = [os.path.abspath(p or ".") for p in sys.path]
    if here not in paths:
        return
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path[paths.index(here) + 1 :])
    if spec is not None and spec.loader is not None:
        try:
            spec.loader.exec_module(module_from_spec(spec))
        except Exception:  # someone else's hook: never stop the server for it
            pass


# -- inside the server ------------------------------------------------------------


def install() -> None:
    """Patch SGLang's modules (``_PATCHES``) as they are imported."""
    import importlib.abc
    import importlib.util
    import sys

    pending = {name: fn for name, fn in _PATCHES.items() if name not in sys.modules}
    for name, fn in _PATCHES.items():
        if name in sys.modules:
            fn(sys.modules[name])
    if not pending:
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            fn = pending.pop(name, None)
            if fn is None:
                return None
            sys.meta_path.remove(self)  # the real finders look it up, not this one again
            try:
                spec = importlib.util.find_spec(name)
            finally:
                if pending:
                    sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                fn(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


def _patch_controller(module) -> None:
    patch(module.HiCacheController)


def _patch_host_reserve(module) -> None:
    """SGLang 0.5.23 refuses a host pool unless 10 GiB of the machine's RAM
    stay free after it (``HICACHE_HOST_MEMORY_RESERVE_BYTES``), so a few
    servers side by side on a small shared machine fail to start on a
    pool of megabytes; ``$SGLANG_SIMM_BENCH_HOST_RESERVE`` (bytes) sets it."""
    value = os.environ.get(RESERVE_ENV)
    if value and hasattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES"):
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(value)


#: the environment variable lowering SGLang's host-memory reserve
RESERVE_ENV = "SGLANG_SIMM_BENCH_HOST_RESERVE"

#: module -> what to do once SGLang imported it
_PATCHES = {
    CONTROLLER_MODULE: _patch_controller,
    "sglang.srt.mem_cache.pool_host.base": _patch_host_reserve,
}


#: the controller's per-batch functions: (name, op, reads) -- a read is
#: ``(self, operation, keys, host_indices, extra_info)`` returning the pages
#: it loaded, a write ``(self, keys, host_indices, extra_info)`` returning
#: whether every page was stored
BATCH_FUNCTIONS = (("_page_get_zero_copy", "get", True), ("_generic_page_get", "get", True),
                   ("_page_set_zero_copy", "set", False), ("_generic_page_set", "set", False))


def patch(controller_class) -> None:
    """Time ``BATCH_FUNCTIONS`` of ``controller_class`` (idempotent)."""
    if getattr(controller_class, "_sglang_simm_tapped", False):
        return
    for name, op, reads in BATCH_FUNCTIONS:
        original = getattr(controller_class, name, None)
        if original is not None:
            setattr(controller_class, name, _timed(original, op, reads))
    controller_class._sglang_simm_tapped = True


_OUT: dict[str, int] = {}


def _write(line: str) -> None:
    folder = os.environ.get(TAP_ENV)
    if not folder:
        return
    fd = _OUT.get(folder)
    if fd is None:
        os.makedirs(folder, exist_ok=True)
        fd = _OUT[folder] = os.open(os.path.join(folder, f"{os.getpid()}.jsonl"),
                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, line.encode())  # one write per line: O_APPEND keeps lines whole


def _timed(original, op: str, reads: bool):
    import functools
    import time

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        result = original(self, *args, **kwargs)
        seconds = time.perf_counter() - started
        try:
            keys = args[1] if reads else args[0]
            pages = len(keys)
            ok = int(result) if reads else (pages if result else 0)
            pool = self.storage_host_pool
            page_bytes = int(pool.get_size_per_token()) * int(pool.page_size)
            backend = type(self.storage_backend).__name__
            _write(json.dumps({"op": op, "pages": pages, "ok": ok, "seconds": seconds, "page_bytes": page_bytes,
                               "backend": backend, "path": original.__name__, "t": time.time()}) + "\n")
        except Exception:  # a lost line, never a failed transfer
            pass
        return result

    return wrapper


# -- in the bench -------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One timed call."""

    op: str
    pages: int
    ok: int
    seconds: float
    page_bytes: int
    t: float

    @property
    def gib_per_s(self) -> float:
        """Bytes of the pages that succeeded over the call's wall time."""
        return self.ok * self.page_bytes / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


def read_ops(folder: str | os.PathLike, since: float = 0.0) -> list[Op]:
    """Every call recorded under ``folder`` at or after ``since`` (a
    ``time.time()``), oldest first; a torn last line is skipped."""
    ops: list[Op] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ops
    for name in names:
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                    op = Op(d["op"], int(d["pages"]), int(d["ok"]), float(d["seconds"]), int(d["page_bytes"]),
                            float(d["t"]))
                except (ValueError, KeyError, TypeError):
                    continue
                if op.t >= since:
                    ops.append(op)
    ops.sort(key=lambda o: o.t)
    return ops


#: batch-size classes (pages per call) the distributions are given for
SIZE_CLASSES = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 1 << 30))


def size_class(pages: int) -> str:
    for lo, hi in SIZE_CLASSES:
        if lo <= pages <= hi:
            return f"{lo}-{hi}" if hi < (1 << 30) else f">{lo - 1}"
    return "0"


def distribution(values: Iterable[float]) -> dict[str, float] | None:
    """n, p10, median, p90 (numpy's linear quantiles); None when empty."""
    import numpy as np

    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return None
    p10, p50, p90 = np.quantile(arr, [0.1, 0.5, 0.9])
    return {"n": int(arr.size), "p10": float(p10), "median": float(p50), "p90": float(p90)}


def by_size(ops: Iterable[Op]) -> dict[str, dict[str, dict[str, float]]]:
    """``{op: {size class: distribution of GiB/s}}`` over calls that moved a
    page (a call whose every page missed moves nothing)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for o in ops:
        if o.ok:
            groups.setdefault(o.op, {}).setdefault(size_class(o.pages), []).append(o.gib_per_s)
    order = [size_class(lo) for lo, _ in SIZE_CLASSES]
    return {op: {c: distribution(sizes[c]) for c in order if c in sizes} for op, sizes in sorted(groups.items())}
