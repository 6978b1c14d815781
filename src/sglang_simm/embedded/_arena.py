"""The local store's shared memory: one file on tmpfs, mapped by every client.

The store process creates it sparse, at its full size, and commits memory
(``posix_fallocate``) only as objects need it, in steps, one step ahead,
so a 4 GiB store holding 100 MiB uses about 100 MiB. Committing before an
offset is handed out means a client never writes into a hole of the file:
on a full tmpfs that write would be a SIGBUS, not an error code. A client
maps the whole file and pre-faults (``MADV_POPULATE_WRITE``) what is
committed once, behind its puts, so its copies do not take a page fault
per 4 KiB on the hot path.

The file starts with the lease table (``lease_table_bytes``), written by
the store process only: per lease slot, ``LEASE_WORDS`` int64 words, the
id of the lease that holds it (or 0) and who holds what (``_index``), so
the next store process after a crash keeps a live holder's memory out of
use. A reader checks its lease's id word after its copy. Objects start
after it.

The file outlives a store process that dies (kill -9, OOM): the next
store process of the name reopens it (``reuse``) and takes over the
objects its index table (``_table``) lists.
"""

from __future__ import annotations

import _thread
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import threading
from dataclasses import dataclass

from sglang_simm.embedded._copy import HELD_COPY_MAX, released_libc
from sglang_simm.embedded._paths import flock_held, open_private

logger = logging.getLogger("sglang_simm.embedded")

PAGE = mmap.PAGESIZE
#: Linux 5.14+: fault pages in, writable, without touching their bytes.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def prefault(mm: mmap.mmap, start: int, length: int) -> None:
    """Fault ``length`` bytes of ``mm`` from ``start`` in, in one system call
    (a first write to each page is otherwise a page fault apiece, dear in a
    VM); on an older kernel, nothing: the pages fault in as they are written.
    ``mmap.madvise`` keeps the GIL: for a mapping other threads use, see
    ``ArenaMap.populate``, which lets it go."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError):
        pass


#: libc's ``madvise``, letting the GIL go (None where it cannot be found)
_madvise_released = released_libc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


#: Memory is committed in steps of 1/16 of the arena, within these bounds,
#: and one step ahead of what puts have asked for: committing a step takes
#: about 30 ms for 64 MiB on a 2-core VM, which a put that found its step
#: uncommitted used to wait for. Once a put's room is committed, the store
#: commits the next step on a thread of its own (``ArenaFile.commit``), so
#: the put that next crosses into it finds it ready. The cost: at most one
#: step committed that no object uses yet.
COMMIT_STEP_MIN = 2 << 20
COMMIT_STEP_MAX = 64 << 20
#: A client faults in the committed arena on a thread of its own, this much
#: at a time (``ArenaMap.populate_behind``), so its puts find their pages
#: faulted in: faulting in cost this VM about 0.45 ms a MiB, twice the copy
#: it spares, and a put that faulted in its own pages ran at a third of its
#: bandwidth. A put that gets there first faults in only its own pages, and
#: waits at most for the chunk in flight.
POPULATE_CHUNK = 2 << 20
#: A put that faults in its own pages keeps the GIL for up to as much as a
#: copy does (``_copy.HELD_COPY_MAX``; about half a millisecond of faulting
#: here): a thread that lets it go beside a busy scheduler may wait up to
#: the 5 ms switch interval to get it back. More than this lets it go.
HELD_FAULT_MAX = HELD_COPY_MAX


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: nice is per thread):
    work done ahead, such as faulting memory in, then takes a core only
    when the threads serving requests leave one free."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


#: int64 words per lease slot: lease id (0: free; written last), pid,
#: process start time, connection, first byte and end of its span. Slot 0
#: is the header: its word 0 holds the store process's epoch.
LEASE_WORDS = 6


def lease_table_bytes(max_leases: int) -> int:
    return _page_up(8 * LEASE_WORDS * (max_leases + 1))


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


class ArenaInUse(OSError):
    """Another live store process holds the arena (its lock on the file)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EBUSY, f"arena {path} is held by another live store process")


def lock_arena(path: str) -> int | None:
    """The arena file ``path``, opened (never through a symlink) and locked
    for this process's life (``flock`` on the file itself: whatever happens
    to ``NAME.lock``, no second store process can take over an arena a live
    one serves); None when another process holds it. FileNotFoundError
    passes through."""
    fd = open_private(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def arena_held(path: str) -> bool:
    """Whether a live store process holds the arena ``path``."""
    return flock_held(path)


#: statfs's f_type of tmpfs: its files are memory
_TMPFS_MAGIC = 0x01021994


def _fs_type(path: str) -> int | None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first
    try:
        if _libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (AttributeError, OSError):
        return None
    return ctypes.c_long.from_buffer(buf).value


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key] = int(fields[0]) * 1024
    except OSError:
        pass
    return out


@dataclass(frozen=True)
class Backing:
    """What can back a store's arena in ``root``: its filesystem's size and
    free space (``statvfs``), and, where that filesystem is memory (tmpfs),
    the host's memory and what is available of it."""

    fs_total: int
    fs_free: int
    memory: bool
    mem_total: int
    mem_available: int

    @classmethod
    def of(cls, root: str) -> Backing:
        st = os.statvfs(root)
        info = _meminfo()
        return cls(fs_total=st.f_blocks * st.f_frsize, fs_free=st.f_bavail * st.f_frsize,
                   memory=_fs_type(root) == _TMPFS_MAGIC,
                   mem_total=info.get("MemTotal", 0), mem_available=info.get("MemAvailable", 0))

    def limit(self) -> int:
        """The most object bytes this can ever back: the filesystem's size,
        and the host's memory for a tmpfs."""
        limit = self.fs_total
        if self.memory and self.mem_total:
            limit = min(limit, self.mem_total)
        return limit

    def free(self) -> int:
        free = self.fs_free
        if self.memory and self.mem_available:
            free = min(free, self.mem_available)
        return free

    def figures(self) -> str:
        from sglang_simm.embedded._copy import human_bytes

        text = f"its filesystem holds {human_bytes(self.fs_total)} ({human_bytes(self.fs_free)} free)"
        if self.memory and self.mem_total:
            text += (f"; it is memory (tmpfs), and the host has {human_bytes(self.mem_total)} "
                     f"({human_bytes(self.mem_available)} available)")
        return text

    def check(self, capacity: int, held: int = 0) -> tuple[str | None, str | None]:
        """``(refusal, warning)`` for a store of ``capacity`` object bytes
        whose files hold ``held`` bytes already: a refusal when no filesystem
        or memory of this host could ever back it, a warning when what is
        free now cannot."""
        from sglang_simm.embedded._copy import human_bytes

        if capacity > self.limit():
            return (f"a capacity of {human_bytes(capacity)} is more than this host can back: "
                    f"{self.figures()}"), None
        if capacity > self.free() + held:
            return None, (f"a capacity of {human_bytes(capacity)} is more than is free now ({self.figures()}): "
                          "puts will fail with OutOfMemory, and the store lower its capacity, when it runs out")
        return None, None


class ArenaFile:
    """The store process's handle: creates the file, commits memory."""

    def __init__(self, path: str, size: int, *, reuse: bool = False, fd: int | None = None) -> None:
        """``reuse``: take the file at ``path`` over (a store process that
        died left it), at its real size or ``size``, whichever is larger
        (a truncated file grows back, sparse; ``found_size`` is what it
        held: no object of the old store lies past it); ``fd``: the file,
        open and locked already (``lock_arena``)."""
        self.path = path
        self.size = _page_up(size)
        self.reused = False
        self.found_size = 0
        if reuse:
            if fd is None:
                try:
                    fd = lock_arena(path)
                except FileNotFoundError:
                    fd = None
                else:
                    if fd is None:
                        raise ArenaInUse(path)
            if fd is not None:
                try:
                    found = os.fstat(fd).st_size
                    self.found_size = found - found % PAGE
                    self.size = max(self.size, self.found_size)
                    if found != self.size:
                        os.ftruncate(fd, self.size)
                except BaseException:
                    os.close(fd)
                    raise
                self.reused = True
        if not self.reused:
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
                os.ftruncate(fd, self.size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        self._fd = fd
        self._head: mmap.mmap | None = None
        self.step = min(max(self.size // 16, COMMIT_STEP_MIN), COMMIT_STEP_MAX)
        self.committed = 0
        #: the end of what may still be backed: ``committed`` drops to the
        #: first hole ``release_holes`` punches while what lies past it (a put
        #: being copied) stays backed, and ``release_after`` must give that
        #: back too; past it, anything backed is a client's doing (``release_stale``)
        self._backed = 0
        self.commit_error: str | None = None
        # fallocate and hole punching one at a time: the store's loop and the
        # thread committing ahead (``committed`` is written under it)
        self._lock = threading.Lock()
        self._ahead: threading.Thread | None = None
        #: bumped when memory is given back: a commit ahead planned before
        #: it must not commit what was just given back
        self._epoch = 0
        #: False once the filesystem refused a commit ahead, until memory
        #: is given back (a full tmpfs is reported by the put that needs it)
        self._ahead_ok = True

    def commit(self, end: int) -> int:
        """Back the file with memory up to at least ``end``; the committed end
        (short of ``end`` when the filesystem is full). Then the next step
        is committed in the background (``_commit_ahead``); a call that
        needs it before that is done waits for it here."""
        if end > self.committed:
            with self._lock:
                committed = self._commit(end)
        else:
            committed = self.committed
        self._commit_ahead()
        return committed

    def _commit(self, end: int) -> int:
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
            self._backed = max(self._backed, target)
            return target
        logger.error("local store: shared memory is full (%s)", self.commit_error)
        return self.committed

    def _commit_ahead(self) -> None:
        if not self._ahead_ok or self.committed >= self.size or self._fd < 0:
            return
        if self._ahead is not None and self._ahead.is_alive():
            return
        self._ahead = threading.Thread(target=self._commit_step, args=(self._epoch,),
                                       name="sglang-simm-arena-commit", daemon=True)
        self._ahead.start()

    def _commit_step(self, epoch: int) -> None:
        """One step past what is committed (``posix_fallocate`` lets the GIL
        go); nothing when memory was given back since it was asked for."""
        background_priority()
        with self._lock:
            start = self.committed
            target = min(self.size, start + self.step)
            if epoch != self._epoch or self._fd < 0 or target <= start:
                return
            try:
                os.posix_fallocate(self._fd, start, target - start)
            except OSError as exc:
                self._ahead_ok = False
                logger.debug("local store: no commit ahead (%s)", os.strerror(exc.errno))
                return
            self.committed = target
            self._backed = max(self._backed, target)

    def wait_ahead(self, timeout: float | None = None) -> None:
        """Until the commit ahead in flight, if any, is done."""
        ahead = self._ahead
        if ahead is not None:
            ahead.join(timeout)

    def lease_words(self, nbytes: int) -> memoryview:
        """The lease table (committed; a dead store process's records as it
        left them, for the caller to read and clear), as int64 words."""
        self.commit(nbytes)
        self._head = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if not self.reused:
            self._head[:] = bytes(nbytes)
        return memoryview(self._head).cast("q")

    def release_after(self, end: int, upto: int | None = None) -> int:
        """Give back the memory committed past ``end`` (no object lies
        there), up to ``upto`` (default: what this process committed; a
        store taking over a file, and a clear, pass its size: the memory
        there may have been backed by another process); the bytes still
        committed."""
        start = _page_up(end)
        with self._lock:
            self._epoch += 1
            self._ahead_ok = True
            backed = max(self.committed, self._backed)
            stop = backed if upto is None else max(upto, backed)
            # ``_backed`` is what ``release_stale`` leaves alone: below
            # ``start`` memory may be backed (a taken-over file's objects,
            # which this process never committed), and where the punch
            # failed, everything below ``stop`` may be
            if start < stop and _punch_hole(self._fd, start, stop - start):
                self.committed = min(self.committed, start)
                self._backed = start
            else:
                self._backed = min(max(self._backed, start, stop), self.size)
            return self.committed

    def release_stale(self) -> int:
        """Give back memory backed past what this process committed (the
        bytes given back; 0 when there were none). Only a client can put
        it there: its thread faulting in the committed arena behind its
        puts (``ArenaMap.populate_behind``) may still run on a target set
        before a ``store clear`` gave that memory back, and touching a
        page of a shared file backs it again. Nothing the store handed out
        lies there, so the housekeeping gives it back."""
        with self._lock:
            return self._release_data([(max(self.committed, self._backed), self.size)])

    def release_refaulted(self, extents: list[tuple[int, int]]) -> int:
        """Give back the memory backed in free ``(start, end)`` extents past
        the committed prefix (the bytes given back). Nothing is handed out
        there, so after a clear only a client's lagging fault-in can have
        backed it: where a put being copied or a pinned object lies high, the
        clear leaves free memory below it that ``release_stale`` does not
        reach.
        Only extents with data are punched, so a tick with nothing to give
        back unmaps nothing in the clients."""
        with self._lock:
            return self._release_data(extents)

    def _release_data(self, extents: list[tuple[int, int]]) -> int:
        """Punch the whole pages of ``extents`` past the committed prefix
        from their first byte of data on (a client's write faults pages in
        as data; ``posix_fallocate``'s are holes to ``SEEK_DATA``); the bytes
        given back. The caller holds ``_lock``."""
        if self._fd < 0:
            return 0
        floor, punches = _page_up(self.committed), []
        for start, end in extents:
            lo, hi = max(_page_up(start), floor), end - end % PAGE
            if lo >= hi:
                continue
            try:
                data = os.lseek(self._fd, lo, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past lo at all
                break
            data -= data % PAGE
            if data < hi:
                punches.append((data, hi - data))
        if not punches:  # an idle tick: one lseek, no more
            return 0
        before = os.fstat(self._fd).st_blocks * 512
        for offset, length in punches:
            _punch_hole(self._fd, offset, length)
        return max(before - os.fstat(self._fd).st_blocks * 512, 0)

    def release_holes(self, extents: list[tuple[int, int]]) -> int:
        """Give back the memory of free ``(start, end)`` extents below the
        high water (nobody holds them: the store's allocator says so), each
        cut inward to whole pages; the bytes still committed, which drop to
        the first hole. Committing is a prefix: everything from the first
        hole up is committed again (``posix_fallocate`` skips the pages
        still backed, such as a held put's) before any of it is handed out."""
        with self._lock:
            first, backed = None, max(self.committed, self._backed)
            for start, end in extents:
                lo, hi = _page_up(start), min(end - end % PAGE, backed)
                if lo < hi and _punch_hole(self._fd, lo, hi - lo):
                    first = lo if first is None else min(first, lo)
            if first is not None:
                self._epoch += 1
                self._ahead_ok = True
                self.committed = min(self.committed, first)
            return self.committed

    def close(self, *, unlink: bool = True) -> None:
        with self._lock:  # a commit ahead in flight ends before its fd does
            self._epoch += 1
            self._close(unlink)

    def _close(self, unlink: bool) -> None:
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
        fd = open_private(path, os.O_RDWR)
        try:
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
        self._populated = 0  # faulted in below this, in order
        self._lock = threading.Lock()
        self._fault_lock = threading.Lock()  # one fault-in at a time, never under an unmap
        self._target = 0  # what the thread behind faults in up to
        self._behind = False  # whether that thread runs
        self._behind_done = threading.Event()
        self._behind_done.set()
        self.users = 0
        self.retired = False

    def populate(self, end: int, start: int = 0) -> None:
        """Fault in ``[start, end)`` of the mapping now, so copies run without
        page faults; nothing of it that is faulted in already. A range past
        what is faulted in in order (a put that got ahead of the thread
        behind) is faulted in alone, leaving the order's end where it is."""
        done = self._populated
        if end <= done:
            return
        end = min(_page_up(end), self.size)
        if start <= done:
            self._fault_in(end, HELD_FAULT_MAX)
            return
        start -= start % PAGE
        with self._fault_lock:
            if self._anchor is not None and start < end:
                self._madvise(start, end, end - start <= HELD_FAULT_MAX)

    def _madvise(self, start: int, end: int, hold: bool = False) -> None:
        if hold or _madvise_released is None:
            prefault(self._mm, start, end - start)
        else:  # lets the GIL go: a server's scheduler thread runs on
            _madvise_released(self.base + start, end - start, MADV_POPULATE_WRITE)

    def populate_behind(self, end: int) -> None:
        """Fault in the mapping up to ``end`` (what the store has committed)
        on a thread of its own, a chunk at a time, ahead of the puts."""
        end = min(_page_up(end), self.size)
        if end <= self._target:
            return
        with self._lock:
            if end <= self._target or self.retired:
                return
            self._target = end
            if self._behind:
                return  # running: it reads the new target
            self._behind = True
            self._behind_done.clear()
        # Not threading.Thread.start(): it waits for the thread to start,
        # letting the GIL go, which a put beside a busy scheduler may pay
        # up to the 5 ms switch interval to get back.
        _thread.start_new_thread(self._fault_in_behind, ())

    def wait_behind(self, timeout: float | None = None) -> None:
        """Until the thread behind, if any, has faulted in its target."""
        self._behind_done.wait(timeout)

    def _fault_in_behind(self) -> None:
        background_priority()
        try:
            while True:
                with self._lock:
                    target = self._target
                    if self._populated >= target or self.retired:
                        return
                if not self._fault_in(min(self._populated + POPULATE_CHUNK, target)):
                    return
        finally:
            with self._lock:
                self._behind = False
                self._behind_done.set()

    def _fault_in(self, end: int, hold_max: int = 0) -> bool:
        """Up to ``end``, a chunk at a time, chunks up to ``hold_max`` bytes
        keeping the GIL; False once unmapped."""
        while True:
            with self._fault_lock:
                start = self._populated
                if end <= start:
                    return True
                if self._anchor is None:
                    return False
                stop = min(end, start + POPULATE_CHUNK)
                self._madvise(start, stop, stop - start <= hold_max)
                self._populated = stop

    def enter(self) -> bool:
        """A copy begins; False (and nothing counted) once retired."""
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
        """No new copies; unmapped when the last copy in flight is done."""
        with self._lock:
            self.retired = True
            done = self.users == 0
        if done:
            self._unmap()

    def _unmap(self) -> None:
        with self._fault_lock:  # never under a fault-in in flight
            anchor, self._anchor = self._anchor, None
            if anchor is not None:
                del anchor
                try:
                    self._mm.close()
                except BufferError:  # still exported somewhere: the GC unmaps it later
                    pass
