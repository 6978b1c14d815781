"""The same-run memcpy a demo's write-back is held against.

A write-back into a store that has not used its memory yet is bound by the
kernel, not by the copy: every new 4 KiB page is allocated and zeroed
(``posix_fallocate`` in the local store's process, a page fault for the
in-process local store) and then mapped into the writer (``MADV_POPULATE_WRITE``
or the fault itself) before a byte is copied. Later writes into memory the
store already uses run at copy speed. So the reference is the store's own
copy routine (``memmove`` per object, spread over the cores), over bytes
of the host pool, timed twice in this run: into new memory of the store's
kind (shared memory for the local store, process memory for the in-process
one), then again into the same memory, now in use.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from typing import Any

#: Bytes copied for the reference (or the host pool's size, if smaller).
REFERENCE_BYTES = 256 << 20


def _new_memory(nbytes: int, shared: bool) -> mmap.mmap:
    if shared and hasattr(os, "memfd_create"):
        fd = os.memfd_create("sglang-simm-memcpy-reference", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, nbytes)
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    return mmap.mmap(-1, nbytes)


def memcpy_reference(src_ptr: int, src_bytes: int, object_bytes: int, *, shared: bool,
                     limit: int = REFERENCE_BYTES) -> dict[str, Any]:
    """GB/s of the store's copy routine over ``min(limit, src_bytes)`` bytes
    at ``src_ptr``, in objects of ``object_bytes``: into new memory, then
    into the same memory again."""
    from sglang_simm.local_store._copy import copy_many

    nbytes = max(object_bytes, min(limit, src_bytes) // object_bytes * object_bytes)
    mm = _new_memory(nbytes, shared)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        base = ctypes.addressof(anchor)
        copies = [(base + off, src_ptr + off, object_bytes) for off in range(0, nbytes, object_bytes)]
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            copy_many(copies)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        del anchor
        mm.close()
    return {
        "bytes": nbytes, "object_bytes": object_bytes,
        "memory": "new shared memory (memfd)" if shared else "new process memory",
        "new_memory_gbps": rates[0], "memory_in_use_gbps": rates[1],
    }
