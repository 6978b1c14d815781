"""The host store's object index: keys, extents, capacity, eviction, leases.

Owned by the store process alone (``_daemon``), so it needs no lock; it is
pure bookkeeping, testable without processes. Clients copy the bytes
themselves, between their own memory and the shared arena, inside
*leases* this index grants:

* a put is two steps. ``begin_put`` reserves room (evicting as needed) and
  hands out offsets; the client copies into them; ``commit_put`` publishes
  the objects. Until then nobody can see them, so a writer killed in the
  middle of a batch leaves nothing torn behind: ``drop_owner`` (its
  connection closed) returns the reserved extents.
* a get pins the objects it hands out (``begin_get``); ``release`` unpins
  them after the client's copy. An object deleted, overwritten or evicted
  while pinned disappears from the index at once but keeps its extent until
  the last pin goes, so a reader never copies bytes that are being reused.
  A reader killed mid-get unpins through ``drop_owner``.

Capacity is in object bytes (what a put stores, as the in-process store and
SiMM count it); the arena is larger by some slack, for alignment and holes.
Eviction takes the oldest unpinned object: FIFO by default, as SiMM's data
server behaves (it has no access bit: ``src/data_server/kv_cache_evictor.cc``
at HEAD), or LRU, where a get makes an object young again.

Codes are the data server's (``DS_*``, ``INVALID_ARGUMENT`` for a reader's
buffer smaller than the object, ``OUT_OF_MEMORY`` when the arena's memory
cannot be committed); the client maps them as the real client does.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sglang_simm.embedded._allocator import ExtentAllocator, aligned
from sglang_simm.errors import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    OUT_OF_MEMORY,
)

EVICTION_POLICIES = ("fifo", "lru")


def check_policy(policy: object) -> str:
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    return policy  # type: ignore[return-value]


#: The counters of both servers (host store and in-process).
STAT_NAMES = (
    "puts",  # objects published
    "gets",  # get entries that reached the store
    "hits",  # get entries that found an object
    "misses",  # get entries for an absent key
    "evictions",  # objects dropped to make room
    "bytes_in",  # bytes published
    "bytes_out",  # bytes handed out to readers
    "already_exists",  # puts refused because the key was there (no overwrite)
    "rejected",  # puts refused for capacity
    "out_of_memory",  # puts refused because the arena's memory could not be committed
    "deletes",  # objects deleted
    "aborted",  # reserved objects never published (writer gone or aborted)
)


@dataclass(slots=True, eq=False)
class _Object:
    offset: int
    size: int
    pins: int = 0
    #: False once it left the index while pinned: freed at the last unpin
    live: bool = True


@dataclass(slots=True)
class _Lease:
    owner: int
    #: put: (entry index, key, object); get: the pinned objects
    items: list = field(default_factory=list)
    overwrite: bool = False
    is_put: bool = True


class StoreIndex:
    """Objects by key in one arena of ``arena_bytes``, ``capacity`` object
    bytes at most. ``commit(end)`` makes the arena's memory real up to at
    least byte ``end`` if it can, and returns the end of the memory now
    committed (less than ``end``: the host has no memory left for it)."""

    def __init__(
        self,
        *,
        capacity: int,
        arena_bytes: int,
        policy: str = "fifo",
        commit: Callable[[int], int] | None = None,
    ) -> None:
        self.set_policy(policy)
        self.alloc = ExtentAllocator(arena_bytes)
        self.capacity = self._check_capacity(capacity)
        self._commit = commit or (lambda end: end)
        self._committed = 0
        self.objects: OrderedDict[bytes, _Object] = OrderedDict()  # oldest first
        self.used = 0  # bytes of published objects
        self.reserved = 0  # bytes of puts between begin and commit
        self._leases: dict[int, _Lease] = {}
        self._by_owner: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        #: bytes the capacity was lowered to when the host ran out of memory
        self.memory_limited: int | None = None

    def _check_capacity(self, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"capacity_bytes must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {value!r}")
        if value > self.alloc.size:
            raise ValueError(
                f"capacity_bytes {value} is above the {self.alloc.size} bytes this store's shared "
                "memory can hold; stop the store and start it with the larger capacity"
            )
        return value

    # -- room ---------------------------------------------------------------

    def _unpublish(self, key: bytes) -> _Object:
        obj = self.objects.pop(key)
        self.used -= obj.size
        if obj.pins:
            obj.live = False
        else:
            self.alloc.free(obj.offset, obj.size)
        return obj

    def _evict_one(self) -> bool:
        for key, obj in self.objects.items():
            if not obj.pins:
                self._unpublish(key)
                self.stats["evictions"] += 1
                return True
        return False

    def _evict_bytes(self, nbytes: int) -> bool:
        """Evict the oldest unpinned objects until ``nbytes`` of them are
        gone (True) or none is left (False). Their extents are freed as merged
        runs: a batch evicted is usually a batch stored side by side."""
        objects = self.objects
        victims: list[tuple[bytes, _Object]] = []
        freed = 0
        for key, obj in objects.items():
            if freed >= nbytes:
                break
            if not obj.pins:
                victims.append((key, obj))
                freed += obj.size
        for key, _ in victims:
            del objects[key]
        self.used -= freed
        self.stats["evictions"] += len(victims)
        align = self.alloc.align
        run_start = run_end = -1
        for offset, size in sorted((obj.offset, aligned(obj.size, align)) for _, obj in victims):
            if offset != run_end:
                if run_end > run_start:
                    self.alloc.free(run_start, run_end - run_start)
                run_start = offset
            run_end = offset + size
        if run_end > run_start:
            self.alloc.free(run_start, run_end - run_start)
        return freed >= nbytes

    def _place(self, size: int) -> tuple[int, int]:
        """``(offset, OK)`` of room for ``size`` object bytes, evicting the
        oldest unpinned objects for it; else ``(-1, code)``."""
        while self.used + self.reserved + size > self.capacity:
            if not self._evict_one():
                return -1, DS_CACHE_POOL_ALLOC_FAILED
        while True:
            offset = self.alloc.alloc(size)
            if offset is not None:
                end = offset + aligned(size)
                if end <= self._committed:
                    return offset, OK
                self._committed = max(self._committed, self._commit(end))
                if end <= self._committed:
                    return offset, OK
                self.alloc.free(offset, size)
                self._memory_exhausted()
                return -1, OUT_OF_MEMORY
            if not self._evict_one():  # holes too small: make a bigger one
                return -1, DS_CACHE_POOL_ALLOC_FAILED

    def _memory_exhausted(self) -> None:
        """The host could not back more of the arena: from now on, store
        only what the memory committed so far holds (evicting within it),
        so later puts succeed instead of failing one by one."""
        self.alloc.truncate(self._committed)
        limit = max(min(self.capacity, self.alloc.size), 1)
        if limit < self.capacity:
            self.capacity = limit
            self.memory_limited = limit

    # -- puts -----------------------------------------------------------------

    def begin_put(
        self, owner: int, keys: Sequence[bytes], sizes: Sequence[int], overwrite: bool
    ) -> tuple[int, list[int], list[int]]:
        """Reserve room: ``(lease, codes, offsets)``; lease 0 when nothing was
        reserved. Entries with a code other than OK get offset -1."""
        n = len(keys)
        codes = [OK] * n
        offsets = [-1] * n
        stats = self.stats
        objects = self.objects
        todo = []
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if not overwrite and key in objects:
                codes[i] = DS_DATA_ALREADY_EXISTS
                stats["already_exists"] += 1
            elif size > self.capacity:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
                stats["rejected"] += 1
            else:
                todo.append(i)
        items = self._place_run(todo, keys, sizes, offsets)
        for i in todo[len(items):]:  # one at a time, each evicting what it needs
            offset, code = self._place(sizes[i])
            if code:
                codes[i] = code
                stats["out_of_memory" if code == OUT_OF_MEMORY else "rejected"] += 1
                continue
            self.reserved += sizes[i]
            offsets[i] = offset
            items.append((i, keys[i], _Object(offset, sizes[i])))
        if not items:
            return 0, codes, offsets
        return self._lease(_Lease(owner, items, overwrite, True)), codes, offsets

    def _place_run(self, todo: list[int], keys: Sequence[bytes], sizes: Sequence[int],
                   offsets: list[int]) -> list[tuple[int, bytes, _Object]]:
        """The common backup, placed in one step: a batch of objects of one
        size, with room for all of it. Places a leading part of ``todo``
        (possibly none); the rest goes through ``_place``."""
        if len(todo) < 2:
            return []
        size = sizes[todo[0]]
        if any(sizes[i] != size for i in todo):
            return []
        total = size * len(todo)
        excess = self.used + self.reserved + total - self.capacity
        if excess > 0 and not self._evict_bytes(excess):
            return []
        run = self.alloc.alloc_run(size, len(todo))
        while len(run) < len(todo) and self._evict_one():
            run += self.alloc.alloc_run(size, len(todo) - len(run))
        if run:
            end = max(run) + aligned(size)
            if end > self._committed:
                self._committed = max(self._committed, self._commit(end))
            if end > self._committed:  # out of memory: let _place sort it out
                for offset in run:
                    self.alloc.free(offset, size)
                return []
        self.reserved += size * len(run)
        items = []
        for i, offset in zip(todo, run):
            offsets[i] = offset
            items.append((i, keys[i], _Object(offset, size)))
        return items

    def commit_put(self, lease_id: int) -> list[tuple[int, int]]:
        """Publish a put lease: ``(entry index, code)`` for each reserved
        entry (OK, or DS_DATA_ALREADY_EXISTS when another put of the key,
        without overwrite, was published first)."""
        lease = self._end_lease(lease_id, is_put=True)
        out = []
        objects = self.objects
        published = published_bytes = 0
        for i, key, obj in lease.items:
            self.reserved -= obj.size
            if key in objects:
                if not lease.overwrite:
                    self.alloc.free(obj.offset, obj.size)
                    self.stats["already_exists"] += 1
                    out.append((i, DS_DATA_ALREADY_EXISTS))
                    continue
                self._unpublish(key)
            objects[key] = obj
            published += 1
            published_bytes += obj.size
            out.append((i, OK))
        self.used += published_bytes
        self.stats["puts"] += published
        self.stats["bytes_in"] += published_bytes
        return out

    # -- gets -----------------------------------------------------------------

    def begin_get(
        self, owner: int, keys: Sequence[bytes], capacities: Sequence[int]
    ) -> tuple[int, list[int], list[int]]:
        """Pin what is there: ``(lease, sizes or codes, offsets)``; lease 0
        when nothing was pinned. A reader's buffer smaller than the object
        is INVALID_ARGUMENT (the data server's check), an absent key
        DS_KEY_NOT_FOUND."""
        n = len(keys)
        results = [DS_KEY_NOT_FOUND] * n
        offsets = [-1] * n
        objects = self.objects
        stats = self.stats
        stats["gets"] += n
        pinned = []
        lru = self.policy == "lru"
        for i, (key, cap) in enumerate(zip(keys, capacities)):
            obj = objects.get(key)
            if obj is None:
                stats["misses"] += 1
                continue
            if obj.size > cap:
                results[i] = INVALID_ARGUMENT
                continue
            obj.pins += 1
            pinned.append(obj)
            results[i] = obj.size
            offsets[i] = obj.offset
            stats["hits"] += 1
            stats["bytes_out"] += obj.size
            if lru:
                objects.move_to_end(key)
        if not pinned:
            return 0, results, offsets
        return self._lease(_Lease(owner, pinned, False, False)), results, offsets

    def release(self, lease_id: int) -> None:
        """Unpin a get lease, or abort a put lease (its room is returned)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._end_lease(lease_id, is_put=lease.is_put)
            self._undo(lease)

    def _undo(self, lease: _Lease) -> None:
        if lease.is_put:
            for _, _, obj in lease.items:
                self.reserved -= obj.size
                self.alloc.free(obj.offset, obj.size)
            self.stats["aborted"] += len(lease.items)
            return
        for obj in lease.items:
            obj.pins -= 1
            if not obj.pins and not obj.live:
                self.alloc.free(obj.offset, obj.size)

    # -- leases -----------------------------------------------------------------

    def _lease(self, lease: _Lease) -> int:
        lease_id = next(self._ids)
        self._leases[lease_id] = lease
        self._by_owner.setdefault(lease.owner, set()).add(lease_id)
        return lease_id

    def _end_lease(self, lease_id: int, *, is_put: bool) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.is_put != is_put:
            raise KeyError(f"no open {'put' if is_put else 'get'} lease {lease_id}")
        del self._leases[lease_id]
        owned = self._by_owner[lease.owner]
        owned.discard(lease_id)
        if not owned:
            del self._by_owner[lease.owner]
        return lease

    def drop_owner(self, owner: int) -> int:
        """A client is gone: abort its puts and unpin its gets; how many
        leases it held."""
        lease_ids = self._by_owner.pop(owner, set())
        for lease_id in lease_ids:
            self._undo(self._leases.pop(lease_id))
        return len(lease_ids)

    def open_leases(self, owner: int | None = None) -> int:
        if owner is None:
            return len(self._leases)
        return len(self._by_owner.get(owner, ()))

    # -- the rest of the surface ----------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Per key OK or DS_KEY_NOT_FOUND; eviction order is left alone."""
        objects = self.objects
        return [OK if key in objects else DS_KEY_NOT_FOUND for key in keys]

    def delete(self, key: bytes) -> int:
        if key not in self.objects:
            return DS_KEY_NOT_FOUND
        self._unpublish(key)
        self.stats["deletes"] += 1
        return OK

    def delete_prefix(self, prefix: bytes) -> int:
        doomed = [key for key in self.objects if key.startswith(prefix)]
        for key in doomed:
            self._unpublish(key)
        self.stats["deletes"] += len(doomed)
        return len(doomed)

    def clear(self) -> int:
        """Drop every published object (leases stay valid); how many."""
        doomed = list(self.objects)
        for key in doomed:
            self._unpublish(key)
        return len(doomed)

    def set_policy(self, policy: str) -> None:
        self.policy = check_policy(policy)

    def set_capacity(self, capacity: int) -> None:
        """Change the capacity now, evicting the oldest objects until the
        stored bytes fit."""
        self.capacity = self._check_capacity(capacity)
        self.memory_limited = None
        while self.used + self.reserved > self.capacity and self._evict_one():
            pass

    def snapshot(self) -> dict[str, int]:
        out = dict(self.stats)
        out.update(
            objects=len(self.objects),
            used_bytes=self.used,
            reserved_bytes=self.reserved,
            capacity_bytes=self.capacity,
            arena_bytes=self.alloc.size,
            arena_free_bytes=self.alloc.free_bytes,
            arena_high_water=self.alloc.high_water(),
            pinned_objects=sum(len(lease.items) for lease in self._leases.values() if not lease.is_put),
            open_leases=len(self._leases),
            memory_limited=self.memory_limited or 0,
        )
        return out
