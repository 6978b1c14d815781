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
* a *room* is a put lease whose keys come later (``reserve_room``): the
  client copies a backup into some of its extents and publishes them with
  ``commit_room``, which needs no reply, so a small backup waits for no
  round trip. The rest of the room stays reserved for the next backups;
  each commit renews the lease.
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

Leases belong to the connection that took them: another connection's
COMMIT, ABORT or RELEASE is refused (``LeaseError``). A lease older than
the lease time limit expires (``expire``): a get lease's pins are dropped
and its word in the arena's lease table cleared, so the reader, which
checks that word after its copy, reports a miss instead of bytes that may
have been reused meanwhile; a put lease's room stops counting against the
capacity but its extents stay quarantined until its connection closes,
since its writer may still be copying into them.

Every object also lives in the crash-consistent table (``_table``), when
one is given, so the next store process of the name can take it over.

Codes are the data server's (``DS_*``, ``INVALID_ARGUMENT`` for a reader's
buffer smaller than the object or a key or size past SiMM's limits,
``OUT_OF_MEMORY`` when the arena's memory cannot be committed); the client
maps them as the real client does.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.embedded._allocator import ExtentAllocator, aligned
from sglang_simm.embedded._limits import StoreLimits, key_ok
from sglang_simm.embedded._table import SlotPool
from sglang_simm.errors import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    OUT_OF_MEMORY,
    SEND_RPC_FAILED,
    TARGET_UNAVAILABLE,
)
from sglang_simm.keys import warmup_keys

EVICTION_POLICIES = ("fifo", "lru")
#: All rooms together hold at most this fraction of the capacity (1 / it).
ROOMS_SHARE = 8


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
    "recovered",  # objects taken over from a store process that died
    "refused_key",  # entries with a key past 256 bytes
    "refused_size",  # entries with a negative size or one past SiMM's limit
    "refused_leases",  # batches refused because max_leases were open
    "refused_lease_owner",  # COMMIT/ABORT/RELEASE of another connection's lease
    "refused_lease_expired",  # leases that outlived the lease time limit
    "rooms_granted",  # rooms granted (put room a client holds for its next backups)
    "refused_room",  # room entries naming an extent not in the room, or a bad key
    # Of the puts and hits, those of warm-up keys (``keys.WARMUP_KEY_PREFIX``):
    # a backend's start-up round trip, so that pages counted from these
    # counters (puts minus these, over objects per page) leave it out.
    "warmup_puts",
    "warmup_hits",
)


class LeaseError(KeyError):
    """A COMMIT, ABORT or RELEASE the index refuses; ``code`` for the client."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why

    def __str__(self) -> str:
        return self.why


@dataclass(slots=True, eq=False)
class _Object:
    offset: int
    size: int
    slot: int = -1  # its entry in the table
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
    started: float = 0.0
    slot: int = 0  # its word in the lease table


class _NoTable:
    """The table's surface for an index kept in memory only (unit tests)."""

    def raise_high_water(self, end: int) -> None: ...
    def commit(self, *args: object) -> None: ...
    def free(self, *args: object) -> None: ...
    def clear(self) -> None: ...


class StoreIndex:
    """Objects by key in one arena of ``arena_bytes``, ``capacity`` object
    bytes at most. ``commit(end)`` makes the arena's memory real up to at
    least byte ``end`` if it can, and returns the end of the memory now
    committed (less than ``end``: the host has no memory left for it).

    ``data_start``: the first byte objects may use (the lease table lies
    before it); ``lease_words``: that table, one int64 per lease slot (a
    lease's id while it is open, else 0); ``table``: the crash-consistent
    index (``_table.IndexTable``)."""

    def __init__(
        self,
        *,
        capacity: int,
        arena_bytes: int,
        policy: str = "fifo",
        commit: Callable[[int], int] | None = None,
        limits: StoreLimits | None = None,
        data_start: int = 0,
        lease_words: Any = None,
        table: Any = None,
        clock: Callable[[], float] = time.monotonic,
        max_objects: int | None = None,
    ) -> None:
        self.set_policy(policy)
        self.alloc = ExtentAllocator(arena_bytes)
        if data_start:
            taken = self.alloc.alloc(data_start)
            assert taken == 0, "a fresh allocator hands out offset 0 first"
        self.data_start = data_start
        self.capacity = self._check_capacity(capacity)
        self.limits = limits or StoreLimits()
        #: the table's entries (a taken-over table keeps its own number)
        self.max_objects = max_objects if max_objects is not None else self.limits.objects_for(capacity)
        self._commit = commit or (lambda end: end)
        self._committed = 0
        self.objects: OrderedDict[bytes, _Object] = OrderedDict()  # oldest first
        self.used = 0  # bytes of published objects
        self.reserved = 0  # bytes of puts between begin and commit
        self._leases: dict[int, _Lease] = {}
        #: the put leases that are rooms: extents with no keys yet, published
        #: a few at a time (``commit_room``)
        self._rooms: set[int] = set()
        self._by_owner: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self._next_seq = 1  # publish order, kept in the table
        self._high_water = data_start  # recorded in the table: room is handed out below it only
        self._lease_words = lease_words if lease_words is not None else [0] * self.limits.max_leases
        self._lease_slots = array("q", range(self.limits.max_leases - 1, -1, -1))
        self._table = table if table is not None else _NoTable()
        self._slots = SlotPool(self.max_objects)
        #: expired put leases' extents, by owner: freed when it is gone
        self._quarantine: dict[int, list[_Object]] = {}
        self._clock = clock
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        #: bytes the capacity was lowered to when the host ran out of memory
        self.memory_limited: int | None = None

    def _check_capacity(self, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"capacity_bytes must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {value!r}")
        if value > self.alloc.size - self.data_start:
            raise ValueError(
                f"capacity_bytes {value} is above the {self.alloc.size - self.data_start} bytes this store's "
                "shared memory can hold; stop the store and start it with the larger capacity"
            )
        return value

    # -- taking over a dead store's objects -----------------------------------

    def restore(self, recovered: Any, quarantine_owner: int) -> int:
        """Publish what a dead store process's table held (``_table.Recovered``),
        oldest first, and hold the free space below its high-water mark
        (where its writers may still be copying) under ``quarantine_owner``
        (released with ``drop_owner``); how many objects."""
        align = self.alloc.align
        extents = sorted((o, aligned(max(s, 1), align)) for o, s in zip(recovered.offsets, recovered.sizes))
        clean, end = [], self.data_start
        for offset, length in extents:
            if offset < end:  # overlaps what is kept: the table is lying about it
                continue
            clean.append((offset, length))
            end = offset + length
        high = aligned(max(recovered.high_water, end), align)
        quarantined, at = [], self.data_start
        for offset, length in clean:
            if offset > at:
                quarantined.append(_Object(at, offset - at))
            at = offset + length
        if high > at:
            quarantined.append(_Object(at, min(high, self.alloc.size) - at))
        self.alloc.take_used(sorted(clean + [(q.offset, q.size) for q in quarantined]))
        keep = set(clean)
        taken_slots = set()
        for key, offset, size, slot in zip(recovered.keys, recovered.offsets, recovered.sizes, recovered.slots):
            extent = (offset, aligned(max(size, 1), align))
            if extent not in keep or self.used + size > self.capacity:
                if extent in keep:  # sound, but past the capacity: its room is free
                    keep.discard(extent)
                    self.alloc.free(offset, size)
                self._table.free([slot])
                continue
            keep.discard(extent)  # one object per extent, whatever the table says
            self.objects[key] = _Object(offset, size, slot)
            self.used += size
            taken_slots.add(slot)
        if quarantined:
            self._quarantine[quarantine_owner] = quarantined
        self._table.raise_high_water(high)
        self._high_water = high
        if taken_slots:
            self._slots = SlotPool(self.max_objects, taken_slots)
        if recovered.seqs:
            self._next_seq = max(recovered.seqs) + 1
        self._committed = self._commit(self.alloc.high_water())
        self.stats["recovered"] = len(self.objects)
        return len(self.objects)

    # -- room ---------------------------------------------------------------

    def _unpublish(self, key: bytes) -> _Object:
        obj = self.objects.pop(key)
        self.used -= obj.size
        self._release_slot(obj)
        if obj.pins:
            obj.live = False
        else:
            self.alloc.free(obj.offset, obj.size)
        return obj

    def _release_slot(self, obj: _Object) -> None:
        if obj.slot >= 0:
            self._table.free([obj.slot])
            self._slots.append(obj.slot)
            obj.slot = -1

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
        slots = [obj.slot for _, obj in victims if obj.slot >= 0]
        self._table.free(slots)
        self._slots.extend(slots)
        align = self.alloc.align
        run_start = run_end = -1
        for offset, size in sorted((obj.offset, aligned(max(obj.size, 1), align)) for _, obj in victims):
            if offset != run_end:
                if run_end > run_start:
                    self.alloc.free(run_start, run_end - run_start)
                run_start = offset
            run_end = offset + size
        if run_end > run_start:
            self.alloc.free(run_start, run_end - run_start)
        return freed >= nbytes

    def _make_slots(self, n: int) -> bool:
        """Table entries for ``n`` more objects, evicting the oldest for them
        (the object cap); False when pinned objects hold them all."""
        while len(self._slots) < n:
            if not self._evict_one():
                return False
        return True

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

    def memory_released(self, committed: int) -> None:
        """The arena gave back its memory past ``committed`` (no object
        lies there): commit it again before handing it out."""
        self._committed = min(self._committed, committed)

    def _memory_exhausted(self) -> None:
        """The host could not back more of the arena: from now on, store
        only what the memory committed so far holds (evicting within it),
        so later puts succeed instead of failing one by one."""
        self.alloc.truncate(self._committed)
        limit = max(min(self.capacity, self.alloc.size - self.data_start), 1)
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
        if (n and overwrite and max(map(len, keys)) <= MAX_KEY_BYTES
                and 0 <= min(sizes) and max(sizes) <= min(MAX_VALUE_BYTES, self.capacity)):
            todo = list(range(n))  # a backup: every entry passes, checked in bulk
        else:
            todo = self._admissible(keys, sizes, overwrite, codes)
        if not todo:
            return 0, codes, offsets
        if not self._lease_slots:
            for i in todo:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
            stats["refused_leases"] += 1
            return 0, codes, offsets
        if not self._make_slots(len(todo)):
            todo_ok = len(self._slots)
            for i in todo[todo_ok:]:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
                stats["rejected"] += 1
            todo = todo[:todo_ok]
        items, end = self._place_run(todo, keys, sizes, offsets)
        slots = self._slots
        for i in todo[len(items):]:  # one at a time, each evicting what it needs
            offset, code = self._place(sizes[i])
            if code:
                codes[i] = code
                stats["out_of_memory" if code == OUT_OF_MEMORY else "rejected"] += 1
                continue
            self.reserved += sizes[i]
            offsets[i] = offset
            items.append((i, keys[i], _Object(offset, sizes[i], slots.pop())))
            end = max(end, offset + sizes[i])
        if not items:
            return 0, codes, offsets
        if end > self._high_water:  # recorded before the room is handed out
            self._high_water = aligned(end, self.alloc.align)
            self._table.raise_high_water(self._high_water)
        return self._lease(_Lease(owner, items, overwrite, True)), codes, offsets

    def _admissible(self, keys: Sequence[bytes], sizes: Sequence[int], overwrite: bool,
                    codes: list[int]) -> list[int]:
        """The entries a put may place, checked one by one; the others' codes set."""
        stats = self.stats
        objects = self.objects
        todo = []
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if len(key) > MAX_KEY_BYTES or not 0 <= size <= MAX_VALUE_BYTES:  # _limits' rule, inlined: hot
                codes[i] = INVALID_ARGUMENT
                stats["refused_key" if not key_ok(key) else "refused_size"] += 1
            elif not overwrite and key in objects:
                codes[i] = DS_DATA_ALREADY_EXISTS
                stats["already_exists"] += 1
            elif size > self.capacity:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
                stats["rejected"] += 1
            else:
                todo.append(i)
        return todo

    def _place_run(self, todo: list[int], keys: Sequence[bytes], sizes: Sequence[int],
                   offsets: list[int]) -> tuple[list[tuple[int, bytes, _Object]], int]:
        """The common backup, placed in one step: a batch of objects of one
        size, with room for all of it. Places a leading part of ``todo``
        (possibly none; the rest goes through ``_place``), each with a table
        slot: ``(items, end of the last extent)``."""
        if len(todo) < 2:
            return [], 0
        size = sizes[todo[0]]
        if sizes.count(size) != len(sizes) and any(sizes[i] != size for i in todo):
            return [], 0
        total = size * len(todo)
        excess = self.used + self.reserved + total - self.capacity
        if excess > 0 and not self._evict_bytes(excess):
            return [], 0
        run = self.alloc.alloc_run(size, len(todo))
        while len(run) < len(todo) and self._evict_one():
            run += self.alloc.alloc_run(size, len(todo) - len(run))
        if not run:
            return [], 0
        end = max(run) + aligned(size)
        if end > self._committed:
            self._committed = max(self._committed, self._commit(end))
        if end > self._committed:  # out of memory: let _place sort it out
            for offset in run:
                self.alloc.free(offset, size)
            return [], 0
        self.reserved += size * len(run)
        taken = self._slots.take(len(run))  # as one pop() at a time would hand them out
        placed = todo[:len(run)]
        for i, offset in zip(placed, run):
            offsets[i] = offset
        return [(i, keys[i], _Object(offset, size, slot)) for i, offset, slot in zip(placed, run, taken)], end

    def commit_put(self, lease_id: int, owner: int | None = None) -> list[tuple[int, int]]:
        """Publish a put lease: ``(entry index, code)`` for each reserved
        entry (OK, or DS_DATA_ALREADY_EXISTS when another put of the key,
        without overwrite, was published first). ``owner``: the connection
        asking, refused (``LeaseError``) unless the lease is its own."""
        lease = self._leases.get(lease_id)
        if lease_id in self._rooms and (owner is None or lease.owner == owner):
            raise LeaseError(INVALID_ARGUMENT, f"lease {lease_id} is a room: its extents are published with "
                             "COMMIT_ROOM, naming a key for each")
        lease = self._end_lease(lease_id, is_put=True, owner=owner)
        return self._publish(lease.items, lease.overwrite)

    def _publish(self, items: list[tuple[int, bytes, _Object]], overwrite: bool) -> list[tuple[int, int]]:
        """Put reserved ``(entry index, key, object)`` items in the index and
        the table: ``(entry index, code)`` each."""
        objects = self.objects
        reserved = sum([obj.size for _, _, obj in items])
        self.reserved -= reserved
        keys = [key for _, key, _ in items]
        if objects.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            out = [(i, OK) for i, _, _ in items]  # a backup of new pages: all publish
            for _, key, obj in items:
                objects[key] = obj
            published, published_bytes = len(items), reserved
            warmups = warmup_keys(keys)
        else:
            out = self._publish_one_by_one(items, overwrite)
            won = [obj for (_, _, obj), (_, code) in zip(items, out) if code == OK]
            # (a key named twice: the later entry replaced the earlier, counted in and out as two puts)
            published, published_bytes = len(won), sum([obj.size for obj in won])
            warmups = warmup_keys([key for (_, key, _), (_, code) in zip(items, out) if code == OK])
            items = [(i, key, obj) for i, key, obj in items if objects.get(key) is obj]
            keys = [key for _, key, _ in items]
        self._table.commit([obj.slot for _, _, obj in items], keys,
                           [obj.offset for _, _, obj in items], [obj.size for _, _, obj in items], self._next_seq)
        self._next_seq += len(items)
        self.used += published_bytes
        self.stats["puts"] += published
        self.stats["bytes_in"] += published_bytes
        self.stats["warmup_puts"] += warmups
        return out

    # -- rooms ----------------------------------------------------------------

    def open_rooms(self, owner: int) -> int:
        return sum(1 for lease_id in self._by_owner.get(owner, ()) if lease_id in self._rooms)

    def room_bytes_held(self) -> int:
        """Bytes held in every room, not yet published."""
        return sum([obj.size for lease_id in self._rooms for _, _, obj in self._leases[lease_id].items])

    def reserve_room(self, owner: int, size: int, count: int) -> tuple[int, list[int]]:
        """Up to ``count`` extents of ``size`` bytes held for ``owner``'s
        later backups (``commit_room``), placed and evicted for as a put's
        are: ``(lease, offsets)``, lease 0 when none could be placed. The
        caller bounds one room (the daemon: ``room_bytes``); all rooms
        together hold at most ``1 / ROOMS_SHARE`` of the capacity, so that
        however many connections hold rooms, they never evict the cache
        for room nobody writes: past it, fewer extents or none (lease 0)."""
        share = self.capacity // ROOMS_SHARE - self.room_bytes_held()
        count = min(count, max(share, 0) // max(size, 1))
        if count < 1:
            return 0, []
        lease_id, codes, offsets = self.begin_put(owner, [b""] * count, [size] * count, True)
        if not lease_id:
            return 0, []
        self._rooms.add(lease_id)
        self.stats["rooms_granted"] += 1
        return lease_id, [offset for offset, code in zip(offsets, codes) if code == OK]

    def commit_room(self, lease_id: int, owner: int, keys: Sequence[bytes],
                    offsets: Sequence[int]) -> list[int]:
        """Publish the room's extents at ``offsets`` under ``keys`` (an
        overwriting put each): a code per entry. An offset that is not a free
        extent of this room, or a key past SiMM's limit, is refused
        (INVALID_ARGUMENT) and harms nothing else; a refused key's extent
        is given back. The room's lease is renewed; it ends once every
        extent is used."""
        if lease_id not in self._rooms:
            raise LeaseError(SEND_RPC_FAILED, f"no open room {lease_id} (expired, or never granted)")
        lease = self._leases[lease_id]
        if lease.owner != owner:
            self.stats["refused_lease_owner"] += 1
            raise LeaseError(INVALID_ARGUMENT, f"room {lease_id} belongs to another connection")
        spare = {item[2].offset: item for item in lease.items}
        codes = [INVALID_ARGUMENT] * len(keys)
        taken: list[tuple[int, bytes, _Object]] = []
        dropped: list[_Object] = []
        for i, (key, offset) in enumerate(zip(keys, offsets)):
            item = spare.pop(offset, None)
            if item is None:
                self.stats["refused_room"] += 1
            elif not key_ok(key):
                self.stats["refused_room"] += 1
                self.stats["refused_key"] += 1
                dropped.append(item[2])
            else:
                taken.append((i, key, item[2]))
        for obj in dropped:
            self.reserved -= obj.size
            self.alloc.free(obj.offset, obj.size)
            self._release_slot(obj)
        lease.items = list(spare.values())
        lease.started = self._clock()
        if not lease.items:
            self._end_lease(lease_id, is_put=True, owner=owner)
        for i, code in self._publish(taken, True):
            codes[i] = code
        return codes

    def _publish_one_by_one(self, items: list, overwrite: bool) -> list[tuple[int, int]]:
        """A put lease whose keys were published meanwhile, or that names one
        key twice: in order, an entry replaces the object of its key
        (overwrite) or loses to it."""
        objects = self.objects
        out = []
        for i, key, obj in items:
            if key in objects:
                if not overwrite:
                    self._release_slot(obj)
                    self.alloc.free(obj.offset, obj.size)
                    self.stats["already_exists"] += 1
                    out.append((i, DS_DATA_ALREADY_EXISTS))
                    continue
                self._unpublish(key)
            objects[key] = obj
            out.append((i, OK))
        return out

    # -- gets -----------------------------------------------------------------

    def begin_get(
        self, owner: int, keys: Sequence[bytes], capacities: Sequence[int]
    ) -> tuple[int, list[int], list[int]]:
        """Pin what is there: ``(lease, sizes or codes, offsets)``; lease 0
        when nothing was pinned. A reader's buffer smaller than the object
        is INVALID_ARGUMENT (the data server's check), an absent key
        DS_KEY_NOT_FOUND. The lease's slot in the lease table is
        ``lease_slot(lease)``."""
        n = len(keys)
        results = [DS_KEY_NOT_FOUND] * n
        offsets = [-1] * n
        objects = self.objects
        stats = self.stats
        stats["gets"] += n
        pinned = []
        lru = self.policy == "lru"
        full = not self._lease_slots
        for i, (key, cap) in enumerate(zip(keys, capacities)):
            obj = objects.get(key)
            if obj is None:
                if not key_ok(key):
                    results[i] = INVALID_ARGUMENT
                    stats["refused_key"] += 1
                stats["misses"] += 1
                continue
            if obj.size > cap:
                results[i] = INVALID_ARGUMENT
                continue
            if full:
                results[i] = TARGET_UNAVAILABLE
                continue
            obj.pins += 1
            pinned.append(obj)
            results[i] = obj.size
            offsets[i] = obj.offset
            stats["hits"] += 1
            stats["bytes_out"] += obj.size
            if lru:
                objects.move_to_end(key)
        if full and any(r == TARGET_UNAVAILABLE for r in results):
            stats["refused_leases"] += 1
        if pinned and warmup_keys(keys):
            stats["warmup_hits"] += warmup_keys([key for key, r in zip(keys, results) if r >= 0])
        if not pinned:
            return 0, results, offsets
        return self._lease(_Lease(owner, pinned, False, False)), results, offsets

    def lease_slot(self, lease_id: int) -> int:
        lease = self._leases.get(lease_id)
        return lease.slot if lease is not None else -1

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """Unpin a get lease, or abort a put lease (its room is returned).
        An unknown lease (expired, or released already) is ignored; another
        connection's is refused (``LeaseError``)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._end_lease(lease_id, is_put=lease.is_put, owner=owner)
            self._undo(lease)

    def _undo(self, lease: _Lease) -> None:
        if lease.is_put:
            slots = []
            for _, _, obj in lease.items:
                self.reserved -= obj.size
                self.alloc.free(obj.offset, obj.size)
                if obj.slot >= 0:
                    slots.append(obj.slot)
            self._table.free(slots)
            self._slots.extend(slots)
            self.stats["aborted"] += len(lease.items)
            return
        for obj in lease.items:
            obj.pins -= 1
            if not obj.pins and not obj.live:
                self.alloc.free(obj.offset, obj.size)

    # -- leases -----------------------------------------------------------------

    def _lease(self, lease: _Lease) -> int:
        lease_id = next(self._ids)
        lease.started = self._clock()
        lease.slot = self._lease_slots.pop()
        self._lease_words[lease.slot] = lease_id
        self._leases[lease_id] = lease
        self._by_owner.setdefault(lease.owner, set()).add(lease_id)
        return lease_id

    def _end_lease(self, lease_id: int, *, is_put: bool, owner: int | None = None) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.is_put != is_put:
            raise LeaseError(
                SEND_RPC_FAILED, f"no open {'put' if is_put else 'get'} lease {lease_id} (expired, or never granted)"
            )
        if owner is not None and lease.owner != owner:
            self.stats["refused_lease_owner"] += 1
            raise LeaseError(INVALID_ARGUMENT, f"lease {lease_id} belongs to another connection")
        del self._leases[lease_id]
        self._rooms.discard(lease_id)
        self._lease_words[lease.slot] = 0
        self._lease_slots.append(lease.slot)
        owned = self._by_owner[lease.owner]
        owned.discard(lease_id)
        if not owned:
            del self._by_owner[lease.owner]
        return lease

    def expire(self, max_age_s: float | None = None) -> int:
        """End the leases older than ``max_age_s`` (the lease time limit):
        unpin gets (their readers' check then fails), quarantine puts' room
        until their connection is gone. How many expired."""
        limit = self.limits.lease_timeout_s if max_age_s is None else max_age_s
        cutoff = self._clock() - limit
        old = [lid for lid, lease in self._leases.items() if lease.started <= cutoff]
        for lease_id in old:
            self._expire_lease(lease_id)
        self.stats["refused_lease_expired"] += len(old)
        return len(old)

    def _expire_lease(self, lease_id: int) -> None:
        lease = self._end_lease(lease_id, is_put=self._leases[lease_id].is_put)
        if lease.is_put:
            for _, _, obj in lease.items:
                self.reserved -= obj.size  # room no longer held against capacity
            self._quarantine.setdefault(lease.owner, []).extend(obj for _, _, obj in lease.items)
        else:
            self._undo(lease)

    def drop_owner(self, owner: int) -> int:
        """A client is gone: abort its puts, unpin its gets and free its
        quarantined room; how many leases it held."""
        lease_ids = self._by_owner.pop(owner, set())
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id)
            self._rooms.discard(lease_id)
            self._lease_words[lease.slot] = 0
            self._lease_slots.append(lease.slot)
            self._undo(lease)
        slots = []
        for obj in self._quarantine.pop(owner, ()):
            self.alloc.free(obj.offset, obj.size)
            if obj.slot >= 0:
                slots.append(obj.slot)
        self._table.free(slots)
        self._slots.extend(slots)
        return len(lease_ids)

    def open_leases(self, owner: int | None = None) -> int:
        if owner is None:
            return len(self._leases)
        return len(self._by_owner.get(owner, ()))

    @property
    def quarantined_bytes(self) -> int:
        return sum(obj.size for objs in self._quarantine.values() for obj in objs)

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
        stored bytes fit. Rooms end (sized for the old capacity, they
        could hold all of a smaller one): their extents are quarantined
        until their connections close, as an expired room's are, and
        their clients' next commits into them read as misses."""
        self.capacity = self._check_capacity(capacity)
        self.memory_limited = None
        for lease_id in list(self._rooms):
            self._expire_lease(lease_id)
        while self.used + self.reserved > self.capacity and self._evict_one():
            pass

    def snapshot(self) -> dict[str, int]:
        out = dict(self.stats)
        rooms = [self._leases[lease_id] for lease_id in self._rooms]
        room_bytes = self.room_bytes_held()
        out.update(
            objects=len(self.objects),
            max_objects=self.max_objects,
            used_bytes=self.used,
            reserved_bytes=self.reserved - room_bytes,
            rooms_open=len(rooms),
            room_extents=sum(len(lease.items) for lease in rooms),
            room_reserved_bytes=room_bytes,
            quarantined_bytes=self.quarantined_bytes,
            capacity_bytes=self.capacity,
            arena_bytes=self.alloc.size,
            arena_free_bytes=self.alloc.free_bytes,
            arena_high_water=self.alloc.high_water(),
            pinned_objects=sum(len(lease.items) for lease in self._leases.values() if not lease.is_put),
            open_leases=len(self._leases) - len(rooms),
            memory_limited=self.memory_limited or 0,
        )
        return out
