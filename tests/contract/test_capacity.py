"""Capacity and eviction of the local store.

The real cluster evicts too, per size class and first in, first out (its
data server never marks an object accessed). These pin down the local
one: oldest put first by default, least recently used first with
``local_store_eviction=lru`` (get and put count as use, exists never does); an
object larger than the capacity is refused; memory never exceeds the
capacity.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from sglang_simm.errors import (
    DS_CACHE_POOL_ALLOC_FAILED,
    GET_OBJECT_FAILED,
    OK,
    PUT_OBJECT_FAILED,
)

OBJ = 1000


@pytest.fixture
def small(server):
    """The server shrunk to ten OBJ-byte objects."""
    server.set_capacity(10 * OBJ)
    return server


@pytest.fixture
def lru(small):
    small.set_policy("lru")
    return small


def fill(store, mem, key, rand, count):
    datas = {}
    for i in range(count):
        datas[i] = rand(OBJ, seed=i)
        assert store.put(key(str(i)), mem.holding(datas[i])[0]) == OK
    return datas


def read(store, mem, k, size=OBJ):
    view, out = mem.view(size, fill=0)
    n = store.get(k, view)
    return n, out[: max(n, 0)]


def test_evicts_oldest_put_by_default(small, store, mem, key, rand):
    datas = fill(store, mem, key, rand, 10)
    assert small.policy == "fifo"
    assert read(store, mem, key("0"))[0] == OBJ  # a get does not make it young
    assert store.put(key("10"), mem.holding(rand(OBJ, seed=99))[0]) == OK
    assert store.exists(key("0")) is False
    for i in range(1, 10):
        n, out = read(store, mem, key(str(i)))
        assert n == OBJ and torch.equal(out, datas[i]), f"survivor {i} damaged"
    assert small.stats()["evictions"] == 1


def test_fifo_order_over_many_puts(small, store, mem, key, rand):
    fill(store, mem, key, rand, 10)
    for i in (7, 3, 9):
        assert read(store, mem, key(str(i)))[0] == OBJ
    for j in range(10, 17):
        assert store.put(key(str(j)), mem.holding(rand(OBJ, seed=j))[0]) == OK
    present = store.mexists([key(str(i)) for i in range(17)])
    assert [i for i, p in enumerate(present) if p] == list(range(7, 17))


def test_overwrite_makes_an_object_young(small, store, mem, key, rand):
    fill(store, mem, key, rand, 10)
    assert store.put(key("0"), mem.holding(rand(OBJ, seed=50))[0]) == OK
    assert store.put(key("10"), mem.holding(rand(OBJ, seed=51))[0]) == OK
    assert store.mexists([key("0"), key("1")]) == [True, False]


def test_set_policy_rejects_unknown(server):
    with pytest.raises(ValueError):
        server.set_policy("random")
    assert server.policy == "fifo"


def test_evicts_least_recently_used(lru, store, mem, key, rand):
    datas = fill(store, mem, key, rand, 10)
    assert read(store, mem, key("0"))[0] == OBJ  # 0 is now the most recently used
    extra = rand(OBJ, seed=99)
    assert store.put(key("10"), mem.holding(extra)[0]) == OK

    assert store.exists(key("1")) is False  # the least recently used went
    assert read(store, mem, key("1"))[0] == GET_OBJECT_FAILED
    for i in [0, *range(2, 10)]:
        n, out = read(store, mem, key(str(i)))
        assert n == OBJ and torch.equal(out, datas[i]), f"survivor {i} damaged"
    assert lru.stats()["evictions"] == 1


def test_exists_does_not_count_as_use(lru, store, mem, key, rand):
    fill(store, mem, key, rand, 10)
    assert store.exists(key("0")) is True
    assert store.mexists([key("0")]) == [True]
    assert store.put(key("10"), mem.holding(rand(OBJ))[0]) == OK
    assert store.exists(key("0")) is False


def test_lru_order_over_many_puts(lru, store, mem, key, rand):
    fill(store, mem, key, rand, 10)
    touched = [7, 3, 9]
    for i in touched:
        assert read(store, mem, key(str(i)))[0] == OBJ
    for j in range(10, 17):  # seven new objects evict the seven untouched ones
        assert store.put(key(str(j)), mem.holding(rand(OBJ, seed=j))[0]) == OK
    present = store.mexists([key(str(i)) for i in range(17)])
    assert [i for i, p in enumerate(present) if p] == sorted(touched + list(range(10, 17)))


def test_object_larger_than_capacity_is_refused(small, store, mem, key, rand):
    datas = fill(store, mem, key, rand, 5)
    big, _ = mem.holding(rand(10 * OBJ + 1))
    assert store.put(key("big"), big) == PUT_OBJECT_FAILED
    assert store.mput([key("big")], [big]) == [PUT_OBJECT_FAILED]
    assert asyncio.run(store.put_async(key("big"), big)) == DS_CACHE_POOL_ALLOC_FAILED
    assert store.exists(key("big")) is False
    for i, data in datas.items():  # nothing was evicted for it
        n, out = read(store, mem, key(str(i)))
        assert n == OBJ and torch.equal(out, data)
    assert small.stats()["rejected"] == 3


def test_object_of_exactly_capacity_fits(small, store, mem, key, rand):
    fill(store, mem, key, rand, 3)
    data = rand(10 * OBJ, seed=5)
    assert store.put(key("all"), mem.holding(data)[0]) == OK
    n, out = read(store, mem, key("all"), 10 * OBJ)
    assert n == 10 * OBJ and torch.equal(out, data)
    assert len(small) == 1


def test_set_capacity_evicts_live(server, store, mem, key, rand):
    fill(store, mem, key, rand, 10)
    server.set_policy("lru")
    assert read(store, mem, key("0"))[0] == OBJ
    server.set_capacity(4 * OBJ)
    assert server.used_bytes <= 4 * OBJ
    present = store.mexists([key(str(i)) for i in range(10)])
    assert [i for i, p in enumerate(present) if p] == [0, 7, 8, 9]


def test_set_capacity_rejects_nonsense(server):
    with pytest.raises(ValueError):
        server.set_capacity(0)
    with pytest.raises(TypeError):
        server.set_capacity("1GiB")


def test_used_bytes_never_exceed_capacity(small, store, mem, key, rand):
    rng = random.Random(0)
    for i in range(200):
        size = rng.randint(1, 3 * OBJ)
        code = store.put(key(str(rng.randrange(40))), mem.holding(rand(size, seed=i))[0])
        assert code == OK
        assert small.used_bytes <= small.capacity_bytes
    stats = small.stats()
    assert stats["evictions"] > 0 and stats["used_bytes"] <= 10 * OBJ


def test_overwrite_accounts_bytes(server, store, mem, key, rand):
    k = key()
    assert store.put(k, mem.holding(rand(3000))[0]) == OK
    assert server.used_bytes == 3000
    assert store.put(k, mem.holding(rand(1000))[0]) == OK
    assert server.used_bytes == 1000
    assert store.delete(k) == OK
    assert server.used_bytes == 0


def test_capacity_flag_applies_when_a_server_is_created(kv, local_store_only):
    assert kv.set_flag("local_store_capacity_bytes", str(123_456))
    assert kv.set_flag("cm_primary_node_ip", "capacity-flag-test")
    assert kv.Store().server.capacity_bytes == 123_456
    assert kv.set_flag("local_store_capacity_bytes", str(999_999))
    assert kv.get_server("capacity-flag-test").capacity_bytes == 123_456  # existing one unchanged
    assert kv.get_server("capacity-flag-test-2").capacity_bytes == 999_999


def test_default_capacity_is_4gib_capped_at_a_quarter_of_ram_or_half_a_disks_free_space(kv, server):
    from sglang_simm.local_store._segments import medium_of, physical_memory_bytes

    root = getattr(server, "root", None)
    if root and medium_of(root) == "disk":
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        # half of what was free when it started; the store's own files since are small
        assert free // 2 - (256 << 20) <= server.capacity_bytes <= free // 2 + (256 << 20)
        return
    ram = physical_memory_bytes()
    expected = min(4 << 30, ram // 4) if ram else 4 << 30
    assert kv.default_capacity_bytes() == expected
    assert server.capacity_bytes == expected


def test_stats_count_the_data_path(server, store, mem, key, rand):
    k = key()
    assert store.put(k, mem.holding(rand(500))[0]) == OK
    assert store.get(k, mem.view(500)[0]) == 500
    assert store.get(key("absent"), mem.view(500)[0]) == GET_OBJECT_FAILED
    assert store.delete(k) == OK
    stats = server.stats()
    assert {
        name: stats[name] for name in ("puts", "gets", "hits", "misses", "bytes_in", "bytes_out", "deletes")
    } == {
        "puts": 1,
        "gets": 2,
        "hits": 1,
        "misses": 1,
        "bytes_in": 500,
        "bytes_out": 500,
        "deletes": 1,
    }
    assert stats["evictions"] == 0 and stats["objects"] == 0


def test_repr_shows_name_usage_and_count(server, store, mem, key, rand):
    server.set_capacity(2 << 20)
    store.put(key(), mem.holding(rand(1536))[0])
    text = repr(server)
    assert server.name in text and "1.5 KiB" in text and "2.0 MiB" in text and "objects=1" in text
