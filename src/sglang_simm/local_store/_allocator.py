"""Where objects lie in a store process's own segment: free extents, best fit.

Pure bookkeeping over byte offsets, owned by the store process. Best fit,
equal holes lowest address first, so objects pack low and the segment's
file is backed only up to the high water. Freed extents merge with their
free neighbours. Each operation is O(log n) in the number of distinct
free lengths, which stays small for KV pages (a pool's pages are one size).
"""

from __future__ import annotations

import bisect
import heapq

#: Objects start on this boundary (a cache line: memmove's fast path).
ALIGN = 64


def aligned(nbytes: int, align: int = ALIGN) -> int:
    """The extent an object of ``nbytes`` takes (a zero-byte one takes one unit)."""
    return -(-max(nbytes, 1) // align) * align


class ExtentAllocator:
    """Free extents of ``[start, size)``: ``alloc`` and ``free`` by offset."""

    def __init__(self, size: int, start: int = 0) -> None:
        self.size = size - size % ALIGN
        if self.size - start < ALIGN:
            raise ValueError(f"a segment of {size} bytes holds no object past byte {start}")
        self._start_len: dict[int, int] = {}  # free extent start -> length
        self._end_start: dict[int, int] = {}  # free extent end -> start
        self._lengths: list[int] = []  # distinct free lengths, ascending
        self._count: dict[int, int] = {}  # free length -> extents of it
        self._heaps: dict[int, list[int]] = {}  # free length -> starts (lazily pruned)
        self.free_bytes = 0
        self._add(start, self.size - start)

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
            del self._count[length], self._heaps[length]
            self._lengths.pop(bisect.bisect_left(self._lengths, length))
        self.free_bytes -= length
        return length

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free extent for ``nbytes``, or None when no free
        extent is that long."""
        need = aligned(nbytes)
        i = bisect.bisect_left(self._lengths, need)
        if i == len(self._lengths):
            return None
        length = self._lengths[i]
        heap = self._heaps[length]
        while self._start_len.get(heap[0]) != length:  # stale: merged or taken
            heapq.heappop(heap)
        start = heap[0]
        self._remove(start)
        if length > need:
            self._add(start + need, length - need)
        return start

    def free(self, start: int, nbytes: int) -> None:
        """Give back an extent ``alloc`` returned for ``nbytes``."""
        end = start + aligned(nbytes)
        if start < 0 or start in self._start_len:
            raise ValueError(f"extent [{start}, {end}) was not allocated from this segment")
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

    def truncate(self, end: int) -> None:
        """Hand out nothing past ``end`` from now on (the host could back no
        more): the free bytes past it are dropped; extents still allocated
        past it are dropped when freed."""
        end -= end % ALIGN
        if end >= self.size:
            return
        for start in [s for s, n in self._start_len.items() if s + n > end]:
            self._remove(start)
            if start < end:
                self._add(start, end - start)
        self.size = end

    def free_extents(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every free extent, sorted."""
        return sorted((s, s + n) for s, n in self._start_len.items())
