"""The host store's index, kept crash-consistently beside the arena.

``NAME.index`` is a file on the same tmpfs as the arena, mapped by the
store process alone: a header, then one fixed-size entry per object slot.
A published object's entry (key, offset, size, publish order) is written
when its writer commits, its state word ``COMMITTED`` last; an object that
leaves the index is set ``FREE`` first. So a store process killed at any
instruction leaves every entry whole or not committed. Puts being copied
are not written down one by one (that would double the cost of a put):
the header keeps the arena's high-water mark instead, raised before any
room past it is handed out, and every extent a writer may hold lies below
it.

Why this, and not a journal: the entries are plain stores into shared
memory (no system call per batch, nothing to compact, recovery is one
vectorised scan), and a process crash loses no store that reached the
page cache. A power loss loses tmpfs anyway. Object bytes carry no
checksum: an object is committed only after its writer's copy is done, so
a committed entry's bytes are whole; a reserved one is never served.

The next store process of the name (``recover``) publishes every
committed entry again, in publish order, after checking it against the
arena (in bounds, aligned, no overlap); the free space below the recorded
high-water mark stays quarantined for a lease time, since a writer of the
dead store may still be copying into some of it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from sglang_simm.embedded._arena import prefault
from sglang_simm.embedded._paths import check_file

FREE = 0
COMMITTED = 0x434F4D54  # "COMT"

MAGIC = b"SGSIMMIX"
VERSION = 2
_HEADER = struct.Struct("<8sIIqqq")  # magic, version, pad, slots, arena bytes, high water
_HIGH_WATER_AT = _HEADER.size - 8
HEADER_BYTES = 4096
#: Entries are faulted in ahead of use, this much at a time, in one system
#: call: fresh slots are handed out in ascending order, and a first write to
#: each page of the file (a page fault apiece, dear in a VM) otherwise tripled
#: the cost of committing a batch of new objects.
POPULATE_BYTES = 1 << 20

ENTRY = np.dtype([
    ("state", "<u4"),
    ("pad", "<u4"),
    ("seq", "<u8"),
    ("offset", "<i8"),
    ("size", "<i8"),
    ("key", "S256"),
])


@dataclass(frozen=True)
class Recovered:
    """What a table held when its store process died."""

    keys: list[bytes]
    offsets: list[int]
    sizes: list[int]
    seqs: list[int]
    slots: list[int]
    #: the arena's high-water mark: no room was handed out past it
    high_water: int


class IndexTable:
    """The entries of ``path`` for ``slots`` objects of an arena of ``arena_bytes``."""

    def __init__(self, path: str, slots: int, arena_bytes: int) -> None:
        self.path = path
        self.slots = slots
        size = HEADER_BYTES + slots * ENTRY.itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            check_file(path, fd)
            fresh = os.fstat(fd).st_size == 0
            if fresh or not self._matches(fd, slots, arena_bytes):
                os.ftruncate(fd, 0)  # another layout: nothing in it is ours
                fresh = True
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.fresh = fresh
        if fresh:
            self._mm[: _HEADER.size] = _HEADER.pack(MAGIC, VERSION, 0, slots, arena_bytes, 0)
        self._hw = memoryview(self._mm)[_HIGH_WATER_AT:_HIGH_WATER_AT + 8].cast("q")
        self.entries = np.ndarray((slots,), dtype=ENTRY, buffer=self._mm, offset=HEADER_BYTES)
        e = self.entries
        self._state, self._seq, self._key = e["state"], e["seq"], e["key"]
        self._populated = 0  # bytes of the file faulted in (ahead of the highest slot written)
        self._offset, self._size = e["offset"], e["size"]

    @staticmethod
    def _matches(fd: int, slots: int, arena_bytes: int) -> bool:
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            return False
        magic, version, _, have_slots, have_arena, _ = _HEADER.unpack(head)
        return magic == MAGIC and version == VERSION and have_slots == slots and have_arena == arena_bytes

    # -- writes (state last) ------------------------------------------------

    def raise_high_water(self, end: int) -> None:
        """Before room up to ``end`` is handed out."""
        self._hw[0] = end

    def commit(self, slots: list[int], keys: list[bytes], offsets: list[int], sizes: list[int],
               first_seq: int) -> None:
        """Publish entries, numbered from ``first_seq`` in order."""
        if slots:
            self._populate_for(max(slots))
        if len(slots) == 1:  # numpy's batch machinery costs more than it saves here
            s = slots[0]
            self._key[s], self._offset[s], self._size[s], self._seq[s] = keys[0], offsets[0], sizes[0], first_seq
            self._state[s] = COMMITTED
        elif slots:
            idx = np.asarray(slots, dtype=np.int64)
            self._key[idx] = keys
            self._offset[idx] = offsets
            self._size[idx] = sizes
            self._seq[idx] = np.arange(first_seq, first_seq + len(slots), dtype=np.uint64)
            self._state[idx] = COMMITTED

    def _populate_for(self, slot: int) -> None:
        end = HEADER_BYTES + (slot + 1) * ENTRY.itemsize
        if end <= self._populated:
            return
        upto = min(end + POPULATE_BYTES, len(self._mm))
        prefault(self._mm, self._populated, upto - self._populated)
        self._populated = upto

    def free(self, slots: list[int]) -> None:
        if len(slots) == 1:
            self._state[slots[0]] = FREE
        elif slots:
            self._state[np.asarray(slots, dtype=np.int64)] = FREE

    def clear(self) -> None:
        self._state[:] = FREE

    # -- recovery -----------------------------------------------------------------

    def recover(self, data_start: int, arena_bytes: int, align: int) -> tuple[Recovered, int]:
        """Committed entries that are sound, oldest first, and the recorded
        high-water mark; plus how many entries were dropped as unsound."""
        e = self.entries
        state = e["state"]
        committed = np.flatnonzero(state == COMMITTED)
        rows = e[committed]
        order = np.argsort(rows["seq"], kind="stable")
        committed, rows = committed[order], rows[order]
        offsets, sizes = rows["offset"], rows["size"]
        ok = (offsets >= data_start) & (sizes >= 0) & (offsets + sizes <= arena_bytes) & (offsets % align == 0)
        # Newest wins for a key published twice (an overwrite cut short).
        keys = rows["key"]
        _, last = np.unique(keys[::-1], return_index=True)
        newest = np.zeros(len(keys), dtype=bool)
        newest[len(keys) - 1 - last] = True
        ok &= newest
        # No two objects may share a byte: drop the later of an overlap.
        by_offset = np.argsort(offsets, kind="stable")
        ends = offsets + np.maximum(-(-sizes // align) * align, align)
        taken_end = -1
        for i in by_offset:
            if not ok[i]:
                continue
            if offsets[i] < taken_end:
                ok[i] = False
                continue
            taken_end = ends[i]
        dropped = int((~ok).sum())
        good = np.flatnonzero(ok)
        result = Recovered(
            keys=[bytes(k) for k in keys[good]],
            offsets=offsets[good].tolist(),
            sizes=sizes[good].tolist(),
            seqs=rows["seq"][good].tolist(),
            slots=committed[good].tolist(),
            high_water=min(max(int(self._hw[0]), data_start), arena_bytes),
        )
        # Entries not recovered are free from now on.
        keep = np.zeros(self.slots, dtype=bool)
        keep[committed[good]] = True
        state[~keep] = FREE
        return result, dropped

    def close(self, *, unlink: bool = False) -> None:
        self.entries = self._state = self._seq = self._key = self._offset = self._size = None  # type: ignore
        self._hw.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
