"""The index alone (``_index.StoreIndex``): grants, room, eviction, shares and
recovery, with no process: a table in memory and segments that record what
they were asked."""

from __future__ import annotations

import pytest

from sglang_simm.local_store._allocator import aligned
from sglang_simm.local_store._index import StoreIndex
from sglang_simm.local_store._limits import StoreLimits
from sglang_simm.local_store._table import IndexTable
from sglang_simm.simm_rules import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    OUT_OF_MEMORY,
)

pytestmark = []  # pure: no store process

DATA_START = 64 << 10


class FakeSegment:
    """A segment's bookkeeping: what was committed, punched, deleted."""

    def __init__(self, gen: str, size: int, backs: int | None = None, blocks: int = 0) -> None:
        self.gen, self.size, self.data_start = gen, size, DATA_START
        self.backs = size if backs is None else backs  # the host backs no more than this
        self.punched: list[tuple[int, int]] = []
        self.closed = self.unlinked = False
        self._blocks = blocks
        self.is_quiet = True

    def commit(self, end: int) -> int:
        return min(end, self.backs)

    def give_back(self, extents):
        self.punched += extents
        return self.data_start

    def punch(self, extents):
        self.punched += extents

    def close(self, unlink=False):
        self.closed, self.unlinked = True, unlink

    def blocks(self) -> int:
        return self._blocks

    def quiet(self) -> bool:
        return self.is_quiet


def index(capacity: int = 64 << 10, *, segment: int = 256 << 10, earlier=(), table=None, **kw) -> StoreIndex:
    limits = kw.pop("limits", StoreLimits(max_objects=256))
    own = FakeSegment("a" * 16, DATA_START + segment, backs=kw.pop("backs", None))
    return StoreIndex(capacity=capacity, table=table or IndexTable(None, 256), own=own, earlier=list(earlier),
                      limits=limits, **kw)


def put(ix: StoreIndex, keys, sizes, owner=1, proc=1, overwrite=True):
    grant, codes, offsets = ix.begin_put(owner, proc, [k.encode() for k in keys], sizes, overwrite)
    done = ix.commit_put(owner, grant, [0] * codes.count(OK)) if grant else []
    it = iter(done)
    return [next(it) if c == OK else c for c in codes]


def get(ix: StoreIndex, keys, cap=1 << 20, owner=2, proc=2):
    grant, results, _, _, _ = ix.begin_get(owner, proc, [k.encode() for k in keys], [cap] * len(keys))
    if grant:
        ix.release(owner, grant)
    return results


def test_a_put_is_invisible_until_committed_and_its_room_counts_meanwhile():
    ix = index()
    grant, codes, offsets = ix.begin_put(1, 1, [b"k"], [1000], True)
    assert codes == [OK] and offsets[0] >= DATA_START
    assert ix.lookup([b"k"]) == [DS_KEY_NOT_FOUND] and ix.reserved == 1000
    assert ix.commit_put(1, grant, [0]) == [OK]
    assert ix.lookup([b"k"]) == [OK] and ix.reserved == 0 and ix.used == 1000


def test_an_aborted_put_gives_its_room_back():
    ix = index()
    grant, _, _ = ix.begin_put(1, 1, [b"k"], [1000], True)
    free = ix.alloc.free_bytes
    ix.release(1, grant)
    assert ix.reserved == 0 and ix.alloc.free_bytes == free + aligned(1000) and ix.lookup([b"k"]) == [DS_KEY_NOT_FOUND]


def test_without_overwrite_a_stored_key_is_refused_and_the_first_commit_wins():
    ix = index()
    assert put(ix, ["k"], [100]) == [OK]
    assert put(ix, ["k"], [100], overwrite=False) == [DS_DATA_ALREADY_EXISTS]
    a, _, _ = ix.begin_put(1, 1, [b"n"], [100], False)
    b, _, _ = ix.begin_put(3, 3, [b"n"], [100], False)
    assert ix.commit_put(1, a, [0]) == [OK] and ix.commit_put(3, b, [0]) == [DS_DATA_ALREADY_EXISTS]
    assert ix.reserved == 0


def test_a_key_named_twice_in_a_batch_keeps_the_later_with_overwrite_and_the_earlier_without():
    ix = index()
    grant, _, offsets = ix.begin_put(1, 1, [b"k", b"k"], [100, 200], True)
    assert ix.commit_put(1, grant, [0, 0]) == [OK, OK] and get(ix, ["k"]) == [200]
    grant, _, _ = ix.begin_put(1, 1, [b"j", b"j"], [100, 200], False)
    assert ix.commit_put(1, grant, [0, 0]) == [OK, DS_DATA_ALREADY_EXISTS] and get(ix, ["j"]) == [100]


def test_overwrite_replaces_the_object_and_frees_the_old_room():
    ix = index()
    assert put(ix, ["k"], [1000]) == [OK]
    assert put(ix, ["k"], [500]) == [OK]
    assert ix.used == 500 and get(ix, ["k"]) == [500]


def test_a_pinned_object_keeps_its_bytes_until_released_though_it_left_the_index():
    ix = index()
    assert put(ix, ["k"], [1000]) == [OK]
    grant, results, _, offsets, _ = ix.begin_get(2, 2, [b"k"], [1000])
    assert ix.delete(b"k") == OK and ix.lookup([b"k"]) == [DS_KEY_NOT_FOUND]
    assert put(ix, ["x" + str(i) for i in range(60)], [1000] * 60) == [OK] * 60  # room wanted everywhere
    assert all(o != offsets[0] for o in [ix.table.offset[s] for s in ix._keys.slots()])
    ix.release(2, grant)
    assert offsets[0] in [start for start, _ in ix.alloc.free_extents()] or ix.used <= ix.capacity


def test_fifo_ignores_gets_and_lru_does_not():
    for policy, survivor in (("fifo", "k1"), ("lru", "k0")):
        ix = index(capacity=3000, policy=policy)
        assert put(ix, ["k0", "k1", "k2"], [1000] * 3) == [OK] * 3
        get(ix, ["k0"])
        assert put(ix, ["k3"], [1000]) == [OK]
        assert ix.lookup([survivor.encode()]) == [OK], policy


def test_pinned_objects_are_not_evicted_and_everything_pinned_refuses_the_put():
    ix = index(capacity=2000)
    assert put(ix, ["a", "b"], [1000, 1000]) == [OK, OK]
    grant, _, _, _, _ = ix.begin_get(2, 2, [b"a", b"b"], [1000, 1000])
    assert put(ix, ["c"], [1000]) == [DS_CACHE_POOL_ALLOC_FAILED]
    ix.release(2, grant)
    assert put(ix, ["c"], [1000]) == [OK]


def test_a_buffer_smaller_than_the_object_is_invalid_argument():
    ix = index()
    assert put(ix, ["k"], [1000]) == [OK]
    assert get(ix, ["k"], cap=999) == [INVALID_ARGUMENT] and get(ix, ["k"], cap=1000) == [1000]


def test_keys_and_sizes_past_simms_limits_are_refused_per_entry():
    ix = index()
    assert put(ix, ["x" * 257, "ok", "big"], [10, 10, 64 << 20]) == [INVALID_ARGUMENT, OK, INVALID_ARGUMENT]
    assert ix.stats["refused_key"] == 1 and ix.stats["refused_size"] == 1


def test_memory_the_host_cannot_back_is_out_of_memory_and_the_capacity_follows():
    ix = index(capacity=200 << 10, segment=256 << 10, backs=DATA_START + (100 << 10))
    codes = put(ix, [f"k{i}" for i in range(8)], [30 << 10] * 8)
    assert OUT_OF_MEMORY in codes and ix.memory_limited and ix.capacity <= 100 << 10
    assert put(ix, ["later"], [30 << 10]) == [OK]  # within what the host backs: evicting


def test_one_client_holds_at_most_its_share_in_grants_and_pins():
    ix = index(capacity=512 << 20, segment=600 << 20, limits=StoreLimits(max_objects=256, client_share=0.25))
    share = ix.share
    assert share == 128 << 20
    grant, codes, _ = ix.begin_put(1, "p", [f"k{i}".encode() for i in range(4)], [share // 3] * 4, True)
    assert codes == [OK] * 3 + [DS_CACHE_POOL_ALLOC_FAILED]  # the tail past the share
    assert ix.begin_put(5, "p", [b"more"], [100], True)[1] == [DS_CACHE_POOL_ALLOC_FAILED]  # its other connection
    assert ix.begin_put(3, "q", [b"other"], [share // 3], True)[1] == [OK]  # another process is served


def test_a_closed_connections_grants_end_once_its_process_has_no_copy_in_flight_or_is_gone():
    ix = index()
    grant, _, _ = ix.begin_put(1, "p", [b"k"], [1000], True)
    assert ix.close_owner(1, "p") == 1 and ix.reserved == 1000
    busy, alive = {"p": 1}, {"p": True}
    assert ix.end_orphans(busy.get, alive.get) == 0 and ix.reserved == 1000
    busy["p"] = 0
    assert ix.end_orphans(busy.get, alive.get) == 1 and ix.reserved == 0 and ix.orphaned() == {}
    grant, _, _ = ix.begin_put(3, "q", [b"k"], [1000], True)
    ix.close_owner(3, "q")
    assert ix.end_orphans(lambda p: 1, lambda p: False) == 1  # gone, whatever its row says


def test_a_grant_is_its_connections_alone():
    from sglang_simm.local_store._index import GrantError

    ix = index()
    grant, _, _ = ix.begin_put(1, 1, [b"k"], [100], True)
    with pytest.raises(GrantError):
        ix.commit_put(2, grant, [0])
    with pytest.raises(GrantError):
        ix.release(2, grant)
    assert ix.commit_put(1, grant, [0]) == [OK]


def test_objects_of_an_earlier_segment_are_served_and_their_bytes_held_until_it_is_quiet(tmp_path):
    """Recovered objects count as stored; what else the earlier segment's file
    holds counts against the capacity until it is quiet; then their evicted
    bytes are punched and an emptied segment deleted."""
    table = IndexTable(str(tmp_path / "index"), 256)
    old = FakeSegment("b" * 16, DATA_START + (256 << 10), blocks=200 << 10)
    table.commit([0, 1], [b"r0", b"r1"], int(old.gen, 16), [DATA_START, DATA_START + 4096], [1000, 1000], [5, 6], 1)
    table.close()
    table = IndexTable(str(tmp_path / "index"), 256, adopt=True)
    found, dropped = table.recover({int(old.gen, 16): (old.data_start, old.size)})
    assert dropped == 0 and found.keys == [b"r0", b"r1"]
    old.is_quiet = False
    ix = index(capacity=300 << 10, segment=512 << 10, earlier=[old], table=table)
    assert ix.recover(found) == 2 and ix.used == 2000
    assert ix.held == (200 << 10) - 2 * aligned(1000)  # the file's other bytes, until quiet
    assert ix.release_earlier() == 0 and ix.earlier_held()
    grant, results, segs, offsets, verify = ix.begin_get(2, 2, [b"r0"], [1000])
    assert results == [1000] and segs == [1] and verify == [5]  # from the earlier segment, checked on first read
    ix.release(2, grant)
    again = ix.begin_get(2, 2, [b"r0"], [1000])
    assert again[4] == [0]  # checked once
    ix.release(2, again[0])
    old.is_quiet = True
    assert ix.release_earlier() > 0 and ix.held == 0 and old.punched
    ix.delete(b"r0")
    ix.delete(b"r1")
    assert old.unlinked  # emptied: deleted


def test_a_recovered_object_whose_checksum_fails_is_dropped(tmp_path):
    table = IndexTable(str(tmp_path / "index"), 256)
    old = FakeSegment("c" * 16, DATA_START + (256 << 10))
    table.commit([0], [b"r"], int(old.gen, 16), [DATA_START], [1000], [7], 1)
    table.close()
    table = IndexTable(str(tmp_path / "index"), 256, adopt=True)
    ix = index(earlier=[old], table=table)
    ix.recover(table.recover({int(old.gen, 16): (old.data_start, old.size)})[0])
    grant, _, _, _, _ = ix.begin_get(2, 2, [b"r"], [1000])
    ix.release(2, grant, failed=[0])
    assert ix.lookup([b"r"]) == [DS_KEY_NOT_FOUND] and ix.stats["checksum_failures"] == 1


def test_recovery_drops_entries_that_overlap_or_lie_outside_their_segment(tmp_path):
    table = IndexTable(str(tmp_path / "index"), 256)
    gen = int("d" * 16, 16)
    table.commit([0, 1, 2, 3], [b"a", b"b", b"c", b"d"], gen,
                 [DATA_START, DATA_START + 64, DATA_START + 4096, 1 << 30], [1000, 100, 100, 100], [0] * 4, 1)
    table.close()
    table = IndexTable(str(tmp_path / "index"), 256, adopt=True)
    found, dropped = table.recover({gen: (DATA_START, DATA_START + (256 << 10))})
    assert found.keys == [b"a", b"c"] and dropped == 2


def test_random_operations_keep_the_books():
    import random

    rng = random.Random(7)
    ix = index(capacity=64 << 10)
    open_gets: list[tuple[int, int]] = []
    for step in range(3000):
        op = rng.random()
        key = f"k{rng.randrange(40)}"
        if op < 0.5:
            put(ix, [key], [rng.choice([0, 64, 1000, 5000])], overwrite=rng.random() < 0.8)
        elif op < 0.7:
            grant = ix.begin_get(2, 2, [key.encode()], [1 << 20])[0]
            if grant:
                open_gets.append((2, grant))
        elif op < 0.85 and open_gets:
            ix.release(*open_gets.pop(rng.randrange(len(open_gets))))
        elif op < 0.95:
            ix.delete(key.encode())
        else:
            ix.clear()
        live = ix._keys.slots()
        assert ix.used == int(ix.table.size[live].sum()) <= ix.capacity, step
        assert ix.objects == len(live)
    for grant in open_gets:
        ix.release(*grant)
    ix.clear()
    assert ix.alloc.free_bytes == ix.alloc.size - DATA_START  # every byte back
