"""Segments: the files that hold a local store's objects, one per store process.

Each store process makes one, ``NAME.<gen>.seg`` (a random 64-bit
generation), and grants memory only inside it. A header page, the *client
table* (a row per client process: pid, start time, and ``busy``, the copies
it has in flight, counted by the client itself), then the objects from
``data_start``. On memory (tmpfs) the store backs the file a step ahead of
its grants (``commit``), so no client writes into a hole (a SIGBUS on a
full tmpfs); on a disk a full disk is an error code. A segment outlives its
store process: docs/local-store-design.md says when its memory is reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_simm.local_store._paths import boot_id, open_private, proc_alive

logger = logging.getLogger("sglang_simm.local_store")

PAGE = mmap.PAGESIZE
MAGIC = b"SGSIMSEG"
VERSION = 1
#: magic, version, rows, generation, boot id, data start, size
_HEADER = struct.Struct("<8sIIQ16sQQ")
#: Written by the store process as they change, read by its clients' threads
#: that fault the segment in: the end of the memory backed, and how many
#: times memory was given back (a thread stops at its next chunk then).
COMMITTED_AT, EPOCH_AT = 512, 520
HEADER_BYTES = 4096
#: int64 words per client-table row: pid, start time, busy, spare
ROW_WORDS = 4
BUSY = 2
#: Committed (memory medium) in steps of a sixteenth of the segment within
#: these bounds, one step ahead of the grants, on a thread of its own.
COMMIT_STEP_MIN, COMMIT_STEP_MAX = 2 << 20, 64 << 20
_TMPFS_MAGIC, _RAMFS_MAGIC = 0x01021994, 0x858458F6
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def data_start_for(rows: int) -> int:
    return -(-(HEADER_BYTES + 8 * ROW_WORDS * rows) // (64 << 10)) * (64 << 10)


def segment_bytes(capacity: int, rows: int) -> int:
    """A segment's size for a capacity: an eighth more (at least 2 MiB), for
    alignment and the holes between objects of different sizes."""
    return page_up(data_start_for(rows) + capacity + max(capacity // 8, 2 << 20))


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the memory or disk of ``[offset, offset + length)`` back."""
    return _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0


def medium_of(root: str) -> str:
    """"memory" where ``root``'s filesystem (that of its nearest existing
    parent) is RAM (tmpfs, ramfs), else "disk"."""
    while not os.path.exists(root) and os.path.dirname(root) != root:
        root = os.path.dirname(root)
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first
    if _libc.statfs(os.fsencode(root), buf) != 0:
        return "disk"
    return "memory" if ctypes.c_long.from_buffer(buf).value in (_TMPFS_MAGIC, _RAMFS_MAGIC) else "disk"


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


@dataclass(frozen=True)
class Backing:
    """What can back a store in ``root``: its filesystem's size and free space,
    and for memory (tmpfs) the host's RAM too."""

    medium: str
    fs_total: int
    fs_free: int
    mem_total: int
    mem_available: int

    @classmethod
    def of(cls, root: str) -> Backing:
        st = os.statvfs(root)
        info = _meminfo()
        return cls(medium_of(root), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                   info.get("MemTotal", 0), info.get("MemAvailable", 0))

    def limit(self) -> int:
        """The most object bytes this can ever back."""
        return min(self.fs_total, self.mem_total) if self.medium == "memory" and self.mem_total else self.fs_total

    def free(self) -> int:
        return min(self.fs_free, self.mem_available) if self.medium == "memory" and self.mem_available else self.fs_free

    def figures(self) -> str:
        from sglang_simm.local_store._copy import human_bytes

        text = (f"{self.medium} at {human_bytes(self.fs_total)} ({human_bytes(self.fs_free)} free)")
        if self.medium == "memory" and self.mem_total:
            text += f", on a host of {human_bytes(self.mem_total)} RAM ({human_bytes(self.mem_available)} available)"
        return text

    def check(self, capacity: int, held: int = 0) -> tuple[str | None, str | None]:
        """``(refusal, warning)``: a refusal when nothing here could ever back
        ``capacity``, a warning when what is free now cannot."""
        from sglang_simm.local_store._copy import human_bytes

        if capacity > self.limit():
            return f"a capacity of {human_bytes(capacity)} is more than this host can back ({self.figures()})", None
        if capacity > self.free() + held:
            return None, (f"a capacity of {human_bytes(capacity)} is more than is free now ({self.figures()}): "
                          "puts will fail, and the store lower its capacity, when it runs out")
        return None, None


def physical_memory_bytes() -> int | None:
    """Physical RAM, or the cgroup's memory limit when lower; None if unknown."""
    sizes = [_meminfo().get("MemTotal", 0)]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError), open(path) as f:
            text = f.read().strip()
            sizes.append(int(text) if text.isdigit() and int(text) < 1 << 60 else 0)
    return min((s for s in sizes if s > 0), default=None)


def default_capacity_bytes(root: str | None = None) -> int:
    """In a store directory ``root`` on a disk, half of what is free there;
    on memory, 4 GiB capped at a quarter of physical memory."""
    if root is not None and os.path.isdir(root) and medium_of(root) == "disk":
        return max(Backing.of(root).fs_free // 2, 64 << 20)
    ram = physical_memory_bytes()
    return min(4 << 30, ram // 4) if ram else 4 << 30


#: A memory store's segment is mapped whole by every client, beside the
#: client's own memory (an SGLang process reserves terabytes of address
#: space for its devices): no memory segment is larger than this.
MAX_MAPPED = 1 << 44


def capacity_problem(root: str, capacity: int, *, rows: int = 1024, force: bool = False
                     ) -> tuple[str | None, str | None]:
    """``(refusal, warning)`` for a store of ``capacity`` in ``root``: what can
    back it (``Backing.check``; ``force`` makes a refusal of that kind a
    warning), and for memory, what a client can map (never forced)."""
    from sglang_simm.local_store._copy import human_bytes

    backing = Backing.of(root)
    refusal, warning = backing.check(capacity)
    if refusal and force:
        refusal, warning = None, f"{refusal} (forced)"
    size = segment_bytes(capacity, rows)
    if backing.medium == "memory" and not refusal:
        why = f"at most {human_bytes(MAX_MAPPED)}" if size > MAX_MAPPED else ""
        if not why:
            try:  # address space only: no memory, no commit charge
                mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, prot=0).close()
            except (OSError, OverflowError, ValueError) as exc:
                why = f"none here ({exc})"
        if why:
            refusal = (f"a memory store of {human_bytes(capacity)} maps a segment of {human_bytes(size)} into every "
                       f"client, and a client can map {why}: choose a smaller capacity, or a store directory on "
                       "a disk")
    return refusal, warning


class Segment:
    """A segment file, open, with its client table mapped (the store's side)."""

    def __init__(self, path: str, fd: int, gen: str, rows: int, data_start: int, size: int, boot: str) -> None:
        self.path, self.fd, self.gen = path, fd, gen
        self.data_start, self.size, self.boot = data_start, size, boot
        self._head = mmap.mmap(fd, data_start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.rows = np.ndarray((rows, ROW_WORDS), dtype=np.int64, buffer=self._head, offset=HEADER_BYTES)

    @classmethod
    def create(cls, path: str, gen: str, size: int, rows: int) -> Segment:
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.ftruncate(fd, size)
            data_start, boot = data_start_for(rows), uuid.UUID(_boot_id()).bytes
            os.pwrite(fd, _HEADER.pack(MAGIC, VERSION, rows, int(gen, 16), boot, data_start, size), 0)
            return cls(path, fd, gen, rows, data_start, size, boot.hex())
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str, gen: str) -> Segment:
        """An earlier store process's segment; ValueError if it is no segment
        of that generation (it is then left alone, never read as one)."""
        fd = open_private(path, os.O_RDWR)
        try:
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < _HEADER.size:
                raise ValueError(f"{path} is too short to be a segment")
            magic, version, rows, number, boot, data_start, size = _HEADER.unpack(head)
            if (magic, version, number) != (MAGIC, VERSION, int(gen, 16)) or not 0 < rows < 1 << 20 \
                    or data_start != data_start_for(rows):
                raise ValueError(f"{path} is no segment of generation {gen}")
            return cls(path, fd, gen, rows, data_start, min(size, os.fstat(fd).st_size), boot.hex())
        except BaseException:
            os.close(fd)
            raise

    def quiet(self) -> bool:
        """True once no client of this segment's store process may still be
        copying: every row's process is gone (or of another boot) or says it
        has no copy in flight. Nothing else ever lets its memory be reused."""
        if self.boot != uuid.UUID(_boot_id()).bytes.hex():
            return True
        rows = self.rows
        for i in np.flatnonzero(rows[:, BUSY] != 0):
            pid, start = int(rows[i, 0]), int(rows[i, 1])
            if pid and proc_alive(pid, start):
                return False
        return True

    def busy_of(self, row: int) -> int:
        return int(self.rows[row, BUSY])

    def set_row(self, row: int, pid: int, start: int) -> None:
        self.rows[row] = (pid, start, 0, 0)

    def punch(self, extents: list[tuple[int, int]]) -> None:
        """Give back the memory of ``(start, end)`` extents, cut inward to pages."""
        for start, end in extents:
            lo, hi = page_up(start), min(end - end % PAGE, self.size)
            if lo < hi:
                punch_hole(self.fd, lo, hi - lo)

    def blocks(self) -> int:
        return os.fstat(self.fd).st_blocks * 512 if self.fd >= 0 else 0

    def close(self, *, unlink: bool = False) -> None:
        self.rows = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._head.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class OwnSegment(Segment):
    """This store process's segment: where it grants memory. On memory it is
    backed in steps (``commit``), one step ahead, so a grant never lies over
    a hole; ``epoch`` counts the times memory was given back, so a client's
    thread faulting the segment in stops at its next chunk."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.memory = medium_of(os.path.dirname(self.path)) == "memory"
        self._words = np.ndarray((2,), dtype=np.int64, buffer=self._head, offset=COMMITTED_AT)
        self.committed = self.data_start if self.memory else self.size
        self.epoch = 0
        self.commit_error = ""
        self._step = min(max(self.size // 16, COMMIT_STEP_MIN), COMMIT_STEP_MAX)
        self._lock = threading.Lock()  # fallocate and punching one at a time
        self._ahead: threading.Thread | None = None
        self._ahead_ok = True

    committed = property(lambda self: int(self._words[0]), lambda self, v: self._words.__setitem__(0, v))
    epoch = property(lambda self: int(self._words[1]), lambda self, v: self._words.__setitem__(1, v))

    def commit(self, end: int) -> int:
        """Back the file up to at least ``end`` (a step ahead where it can);
        the committed end, short of ``end`` when the filesystem is full."""
        if end > self.committed:
            with self._lock:
                self._fallocate(min(self.size, max(page_up(end), self.committed + self._step)), page_up(end))
        if self.memory and self._ahead_ok and self.committed < self.size and \
                (self._ahead is None or not self._ahead.is_alive()):
            self._ahead = threading.Thread(target=self._commit_ahead, args=(self.epoch,),
                                           name="sglang-simm-store-commit", daemon=True)
            self._ahead.start()
        return self.committed

    def _fallocate(self, *targets: int) -> bool:
        for target in targets:
            if target <= self.committed:
                return True
            try:
                os.posix_fallocate(self.fd, self.committed, target - self.committed)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                    raise
                self.commit_error = f"{os.strerror(exc.errno)} backing {target} bytes of {self.path}"
                continue
            self.committed = target
            return True
        logger.error("local store: its memory is full (%s)", self.commit_error)
        return False

    def _commit_ahead(self, epoch: int) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # a core only when serving leaves one
        with self._lock:
            if epoch == self.epoch and self.fd >= 0:
                self._ahead_ok = self._fallocate(min(self.size, self.committed + self._step))

    def give_back(self, extents: list[tuple[int, int]]) -> int:
        """Punch free extents (nobody holds them: the caller's allocator says
        so); everything from the first hole up is committed again before it
        is handed out. The bytes still committed."""
        with self._lock:
            self.punch(extents)
            first = min((page_up(s) for s, e in extents if page_up(s) < e - e % PAGE), default=None)
            if first is not None and self.memory:
                self.epoch += 1
                self._ahead_ok = True
                self.committed = min(self.committed, first)
            return self.committed

    def close(self, *, unlink: bool = False) -> None:
        with self._lock:  # a commit ahead in flight ends before the fd does
            self.epoch += 1
            super().close(unlink=unlink)


def _boot_id() -> str:
    return boot_id() or "00000000-0000-0000-0000-000000000000"
