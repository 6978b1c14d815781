"""Self-checking objects, put and read by this process through the store's
own client side."""

from __future__ import annotations

import ctypes
import mmap

from polling import until
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._segments import page_up
from store_child import check, fill


class Objects:
    """This process as a client: self-checking objects put and read through a
    ``StoreHandle`` (the store's own client side). ``aligned``: its buffers
    page-aligned, as a pinned host pool is (on a disk, I/O past the page
    cache); else 8 bytes off (through it)."""

    def __init__(self, root: str, name: str, size: int, *, aligned: bool = False) -> None:
        self.handle = StoreHandle(name, root=root, capacity=1 << 20, spawn=False, timeout_s=5.0)
        self.size, self.aligned = size, aligned
        self._maps: list[mmap.mmap] = []

    def _buffers(self, n: int) -> list:
        if not self.aligned:
            return [(ctypes.c_char * self.size).from_buffer(ctypes.create_string_buffer(self.size + 8), 8)
                    for _ in range(n)]
        step = page_up(self.size)
        self._maps.append(mm := mmap.mmap(-1, n * step))
        return [(ctypes.c_char * self.size).from_buffer(mm, i * step) for i in range(n)]

    def _call(self, fn, *args):
        """``fn(*args)``, again while the store cannot be reached (it is
        restarting: the first call after a crash fails, the next reconnects)."""
        def attempt():
            try:
                return [fn(*args)]
            except StoreUnreachable:
                return None
        return until(attempt, what=f"the store to answer {fn.__name__}")[0]

    def put(self, keys: list[str], version: int = 1) -> list[int]:
        bufs = self._buffers(len(keys))
        for key, buf in zip(keys, bufs):
            fill(buf, key, version)
        return self._call(self.handle.put_from, [(k, ctypes.addressof(b), self.size) for k, b in zip(keys, bufs)],
                          True)

    def read(self, keys: list[str]) -> tuple[list[int], list[str]]:
        """Per key its size or code, and what was wrong with the bytes of a hit."""
        out = self._buffers(len(keys))
        got = self._call(self.handle.get_into, [(k, ctypes.addressof(b), self.size) for k, b in zip(keys, out)])
        return got, [why for key, buf, n in zip(keys, out, got) if n == self.size
                     and (why := check(buf, key, self.size))]

    def close(self) -> None:
        self.handle.close()
        self._maps.clear()  # the buffers' maps close when nothing views them
