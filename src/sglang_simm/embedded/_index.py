"""The local store's object index: keys, extents, capacity, eviction, leases.

The one index of both local stores: the store process (``_daemon``) owns
one, from its single thread; the in-process store (``_server``) one, under
its lock, over an arena in its own memory (``_private_arena``). So
capacity, reservation, eviction, publication and the counters follow one
set of rules wherever the store lives. It needs no lock of its own and is
pure bookkeeping, testable without processes. Clients copy the bytes
themselves, between their own memory and the arena, inside *leases* this
index grants:

* a put is two steps. ``begin_put`` reserves room (evicting as needed) and
  hands out offsets; the client copies into them; ``commit_put`` publishes
  the objects. Until then nobody can see them, so a writer killed in the
  middle of a batch leaves nothing torn behind: once its process is gone
  (``reap``) the reserved extents come back.
* a get pins the objects it hands out (``begin_get``); ``release`` unpins
  them after the client's copy. An object deleted, overwritten or evicted
  while pinned disappears from the index at once but keeps its extent until
  the last pin goes, so a reader never copies bytes that are being reused.

Capacity is in object bytes (what a put stores, as the in-process local store and
SiMM count it); the arena is larger by some slack, for alignment and holes.
Eviction takes the oldest unpinned object: FIFO by default, as SiMM's data
server behaves (it has no access bit: ``src/data_server/kv_cache_evictor.cc``
at HEAD), or LRU, where a get makes an object young again.

Leases follow one rule (docs/local-store.md, at the top): memory granted
to a client, for a put or a read, is never granted to anyone else until
that client has said it is done with it or its process is gone. Not on a
timer, not when its connection closes, not across a store crash:

* a lease belongs to its *owner*, the connection that took it; another
  connection's COMMIT, ABORT or RELEASE is refused (``LeaseError``);
* a connection that closes (``disconnect``), whoever closed it, leaves its
  leases to its *process* (pid and start time, so a reused pid is another
  process): they stay held until that process says it is done with them
  (``fence``, naming the connection) or is gone (``reap``);
* every grant is written to the lease table in the arena before its reply
  is sent (lease id, pid, start time, connection, the span it covers), so
  the next store process keeps the spans of owners still alive out of use
  (``restore``'s holds) until they fence or die. Lease ids carry the store
  process's epoch in their high bits: a reader's after-copy check never
  passes on a later process's lease;
* one connection holds at most ``max_leases_per_connection`` leases, and
  put room past its largest batch only within ``capacity / HELD_SHARE``,
  so a stopped or misbehaving client holds a bounded share (the in-process
  store, one trusted owner, has no share: ``held_share=None``).

Every object also lives in the crash-consistent table (``_table``), when
one is given, so the next store process of the name can take it over.

Codes are the data server's (``DS_*``, ``INVALID_ARGUMENT`` for a reader's
buffer smaller than the object or a key or size past SiMM's limits,
``OUT_OF_MEMORY`` when the arena's memory cannot be committed); the client
maps them as the real client does.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.embedded._allocator import ExtentAllocator, aligned
from sglang_simm.embedded._arena import LEASE_WORDS
from sglang_simm.embedded._limits import StoreLimits, check_warmup_prefix, key_ok
from sglang_simm.embedded._table import SlotPool
from sglang_simm.embedded.simm_rules import (
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

EVICTION_POLICIES = ("fifo", "lru")
#: While a connection holds put room, more is granted to it only within
#: this fraction of the capacity (1 / it); a put of its own is always
#: granted when it holds none (its largest batch).
HELD_SHARE = 4
#: Lease ids are ``epoch << EPOCH_SHIFT | sequence``: unique across store
#: processes of one arena (the epoch is kept in the lease table).
EPOCH_SHIFT = 40


def check_capacity(value: object) -> int:
    """``value`` as a capacity: TypeError unless an int, ValueError unless > 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"capacity_bytes must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"capacity_bytes must be > 0, got {value!r}")
    return value


def check_policy(policy: object) -> str:
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    return policy  # type: ignore[return-value]


#: The counters of both servers (the local store's process and the in-process local store).
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
    "refused_leases",  # batches refused: max_leases open, or the connection's share held
    "refused_lease_owner",  # COMMIT/ABORT/RELEASE/FENCE of another connection's or process's lease
    "fenced",  # leases of closed connections ended by their process's fence
    "reaped",  # leases of closed connections ended because their process was gone
    "held_at_takeover",  # grants of a dead store process whose owners lived: kept out of use
    # Of the puts and hits, those of warm-up keys (``count_warmups``: keys
    # that start with a prefix a client declared, ``add_warmup_prefix``):
    # a client's start-up round trip, so that pages counted from these
    # counters (puts minus these, over objects per page) leave it out.
    "warmup_puts",
    "warmup_hits",
)


def count_warmups(keys: Sequence[str] | Sequence[bytes], prefixes: tuple) -> int:
    """How many of ``keys`` (all ``str`` or all ``bytes``, as ``prefixes``)
    are warm-up keys: keys that start with one of ``prefixes``, the warm-up
    key prefixes clients declared (none: nothing is counted apart). A batch
    of pages has none: one scan of the joined keys in C says so, where a
    test per key would cost a publish a tenth of its time; only a batch
    that may hold one is counted key by key."""
    if not keys or not prefixes:
        return 0
    joined = prefixes[0][:0].join(keys)  # type: ignore[arg-type]
    if not any(prefix in joined for prefix in prefixes):
        return 0
    return sum(1 for key in keys if key.startswith(prefixes))  # type: ignore[arg-type]


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
    owner: Hashable
    #: put: (entry index, key, object); a takeover's hold: (-1, b"", free extent)
    items: list = field(default_factory=list)
    overwrite: bool = False
    is_put: bool = True
    slot: int = 0  # its record in the lease table
    #: get and hold: the pinned objects
    pinned: list = field(default_factory=list)
    held_bytes: int = 0  # put room counted against its owner's share


@dataclass(slots=True)
class _Holder:
    """Who holds leases: a connection, or once it closed, its process."""

    pid: int
    start: int  # the process's start time (``/proc/PID/stat``): a reused pid is another process
    leases: set = field(default_factory=set)
    connected: bool = True
    #: its process said it is done with this connection's leases while the
    #: store still saw it open: they end when it closes
    fenced: bool = False
    put_bytes: int = 0


def lease_records(words: Any, slots: int) -> tuple[int, list[tuple[int, ...]]]:
    """The epoch and the open grants ``(slot, lease id, pid, start, conn,
    lo, hi)`` a lease table holds (a dead store process's, at takeover)."""
    epoch = int(words[0])
    out = []
    for slot in range(1, slots):
        at = slot * LEASE_WORDS
        lease_id = int(words[at])
        if lease_id > 0:
            out.append((slot, lease_id, *(int(w) for w in words[at + 1:at + LEASE_WORDS])))
    return epoch, out


class _NoTable:
    """The table's surface for an index kept in memory only (unit tests)."""

    def commit(self, *args: object) -> None: ...
    def free(self, *args: object) -> None: ...
    def clear(self) -> None: ...


class StoreIndex:
    """Objects by key in one arena of ``arena_bytes``, ``capacity`` object
    bytes at most. ``commit(end)`` makes the arena's memory real up to at
    least byte ``end`` if it can, and returns the end of the memory now
    committed (less than ``end``: the host has no memory left for it).

    ``data_start``: the first byte objects may use (the lease table lies
    before it); ``lease_words``: that table, ``LEASE_WORDS`` int64 words per
    lease slot (``lease_records``), zeroed but for the holds ``restore``
    keeps; ``epoch``: this store process's number (lease ids carry it);
    ``table``: the crash-consistent index (``_table.IndexTable``);
    ``held_share``: an owner holding put room is granted more only within
    ``capacity / held_share`` (None: up to the capacity, for a store with
    one trusted owner)."""

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
        max_objects: int | None = None,
        epoch: int = 1,
        held_share: int | None = HELD_SHARE,
    ) -> None:
        self.set_policy(policy)
        self.held_share = held_share
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
        self._holders: dict[Hashable, _Holder] = {}
        if not 0 < epoch < 1 << (63 - EPOCH_SHIFT):
            raise ValueError(f"epoch {epoch} out of range")
        self.epoch = epoch
        self._ids = itertools.count((epoch << EPOCH_SHIFT) + 1)
        self._next_seq = 1  # publish order, kept in the table
        slots = self.limits.max_leases + 1  # slot 0: the header
        self._lease_words = lease_words if lease_words is not None else [0] * (slots * LEASE_WORDS)
        self._lease_words[0] = epoch
        self._lease_slots = array("q", range(slots - 1, 0, -1))
        self._table = table if table is not None else _NoTable()
        self._slots = SlotPool(self.max_objects)
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        #: the warm-up key prefixes clients declared (``add_warmup_prefix``)
        self.warmup_prefixes: tuple[bytes, ...] = ()
        #: bytes the capacity was lowered to when the host ran out of memory
        self.memory_limited: int | None = None

    def add_warmup_prefix(self, prefix: bytes) -> None:
        """Count keys that start with ``prefix`` apart from now on, as well
        (``warmup_puts``, ``warmup_hits``); ValueError past the bounds
        (``check_warmup_prefix``). A prefix held already changes nothing."""
        check_warmup_prefix(prefix, self.warmup_prefixes)
        if prefix not in self.warmup_prefixes:
            self.warmup_prefixes += (prefix,)

    def _check_capacity(self, value: object) -> int:
        value = check_capacity(value)
        if value > self.alloc.size - self.data_start:
            raise ValueError(
                f"capacity_bytes {value} is above the {self.alloc.size - self.data_start} bytes this store's "
                "arena can hold; start a new store with the larger capacity"
            )
        return value

    # -- taking over a dead store's objects -----------------------------------

    def restore(self, recovered: Any, holds: Sequence[tuple[int, ...]] = ()) -> int:
        """Publish what a dead store process's table held (``_table.Recovered``),
        oldest first; how many objects. ``holds``: its grants whose owners
        still live (``lease_records``, their records still in the lease
        table): each keeps its slot, its id and its span, whose free bytes
        stay out of use and whose objects stay pinned, until its owner
        fences (naming the dead process's epoch) or is gone."""
        align = self.alloc.align
        extents = sorted((o, aligned(max(s, 1), align)) for o, s in zip(recovered.offsets, recovered.sizes))
        clean, end = [], self.data_start
        for offset, length in extents:
            if offset < end:  # overlaps what is kept: the table is lying about it
                continue
            clean.append((offset, length))
            end = offset + length
        self.alloc.take_used(clean)
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
        if taken_slots:
            self._slots = SlotPool(self.max_objects, taken_slots)
        if recovered.seqs:
            self._next_seq = max(recovered.seqs) + 1
        self._hold(holds)
        self._committed = self._commit(self.alloc.high_water())
        self.stats["recovered"] = len(self.objects)
        return len(self.objects)

    def _hold(self, holds: Sequence[tuple[int, ...]]) -> None:
        """Keep the spans of a dead store process's live grants out of use."""
        if not holds:
            return
        by_offset = sorted(((obj.offset, obj) for obj in self.objects.values()), key=lambda t: t[0])
        starts = [o for o, _ in by_offset]
        taken_slots = set()
        for slot, lease_id, pid, start, conn, lo, hi in holds:
            lo, hi = max(lo, self.data_start), min(hi, self.alloc.size)
            gaps = [(max(a, lo), min(b, hi)) for a, b in self.alloc.free_extents() if a < hi and b > lo]
            self.alloc.take_used([(a, b - a) for a, b in gaps])
            items = [(-1, b"", _Object(a, b - a)) for a, b in gaps]
            pinned = []
            for _, obj in by_offset[max(bisect.bisect_right(starts, lo) - 1, 0):bisect.bisect_left(starts, hi)]:
                if obj.offset < hi and obj.offset + aligned(max(obj.size, 1)) > lo:
                    obj.pins += 1
                    pinned.append(obj)
            owner = (lease_id >> EPOCH_SHIFT, conn)
            holder = self._holders.get(owner)
            if holder is None:
                holder = self._holders[owner] = _Holder(pid, start, connected=False)
            lease = _Lease(owner, items, is_put=False, slot=slot, pinned=pinned)
            self._leases[lease_id] = lease
            holder.leases.add(lease_id)
            taken_slots.add(slot)
            self.stats["held_at_takeover"] += 1
        self._lease_slots = array("q", (s for s in self._lease_slots if s not in taken_slots))

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
        if not self._may_lease(owner, sum([sizes[i] for i in todo])):
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
        lease = _Lease(owner, items, overwrite, True, held_bytes=sum([obj.size for _, _, obj in items]))
        return self._lease(lease), codes, offsets

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
            warmups = count_warmups(keys, self.warmup_prefixes)
        else:
            out = self._publish_one_by_one(items, overwrite)
            won = [obj for (_, _, obj), (_, code) in zip(items, out) if code == OK]
            # (a key named twice: the later entry replaced the earlier, counted in and out as two puts)
            published, published_bytes = len(won), sum([obj.size for obj in won])
            warmups = count_warmups([key for (_, key, _), (_, code) in zip(items, out) if code == OK],
                                    self.warmup_prefixes)
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
        full = not self._may_lease(owner, 0)
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
        if pinned and count_warmups(keys, self.warmup_prefixes):
            stats["warmup_hits"] += count_warmups([key for key, r in zip(keys, results) if r >= 0],
                                                  self.warmup_prefixes)
        if not pinned:
            return 0, results, offsets
        return self._lease(_Lease(owner, is_put=False, pinned=pinned)), results, offsets

    def lease_slot(self, lease_id: int) -> int:
        lease = self._leases.get(lease_id)
        return lease.slot if lease is not None else -1

    def release(self, lease_id: int, owner: Hashable | None = None) -> None:
        """Unpin a get lease, or abort a put lease (its room is returned).
        An unknown lease (released already) is ignored; another
        connection's is refused (``LeaseError``)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._end_lease(lease_id, is_put=lease.is_put, owner=owner)
            self._undo(lease)

    def _undo(self, lease: _Lease) -> None:
        slots = []
        for _, _, obj in lease.items:
            if lease.is_put:
                self.reserved -= obj.size
                self.stats["aborted"] += 1
            self.alloc.free(obj.offset, obj.size)
            if obj.slot >= 0:
                slots.append(obj.slot)
        if slots:
            self._table.free(slots)
            self._slots.extend(slots)
        for obj in lease.pinned:
            obj.pins -= 1
            if not obj.pins and not obj.live:
                self.alloc.free(obj.offset, obj.size)

    # -- leases: owners, fences, takeover -------------------------------------------

    def connect(self, owner: Hashable, pid: int, start: int) -> None:
        """A connection of process ``pid`` (started at ``start``) is open."""
        self._holders[owner] = _Holder(pid, start)

    def _holder(self, owner: Hashable) -> _Holder:
        holder = self._holders.get(owner)
        if holder is None:  # an owner never connected (unit tests): a process of its own
            holder = self._holders[owner] = _Holder(0, 0)
        return holder

    def _may_lease(self, owner: Hashable, put_bytes: int) -> bool:
        """Whether ``owner`` may open one more lease holding ``put_bytes`` of
        put room: a free slot, under its own count, and within its share
        (any put when it holds no put room: its largest batch)."""
        if not self._lease_slots:
            return False
        holder = self._holder(owner)
        if len(holder.leases) >= self.limits.max_leases_per_connection:
            return False
        if not put_bytes or not holder.put_bytes or self.held_share is None:
            return True
        return holder.put_bytes + put_bytes <= self.capacity // self.held_share

    def _lease(self, lease: _Lease) -> int:
        """Open ``lease``: its record goes into the lease table (id last)
        before the caller answers with its offsets."""
        lease_id = next(self._ids)
        lease.slot = slot = self._lease_slots.pop()
        holder = self._holder(lease.owner)
        spans = [(obj.offset, obj.offset + aligned(max(obj.size, 1))) for _, _, obj in lease.items]
        spans += [(obj.offset, obj.offset + aligned(max(obj.size, 1))) for obj in lease.pinned]
        at = slot * LEASE_WORDS
        words = self._lease_words
        words[at + 1] = holder.pid
        words[at + 2] = holder.start
        words[at + 3] = lease.owner if isinstance(lease.owner, int) else -1
        words[at + 4] = min([a for a, _ in spans])
        words[at + 5] = max([b for _, b in spans])
        words[at] = lease_id
        self._leases[lease_id] = lease
        holder.leases.add(lease_id)
        holder.put_bytes += lease.held_bytes
        return lease_id

    def _end_lease(self, lease_id: int, *, is_put: bool, owner: Hashable | None = None) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.is_put != is_put:
            raise LeaseError(
                SEND_RPC_FAILED, f"no open {'put' if is_put else 'get'} lease {lease_id} (ended, or never granted)"
            )
        if owner is not None and lease.owner != owner:
            self.stats["refused_lease_owner"] += 1
            raise LeaseError(INVALID_ARGUMENT, f"lease {lease_id} belongs to another connection")
        self._forget(lease_id, lease)
        return lease

    def _forget(self, lease_id: int, lease: _Lease) -> None:
        del self._leases[lease_id]
        self._lease_words[lease.slot * LEASE_WORDS] = 0
        self._lease_slots.append(lease.slot)
        holder = self._holders.get(lease.owner)
        if holder is not None:
            holder.leases.discard(lease_id)
            holder.put_bytes -= lease.held_bytes
            if not holder.connected and not holder.leases:
                del self._holders[lease.owner]

    def drop_owner(self, owner: Hashable) -> int:
        """End every lease of ``owner`` (its process is done with them, or
        gone): abort its puts, unpin its gets; how many it held."""
        holder = self._holders.pop(owner, None)
        if holder is None:
            return 0
        lease_ids = list(holder.leases)
        holder.connected = False
        for lease_id in lease_ids:
            lease = self._leases[lease_id]
            self._forget(lease_id, lease)
            self._undo(lease)
        return len(lease_ids)

    def disconnect(self, owner: Hashable) -> int:
        """``owner``'s connection closed, whoever closed it: its leases stay
        held by its process (a thread of it may still be copying) unless it
        fenced them already; how many are left held."""
        holder = self._holders.get(owner)
        if holder is None:
            return 0
        if holder.fenced or not holder.leases:
            self.drop_owner(owner)
            return 0
        holder.connected = False
        return len(holder.leases)

    def fence(self, owner: Hashable, pid: int, *, own: bool = False) -> int:
        """Process ``pid`` says it is done with every lease of connection
        ``owner`` (``own``: the connection asking): they end, now if it is
        closed or asking, else when it closes. How many ended; a fence of
        another process's connection is refused (``LeaseError``)."""
        holder = self._holders.get(owner)
        if holder is None:
            return 0
        if holder.pid != pid:
            self.stats["refused_lease_owner"] += 1
            raise LeaseError(INVALID_ARGUMENT, f"connection {owner} is another process's")
        if holder.connected and not own:
            holder.fenced = True
            return 0
        ended = self.drop_owner(owner)
        if own:
            self._holders[owner] = _Holder(holder.pid, holder.start)
        self.stats["fenced"] += ended
        return ended

    def reap(self, alive: Callable[[int, int], bool]) -> int:
        """End the leases of closed connections whose process is gone
        (``alive(pid, start)`` false); how many."""
        gone = [owner for owner, h in self._holders.items() if not h.connected and not alive(h.pid, h.start)]
        ended = sum(self.drop_owner(owner) for owner in gone)
        self.stats["reaped"] += ended
        return ended

    def held_by_closed(self) -> tuple[int, int, list[int]]:
        """Leases of closed connections: how many, the bytes they keep out of
        use (put room and held spans), and their pids."""
        leases, nbytes, pids = 0, 0, set()
        for h in self._holders.values():
            if not h.connected and h.leases:
                pids.add(h.pid)
                leases += len(h.leases)
                nbytes += sum(obj.size for lid in h.leases for _, _, obj in self._leases[lid].items)
        return leases, nbytes, sorted(pids)

    def open_leases(self, owner: Hashable | None = None) -> int:
        if owner is None:
            return len(self._leases)
        holder = self._holders.get(owner)
        return len(holder.leases) if holder is not None else 0

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
        stored bytes fit (leases stay: their holders may be copying)."""
        self.capacity = self._check_capacity(capacity)
        self.memory_limited = None
        while self.used + self.reserved > self.capacity and self._evict_one():
            pass

    def snapshot(self) -> dict[str, int]:
        out = dict(self.stats)
        closed_leases, closed_bytes, closed_pids = self.held_by_closed()
        out.update(
            objects=len(self.objects),
            max_objects=self.max_objects,
            used_bytes=self.used,
            reserved_bytes=self.reserved,
            capacity_bytes=self.capacity,
            arena_bytes=self.alloc.size,
            arena_free_bytes=self.alloc.free_bytes,
            arena_high_water=self.alloc.high_water(),
            pinned_objects=sum(len(lease.pinned) for lease in self._leases.values()),
            open_leases=len(self._leases),
            # held for processes whose connection closed, until they fence or are gone
            closed_leases=closed_leases,
            closed_held_bytes=closed_bytes,
            closed_pids=closed_pids,
            epoch=self.epoch,
            memory_limited=self.memory_limited or 0,
        )
        return out
