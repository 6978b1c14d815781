"""A client's side of the segments: copying objects in and out, and counting
its copies in flight.

Each segment comes as a descriptor (``SCM_RIGHTS``), never a path that could
be replaced. On memory the client maps it whole and copies with
``memmove``; on a disk it reads and writes through the descriptor
(``pread``/``pwrite``), so its memory does not grow with the store and a
full disk is an error code. No mapping is inherited by a forked child
(``MADV_DONTFORK``). ``Busy`` is this process's row of a store process's
client table (docs/local-store-design.md).
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import errno
import mmap
import os
import threading

from sglang_simm.local_store._copy import HELD_COPY_MAX, copy_many, memory, released_libc
from sglang_simm.local_store._segments import BUSY, COMMITTED_AT, EPOCH_AT, HEADER_BYTES, PAGE, ROW_WORDS, page_up

#: Linux 5.14+: fault pages in, writable, without touching their bytes.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: A client faults the committed segment in on a thread of its own, this
#: much at a time, so its puts take no page fault per 4 KiB; a put that gets
#: ahead of it faults in only its own pages.
POPULATE_CHUNK = 2 << 20
_madvise = released_libc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_syscall = released_libc("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_uint)
_CACHESTAT = 451  # Linux 6.5+, every architecture
#: On a disk, I/O aligned this well goes past the page cache.
DIRECT_ALIGN = 4096
_IOV_MAX = 1024


def _cached(fd: int, off: int, size: int) -> bool:
    """Whether the page cache holds all of ``[off, off + size)`` of ``fd``
    (``cachestat``: it reads nothing ahead); False where the kernel cannot say."""
    if _syscall is None:
        return False
    span, stat = (ctypes.c_uint64 * 2)(off, size), (ctypes.c_uint64 * 5)()
    if _syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        return False
    return stat[0] * PAGE >= size


def _reopened_direct(fd: int) -> int | None:
    """A segment's file opened again for I/O past the page cache (a file
    description of its own), or None where its filesystem cannot."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None


#: Mappings a forked child inherited the Python objects of but not the memory
#: (``MADV_DONTFORK``): kept alive for good, since unmapping them would unmap
#: whatever the child maps at those addresses since.
_INHERITED: list[object] = []


class SegmentMap:
    """One segment, as this process reaches it. ``users`` counts copies in
    flight: a map retired (its store gone, or the handle closed) is unmapped
    once the last copy ends."""

    def __init__(self, fd: int, gen: str, size: int, data_start: int, memory_medium: bool) -> None:
        if os.fstat(fd).st_size < size:
            raise OSError(f"segment {gen} holds {os.fstat(fd).st_size} bytes, the store announced {size}")
        self.gen, self.size, self.data_start, self.memory = gen, size, data_start, memory_medium
        self._mm = mmap.mmap(fd, size if memory_medium else data_start, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        self._mm.madvise(mmap.MADV_DONTFORK)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        self.fd = fd  # closed with the mapping
        self._direct = None if memory_medium else _reopened_direct(fd)
        self._direct_ok = self._direct is not None
        self._lock = threading.Lock()
        self.users, self.retired = 0, False
        self._populated, self._behind = 0, False

    def holds(self, offset: int, size: int) -> bool:
        return self.data_start <= offset and size >= 0 and offset + size <= self.size

    # -- copies -----------------------------------------------------------------

    def write(self, copies: list[tuple[int, int, int]]) -> None:
        """``(offset, src, size)``: into the segment; OSError (a full disk) fails them."""
        if self.memory:
            lo, hi = min(c[0] for c in copies), max(c[0] + c[2] for c in copies)
            if lo < self._populated or hi - lo > 2 * sum(c[2] for c in copies) + POPULATE_CHUNK:
                pass  # faulted in behind already, or scattered: the copies fault their pages in
            else:
                self._fault(lo, hi, hold=hi - lo <= HELD_COPY_MAX)
            copy_many([(self.base + off, src, size) for off, src, size in copies])
            return
        for off, parts, total, fd in self._plan([(src, off, size) for off, src, size in copies], cold=True):
            if self._io(os.pwritev, fd, [memory(a, n) for a, n in parts], off) != total:
                for a, n in parts:  # short: the run again, one object at a time
                    view = memory(a, n)
                    while view:
                        k = os.pwrite(self.fd, view, off)
                        view, off = view[k:], off + k

    def read(self, copies: list[tuple[int, int, int]]) -> None:
        """``(dst, offset, size)``: out of the segment; OSError fails them."""
        if self.memory:
            copy_many([(dst, self.base + off, size) for dst, off, size in copies])
            return
        plan = self._plan(copies, cold=False)
        for off, _, total, fd in plan:
            if fd == self.fd:
                os.posix_fadvise(fd, off, total, os.POSIX_FADV_WILLNEED)
        for off, parts, total, fd in plan:
            if self._io(os.preadv, fd, [memory(a, n) for a, n in parts], off) != total:
                raise OSError(f"segment {self.gen}: a short read at {off}")

    def _plan(self, copies: list[tuple[int, int, int]], *, cold: bool) -> list[tuple[int, list, int, int]]:
        """``(address, offset, size)`` copies on a disk as ``(offset, [(address,
        size)], bytes, fd)`` runs: objects that follow each other in the file
        are one I/O. A run aligned for it goes past the page cache (``O_DIRECT``:
        DMA, no copy, no page cache to fill and reclaim), unless it is a read
        the page cache holds (``cold`` False), which is copied from there."""
        runs: list[list] = []
        for addr, off, size in sorted(copies, key=lambda c: c[1]):
            if runs and runs[-1][0] + runs[-1][2] == off and len(runs[-1][1]) < _IOV_MAX:
                runs[-1][1].append((addr, size))
                runs[-1][2] += size
            else:
                runs.append([off, [(addr, size)], size])
        direct = self._direct
        return [(off, parts, total,
                 direct if self._direct_ok and not any((a | n) % DIRECT_ALIGN for a, n in parts)
                 and not off % DIRECT_ALIGN and (cold or not _cached(self.fd, off, total)) else self.fd)
                for off, parts, total in runs]

    def _io(self, call, fd: int, views: list, off: int) -> int:
        """One run's ``os.pwritev``/``os.preadv``. A filesystem that takes
        ``O_DIRECT`` at open but refuses its I/O (EINVAL) gets the page cache
        from then on; the descriptor stays open until the map's end, since
        another thread's copy may be using it."""
        try:
            return call(fd, views, off)
        except OSError as e:
            if fd == self.fd or e.errno != errno.EINVAL:
                raise
            self._direct_ok = False
            return call(self.fd, views, off)

    # -- faulting in behind the puts (memory) -----------------------------------------

    def _fault(self, start: int, end: int, *, hold: bool) -> None:
        start -= start % PAGE
        end = min(page_up(end), self.size)
        if start < end and self._anchor is not None:
            if hold or _madvise is None:
                with contextlib.suppress(OSError, ValueError):
                    self._mm.madvise(MADV_POPULATE_WRITE, start, end - start)
            else:
                _madvise(self.base + start, end - start, MADV_POPULATE_WRITE)

    def populate_behind(self) -> None:
        """Fault in what the store has backed, on a thread of its own, a
        chunk at a time, up to the end the segment's header names; it starts
        again from the start when the store gave memory back meanwhile."""
        with self._lock:
            if not self.memory or self._behind or self.retired:
                return
            self._behind = True
        _thread.start_new_thread(self._fault_in_behind, ())  # Thread.start() waits, letting the GIL go

    def _fault_in_behind(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        epoch = None
        try:
            while True:
                with self._lock:
                    if self.retired or self._anchor is None:
                        return
                    committed = ctypes.c_int64.from_address(self.base + COMMITTED_AT).value
                    now = ctypes.c_int64.from_address(self.base + EPOCH_AT).value
                    if now != epoch:  # memory was given back: what was faulted in may be gone
                        epoch, self._populated = now, 0
                    start = max(self._populated, self.data_start)
                    stop = min(committed, start + POPULATE_CHUNK, self.size)
                    if start >= stop:
                        return
                    self.users += 1
                try:
                    self._fault(start, stop, hold=False)
                finally:
                    self.leave()
                self._populated = stop
        finally:
            self._behind = False

    # -- lifetime -------------------------------------------------------------------

    def enter(self) -> bool:
        """A copy begins; False once retired."""
        with self._lock:
            if self.retired:
                return False
            self.users += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.users -= 1
            done = self.retired and self.users == 0
        if done:
            self._unmap()

    def retire(self) -> None:
        """No new copies; unmapped (and its descriptor closed) after the last."""
        with self._lock:
            self.retired = True
            done = self.users == 0
        if done:
            self._unmap()

    def _unmap(self) -> None:
        anchor, self._anchor = self._anchor, None
        if anchor is not None:
            del anchor
            with contextlib.suppress(BufferError):
                self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._direct is not None:
            os.close(self._direct)
            self._direct, self._direct_ok = None, False

    def inherited(self) -> None:
        """In a forked child: this map's memory did not come along."""
        _INHERITED.append(self)
        self._anchor, self.retired, self.fd, self._direct, self._direct_ok = None, True, -1, None, False


class Busy:
    """This process's copies in flight under one store process's grants,
    written to its row of that store's client table as they change. Its
    own mapping of the table lasts while a connection to that store process
    is open or a copy is in flight: on memory, any mapping of a segment
    keeps all of its memory."""

    def __init__(self, fd: int, data_start: int, row: int) -> None:
        self._mm = mmap.mmap(fd, data_start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mm.madvise(mmap.MADV_DONTFORK)
        self._word: ctypes.c_int64 | None = ctypes.c_int64.from_buffer(self._mm, HEADER_BYTES + 8 * (ROW_WORDS * row
                                                                                                    + BUSY))
        self.row = row
        self._lock = threading.Lock()
        self.count = self.refs = 0

    def enter(self) -> None:
        with self._lock:
            self.count += 1
            self._word.value = self.count  # type: ignore[union-attr]

    def leave(self) -> None:
        with self._lock:
            self.count -= 1
            self._word.value = self.count  # type: ignore[union-attr]
            self._maybe_unmap()

    def acquire(self) -> None:
        with self._lock:
            self.refs += 1

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            self._maybe_unmap()

    @property
    def mapped(self) -> bool:
        return self._word is not None

    def _maybe_unmap(self) -> None:
        if not self.refs and not self.count and self._word is not None:
            self._word = None
            with contextlib.suppress(BufferError):
                self._mm.close()

    def inherited(self) -> None:
        _INHERITED.append(self)
        self._word = None
