"""The in-process local store's memory: one private anonymous mapping.

The store process keeps its objects in a file on tmpfs (``_arena``); the
in-process store keeps them in one mapping of its own process, laid out by
the same index (``_index.StoreIndex``), so both hold their objects, and
bound their memory, by one set of rules.

The mapping is made ``PROT_NONE``: address space only, no memory and no
commit charge, so a store of the default 4 GiB that holds 100 MiB costs
about 100 MiB, and a test that makes hundreds of stores costs nothing for
the ones it leaves empty. It is committed as the index hands out offsets
(``commit``, the index's ``commit`` callback): made writable in steps, as
the store process commits its file, which is where the kernel charges it.
A host that overcommits (the default) never refuses; one that does not
(``vm.overcommit_memory=2``) refuses there, and the index answers
``OUT_OF_MEMORY`` as the store process does on a full tmpfs. Pages are
backed on their first write.

``release`` gives the memory of free extents back (``MADV_DONTNEED``), as
the store process punches holes in its file on a clear; the commit charge
stays (the kernel keeps a private mapping's charge once made writable). The caller holds
the index's lock across it: nothing may be handed out of those extents
meanwhile.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import weakref

from sglang_simm.embedded._arena import COMMIT_STEP_MAX, COMMIT_STEP_MIN, PAGE
from sglang_simm.embedded._copy import held_libc

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MADV_DONTNEED = 4
logger = logging.getLogger("sglang_simm.embedded")
_MAP_FAILED = ctypes.c_void_p(-1).value

# Held, not released: each call is a few microseconds of page-table work
# (``release`` of a large clear excepted, which an operator calls).
_mmap = held_libc("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int, ctypes.c_long)
_munmap = held_libc("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_mprotect = held_libc("mprotect", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise = held_libc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class PrivateArena:
    """``size`` bytes of this process's address space at ``base``."""

    def __init__(self, size: int) -> None:
        self.size = _page_up(size)
        base = _mmap(None, self.size, _PROT_NONE, _MAP_FLAGS, -1, 0)
        if base is None or base == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot reserve {self.size} bytes of address space: {os.strerror(err)}")
        self.base: int = base
        #: writable (and charged) below this; a prefix, as the store process's
        self.committed = 0
        self.step = min(max(self.size // 16, COMMIT_STEP_MIN), COMMIT_STEP_MAX)
        # The mapping goes with the last reference to the arena (the server's);
        # not at interpreter exit, where a daemon thread may still be copying
        # (the process's exit unmaps it anyway).
        self._unmap = weakref.finalize(self, _munmap, base, self.size)
        self._unmap.atexit = False

    def commit(self, end: int) -> int:
        """Make the arena writable up to at least ``end``, a step ahead where
        it can; the committed end (short of ``end``: the host refused)."""
        if end <= self.committed:
            return self.committed
        for target in (min(self.size, max(_page_up(end), self.committed + self.step)), min(self.size, _page_up(end))):
            if _mprotect(self.base + self.committed, target - self.committed, _PROT_RW) == 0:
                self.committed = target
                break
            err = ctypes.get_errno()
            if err != errno.ENOMEM:  # pragma: no cover - a bad range, a bug: refused all the same, never raised
                logger.error("in-process local store: mprotect of its arena failed: %s", os.strerror(err))
        return self.committed

    def release(self, extents: list[tuple[int, int]]) -> None:
        """Give back the memory of free ``(start, end)`` extents, each cut
        inward to whole pages. They stay committed (writable): a page given
        back is backed again, zeroed, on its next write."""
        for start, end in extents:
            lo, hi = _page_up(start), min(end - end % PAGE, self.committed)
            if lo < hi:
                _madvise(self.base + lo, hi - lo, _MADV_DONTNEED)
