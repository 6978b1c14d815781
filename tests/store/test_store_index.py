"""The local store's index: leases, pins, eviction and memory, without processes."""

from __future__ import annotations

import random

import pytest

from sglang_simm.local_store._index import StoreIndex
from sglang_simm.errors import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    OUT_OF_MEMORY,
)

A, B = 1, 2  # two clients (connections)


def put(index, owner, keys, size=1000, overwrite=True):
    lease, codes, offsets = index.begin_put(owner, keys, [size] * len(keys), overwrite)
    return lease, codes, offsets


def put_now(index, keys, size=1000, overwrite=True):
    lease, codes, _ = put(index, A, keys, size, overwrite)
    if lease:
        done = dict(index.commit_put(lease))
        codes = [done.get(i, c) for i, c in enumerate(codes)]
    return codes


def ks(*names):
    return [n.encode() for n in names]


@pytest.fixture
def index():
    return StoreIndex(capacity=10_000, arena_bytes=1 << 20)


def test_an_owner_holding_put_room_gets_more_within_its_share_unless_it_has_none():
    shared = StoreIndex(capacity=10_000, arena_bytes=1 << 20)  # a share of capacity / HELD_SHARE
    trusted = StoreIndex(capacity=10_000, arena_bytes=1 << 20, held_share=None)  # the in-process store's
    for index, second in ((shared, [DS_CACHE_POOL_ALLOC_FAILED]), (trusted, [OK])):
        assert put(index, A, ks("a", "b"))[1] == [OK, OK]  # its largest batch: always granted
        assert put(index, A, ks("c"))[1] == second  # 3000 bytes held: past 10_000 / 4
        assert put(index, B, ks("d"))[1] == [OK]  # another owner holds none


def test_a_put_is_invisible_until_committed(index):
    lease, codes, offsets = put(index, A, ks("a", "b"))
    assert codes == [OK, OK] and offsets[0] != offsets[1] and lease
    assert index.lookup(ks("a", "b")) == [DS_KEY_NOT_FOUND] * 2
    assert index.begin_get(B, ks("a"), [1000])[1] == [DS_KEY_NOT_FOUND]
    assert index.reserved == 2000 and index.used == 0
    assert index.commit_put(lease) == [(0, OK), (1, OK)]
    assert index.lookup(ks("a", "b")) == [OK, OK]
    assert (index.reserved, index.used) == (0, 2000)


def test_a_writer_gone_mid_batch_leaves_nothing(index):
    lease, _, _ = put(index, A, ks("a", "b"))
    free_before = index.alloc.free_bytes
    assert index.drop_owner(A) == 1
    assert index.lookup(ks("a", "b")) == [DS_KEY_NOT_FOUND] * 2
    assert index.reserved == 0 and index.alloc.free_bytes > free_before
    assert index.stats["aborted"] == 2
    with pytest.raises(KeyError):
        index.commit_put(lease)


def test_reserved_room_counts_against_capacity(index):
    lease, codes, _ = put(index, A, ks(*"abcdefghij"))
    assert codes == [OK] * 10
    # nothing is published yet, so nothing can be evicted for a newcomer
    assert put(index, B, ks("k"))[1] == [DS_CACHE_POOL_ALLOC_FAILED]
    index.commit_put(lease)
    assert put_now(index, ks("k")) == [OK]  # now the oldest goes
    assert index.lookup(ks("a", "k")) == [DS_KEY_NOT_FOUND, OK]


def test_without_overwrite_an_existing_key_is_refused(index):
    put_now(index, ks("a"))
    assert put(index, A, ks("a"), overwrite=False)[1] == [DS_DATA_ALREADY_EXISTS]


def test_without_overwrite_the_first_commit_wins(index):
    first, _, _ = put(index, A, ks("a"), overwrite=False)
    second, _, _ = put(index, B, ks("a"), overwrite=False)
    assert index.commit_put(first) == [(0, OK)]
    assert index.commit_put(second) == [(0, DS_DATA_ALREADY_EXISTS)]
    assert index.used == 1000 and index.reserved == 0


def test_overwrite_replaces_and_frees(index):
    put_now(index, ks("a"), size=3000)
    put_now(index, ks("a"), size=1000)
    assert index.used == 1000 and len(index.objects) == 1


def test_get_pins_until_released(index):
    put_now(index, ks("a"))
    lease, sizes, offsets = index.begin_get(B, ks("a", "zz"), [1000, 1000])
    assert sizes == [1000, DS_KEY_NOT_FOUND] and offsets[0] >= 0
    assert index.delete(b"a") == OK  # gone from the index at once...
    assert index.lookup(ks("a")) == [DS_KEY_NOT_FOUND]
    # ...but its extent is not reused while the reader copies
    lease2, _, offsets2 = put(index, A, ks("b"))
    assert offsets2[0] != offsets[0]
    index.release(lease)
    index.commit_put(lease2)
    assert put(index, A, ks("c"))[2][0] == offsets[0]  # free again


def test_a_reader_gone_mid_get_unpins(index):
    put_now(index, ks("a"))
    index.begin_get(B, ks("a"), [1000])
    assert index.snapshot()["pinned_objects"] == 1
    index.delete(b"a")
    assert index.drop_owner(B) == 1
    assert index.snapshot()["pinned_objects"] == 0
    assert index.alloc.free_bytes == index.alloc.size


def test_pinned_objects_are_not_evicted(index):
    put_now(index, ks(*"abcdefghij"))
    lease, _, _ = index.begin_get(B, ks("a"), [1000])
    assert put_now(index, ks("k")) == [OK]
    assert index.lookup(ks("a", "b")) == [OK, DS_KEY_NOT_FOUND]  # b went instead
    index.release(lease)


def test_everything_pinned_refuses_the_put(index):
    put_now(index, ks(*"abcdefghij"))
    index.begin_get(B, ks(*"abcdefghij"), [1000] * 10)
    assert put(index, A, ks("k"))[1] == [DS_CACHE_POOL_ALLOC_FAILED]


def test_a_buffer_smaller_than_the_object_is_invalid_argument(index):
    put_now(index, ks("a"))
    assert index.begin_get(B, ks("a"), [999]) == (0, [INVALID_ARGUMENT], [-1])


def test_fifo_ignores_gets_and_lru_does_not():
    for policy, survivor in (("fifo", b"b"), ("lru", b"a")):
        index = StoreIndex(capacity=2000, arena_bytes=1 << 20, policy=policy)
        put_now(index, ks("a", "b"))
        index.release(index.begin_get(B, ks("a"), [1000])[0])
        put_now(index, ks("c"))
        assert [k for k in (b"a", b"b") if k in index.objects] == [survivor], policy


def test_holes_too_small_are_merged_by_evicting():
    index = StoreIndex(capacity=8000, arena_bytes=8192)
    put_now(index, ks(*"abcdefgh"), size=1000)  # 8 x 1024 aligned: the arena is full
    assert put_now(index, ks("big"), size=4000) == [OK]  # evicts the oldest until 4 KiB is contiguous
    assert index.lookup(ks("a", "b", "c", "d", "e")) == [DS_KEY_NOT_FOUND] * 4 + [OK]


def test_memory_that_cannot_be_committed_is_out_of_memory():
    limit = {"end": 4096}

    def commit(end):
        return end if end <= limit["end"] else limit["end"]

    index = StoreIndex(capacity=100_000, arena_bytes=1 << 20, commit=commit)
    assert put_now(index, ks("a", "b", "c", "d"), size=1000) == [OK] * 4
    assert put(index, A, ks("e"))[1] == [OUT_OF_MEMORY]
    assert index.stats["out_of_memory"] == 1
    assert index.memory_limited == 4096 and index.capacity == 4096
    # from now on the store lives within the memory it has: the oldest goes
    assert put_now(index, ks("e")) == [OK]
    assert index.lookup(ks("a", "e")) == [DS_KEY_NOT_FOUND, OK]


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="above"):
        StoreIndex(capacity=2 << 20, arena_bytes=1 << 20)
    index = StoreIndex(capacity=1000, arena_bytes=1 << 20)
    with pytest.raises(ValueError):
        index.set_capacity(0)
    with pytest.raises(TypeError):
        index.set_capacity("1GiB")


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_the_books(seed):
    """Random puts, commits, aborts, gets, releases, deletes and dropped
    clients: used/reserved bytes always match the objects and leases, and
    once everything is released the arena is whole again."""
    rng = random.Random(seed)
    index = StoreIndex(capacity=50_000, arena_bytes=1 << 17, policy=rng.choice(["fifo", "lru"]))
    open_puts: list[tuple[int, int]] = []
    open_gets: list[tuple[int, int]] = []
    for _ in range(2000):
        op = rng.random()
        owner = rng.randrange(4)
        keys = ks(*(f"k{rng.randrange(60)}" for _ in range(rng.randint(1, 4))))
        if op < 0.3:
            lease, _, _ = index.begin_put(owner, keys, [rng.choice([700, 1000, 3000, 9000])] * len(keys),
                                          rng.random() < 0.5)
            if lease:
                open_puts.append((lease, owner))
        elif op < 0.5 and open_puts:
            lease, _ = open_puts.pop(rng.randrange(len(open_puts)))
            index.commit_put(lease) if rng.random() < 0.8 else index.release(lease)
        elif op < 0.7:
            lease, _, _ = index.begin_get(owner, keys, [10_000] * len(keys))
            if lease:
                open_gets.append((lease, owner))
        elif op < 0.8 and open_gets:
            index.release(open_gets.pop(rng.randrange(len(open_gets)))[0])
        elif op < 0.9:
            index.delete(keys[0])
        else:
            index.drop_owner(owner)
            open_puts = [p for p in open_puts if p[1] != owner]
            open_gets = [g for g in open_gets if g[1] != owner]
        assert index.used == sum(o.size for o in index.objects.values())
        assert index.used + index.reserved <= index.capacity
        assert index.open_leases() == len(open_puts) + len(open_gets)
    for owner in range(4):
        index.drop_owner(owner)
    index.clear()
    assert (index.used, index.reserved) == (0, 0)
    assert index.alloc.free_bytes == index.alloc.size


# -- the crash-consistent table, and taking a dead store's objects over ----------


def _table_index(tmp_path, arena=1 << 20):
    from sglang_simm.local_store._table import IndexTable

    table = IndexTable(str(tmp_path / "t.index"), 1000, arena)
    return table, StoreIndex(capacity=100_000, arena_bytes=arena, data_start=4096, table=table)


def test_committed_objects_come_back_and_a_live_writers_grant_stays_out_of_use(tmp_path):
    from sglang_simm.local_store._index import lease_records
    from sglang_simm.local_store._table import IndexTable

    table, index = _table_index(tmp_path)
    words = index._lease_words
    lease, _, offsets = index.begin_put(A, ks("a", "b"), [1000, 1000], True)
    index.commit_put(lease)
    index.delete(b"b")
    _, _, reserved_at = index.begin_put(B, ks("half"), [5000], True)  # the store dies before its commit
    table.close()
    table2 = IndexTable(str(tmp_path / "t.index"), 1000, 1 << 20)
    assert not table2.fresh
    found, dropped = table2.recover(4096, 1 << 20, 64)
    assert (found.keys, found.offsets, dropped) == ([b"a"], [offsets[0]], 0)
    epoch, records = lease_records(words, index.limits.max_leases + 1)
    assert epoch == 1 and len(records) == 1 and records[0][4] == B  # the half-written put's grant
    again = StoreIndex(capacity=100_000, arena_bytes=1 << 20, data_start=4096, table=table2,
                       lease_words=words, epoch=2)
    assert again.restore(found, records) == 1
    assert again.lookup(ks("a", "b", "half")) == [OK, DS_KEY_NOT_FOUND, DS_KEY_NOT_FOUND]
    # the half-written put's room is not handed out while its writer may still copy
    lease, codes, got = again.begin_put(A, ks(*[f"n{i}" for i in range(40)]), [1000] * 40, True)
    assert lease >> 40 == 2 and all(not (reserved_at[0] <= o < reserved_at[0] + 5000) for o in got)
    again.release(lease)
    assert again.snapshot()["closed_leases"] == 1
    assert again.fence((1, B), pid=0) == 1  # its process says it is done (naming the dead store's epoch)
    assert again.snapshot()["closed_leases"] == 0
    lease, codes, got = again.begin_put(A, ks(*[f"m{i}" for i in range(90)]), [1000] * 90, True)
    assert any(reserved_at[0] <= o < reserved_at[0] + 5000 for o in got)  # now it is free


def test_recovery_drops_entries_that_overlap_or_lie_outside_the_arena(tmp_path):
    table, index = _table_index(tmp_path)
    for k in ("a", "b"):
        lease, _, _ = index.begin_put(A, ks(k), [1000], True)
        index.commit_put(lease)
    e = table.entries
    slot_b = int((e["key"] == b"b").nonzero()[0][0])
    slot_a = int((e["key"] == b"a").nonzero()[0][0])
    e["offset"][slot_b] = e["offset"][slot_a]  # a lying table: two objects on one extent
    found, dropped = table.recover(4096, 1 << 20, 64)
    assert found.keys == [b"a"] and dropped == 1
