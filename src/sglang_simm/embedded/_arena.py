"""The host store's shared memory: one file on tmpfs, mapped by every client.

The store process creates it sparse, at its full size, and commits memory
(``posix_fallocate``) only as objects need it, in steps, so a 4 GiB store
holding 100 MiB uses 100 MiB. Committing before an offset is handed out
means a client never writes into a hole of the file: on a full tmpfs that
write would be a SIGBUS, not an error code. A client maps the whole file
and pre-faults (``MADV_POPULATE_WRITE``) each committed range once, so its
copies do not take a page fault per 4 KiB on the hot path.

The file starts with the lease table (``lease_table_bytes``): one int64
per lease slot, the id of the lease that holds it or 0, written by the
store process only. A reader checks its lease's word after its copy: a
lease that expired meanwhile reads as a miss. Objects start after it.

The file outlives a store process that dies (kill -9, OOM): the next
store process of the name reopens it (``reuse``) and takes over the
objects its index table (``_table``) lists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading

from sglang_simm.embedded._paths import check_file

logger = logging.getLogger("sglang_simm.embedded")

PAGE = mmap.PAGESIZE
#: Linux 5.14+: fault pages in, writable, without touching their bytes.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def prefault(mm: mmap.mmap, start: int, length: int) -> None:
    """Fault ``length`` bytes of ``mm`` from ``start`` in, in one system call
    (a first write to each page is otherwise a page fault apiece, dear in a
    VM); on an older kernel, nothing: the pages fault in as they are written."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError):
        pass


#: Memory is committed in steps of 1/16 of the arena, within these bounds.
#: (The put that crosses into a new step waits for the store process to
#: commit it: about 30 ms for 64 MiB on a 2-core VM, off the client's GIL.)
COMMIT_STEP_MIN = 2 << 20
COMMIT_STEP_MAX = 64 << 20
#: A client faults in the arena this far past the end of what a put writes
#: (within what is committed), once that end passes what is faulted in: a
#: whole step faulted in at once held the caller's GIL for 25-31 ms
#: (``mmap.madvise`` keeps it), 4 MiB for about 2.
POPULATE_AHEAD = 4 << 20


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def lease_table_bytes(max_leases: int) -> int:
    return _page_up(8 * max_leases)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = None


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the memory of ``[offset, offset + length)`` back to the host."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0


def arena_bytes_for(capacity: int) -> int:
    """The arena's size for a capacity: an eighth more (at least 2 MiB), for
    alignment and for holes left between objects of different sizes."""
    return _page_up(capacity + max(capacity // 8, 2 << 20))


class ArenaFile:
    """The store process's handle: creates the file, commits memory."""

    def __init__(self, path: str, size: int, *, reuse: bool = False) -> None:
        self.path = path
        self.size = _page_up(size)
        self.reused = False
        if reuse:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            else:
                try:
                    check_file(path, fd)
                    if os.fstat(fd).st_size != self.size:
                        raise OSError(errno.EINVAL, f"arena {path} is not {self.size} bytes")
                except BaseException:
                    os.close(fd)
                    raise
                self.reused = True
        if not self.reused:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, self.size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        self._fd = fd
        self._head: mmap.mmap | None = None
        self.step = min(max(self.size // 16, COMMIT_STEP_MIN), COMMIT_STEP_MAX)
        self.committed = 0
        self.commit_error: str | None = None

    def commit(self, end: int) -> int:
        """Back the file with memory up to at least ``end``; the committed end
        (short of ``end`` when the filesystem is full)."""
        if end <= self.committed:
            return self.committed
        want = min(self.size, max(_page_up(end), self.committed + self.step))
        for target in (want, min(self.size, _page_up(end))):
            try:
                os.posix_fallocate(self._fd, self.committed, target - self.committed)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                    raise
                self.commit_error = f"{os.strerror(exc.errno)} committing {target} bytes of {self.path}"
                continue
            self.committed = target
            return target
        logger.error("host store: shared memory is full (%s)", self.commit_error)
        return self.committed

    def lease_words(self, nbytes: int) -> memoryview:
        """The lease table (committed and zeroed: no lease of a dead store
        process is valid), as int64 words."""
        if nbytes <= 0:
            return memoryview(bytearray(8)).cast("q")
        self.commit(nbytes)
        self._head = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._head[:] = bytes(nbytes)
        return memoryview(self._head).cast("q")

    def release_after(self, end: int, upto: int | None = None) -> int:
        """Give back the memory committed past ``end`` (no object lies
        there), up to ``upto`` (default: what this process committed; a
        store taking over a file passes its size); the bytes still
        committed."""
        start = _page_up(end)
        stop = self.committed if upto is None else max(upto, self.committed)
        if start < stop and _punch_hole(self._fd, start, stop - start):
            self.committed = min(self.committed, start)
        return self.committed

    def close(self, *, unlink: bool = True) -> None:
        if self._head is not None:
            try:
                self._head.close()
            except BufferError:  # the index's view still holds it: the GC unmaps it
                pass
            self._head = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ArenaMap:
    """A client's mapping of one arena generation.

    ``users`` counts copies in flight; a mapping replaced after a store
    restart is unmapped only once none uses it, so a slow copy never writes
    into unmapped memory.
    """

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            check_file(path, fd)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise OSError(errno.EINVAL, f"arena {path} holds {actual} bytes, the store announced {size}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self._anchor = ctypes.c_char.from_buffer(self._mm)  # pins the mapping while referenced
        self.base = ctypes.addressof(self._anchor)
        self._populated = 0
        self._lock = threading.Lock()
        self.users = 0
        self.retired = False

    def populate(self, end: int, ahead: int = 0, limit: int | None = None) -> None:
        """Fault in the mapping up to ``end`` once, so copies run without page
        faults; when that is needed, ``ahead`` bytes further too (up to
        ``limit``), so the next writes find their pages faulted in."""
        if end <= self._populated:
            return
        end += ahead
        if limit is not None:
            end = min(end, limit)
        end = min(_page_up(end), self.size)
        if end <= self._populated:
            return
        with self._lock:
            start = self._populated
            if end <= start:
                return
            prefault(self._mm, start, end - start)
            self._populated = end

    def enter(self) -> None:
        with self._lock:
            self.users += 1

    def leave(self) -> None:
        with self._lock:
            self.users -= 1
            done = self.retired and self.users == 0
        if done:
            self._unmap()

    def retire(self) -> None:
        """No new copies; unmapped when the last copy in flight is done."""
        with self._lock:
            self.retired = True
            done = self.users == 0
        if done:
            self._unmap()

    def _unmap(self) -> None:
        anchor, self._anchor = self._anchor, None
        if anchor is not None:
            del anchor
            try:
                self._mm.close()
            except BufferError:  # still exported somewhere: the GC unmaps it later
                pass
