"""The local store's index, kept crash-consistently beside the arena.

``NAME.index`` is a file on the same tmpfs as the arena, mapped by the
store process alone: a header, then one fixed-size entry per object slot.
A published object's entry (key, offset, size, publish order) is written
when its writer commits, its state word ``COMMITTED`` last; an object that
leaves the index is set ``FREE`` first. So a store process killed at any
instruction leaves every entry whole or not committed. Puts being copied
are not written down here (that would double the cost of a put): every
grant, for a put or a read, is in the lease table at the head of the arena
(``_arena``, ``_index``), written before its reply is sent.

Why this, and not a journal: the entries are plain stores into shared
memory (no system call per batch, nothing to compact, recovery is a
vectorised scan of the parts of the file ever written), and a process
crash loses no store that reached the page cache. The file is sparse, sized
for the object cap: an entry holds memory only once written, and nothing
reads or writes the others (not a takeover either: it finds the written
parts with ``SEEK_DATA``). A power loss loses tmpfs anyway. Object bytes carry no
checksum: an object is committed only after its writer's copy is done, so
a committed entry's bytes are whole; a reserved one is never served.

The next store process of the name (``recover``) publishes every
committed entry again, in publish order, after checking it against the
arena's real size (in bounds without overflow, aligned, no overlap); one
that fails is dropped, and set free. The spans of the dead store's grants
whose holders still live stay out of use until they fence or are gone
(``_index.StoreIndex.restore``).
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from array import array
from dataclasses import dataclass

import numpy as np

from sglang_simm.embedded._arena import _punch_hole, prefault
from sglang_simm.embedded._paths import open_private
from sglang_simm.embedded.simm_rules import MAX_VALUE_BYTES

FREE = 0
COMMITTED = 0x434F4D54  # "COMT"

MAGIC = b"SGSIMMIX"
VERSION = 2
_HEADER = struct.Struct("<8sIIqqq")  # magic, version, pad, slots, arena bytes, reserved (0)
HEADER_BYTES = 4096
#: A publish order at or past this is damage: the next store process
#: numbers its publishes on from the largest it keeps, in a uint64.
SEQ_LIMIT = 1 << 62
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


class SlotPool:
    """The free entries of a table of ``slots``: fresh ones in ascending
    order, from a counter, and those given back, reused first (last in,
    first out). Its memory is bounded by the entries given back, not by the
    table's size: a store of 1 TiB has 268 million slots, and a list of
    them all took 2.1 GB and 16 s to build before the store served."""

    __slots__ = ("_fresh", "_free", "slots")

    def __init__(self, slots: int, taken: "set[int] | None" = None) -> None:
        self.slots = slots
        self._free = array("q")
        self._fresh = 0  # every slot from here up is free
        if taken:
            top = max(taken) + 1
            free = np.ones(top, dtype=bool)
            free[np.fromiter(taken, dtype=np.int64, count=len(taken))] = False
            self._free = array("q", np.flatnonzero(free)[::-1].tolist())
            self._fresh = top

    def __len__(self) -> int:
        return len(self._free) + self.slots - self._fresh

    def pop(self) -> int:
        if self._free:
            return self._free.pop()
        if self._fresh >= self.slots:
            raise IndexError("no free slot")
        self._fresh += 1
        return self._fresh - 1

    def take(self, n: int) -> list[int]:
        """``n`` slots, in the order ``n`` pops would hand them out."""
        if n > len(self):
            raise IndexError("not enough free slots")
        reused = min(n, len(self._free))
        out = self._free[len(self._free) - reused:].tolist()
        out.reverse()
        del self._free[len(self._free) - reused:]
        fresh = n - reused
        out.extend(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        return out

    def append(self, slot: int) -> None:
        self._free.append(slot)

    def extend(self, slots: "list[int]") -> None:
        self._free.extend(slots)


def _data_segments(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The ``[from, to)`` ranges of ``fd`` past ``start`` that hold data
    (``SEEK_DATA``/``SEEK_HOLE``): what was ever written, so recovery reads
    no hole (a read through a shared mapping of a tmpfs hole would back
    it with memory)."""
    out: list[tuple[int, int]] = []
    at = start
    while at < end:
        try:
            data = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past ``at``
                break
            return [(start, end)]  # no SEEK_DATA here: read it all
        if data >= end:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        out.append((data, hole))
        at = hole
    return out


class IndexTable:
    """The entries of ``path`` for ``slots`` objects of an arena of ``arena_bytes``.

    ``adopt``: a store taking over keeps a sound table as it finds it,
    whatever its number of slots (a capacity changed at run time, or
    settings that say otherwise: ``slots`` is then the table's own, bounded
    by its file's size, or the number asked for if larger); its entries are
    checked against the arena when recovered. The file is sparse: only the entries written hold memory,
    and nothing here reads or writes the others."""

    def __init__(self, path: str, slots: int, arena_bytes: int, *, adopt: bool = False) -> None:
        self.path = path
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            st = os.fstat(fd)
            fresh = st.st_size == 0
            found = None if fresh else self._header(fd)
            if found is not None and adopt:
                # its own entries, at least as many as asked for (more is
                # sparse file: an entry is a slot number, so growing keeps them)
                slots = max(slots, min(found, max((st.st_size - HEADER_BYTES) // ENTRY.itemsize, 0)))
            elif found != slots or fresh:
                os.ftruncate(fd, 0)  # another layout: nothing in it is ours
                fresh = True
            size = HEADER_BYTES + slots * ENTRY.itemsize
            if st.st_size != size or fresh:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept: recovery looks for the entries written (SEEK_DATA)
        self.slots = slots
        self.fresh = fresh
        self._mm[: _HEADER.size] = _HEADER.pack(MAGIC, VERSION, 0, slots, arena_bytes, 0)  # the arena it describes now
        self.entries = np.ndarray((slots,), dtype=ENTRY, buffer=self._mm, offset=HEADER_BYTES)
        e = self.entries
        self._state, self._seq, self._key = e["state"], e["seq"], e["key"]
        self._populated = 0  # bytes of the file faulted in (ahead of the highest slot written)
        self._offset, self._size = e["offset"], e["size"]

    @classmethod
    def unreadable(cls, path: str) -> str:
        """Why ``path`` holds no table of this layout ("" when it does): absent,
        a symlink, someone else's, another layout."""
        try:
            fd = open_private(path, os.O_RDONLY)
        except OSError as exc:
            return str(exc) if not isinstance(exc, FileNotFoundError) else f"{path} is missing"
        try:
            return "" if cls._header(fd) is not None else f"{path} is of another layout"
        finally:
            os.close(fd)

    @staticmethod
    def _header(fd: int) -> int | None:
        """The slots of a table of this layout, or None."""
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            return None
        magic, version, _, have_slots, _, _ = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or have_slots < 0:
            return None
        return have_slots

    # -- writes (state last) ------------------------------------------------

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
        """Every entry free, and the memory of the entries given back."""
        end = len(self._mm)
        if end > HEADER_BYTES and _punch_hole(self._fd, HEADER_BYTES, end - HEADER_BYTES):
            self._populated = 0
        else:  # no hole punching here: free only the entries written
            for lo, hi in _data_segments(self._fd, HEADER_BYTES, end):
                first, last = (lo - HEADER_BYTES) // ENTRY.itemsize, -(-(hi - HEADER_BYTES) // ENTRY.itemsize)
                self._state[first:min(last, self.slots)] = FREE

    # -- recovery -----------------------------------------------------------------

    def _committed_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, rows)`` of the committed entries, read with ``pread``
        from the ranges of the file that hold data only: a takeover touches
        no entry never written (through the mapping, reading a hole of a
        tmpfs file backs it: a 4 GiB store's index went from 1 MiB to
        288 MiB at a takeover)."""
        size, first_entry = ENTRY.itemsize, HEADER_BYTES
        chunk = max(size, (16 << 20) // size * size)
        slots, rows = [], []
        for lo, hi in _data_segments(self._fd, first_entry, first_entry + self.slots * size):
            first = (lo - first_entry) // size
            last = min(-(-(hi - first_entry) // size), self.slots)
            at = first
            while at < last:
                n = min(last - at, chunk // size)
                raw = os.pread(self._fd, n * size, first_entry + at * size)
                block = np.frombuffer(raw, dtype=ENTRY, count=len(raw) // size)
                hit = np.flatnonzero(block["state"] == COMMITTED)
                if len(hit):
                    slots.append(hit + at)
                    rows.append(block[hit].copy())
                at += n
        if not slots:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=ENTRY)
        return np.concatenate(slots), np.concatenate(rows)

    def recover(self, data_start: int, arena_bytes: int, align: int) -> tuple[Recovered, int]:
        """Committed entries that are sound, oldest first, plus how many
        entries were dropped as unsound.
        Sound: inside ``[data_start, arena_bytes)`` (the arena's real size;
        checked without overflow, whatever the sizes say), aligned, no
        larger than SiMM's largest value, numbered below ``SEQ_LIMIT``, the
        newest of its key, sharing no byte with another kept object. Dropped entries are set free."""
        committed, rows = self._committed_rows()
        order = np.argsort(rows["seq"], kind="stable")
        committed, rows = committed[order], rows[order]
        offsets, sizes = rows["offset"], rows["size"]
        ok = ((offsets >= data_start) & (offsets <= arena_bytes) & (sizes >= 0) & (sizes <= MAX_VALUE_BYTES)
              & (sizes <= arena_bytes - offsets) & (offsets % align == 0)
              & (rows["seq"] < SEQ_LIMIT))  # later publishes number on from the largest kept
        # Newest wins for a key published twice (an overwrite cut short).
        keys = rows["key"]
        _, last = np.unique(keys[::-1], return_index=True)
        newest = np.zeros(len(keys), dtype=bool)
        newest[len(keys) - 1 - last] = True
        ok &= newest
        # No two objects may share a byte: drop the later of an overlap
        # (sizes of unsound rows are not used: they may overflow).
        safe = np.where(ok, sizes, 0)
        by_offset = np.argsort(offsets, kind="stable")
        ends = offsets + np.maximum(-(-safe // align) * align, align)
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
        )
        # Entries not recovered are free from now on (only those: the rest
        # are free already, and writing them would back them with memory).
        bad = committed[~ok]
        if len(bad):
            self._state[bad] = FREE
        return result, dropped

    def close(self, *, unlink: bool = False) -> None:
        self.entries = self._state = self._seq = self._key = self._offset = self._size = None  # type: ignore
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
