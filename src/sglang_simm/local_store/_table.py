"""The store's objects, kept crash-consistently in ``NAME.index``: a header,
then one fixed-size entry per slot (state, publish order, segment, offset,
size, checksum, key) in a shared mapping.

A published entry's state word is written last, and an object that leaves
is set ``FREE`` first, so a store process killed at any instruction leaves
every entry whole or not committed. The next store process (``recover``)
keeps the committed entries that are sound (docs/local-store-design.md,
"Recovery"); a power loss that kept an entry but not its bytes is caught
by the object's checksum on its first read.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from array import array
from dataclasses import dataclass

import numpy as np

from sglang_simm.local_store._allocator import ALIGN
from sglang_simm.local_store._paths import open_private
from sglang_simm.local_store._segments import punch_hole
from sglang_simm.simm_rules import MAX_VALUE_BYTES

FREE, COMMITTED = 0, 0x434F4D54  # "COMT"
MAGIC, VERSION = b"SGSIMMIX", 3
_HEADER = struct.Struct("<8sIIq")  # magic, version, pad, slots
HEADER_BYTES = 4096
SEQ_LIMIT = 1 << 62
ENTRY = np.dtype([("state", "<u4"), ("pad", "<u4"), ("seq", "<u8"), ("gen", "<u8"), ("offset", "<i8"),
                  ("size", "<i8"), ("crc", "<i8"), ("key", "S256")])


@dataclass(frozen=True)
class Recovered:
    """The sound objects of a table, oldest first."""

    slots: np.ndarray
    keys: list[bytes]
    gens: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    crcs: np.ndarray
    seqs: np.ndarray


class SlotPool:
    """The free entries of a table of ``slots``: fresh ones in ascending order
    from a counter, those given back reused first. Its memory is bounded by
    the entries given back, not by the table's size (a 1 TiB store has 268
    million slots)."""

    __slots__ = ("_free", "_fresh", "slots")

    def __init__(self, slots: int, taken: np.ndarray | None = None) -> None:
        self.slots = slots
        self._free = array("q")
        self._fresh = 0
        if taken is not None and len(taken):
            top = int(taken.max()) + 1
            free = np.ones(top, dtype=bool)
            free[taken] = False
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

    def push(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def high(self) -> int:
        """Every slot ever handed out lies below this."""
        return self._fresh


def _data_ranges(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The ranges of ``fd`` in ``[start, end)`` that hold data: recovery reads
    no hole (reading a hole of a tmpfs file through a mapping backs it)."""
    out, at = [], start
    while at < end:
        try:
            data = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            return [(start, end)]  # no SEEK_DATA here: read it all
        if data >= end:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        out.append((data, hole))
        at = hole
    return out


class IndexTable:
    """The entries of ``path``, ``slots`` of them, locked (``flock``) for this
    object's life: whatever happens to ``NAME.lock``, a table has one writer
    (``BlockingIOError`` when another process holds it). ``adopt`` keeps a
    table of this layout as found (``adopted``), with its own number of
    slots if larger; ``path`` None: a table in memory only."""

    def __init__(self, path: str | None, slots: int, *, adopt: bool = False) -> None:
        self.path = path
        fd = open_private(path, os.O_RDWR | os.O_CREAT) if path else os.memfd_create("index", os.MFD_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            found = self.slots_in(fd)
            self.adopted = found is not None and adopt
            if self.adopted:
                slots = max(slots, found)  # type: ignore[type-var]
            else:
                os.ftruncate(fd, 0)  # another layout, or not to be adopted: nothing in it is ours
            size = HEADER_BYTES + slots * ENTRY.itemsize
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.pwrite(fd, _HEADER.pack(MAGIC, VERSION, 0, slots), 0)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.slots = fd, slots
        e = np.ndarray((slots,), dtype=ENTRY, buffer=self._mm, offset=HEADER_BYTES)
        self.entries = e
        self.state, self.seq, self.gen, self.offset = e["state"], e["seq"], e["gen"], e["offset"]
        self.size, self.crc, self.key = e["size"], e["crc"], e["key"]

    @staticmethod
    def slots_in(fd: int) -> int | None:
        """The slots of a table of this layout in ``fd``, or None."""
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            return None
        magic, version, _, slots = _HEADER.unpack(head)
        fits = 0 <= slots <= (os.fstat(fd).st_size - HEADER_BYTES) // ENTRY.itemsize
        return slots if (magic, version) == (MAGIC, VERSION) and fits else None

    def commit(self, slots: list[int], keys: list[bytes], gen: int, offsets: list[int], sizes: list[int],
               crcs: list[int], first_seq: int) -> None:
        """Publish entries in segment ``gen``, numbered from ``first_seq``, state last."""
        idx = np.asarray(slots, dtype=np.int64)
        self.key[idx] = keys
        self.gen[idx] = gen
        self.offset[idx] = offsets
        self.size[idx] = sizes
        self.crc[idx] = crcs
        self.seq[idx] = np.arange(first_seq, first_seq + len(slots), dtype=np.uint64)
        self.state[idx] = COMMITTED

    def free(self, slots: list[int]) -> None:
        self.state[np.asarray(slots, dtype=np.int64)] = FREE

    def clear(self) -> None:
        """Every entry free, and the memory of the entries given back."""
        end = len(self._mm)
        if not punch_hole(self.fd, HEADER_BYTES, end - HEADER_BYTES):
            for lo, hi in _data_ranges(self.fd, HEADER_BYTES, end):
                first = (lo - HEADER_BYTES) // ENTRY.itemsize
                self.state[first:min(-(-(hi - HEADER_BYTES) // ENTRY.itemsize), self.slots)] = FREE

    def recover(self, bounds: dict[int, tuple[int, int]]) -> tuple[Recovered, int]:
        """The sound committed entries, oldest first, and how many were
        dropped. ``bounds``: segment generation -> ``(data start, end)``; an
        entry of any other segment is dropped. Read with ``pread`` from the
        parts of the file that hold data only."""
        size, chunks = ENTRY.itemsize, []
        for lo, hi in _data_ranges(self.fd, HEADER_BYTES, HEADER_BYTES + self.slots * size):
            first, last = (lo - HEADER_BYTES) // size, min(-(-(hi - HEADER_BYTES) // size), self.slots)
            for at in range(first, last, (16 << 20) // size):
                n = min(last - at, (16 << 20) // size)
                block = np.frombuffer(os.pread(self.fd, n * size, HEADER_BYTES + at * size), dtype=ENTRY)
                hit = np.flatnonzero(block["state"] == COMMITTED)
                chunks.append((hit + at, block[hit].copy()))
        slots = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
        rows = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, ENTRY)
        order = np.argsort(rows["seq"], kind="stable")
        slots, rows = slots[order], rows[order]
        gens, offsets, sizes = rows["gen"], rows["offset"], rows["size"]
        known = np.array(sorted(bounds), dtype=np.uint64)
        where = np.minimum(np.searchsorted(known, gens), max(len(known) - 1, 0))
        lo = np.array([bounds[int(g)][0] for g in known] or [0], dtype=np.int64)[where]
        hi = np.array([bounds[int(g)][1] for g in known] or [0], dtype=np.int64)[where]
        ok = ((known[where] == gens) if len(known) else np.zeros(len(rows), bool))
        ok &= (offsets >= lo) & (offsets <= hi) & (sizes >= 0) & (sizes <= MAX_VALUE_BYTES)
        ok &= (sizes <= hi - offsets) & (offsets % ALIGN == 0) & (rows["seq"] < SEQ_LIMIT)
        keys = rows["key"]
        _, last = np.unique(keys[::-1], return_index=True)  # newest wins for a key written twice
        newest = np.zeros(len(keys), dtype=bool)
        newest[len(keys) - 1 - last] = True
        ok &= newest
        # No two kept objects share a byte: one that starts below the end of
        # any before it in its segment goes (only damage makes an overlap).
        ends = offsets + np.maximum(-(-np.where(ok, sizes, 0) // ALIGN) * ALIGN, ALIGN)
        idx = np.flatnonzero(ok)
        idx = idx[np.lexsort((offsets[idx], gens[idx]))]
        cuts = np.flatnonzero(np.r_[True, gens[idx][1:] != gens[idx][:-1]]) if len(idx) else []
        for a, b in zip(cuts, [*cuts[1:], len(idx)]):
            part = idx[a:b]
            reach = np.maximum.accumulate(ends[part])
            ok[part[1:][offsets[part][1:] < reach[:-1]]] = False
        bad = slots[~ok]
        if len(bad):
            self.state[bad] = FREE
        good = np.flatnonzero(ok)
        return Recovered(slots[good], [bytes(k) for k in keys[good]], gens[good], offsets[good], sizes[good],
                         rows["crc"][good], rows["seq"][good]), int(len(bad))

    def close(self, *, unlink: bool = False) -> None:
        self.entries = self.state = self.seq = self.gen = self.offset = self.size = self.crc = self.key = None
        os.close(self.fd)
        try:
            self._mm.close()
        except BufferError:  # a view still holds it: the collector unmaps it
            pass
        if unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
