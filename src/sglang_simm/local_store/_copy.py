"""Copies between host memory regions, and the objects' checksums.

A server's backup and prefetch threads share the GIL with a scheduler
thread that runs Python all the time, and each call that lets the GIL go
may wait up to the switch interval (5 ms) to get it back. So copies up to
``HELD_COPY_MAX`` keep it (libc's ``memmove`` through ``ctypes.PyDLL``), and
larger ones, and big batches spread over a few threads as the real client
spreads a batch over its thread pool, let it go. Each choice was measured
at the server level (docs/benchmarks.md, "GIL releases and waits").
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:  # pragma: no cover
    import torch


def held_libc(name: str, restype: Any, *argtypes: Any) -> Any:
    """libc's ``name`` as a foreign call that keeps the GIL (None where absent)."""
    return _libc_function(ctypes.PyDLL, name, restype, argtypes)


def released_libc(name: str, restype: Any, *argtypes: Any) -> Any:
    """libc's ``name`` as a foreign call that lets the GIL go."""
    return _libc_function(ctypes.CDLL, name, restype, argtypes)


def _libc_function(dll: Any, name: str, restype: Any, argtypes: tuple[Any, ...]) -> Any:
    try:
        fn = getattr(dll(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - no dlopen(NULL)
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


_memmove = ctypes.memmove  # lets the GIL go
_memmove_held = held_libc("memmove", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t) or _memmove
HELD_COPY_MAX = 1 << 20
#: Batches smaller than this, or of objects smaller on average than
#: PARALLEL_COPY_OBJECT, are copied on the calling thread.
PARALLEL_COPY_BYTES = 8 << 20
PARALLEL_COPY_OBJECT = 512 << 10
COPY_WORKERS = min(os.cpu_count() or 1, 8)
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()

_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def memory(ptr: int, size: int) -> memoryview:
    """A writable memoryview of ``size`` bytes at ``ptr`` (no copy, no ownership)."""
    return _memory_view(ptr, size, _PYBUF_WRITE)


def wrap_memory(ptr: int, size: int) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes at ``ptr`` (no copy, no ownership)."""
    import torch

    return torch.empty(0, dtype=torch.uint8) if size == 0 else torch.frombuffer(memory(ptr, size), dtype=torch.uint8)


def checksum(key: bytes, ptr: int, size: int) -> int:
    """An object's checksum (xxh3, 64 bits, as a signed int64), over its key,
    its size and its bytes: bytes under another key or of another length
    never match. Lets the GIL go for large objects."""
    seed = xxhash.xxh3_64_intdigest(key + size.to_bytes(8, "little"))
    value = xxhash.xxh3_64_intdigest(memory(ptr, size), seed=seed) if size else seed
    return value - (1 << 64) if value >= 1 << 63 else value


def _copy_group(group: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, size in group:
        _memmove(dst, src, size)


def copy_many(copies: Sequence[tuple[int, int, int]], *, hold: bool = True) -> None:
    """``memmove(dst, src, size)`` for every entry: small ones keeping the GIL
    (``hold``), a big batch over several threads."""
    global _copier
    total = sum(c[2] for c in copies)
    if COPY_WORKERS < 2 or len(copies) < 2 or total < max(PARALLEL_COPY_BYTES, len(copies) * PARALLEL_COPY_OBJECT):
        held = _memmove_held if hold else _memmove
        for dst, src, size in copies:
            (held if size <= HELD_COPY_MAX else _memmove)(dst, src, size)
        return
    if _copier is None:
        with _copier_lock:
            if _copier is None:
                _copier = ThreadPoolExecutor(COPY_WORKERS - 1, thread_name_prefix="sglang-simm-copy")
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(min(COPY_WORKERS, len(copies)))]
    loads = [0] * len(groups)
    for copy in sorted(copies, key=lambda c: -c[2]):  # largest first onto the least loaded
        g = loads.index(min(loads))
        groups[g].append(copy)
        loads[g] += copy[2]
    futures = [_copier.submit(_copy_group, g) for g in groups[1:]]
    _copy_group(groups[0])
    for f in futures:
        f.result()


def _after_fork() -> None:
    global _copier, _copier_lock
    _copier, _copier_lock = None, threading.Lock()  # its threads did not come along


os.register_at_fork(after_in_child=_after_fork)


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
