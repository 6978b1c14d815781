"""The shared state of one in-process local store: the "data server".

An :class:`EmbeddedServer` holds objects in host memory under one lock, with
a byte capacity and FIFO (or LRU) eviction, the way one SiMM cluster holds them for all
of its clients. Clients (``Store()``) are thin; several share one server by
name through the process-wide registry at the bottom of this module.

It speaks the data server's codes (``DS_KEY_NOT_FOUND``,
``DS_DATA_ALREADY_EXISTS``, ``DS_CACHE_POOL_ALLOC_FAILED``, and
``INVALID_ARGUMENT`` for a reader's buffer smaller than the object); the
client maps them exactly as the real client does on each path.

Consistency: a put copies the caller's bytes into a freshly allocated private
buffer outside the lock, then publishes it under the lock (replacing the
entry); published buffers are never written again. A reader takes a
reference under the lock and copies outside it. So a reader sees a whole old
value or a whole new one, never a torn or foreign one. Memory is bounded:
a put reserves its bytes (evicting least recently used objects as needed)
before allocating, so published plus in-flight bytes never exceed capacity.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import torch

from sglang_simm.embedded._copy import copy_many, human_bytes, wrap_memory  # noqa: F401 (wrap_memory re-exported)
from sglang_simm.embedded._index import STAT_NAMES, check_policy, count_warmups
from sglang_simm.embedded._limits import check_warmup_prefix
from sglang_simm.embedded.simm_rules import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    OUT_OF_MEMORY,
)

logger = logging.getLogger("sglang_simm.embedded")

# -- the server --------------------------------------------------------------


class EmbeddedServer:
    """Objects in host memory, a byte capacity, eviction, one lock.

    ``policy`` "fifo" (SiMM's data server: no access bit) evicts the oldest
    put first; "lru" also counts a get as use. ``exists`` never does.
    """

    def __init__(self, name: str, capacity_bytes: int, policy: str = "fifo") -> None:
        self.policy = check_policy(policy)
        self.name = name
        self._lock = threading.Lock()
        # key -> (private uint8 buffer, size); the next to evict first.
        self._objects: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()
        self._capacity = _check_capacity(capacity_bytes)
        self._used = 0  # bytes of published objects
        self._reserved = 0  # bytes of puts copying outside the lock
        # Buffers of removed objects, kept for puts of the same size: a fresh
        # large allocation is a fresh mmap whose every page faults on the
        # first copy, which halves put bandwidth. They count against the
        # capacity and are dropped before any object is evicted.
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        # Buffers that readers are copying from, by id: never recycled.
        self._reading: Counter[int] = Counter()
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._warmup_prefixes: tuple[str, ...] = ()

    # -- capacity ---------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def set_policy(self, policy: str) -> None:
        """Evict "fifo" (oldest put first) or "lru" (least recently used) from now on."""
        self.policy = check_policy(policy)

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the capacity now, evicting least recently used objects until
        the stored bytes fit."""
        capacity = _check_capacity(capacity_bytes)
        with self._lock:
            self._capacity = capacity
            self._free.clear()
            self._free_bytes = 0
            while self._objects and self._used + self._reserved > capacity:
                self._evict_one_locked()

    def add_warmup_prefix(self, prefix: str) -> None:
        """Count keys that start with ``prefix`` apart from now on, as well
        (``warmup_puts``, ``warmup_hits``); ValueError for an empty or
        too long prefix, or one too many."""
        with self._lock:
            check_warmup_prefix(prefix, self._warmup_prefixes)
            if prefix not in self._warmup_prefixes:
                self._warmup_prefixes += (prefix,)

    def _evict_one_locked(self) -> None:
        _, (buf, size) = self._objects.popitem(last=False)
        self._used -= size
        self._stats["evictions"] += 1
        self._retire_locked(buf, size)

    def _retire_locked(self, buf: torch.Tensor, size: int) -> None:
        """A removed object's buffer: kept for reuse unless a reader holds it."""
        if id(buf) in self._reading or size > self._capacity - self._used - self._reserved - self._free_bytes:
            return
        self._free.setdefault(size, []).append(buf)
        self._free_bytes += size

    def _drop_free_locked(self) -> None:
        size, bufs = next(iter(self._free.items()))
        bufs.pop()
        if not bufs:
            del self._free[size]
        self._free_bytes -= size

    def _reserve_locked(self, size: int) -> torch.Tensor | bool:
        """Room for a put of ``size`` bytes: a recycled buffer of that size,
        True (allocate one), or False (it cannot fit at all)."""
        if self._reserved + size > self._capacity:
            return False  # would not fit even with every object evicted
        reuse = self._free.get(size)
        if not reuse:
            while self._used + self._reserved + self._free_bytes + size > self._capacity:
                if self._free_bytes:
                    self._drop_free_locked()
                else:
                    self._evict_one_locked()
            reuse = self._free.get(size)
        self._reserved += size
        if reuse:
            buf = reuse.pop()
            if not reuse:
                del self._free[size]
            self._free_bytes -= size
            return buf
        return True

    # -- data path (server codes) -------------------------------------------

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        """Store ``(key, ptr, size)`` entries, copying from ``ptr``.

        Per entry: OK; ``DS_DATA_ALREADY_EXISTS`` when the key is there and
        ``overwrite`` is false; ``DS_CACHE_POOL_ALLOC_FAILED`` when the object
        cannot fit; ``OUT_OF_MEMORY`` when the host cannot allocate it.
        """
        results = [OK] * len(items)
        todo: list[int] = []
        recycled: list[torch.Tensor | None] = []
        objects = self._objects
        with self._lock:
            for i, (key, _, size) in enumerate(items):
                room = False if not overwrite and key in objects else self._reserve_locked(size)
                if room is False:
                    if not overwrite and key in objects:
                        results[i] = DS_DATA_ALREADY_EXISTS
                        self._stats["already_exists"] += 1
                    else:
                        results[i] = DS_CACHE_POOL_ALLOC_FAILED
                        self._stats["rejected"] += 1
                    continue
                todo.append(i)
                recycled.append(None if room is True else room)
        if not todo:
            return results

        # Private buffers nobody else can see (recycled, or new), then the copies.
        bufs: list[torch.Tensor | None] = []
        copies: list[tuple[int, int, int]] = []
        for i, buf in zip(todo, recycled):
            _, ptr, size = items[i]
            if buf is None:
                try:
                    buf = torch.empty(size, dtype=torch.uint8)
                except (MemoryError, RuntimeError):  # torch raises RuntimeError on ENOMEM
                    logger.warning("in-process local store %r: cannot allocate %s", self.name, human_bytes(size))
            if buf is not None:
                copies.append((buf.data_ptr(), ptr, size))
            bufs.append(buf)
        copy_many(copies)

        published: list[str] = []
        with self._lock:
            stats = self._stats
            for i, buf in zip(todo, bufs):
                key, _, size = items[i]
                self._reserved -= size
                if buf is None:
                    results[i] = OUT_OF_MEMORY
                    stats["out_of_memory"] += 1
                    continue
                old = objects.get(key)
                if old is not None:
                    if not overwrite:  # another put published it meanwhile
                        results[i] = DS_DATA_ALREADY_EXISTS
                        stats["already_exists"] += 1
                        continue
                    self._used -= old[1]
                    del objects[key]
                    self._retire_locked(*old)
                objects[key] = (buf, size)
                self._used += size
                stats["puts"] += 1
                stats["bytes_in"] += size
                published.append(key)
            stats["warmup_puts"] += count_warmups(published, self._warmup_prefixes)
        return results

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        """Copy objects into ``(key, ptr, capacity)`` buffers.

        Per entry: the object's size; ``DS_KEY_NOT_FOUND``; or
        ``INVALID_ARGUMENT`` when the buffer is smaller than the object.
        """
        results = [DS_KEY_NOT_FOUND] * len(items)
        found: list[tuple[int, torch.Tensor, int, int]] = []
        objects = self._objects
        lru = self.policy == "lru"
        with self._lock:
            stats = self._stats
            stats["gets"] += len(items)
            for i, (key, ptr, capacity) in enumerate(items):
                entry = objects.get(key)
                if entry is None:
                    stats["misses"] += 1
                    continue
                buf, size = entry
                if size > capacity:
                    results[i] = INVALID_ARGUMENT
                    continue
                if lru:
                    objects.move_to_end(key)
                stats["hits"] += 1
                stats["bytes_out"] += size
                found.append((i, buf, size, ptr))
                self._reading[id(buf)] += 1
            if found:
                stats["warmup_hits"] += count_warmups([items[i][0] for i, _, _, _ in found], self._warmup_prefixes)
        try:
            copy_many([(ptr, buf.data_ptr(), size) for _, buf, size, ptr in found])
            for i, _, size, _ in found:
                results[i] = size
        finally:
            if found:
                with self._lock:
                    self._reading.subtract(id(buf) for _, buf, _, _ in found)
                    self._reading += Counter()  # drop the zero counts
        return results

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """Per key, OK or ``DS_KEY_NOT_FOUND``; eviction order is left alone."""
        objects = self._objects
        with self._lock:
            return [OK if key in objects else DS_KEY_NOT_FOUND for key in keys]

    def delete(self, key: str) -> int:
        """OK, or ``DS_KEY_NOT_FOUND``."""
        with self._lock:
            entry = self._objects.pop(key, None)
            if entry is None:
                return DS_KEY_NOT_FOUND
            self._used -= entry[1]
            self._stats["deletes"] += 1
            self._retire_locked(*entry)
            return OK

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; how many."""
        with self._lock:
            doomed = [key for key in self._objects if key.startswith(prefix)]
            for key in doomed:
                entry = self._objects.pop(key)
                self._used -= entry[1]
                self._retire_locked(*entry)
            self._stats["deletes"] += len(doomed)
            return len(doomed)

    # -- inspection -----------------------------------------------------------

    def clear(self) -> None:
        """Drop every object (statistics are kept)."""
        with self._lock:
            self._objects.clear()
            self._used = 0
            self._free.clear()
            self._free_bytes = 0

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._objects)

    def stats(self) -> dict[str, int]:
        """Counters since creation, plus ``objects``, ``used_bytes``,
        ``capacity_bytes`` and ``injected_errors`` (0: a store injects
        nothing; a ``FaultyServer`` in front counts its own)."""
        with self._lock:
            out = dict(self._stats)
            out["objects"] = len(self._objects)
            out["used_bytes"] = self._used
            out["capacity_bytes"] = self._capacity
        out["injected_errors"] = 0
        return out

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def __repr__(self) -> str:
        return (
            f"<EmbeddedServer {self.name!r} used={human_bytes(self._used)}"
            f"/{human_bytes(self._capacity)} objects={len(self._objects)}>"
        )


def _check_capacity(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"capacity_bytes must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"capacity_bytes must be > 0, got {value!r}")
    return value


# -- registry -----------------------------------------------------------------

_SERVERS: dict[str, EmbeddedServer] = {}
_SERVERS_LOCK = threading.Lock()


def get_or_create(name: str, make: Callable[[str], EmbeddedServer]) -> EmbeddedServer:
    """The server called ``name``, made with ``make(name)`` on first use."""
    server = _SERVERS.get(name)
    if server is not None:
        return server
    with _SERVERS_LOCK:
        server = _SERVERS.get(name)
        if server is None:
            server = make(name)
            _SERVERS[name] = server
            logger.info(
                "in-process local store %r created, capacity %s", name, human_bytes(server.capacity_bytes)
            )
        return server


def reset_servers(*names: str) -> None:
    """Forget the named servers, or every server when no name is given.
    Clients already holding a forgotten server keep using it; a new
    ``Store()`` of that name gets a fresh, empty one."""
    with _SERVERS_LOCK:
        if not names:
            _SERVERS.clear()
        for name in names:
            _SERVERS.pop(name, None)


def server_names() -> list[str]:
    """Names of the servers in the registry, sorted."""
    with _SERVERS_LOCK:
        return sorted(_SERVERS)
