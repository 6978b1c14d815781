"""The store's objects and grants: keys, room, eviction, capacity. Pure
bookkeeping, driven by the store process's one thread; no object byte.

A put is two steps: ``begin_put`` grants room in the own segment
(``segs[0]``), evicting as needed, the client copies, ``commit_put``
publishes; nothing is visible before, and a failed put leaves the key's
value alone. A get pins what it hands out (``begin_get``) until
``release``; an object that leaves the index while pinned keeps its bytes
until its last pin goes. When a grant ends, and when the earlier segments'
memory may be reused (``release_earlier``): docs/local-store-design.md.
Keys live in the table (``_table``), found through a hash table of 64-bit
hashes (``_Keys``): no Python object per key.
"""

from __future__ import annotations

import itertools
import secrets
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_simm.local_store._allocator import ALIGN, ExtentAllocator, aligned
from sglang_simm.local_store._limits import EVICTION_POLICIES, StoreLimits, check_policy  # noqa: F401 (EVICTION_POLICIES re-exported)
from sglang_simm.local_store._table import SlotPool
from sglang_simm.simm_rules import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    OK,
    OUT_OF_MEMORY,
    TARGET_UNAVAILABLE,
)

#: The store's counters.
STAT_NAMES = (
    "puts",  # objects published
    "gets",  # get entries that reached the store
    "hits",  # get entries that found their object
    "misses",  # get entries for an absent key
    "evictions",  # objects dropped to make room
    "bytes_in",  # bytes published
    "bytes_out",  # bytes handed out to readers
    "already_exists",  # puts refused because the key was there (no overwrite)
    "rejected",  # puts refused for capacity
    "out_of_memory",  # puts refused because the host could back no more
    "deletes",  # objects deleted one by one (DELETE)
    "prefix_deletes",  # objects deleted by prefix (DELETE_PREFIX)
    "aborted",  # granted objects never published (aborted, or the writer gone)
    "recovered",  # objects found in earlier segments at start
    "checksum_failures",  # recovered objects whose bytes did not match: dropped, read as misses
    "refused_key",  # entries with a key past 256 bytes
    "refused_size",  # entries with a negative size or one past SiMM's limit
    "refused_grants",  # entries past a connection's grant count or its process's share
)


def check_capacity(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"capacity_bytes must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"capacity_bytes must be > 0, got {value!r}")
    return value


class GrantError(KeyError):
    """A COMMIT, ABORT or RELEASE of a grant the connection does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Keys:
    """key -> slot: open addressing over 64-bit hashes (``hash`` of the key),
    each hit checked against the key the table holds, so two keys of one
    hash are two entries. Batches are handled by numpy, not key by key;
    about 20 bytes an object at the fullest."""

    EMPTY, TOMB = 0, -1

    def __init__(self, key_column: Any, cap: int = 1 << 12) -> None:
        self.key_column = key_column  # slot -> key bytes (the table's)
        self.h = np.zeros(cap, np.int64)
        self.s = np.zeros(cap, np.int32)
        self.cell = np.zeros(0, np.int64)  # slot -> its cell
        self.n = self.tombs = 0

    @staticmethod
    def hashes(keys: Sequence[bytes]) -> np.ndarray:
        hs = np.fromiter(map(hash, keys), np.int64, len(keys))
        hs[hs == 0] = 1  # hash() is never -1 (the tombstone); 0 is the empty cell
        return hs

    def find(self, keys: Sequence[bytes]) -> np.ndarray:
        """Per key its slot, or -1."""
        n = len(keys)
        out = np.full(n, -1, np.int64)
        if not n or not self.n:
            return out
        hs, mask = self.hashes(keys), len(self.h) - 1
        # a key past SiMM's length is never stored (and would be cut to 256 bytes below)
        pos, want = hs & mask, None
        todo = np.flatnonzero(np.fromiter(map(len, keys), np.int64, n) <= MAX_KEY_BYTES)
        while len(todo):
            cell = self.h[pos[todo]]
            match = np.flatnonzero(cell == hs[todo])
            done = cell == self.EMPTY
            if len(match):
                if want is None:
                    want = np.array(keys, dtype="S256")
                cand = todo[match]
                slots = self.s[pos[cand]]
                same = self.key_column[slots] == want[cand]
                out[cand[same]] = slots[same]
                done[match[same]] = True
            todo = todo[~done]
            pos[todo] = (pos[todo] + 1) & mask
        return out

    def add(self, keys: Sequence[bytes], slots: np.ndarray) -> None:
        """Map keys not held yet to ``slots``."""
        if (self.n + self.tombs + len(keys)) * 3 > len(self.h) * 2:
            self._rebuild(max(len(self.h), 1 << max(int(self.n + len(keys)).bit_length() + 1, 12)))
        if len(self.cell) <= slots.max(initial=0):
            self.cell = np.concatenate([self.cell, np.zeros(max(int(slots.max()) + 1, 2 * len(self.cell))
                                                            - len(self.cell), np.int64)])
        hs, mask = self.hashes(keys), len(self.h) - 1
        pos, todo = hs & mask, np.arange(len(keys))
        while len(todo):
            cell = self.h[pos[todo]]
            free = todo[(cell == self.EMPTY) | (cell == self.TOMB)]
            won = free[np.unique(pos[free], return_index=True)[1]]  # one key per free cell
            at = pos[won]
            self.tombs -= int(np.count_nonzero(self.h[at] == self.TOMB))
            self.h[at], self.s[at], self.cell[slots[won]] = hs[won], slots[won], at
            todo = np.setdiff1d(todo, won, assume_unique=True)
            pos[todo] = (pos[todo] + 1) & mask
        self.n += len(keys)

    def remove(self, slots: np.ndarray) -> None:
        """Forget the keys of ``slots`` (held)."""
        self.h[self.cell[slots]] = self.TOMB
        self.n -= len(slots)
        self.tombs += len(slots)

    def slots(self) -> np.ndarray:
        return self.s[(self.h != self.EMPTY) & (self.h != self.TOMB)].astype(np.int64)

    def _rebuild(self, cap: int) -> None:
        slots = self.slots()
        keys = [bytes(k) for k in self.key_column[slots]]
        self.h, self.s = np.zeros(cap, np.int64), np.zeros(cap, np.int32)
        self.n = self.tombs = 0
        if len(slots):
            self.add(keys, slots)


@dataclass(slots=True)
class _Seg:
    """A segment as the index sees it."""

    gen: int
    seg: Any  # the file (``_segments.Segment``): punch, close; None in tests
    own: bool = False
    released: bool = False
    live: int = 0  # objects of it in the index
    pinned: int = 0  # pins on its objects that left the index
    gone: bool = False  # deleted


@dataclass(slots=True)
class Grant:
    owner: Hashable  # the connection
    proc: Hashable  # its process: the share is counted per process
    put: bool
    #: put: (entry, key, slot, offset, size); get: (entry, slot)
    entries: list = field(default_factory=list)
    nbytes: int = 0
    overwrite: bool = False


class StoreIndex:
    """Objects of ``capacity`` bytes at most, in ``own`` (this process's
    segment: ``commit(end)``, ``give_back(extents)``, ``data_start``,
    ``size``, ``gen``) and ``earlier`` segments (``punch``, ``close``);
    kept in ``table`` (``_table.IndexTable``)."""

    def __init__(self, *, capacity: int, table: Any, own: Any, earlier: Sequence[Any] = (), policy: str = "fifo",
                 limits: StoreLimits | None = None, max_objects: int | None = None) -> None:
        self.policy = check_policy(policy)
        self.limits = limits or StoreLimits()
        self.table = table
        self.own = own
        self.alloc = ExtentAllocator(own.size, own.data_start)
        self.capacity = self._check_capacity(capacity)
        self.committed = own.data_start
        self.segs = [_Seg(int(own.gen, 16), own, own=True, released=True)]
        self.segs += [_Seg(int(s.gen, 16), s) for s in earlier]
        self._seg_of_gen = {s.gen: i for i, s in enumerate(self.segs)}
        self.max_objects = max_objects or table.slots
        self._slots = SlotPool(self.max_objects)
        self._keys = _Keys(table.key)
        self.stamp = array("q")  # slot -> eviction stamp; -1: not in the index
        self.segi = array("b")  # slot -> its segment
        self.verified = bytearray()  # slot -> its bytes were checked (or written) by this process
        self._pins: dict[int, int] = {}
        self._doomed: set[int] = set()  # left the index while pinned
        self._queue_slot, self._queue_stamp, self._head = array("q"), array("q"), 0
        self._stamps = itertools.count(1)
        self._next_seq = 1
        self.used = self.reserved = self.held = 0
        self.memory_limited = 0
        self._grants: dict[int, Grant] = {}
        self._by_owner: dict[Hashable, set[int]] = {}
        self._orphans: dict[Hashable, set[Hashable]] = {}  # process -> its closed connections with grants
        self._proc_bytes: dict[Hashable, int] = {}
        self._ids = itertools.count(secrets.randbits(40) << 20)  # grant ids never repeat across store processes
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        #: what left the index, for clients that follow it: (a prefix?, key or prefix)
        self.removals: deque[tuple[bool, bytes]] = deque(maxlen=self.limits.removals_kept)
        self.removals_end = 0  # removals ever noted

    def _check_capacity(self, value: object) -> int:
        value = check_capacity(value)
        if value > self.alloc.size - self.own.data_start:
            raise ValueError(f"capacity_bytes {value} is above the {self.alloc.size - self.own.data_start} bytes "
                             "this store's segment holds; start a new store with the larger capacity")
        return value

    @property
    def objects(self) -> int:
        return self._keys.n

    @property
    def share(self) -> int:
        """The bytes one client process may hold in grants and pins at once."""
        return max(int(self.capacity * self.limits.client_share), MAX_VALUE_BYTES)

    # -- publishing --------------------------------------------------------------

    def _grow(self, top: int) -> None:
        short = top + 1 - len(self.stamp)
        if short > 0:
            short = max(short, len(self.stamp) // 2, 1024)
            self.stamp.extend(itertools.repeat(-1, short))
            self.segi.extend(bytes(short))
            self.verified.extend(bytes(short))

    def _publish(self, slots: list[int], keys: list[bytes], segi: int, verified: bool) -> None:
        """Objects of ``slots`` (written in the table) join the index, youngest last."""
        if not slots:
            return
        self._grow(max(slots))
        self._keys.add(keys, np.asarray(slots, np.int64))
        stamp, seg_of, checked = self.stamp, self.segi, self.verified
        first = next(self._stamps)
        self._stamps = itertools.count(first + len(slots))
        for n, slot in enumerate(slots):
            stamp[slot], seg_of[slot], checked[slot] = first + n, segi, verified
        self._queue_slot.extend(slots)
        self._queue_stamp.extend(range(first, first + len(slots)))
        self.segs[segi].live += len(slots)
        self.used += int(self.table.size[slots].sum())

    def _unpublish(self, slots: list[int]) -> None:
        """The objects of ``slots`` leave the index; their bytes go once unpinned."""
        if not slots:
            return
        self._keys.remove(np.asarray(slots, np.int64))
        self.table.free(slots)
        sizes = self.table.size[slots].tolist()
        self.used -= sum(sizes)
        for slot in slots:
            self.stamp[slot] = -1
            seg = self.segs[self.segi[slot]]
            seg.live -= 1
            if slot in self._pins:
                self._doomed.add(slot)
                seg.pinned += 1
            else:
                self._drop_bytes(slot)

    def note(self, items: list[tuple[bool, bytes]]) -> None:
        self.removals.extend(items)
        self.removals_end += len(items)

    def _note_keys(self, slots: list[int]) -> None:
        self.note([(False, bytes(k)) for k in self.table.key[slots]] if slots else [])

    def removed_since(self, cursor: int, most: int) -> tuple[int, bool, list[bytes], list[bytes]]:
        """What left the index from ``cursor`` on (an end this answered
        before; -1: from now): ``(end, lost, keys, prefixes)``, at most
        ``most`` entries. ``lost``: entries past ``removals_kept`` were
        dropped meanwhile. A key stored again since is left out: it is there."""
        first = self.removals_end - len(self.removals)
        if cursor < 0:
            return self.removals_end, False, [], []
        lost = not first <= cursor <= self.removals_end
        at = cursor if not lost else first
        items = list(itertools.islice(self.removals, at - first, at - first + most))
        keys = [k for prefix, k in items if not prefix]
        here = self._keys.find(keys) if keys else []
        return (at + len(items), lost, [k for k, slot in zip(keys, here) if slot < 0],
                [k for prefix, k in items if prefix])

    def _drop_bytes(self, slot: int) -> None:
        """Nobody holds ``slot``'s bytes any more: its room and its slot come back."""
        seg = self.segs[self.segi[slot]]
        offset, size = int(self.table.offset[slot]), int(self.table.size[slot])
        if seg.own:
            self.alloc.free(offset, size)
        elif seg.released:
            seg.seg.punch([(offset, offset + aligned(size))])
            self._delete_if_empty(seg)
        else:
            self.held += aligned(size)  # an earlier segment's client may still copy there
        self._slots.push(slot)

    def _delete_if_empty(self, seg: _Seg) -> None:
        if not seg.own and seg.released and not seg.live and not seg.pinned and not seg.gone:
            seg.gone = True
            if seg.seg is not None:
                seg.seg.close(unlink=True)

    # -- taking over what earlier store processes left --------------------------

    def recover(self, found: Any) -> int:
        """Publish the sound objects an earlier table held (``_table.Recovered``),
        oldest first, up to the capacity; how many. They are served from
        their segments, read-only, and checked on their first read. Until
        ``release_earlier``, everything else an earlier segment holds counts
        against the capacity."""
        keep, seg_of, room = [], [], self.capacity
        for slot, gen, size in zip(*(a[::-1].tolist() for a in (found.slots, found.gens, found.sizes))):
            segi = self._seg_of_gen.get(gen, 0)
            if segi and size <= room:  # the newest that fit
                room -= size
                keep.append(slot)
                seg_of.append(segi)
        keep.reverse()
        seg_of.reverse()
        dropped = np.setdiff1d(found.slots, np.asarray(keep, np.int64))
        if len(dropped):
            self._note_keys(dropped.tolist())
            self.table.free(dropped.tolist())
        for segi in sorted(set(seg_of)):
            mine = [s for s, i in zip(keep, seg_of) if i == segi]
            self._publish(mine, [bytes(k) for k in self.table.key[mine]], segi, verified=False)
        self._slots = SlotPool(self.max_objects, np.asarray(keep, np.int64))
        if len(found.seqs):
            self._next_seq = int(found.seqs.max()) + 1
        live = {i: 0 for i in range(1, len(self.segs))}
        for slot, segi in zip(keep, seg_of):
            live[segi] += aligned(int(self.table.size[slot]))
        for segi, nbytes in live.items():
            seg = self.segs[segi].seg
            self.held += max((seg.blocks() if seg is not None else 0) - nbytes, 0)
        self.stats["recovered"] = len(keep)
        return len(keep)

    def release_earlier(self) -> int:
        """Once every earlier segment is quiet (``quiet()``: no client of its
        store process may still copy), give back what no object of theirs
        uses and delete those left empty; the bytes no longer held (0 while
        one is not quiet)."""
        if not self.earlier_held() or not all(s.seg.quiet() for s in self.segs if not s.released):
            return 0
        freed, self.held = self.held, 0
        live = np.concatenate([self._keys.slots(), np.fromiter(self._doomed, np.int64, len(self._doomed))])
        seg_of = np.frombuffer(self.segi, np.int8)[live] if len(live) else live
        for i, seg in enumerate(self.segs):
            if seg.released:
                continue
            seg.released = True
            if seg.seg is not None:
                mine = live[seg_of == i]
                starts = self.table.offset[mine]
                ends = starts + (-(-np.maximum(self.table.size[mine], 1) // ALIGN) * ALIGN)
                order = np.argsort(starts)
                gaps, at = [], seg.seg.data_start
                for lo, hi in zip(starts[order].tolist(), ends[order].tolist()):
                    if lo > at:
                        gaps.append((at, lo))
                    at = max(at, hi)
                seg.seg.punch(gaps + [(at, seg.seg.size)])
            self._delete_if_empty(seg)
        return freed

    def earlier_held(self) -> bool:
        return any(not s.released for s in self.segs)

    # -- room --------------------------------------------------------------------

    def _evict(self, nbytes: int, count: int = 0) -> bool:
        """Evict the next unpinned objects in eviction order until ``nbytes``
        bytes and ``count`` objects are gone; False when too few are left."""
        q_slot, q_stamp, stamp, pins, size = self._queue_slot, self._queue_stamp, self.stamp, self._pins, self.table.size
        victims, freed, i = [], 0, self._head
        while (freed < nbytes or len(victims) < count) and i < len(q_slot):
            slot = q_slot[i]
            if stamp[slot] != q_stamp[i]:  # stale: gone, or made young again
                self._head += i == self._head
            elif slot not in pins:
                q_stamp[i] = -2
                victims.append(slot)
                freed += int(size[slot])
            i += 1
        self._note_keys(victims)
        self._unpublish(victims)
        self.stats["evictions"] += len(victims)
        if self._head > 4096 and self._head * 2 > len(q_slot):
            slots = np.frombuffer(q_slot, np.int64)[self._head:]
            stamps = np.frombuffer(q_stamp, np.int64)[self._head:]
            keep = np.frombuffer(stamp, np.int64)[slots] == stamps
            self._queue_slot, self._queue_stamp = array("q", slots[keep].tobytes()), array("q", stamps[keep].tobytes())
            self._head = 0
        return freed >= nbytes and len(victims) >= count

    def _fit(self) -> None:
        """Evict until what is stored, granted and held fits the capacity."""
        self._evict(self.used + self.reserved + self.held - self.capacity)

    def _place(self, size: int) -> tuple[int, int]:
        """``(offset, OK)`` of room for ``size`` bytes in the own segment,
        evicting for it; else ``(-1, code)``."""
        if not self._evict(self.used + self.reserved + self.held + size - self.capacity, 1 - len(self._slots)):
            return -1, DS_CACHE_POOL_ALLOC_FAILED
        while True:
            offset = self.alloc.alloc(size)
            if offset is None:
                if self._evict(1):  # holes too small: make a bigger one
                    continue
                return -1, DS_CACHE_POOL_ALLOC_FAILED
            end = offset + aligned(size)
            if end > self.committed:
                self.committed = self.own.commit(end)
            if end <= self.committed:
                return offset, OK
            self.alloc.free(offset, size)
            # The host backs no more of the segment: hold only what it backs
            # now, evicting within it, so later puts succeed again.
            self.alloc.truncate(self.committed)
            self.capacity = self.memory_limited = max(min(self.capacity, self.committed - self.own.data_start), 1)
            self._fit()
            return -1, OUT_OF_MEMORY

    def limit_to_free(self, free_bytes: int) -> None:
        """A disk with only ``free_bytes`` free: hold no more than what is
        stored now plus that."""
        limit = max(self.used + self.reserved + free_bytes, 1)
        if limit < self.capacity:
            self.capacity = self.memory_limited = limit
            self._fit()

    # -- grants ---------------------------------------------------------------------

    def _open(self, grant: Grant) -> int:
        grant_id = next(self._ids)
        self._grants[grant_id] = grant
        self._by_owner.setdefault(grant.owner, set()).add(grant_id)
        self._proc_bytes[grant.proc] = self._proc_bytes.get(grant.proc, 0) + grant.nbytes
        return grant_id

    def _close(self, grant_id: int, owner: Hashable, put: bool) -> Grant:
        grant = self._grants.get(grant_id)
        if grant is None or grant.owner != owner or grant.put != put:
            raise GrantError(f"{'put' if put else 'get'} grant {grant_id} is not this connection's (ended, or "
                             "never granted to it)")
        del self._grants[grant_id]
        self._by_owner[owner].discard(grant_id)
        left = self._proc_bytes.get(grant.proc, 0) - grant.nbytes
        if left:
            self._proc_bytes[grant.proc] = left
        else:
            self._proc_bytes.pop(grant.proc, None)
        return grant

    def _budget(self, owner: Hashable, proc: Hashable) -> int:
        """What ``owner`` may take in one more grant (bytes), or -1 for none."""
        if len(self._by_owner.get(owner, ())) >= self.limits.max_grants_per_connection:
            return -1
        return self.share - self._proc_bytes.get(proc, 0)

    def begin_put(self, owner: Hashable, proc: Hashable, keys: Sequence[bytes], sizes: Sequence[int],
                  overwrite: bool) -> tuple[int, list[int], list[int]]:
        """Grant room: ``(grant, codes, offsets)``; grant 0 when nothing was
        granted. Entries with a code other than OK get offset -1."""
        n = len(keys)
        codes, offsets, want = [OK] * n, [-1] * n, []
        budget = self._budget(owner, proc)
        found = None if overwrite else self._keys.find(keys)
        stats = self.stats
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if len(key) > MAX_KEY_BYTES or not 0 <= size <= MAX_VALUE_BYTES:
                codes[i] = INVALID_ARGUMENT
                stats["refused_key" if len(key) > MAX_KEY_BYTES else "refused_size"] += 1
            elif found is not None and found[i] >= 0:
                codes[i] = DS_DATA_ALREADY_EXISTS
                stats["already_exists"] += 1
            elif size > self.capacity:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
                stats["rejected"] += 1
            elif size > budget:
                codes[i] = DS_CACHE_POOL_ALLOC_FAILED
                stats["refused_grants"] += 1
            else:
                budget -= size
                want.append(i)
        # room for the whole batch at once, then a place for each object
        self._evict(self.used + self.reserved + self.held + sum(sizes[i] for i in want) - self.capacity,
                    len(want) - len(self._slots))
        grant = Grant(owner, proc, True, overwrite=overwrite)
        for i in want:
            offset, code = self._place(sizes[i])
            if code:
                codes[i] = code
                stats["out_of_memory" if code == OUT_OF_MEMORY else "rejected"] += 1
                continue
            offsets[i] = offset
            self.reserved += sizes[i]
            grant.nbytes += sizes[i]
            grant.entries.append((i, keys[i], self._slots.pop(), offset, sizes[i]))
        if not grant.entries:
            return 0, codes, offsets
        return self._open(grant), codes, offsets

    def commit_put(self, owner: Hashable, grant_id: int, crcs: Sequence[int]) -> list[int]:
        """Publish a put grant: per granted entry OK, or DS_DATA_ALREADY_EXISTS
        when (without overwrite) its key was stored first. ``crcs``: the
        objects' checksums, one per granted entry. A key named twice: with
        overwrite the later entry wins, without it the earlier."""
        grant = self._grants.get(grant_id)
        if grant is not None and grant.owner == owner and grant.put and len(crcs) != len(grant.entries):
            raise ValueError(f"COMMIT of {len(grant.entries)} entries with {len(crcs)} checksums")  # the grant stays
        grant = self._close(grant_id, owner, put=True)
        self.reserved -= grant.nbytes
        entries = grant.entries
        winner = {e[1]: j for j, e in (reversed(list(enumerate(entries))) if not grant.overwrite
                                       else enumerate(entries))}
        old = self._keys.find([e[1] for e in entries])
        codes, won, replaced = [], [], []
        for j, (_, key, slot, offset, size) in enumerate(entries):
            lost = winner[key] != j or (old[j] >= 0 and not grant.overwrite)
            if lost:
                self.alloc.free(offset, size)
                self._slots.push(slot)
                self.stats["already_exists"] += not grant.overwrite
                codes.append(OK if grant.overwrite else DS_DATA_ALREADY_EXISTS)
                continue
            if old[j] >= 0:
                replaced.append(int(old[j]))
            won.append(j)
            codes.append(OK)
        self._unpublish(replaced)
        slots = [entries[j][2] for j in won]
        if slots:
            self.table.commit(slots, [entries[j][1] for j in won], self.segs[0].gen, [entries[j][3] for j in won],
                              [entries[j][4] for j in won], [crcs[j] for j in won], self._next_seq)
            self._next_seq += len(slots)
            self._publish(slots, [entries[j][1] for j in won], 0, verified=True)
            self.stats["puts"] += len(slots)
            self.stats["bytes_in"] += sum(entries[j][4] for j in won)
        return codes

    def begin_get(self, owner: Hashable, proc: Hashable, keys: Sequence[bytes], caps: Sequence[int]
                  ) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """Pin what is there: ``(grant, sizes or codes, segments, offsets,
        checksums to verify)``; grant 0 when nothing was pinned. A checksum
        is 0 for an object this process wrote or checked already."""
        n = len(keys)
        results, segis, offsets, verify = [DS_KEY_NOT_FOUND] * n, [0] * n, [-1] * n, [0] * n
        slots = self._keys.find(keys).tolist()
        budget = self._budget(owner, proc)
        grant = Grant(owner, proc, False)
        table, stats, lru = self.table, self.stats, self.policy == "lru"
        stats["gets"] += n
        for i, (slot, cap) in enumerate(zip(slots, caps)):
            if slot < 0:
                stats["misses"] += 1
                if len(keys[i]) > MAX_KEY_BYTES:
                    results[i] = INVALID_ARGUMENT
                    stats["refused_key"] += 1
                continue
            size = int(table.size[slot])
            if size > cap:
                results[i] = INVALID_ARGUMENT
                continue
            if size > budget:
                results[i] = TARGET_UNAVAILABLE
                stats["refused_grants"] += 1
                continue
            budget -= size
            self._pins[slot] = self._pins.get(slot, 0) + 1
            grant.entries.append((i, slot))
            grant.nbytes += size
            results[i], segis[i], offsets[i] = size, self.segi[slot], int(table.offset[slot])
            if not self.verified[slot]:
                verify[i] = int(table.crc[slot])  # 0: nothing to check
            stats["hits"] += 1
            stats["bytes_out"] += size
            if lru:
                stamp = self.stamp[slot] = next(self._stamps)
                self._queue_slot.append(slot)
                self._queue_stamp.append(stamp)
        if not grant.entries:
            return 0, results, segis, offsets, verify
        return self._open(grant), results, segis, offsets, verify

    def release(self, owner: Hashable, grant_id: int, failed: Sequence[int] = ()) -> None:
        """End a get grant (unpin; ``failed``: entries whose checksum did not
        match, dropped) or abort a put grant (its room comes back)."""
        grant = self._grants.get(grant_id)
        if grant is None or grant.owner != owner:
            raise GrantError(f"grant {grant_id} is not this connection's (ended, or never granted to it)")
        self._close(grant_id, owner, grant.put)
        self._undo(grant, set(failed))

    def _undo(self, grant: Grant, failed: set[int] | frozenset[int] = frozenset()) -> None:
        if grant.put:
            self.reserved -= grant.nbytes
            for _, _, slot, offset, size in grant.entries:
                self.alloc.free(offset, size)
                self._slots.push(slot)
            self.stats["aborted"] += len(grant.entries)
            return
        for entry, slot in grant.entries:
            if entry in failed and self.stamp[slot] >= 0:
                self.stats["checksum_failures"] += 1
                self._note_keys([slot])
                self._unpublish([slot])
            elif self.stamp[slot] >= 0:
                self.verified[slot] = 1
            left = self._pins[slot] - 1
            if left:
                self._pins[slot] = left
                continue
            del self._pins[slot]
            if slot in self._doomed:
                self._doomed.discard(slot)
                self.segs[self.segi[slot]].pinned -= 1
                self._drop_bytes(slot)

    def close_owner(self, owner: Hashable, proc: Hashable) -> int:
        """``owner``'s connection is closed, whoever closed it: its grants stay
        (a thread of ``proc`` may still be copying under them) until
        ``end_orphans`` finds ``proc`` with no copy in flight, or gone; how many."""
        held = len(self._by_owner.get(owner, ()))
        if held:
            self._orphans.setdefault(proc, set()).add(owner)
        else:
            self._by_owner.pop(owner, None)
        return held

    def end_orphans(self, busy: Callable[[Hashable], int], alive: Callable[[Hashable], bool]) -> int:
        """End the grants of closed connections whose process has no copy in
        flight (``busy`` 0: it counts every copy from before the request that
        granted it) or is gone; how many."""
        ended = 0
        for proc in [p for p in self._orphans if not alive(p) or busy(p) == 0]:
            for owner in self._orphans.pop(proc):
                ids = list(self._by_owner.get(owner, ()))
                for grant_id in ids:
                    self._undo(self._close(grant_id, owner, self._grants[grant_id].put))
                self._by_owner.pop(owner, None)
                ended += len(ids)
        return ended

    def orphaned(self) -> dict[Hashable, int]:
        """Processes with grants of closed connections, and how many."""
        return {p: sum(len(self._by_owner.get(o, ())) for o in owners) for p, owners in self._orphans.items()}

    # -- the rest ------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        return [OK if s >= 0 else DS_KEY_NOT_FOUND for s in self._keys.find(keys).tolist()]

    def delete(self, key: bytes) -> int:
        slot = int(self._keys.find([key])[0])
        if slot < 0:
            return DS_KEY_NOT_FOUND
        self.note([(False, key)])
        self._unpublish([slot])
        self.stats["deletes"] += 1
        return OK

    def delete_prefix(self, prefix: bytes) -> int:
        slots = self._keys.slots()
        doomed = slots[np.char.startswith(self.table.key[slots], prefix)].tolist() if len(slots) else []
        self.note([(True, prefix)] if doomed else [])
        self._unpublish(doomed)
        self.stats["prefix_deletes"] += len(doomed)
        return len(doomed)

    def clear(self) -> int:
        """Drop every object (grants stay: their holders may be copying); how many."""
        slots = self._keys.slots().tolist()
        self.note([(True, b"")] if slots else [])
        self._unpublish(slots)
        self._queue_slot, self._queue_stamp, self._head = array("q"), array("q"), 0
        return len(slots)

    def give_back(self) -> None:
        """Give the memory of every free extent of the own segment back."""
        self.committed = self.own.give_back(self.alloc.free_extents())

    def keys(self) -> list[bytes]:
        """Every key, the next to be evicted first."""
        slots = np.frombuffer(self._queue_slot, np.int64)[self._head:]
        stamps = np.frombuffer(self._queue_stamp, np.int64)[self._head:]
        live = slots[np.frombuffer(self.stamp, np.int64)[slots] == stamps] if len(slots) else slots
        return [bytes(k) for k in self.table.key[live]]

    def set_policy(self, policy: str) -> None:
        self.policy = check_policy(policy)

    def set_capacity(self, capacity: int) -> None:
        """Change the capacity now, evicting until the stored bytes fit."""
        self.capacity = self._check_capacity(capacity)
        self.memory_limited = 0
        self._fit()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats)
        out.update(
            objects=self.objects, max_objects=self.max_objects, used_bytes=self.used,
            reserved_bytes=self.reserved, held_bytes=self.held, capacity_bytes=self.capacity,
            client_share_bytes=self.share, pinned_objects=len(self._pins), open_grants=len(self._grants),
            segments=len([s for s in self.segs if not s.gone]), earlier_held=self.earlier_held(),
            memory_limited=self.memory_limited, committed_bytes=self.committed,
            segment_bytes=self.alloc.size, free_bytes=self.alloc.free_bytes,
        )
        return out
