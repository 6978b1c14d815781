"""Copies between host memory regions: small ones holding the GIL, large
ones with it released.

Shared by the in-process server (to and from its private arena) and the
local store's clients (to and from the shared arena).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

# -- copies ----------------------------------------------------------------
#
# Every copy is one ctypes.memmove: a CFUNCTYPE foreign call, so it releases
# the GIL. Measured on the 2-core x86 build machine (torch 2.13.0 CPU build,
# median of 30 copies, GB/s):
#
#                         1 MiB   4 MiB   16 MiB   4 threads x 4 MiB
#   torch copy_, idle      51-55   23-24   21-23      7.7-9.4
#   torch copy_, busy      0.1     0.4-12  3-18       3.1-4.0
#   copy_, 1 thread        18-19   11-12   3-10       3.0-3.8
#   memmove, idle          23-24   12      12         8.4-8.9
#   memmove, busy          16-21   10-11   10-11      4.0-5.1
#
# ("busy": other processes using the cores.) copy_ is faster only on an idle
# machine, by splitting the copy over torch's intra-op threads; once the
# cores are busy, as in an inference server, its thread barrier collapses it
# by 10-100x. memmove matches single-threaded copy_ and never collapses, and
# its fixed cost is lower (0.7 us vs 2.4 us for 4 KiB). So: memmove, one per
# object, and the objects of a big batch spread over a few threads
# (copy_many), where a busy core only slows its own share.
_memmove = ctypes.memmove


def held_libc(name: str, restype: Any, *argtypes: Any) -> Any:
    """libc's ``name`` through ``ctypes.PyDLL``: a foreign call that keeps
    the GIL, errno kept for ``ctypes.get_errno`` (None where this process's
    symbols do not hold it)."""
    return _libc_function(ctypes.PyDLL, name, restype, argtypes)


def released_libc(name: str, restype: Any, *argtypes: Any) -> Any:
    """``held_libc``'s twin through ``ctypes.CDLL``: the call lets the GIL go."""
    return _libc_function(ctypes.CDLL, name, restype, argtypes)


def _libc_function(dll: Any, name: str, restype: Any, argtypes: tuple[Any, ...]) -> Any:
    try:
        fn = getattr(dll(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - no dlopen(NULL) or no libc symbols
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


# Why hold the GIL: a server's backup and prefetch threads share it with a
# scheduler thread that runs Python all the time. Each memmove that lets
# the GIL go may have to wait for it up to the switch interval (5 ms) to
# come back. A copy holding it blocks the other threads only for as long
# as that one copy takes: between two copies the interpreter hands the GIL
# over at the switch interval as it does between bytecodes, so what counts
# is the largest single copy, not the batch. Measured on the 2-core build
# machine beside a thread running Python (medians of 15, 128 KiB objects,
# benchmarks/results/ and docs/benchmarks.md): 8 objects 87 us held, 71
# released; 64 objects 1.0 ms held, 1.5 ms released; 256 objects 13.6 ms
# held, 18.6 ms released; idle, both within 20%. One 1 MiB copy takes
# 0.1-0.2 ms here: far under the switch interval, so objects up to
# HELD_COPY_MAX are copied holding it, larger ones (a multi-MiB object,
# 0.5 ms and more) let it go, and a batch big enough for the copy threads
# (below) lets it go in every thread so they copy in parallel.
_memmove_held = held_libc("memmove", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t) or _memmove
HELD_COPY_MAX = 1 << 20

# A writable memoryview over raw memory: unlike ``(c_uint8 * n).from_address``
# it creates no new ctypes array type per distinct size.
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def wrap_memory(ptr: int, size: int) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes at ``ptr`` (no copy, no ownership)."""
    import torch

    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(_memory_view(ptr, size, _PYBUF_WRITE), dtype=torch.uint8)


#: Batches smaller than this, or of objects smaller on average than
#: PARALLEL_COPY_OBJECT, are copied on the calling thread: handing work to
#: other threads costs more than it saves, and every memmove takes the GIL
#: back, so threads copying many small objects queue on it.
PARALLEL_COPY_BYTES = 8 << 20
PARALLEL_COPY_OBJECT = 512 << 10
#: Copy threads at most, counted once: ``os.cpu_count()`` reads a file in
#: /sys on every call (18 us here, a tenth of a one-page backup).
COPY_WORKERS = min(os.cpu_count() or 1, 8)
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def _copy_group(group: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, size in group:
        _memmove(dst, src, size)


def _copy_held(copies: Sequence[tuple[int, int, int]]) -> None:
    """On the calling thread: objects up to ``HELD_COPY_MAX`` keeping the
    GIL, larger ones letting it go."""
    held, limit = _memmove_held, HELD_COPY_MAX
    for dst, src, size in copies:
        if size <= limit:
            held(dst, src, size)
        else:
            _memmove(dst, src, size)


def copy_many(copies: Sequence[tuple[int, int, int]]) -> None:
    """``memmove(dst, src, size)`` for every entry, over all cores for a big
    batch, as the real client spreads a batch over its thread pool (one
    memmove saturates one core, not the memory bus)."""
    global _copier
    workers = COPY_WORKERS
    total = sum(c[2] for c in copies)
    if workers < 2 or len(copies) < 2 or total < max(PARALLEL_COPY_BYTES, len(copies) * PARALLEL_COPY_OBJECT):
        _copy_held(copies)
        return
    if _copier is None:
        with _copier_lock:
            if _copier is None:
                _copier = ThreadPoolExecutor(workers - 1, thread_name_prefix="simm-embedded-copy")
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(min(workers, len(copies)))]
    loads = [0] * len(groups)
    for copy in sorted(copies, key=lambda c: -c[2]):  # largest first onto the least loaded
        g = loads.index(min(loads))
        groups[g].append(copy)
        loads[g] += copy[2]
    futures = [_copier.submit(_copy_group, g) for g in groups[1:]]
    _copy_group(groups[0])
    for f in futures:
        f.result()


# -- units -----------------------------------------------------------------


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
