"""Where objects lie in the local store's shared arena: a free-extent allocator.

Pure bookkeeping over byte offsets (no memory is touched here), owned by the
store process. Best fit, so the large untouched tail of the arena is used
only when no hole fits: objects pack at low offsets, and the arena's file
commits memory (``posix_fallocate``) only up to the high-water mark. Equal
holes go lowest address first for the same reason. Freed extents merge with
their free neighbours, so a hole left by evicting adjacent objects can hold
a bigger one.

Every operation is O(log n) in the number of distinct free-extent lengths,
which stays small for KV pages (a pool's pages are one size).
"""

from __future__ import annotations

import bisect
import heapq

#: Objects start on this boundary (a cache line: memmove's fast path).
ALIGN = 64


def aligned(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


class ExtentAllocator:
    """Free extents of ``[0, size)``: ``alloc`` and ``free`` by offset."""

    def __init__(self, size: int, *, align: int = ALIGN) -> None:
        if size < align:
            raise ValueError(f"an arena of {size} bytes holds no {align}-byte extent")
        self.size = size - size % align
        self.align = align
        self._start_len: dict[int, int] = {}  # free extent start -> length
        self._end_start: dict[int, int] = {}  # free extent end -> start
        self._lengths: list[int] = []  # distinct free lengths, ascending
        self._count: dict[int, int] = {}  # free length -> extents of it
        self._heaps: dict[int, list[int]] = {}  # free length -> starts (lazily pruned)
        self.free_bytes = 0
        self._add(0, self.size)

    # -- free-extent sets ---------------------------------------------------

    def _add(self, start: int, length: int) -> None:
        self._start_len[start] = length
        self._end_start[start + length] = start
        count = self._count.get(length, 0)
        if count == 0:
            bisect.insort(self._lengths, length)
        self._count[length] = count + 1
        heapq.heappush(self._heaps.setdefault(length, []), start)
        self.free_bytes += length

    def _remove(self, start: int) -> int:
        length = self._start_len.pop(start)
        del self._end_start[start + length]
        count = self._count[length] - 1
        if count:
            self._count[length] = count
        else:
            del self._count[length]
            del self._heaps[length]
            self._lengths.pop(bisect.bisect_left(self._lengths, length))
        self.free_bytes -= length
        return length

    def _lowest_start(self, length: int) -> int:
        heap = self._heaps[length]
        while self._start_len.get(heap[0]) != length:  # stale: merged or taken
            heapq.heappop(heap)
        return heap[0]

    # -- the allocator --------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free extent of ``nbytes`` (rounded up to ``align``), or
        None when no free extent is that long."""
        need = aligned(max(nbytes, 1), self.align)
        i = bisect.bisect_left(self._lengths, need)
        if i == len(self._lengths):
            return None
        length = self._lengths[i]
        start = self._lowest_start(length)
        self._remove(start)
        if length > need:
            self._add(start + need, length - need)
        return start

    def alloc_run(self, nbytes: int, count: int) -> list[int]:
        """Offsets for up to ``count`` extents of ``nbytes`` each (fewer when
        the arena has no more room), carved best fit: a batch of one page
        size from the tail is one split, not ``count``."""
        need = aligned(max(nbytes, 1), self.align)
        out: list[int] = []
        lengths = self._lengths
        while len(out) < count:
            i = bisect.bisect_left(lengths, need)
            if i == len(lengths):
                break
            length = lengths[i]
            start = self._lowest_start(length)
            self._remove(start)
            k = min(count - len(out), length // need)
            out.extend(range(start, start + k * need, need))
            if length > k * need:
                self._add(start + k * need, length - k * need)
        return out

    def free(self, start: int, nbytes: int) -> None:
        """Give back an extent ``alloc`` returned for ``nbytes``."""
        end = start + aligned(max(nbytes, 1), self.align)
        if start < 0 or start in self._start_len:
            raise ValueError(f"extent [{start}, {end}) was not allocated from this arena")
        if end > self.size:  # past a truncation: gone for good
            if start >= self.size:
                return
            end = self.size
        before = self._end_start.get(start)
        if before is not None:
            self._remove(before)
            start = before
        if end in self._start_len:
            end += self._remove(end)
        self._add(start, end - start)

    def take_used(self, extents: list[tuple[int, int]]) -> None:
        """Mark ``(offset, length)`` extents allocated, all at once (a store
        taking over a dead one's objects). They must be sorted, disjoint,
        aligned, and lie inside free extents."""
        hint = None  # sorted input: the next extent is nearly always in the last remainder
        for offset, length in extents:
            start = hint if hint is not None and hint <= offset < hint + self._start_len[hint] else None
            if start is None:
                start = self._containing(offset)
            if start is None or offset + length > start + self._start_len[start]:
                raise ValueError(f"extent [{offset}, {offset + length}) is not free")
            free_len = self._remove(start)
            if offset > start:
                self._add(start, offset - start)
            hint = None
            if start + free_len > offset + length:
                hint = offset + length
                self._add(hint, start + free_len - offset - length)

    def _containing(self, offset: int) -> int | None:
        """The start of the free extent holding ``offset`` (a linear scan:
        only a takeover uses it, on an allocator with few free extents)."""
        best = None
        for start, length in self._start_len.items():
            if start <= offset < start + length:
                best = start
                break
        return best

    def truncate(self, end: int) -> None:
        """Stop handing out bytes at ``end`` (rounded down to ``align``):
        every free byte past it is dropped (the free tail, and free extents
        between extents still allocated past it). Allocated extents past it
        stay valid until freed; they are not returned to the free set
        afterwards."""
        end -= end % self.align
        if end >= self.size:
            return
        for start in [s for s, length in self._start_len.items() if s + length > end]:
            length = self._remove(start)
            if start < end:
                self._add(start, end - start)
        self.size = end

    def free_extents(self, below: int | None = None) -> list[tuple[int, int]]:
        """``(start, end)`` of every free extent starting below ``below``
        (default: all), sorted, cut at ``below``."""
        limit = self.size if below is None else below
        return sorted((s, min(s + n, limit)) for s, n in self._start_len.items() if s < limit)

    @property
    def largest_free(self) -> int:
        return self._lengths[-1] if self._lengths else 0

    def high_water(self) -> int:
        """End of the highest allocated byte: the free tail starts there."""
        tail = self._end_start.get(self.size)
        return self.size if tail is None else tail
