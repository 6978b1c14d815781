"""put / get / exists / delete and their batch and async forms: bytes and codes.

Codes are the real client's, per call path (see ``sglang_simm.local_store._kv``):
sync get reports any server-side failure as GET_OBJECT_FAILED; async get,
delete and exists pass the data server's code through; only sync put
overwrites.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from sglang_simm.errors import (
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    GET_OBJECT_FAILED,
    INVALID_ARGUMENT,
    OK,
)

SIZES = [1, 63, 4096, 130 * 1024, (1 << 20) + 3]
SIZE_IDS = ["1B", "63B", "4KiB", "130KiB", "1MiB+3"]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_put_get_roundtrip(store, mem, key, rand, size):
    data = rand(size, seed=size)
    src, _ = mem.holding(data)
    dst, out = mem.view(size, fill=0)
    k = key()

    assert store.put(k, src) == OK
    assert store.exists(k) is True
    assert store.get(k, dst) == size
    assert torch.equal(out, data)


@pytest.mark.parametrize("size", [1, 4096, (1 << 20) + 3], ids=["1B", "4KiB", "1MiB+3"])
def test_async_roundtrip(store, mem, key, rand, size):
    data = rand(size, seed=7)
    src, _ = mem.holding(data)
    dst, out = mem.view(size, fill=0)
    k = key()

    assert run(store.put_async(k, src)) == OK
    assert run(store.exists_async(k)) is True
    assert run(store.get_async(k, dst)) == size
    assert torch.equal(out, data)
    assert run(store.delete_async(k)) == OK
    assert run(store.exists_async(k)) is False


def test_async_calls_run_concurrently_in_one_loop(store, mem, key, rand):
    datas = [rand(4096 + i, seed=i) for i in range(16)]
    srcs = [mem.holding(d)[0] for d in datas]
    dsts = [mem.view(8192, fill=0) for _ in datas]
    keys = [key(str(i)) for i in range(16)]

    async def main():
        puts = await asyncio.gather(*(store.put_async(k, v) for k, v in zip(keys, srcs)))
        gets = await asyncio.gather(*(store.get_async(k, v) for k, (v, _) in zip(keys, dsts)))
        return puts, gets

    puts, gets = run(main())
    assert puts == [OK] * 16
    assert gets == [d.numel() for d in datas]
    for data, (_, out) in zip(datas, dsts):
        assert torch.equal(out[: data.numel()], data)


def test_block_allocate_roundtrip(store, key, rand):
    data = rand(4096, seed=3)
    block = store.allocate(4096)
    ref = block.as_ref()
    assert ref.dtype == torch.uint8 and ref.numel() == 4096
    ref.copy_(data)
    k = key()
    assert store.put(k, block.view()) == OK

    got = store.allocate(4096)
    assert store.get(k, got.view()) == 4096
    assert torch.equal(got.as_ref(), data)


def test_get_into_larger_view_returns_object_size(store, mem, key, rand):
    data = rand(1000, seed=11)
    src, _ = mem.holding(data)
    dst, out = mem.view(4096, fill=0xAB)
    k = key()
    assert store.put(k, src) == OK

    assert store.get(k, dst) == 1000  # a caller wanting 4096 bytes must call this a miss
    assert torch.equal(out[:1000], data)
    assert bool((out[1000:] == 0xAB).all()), "bytes past the object were written"
    assert run(store.get_async(k, dst)) == 1000


def test_get_into_smaller_view_fails_and_leaves_it_alone(store, mem, key, rand):
    src, _ = mem.holding(rand(4096, seed=5))
    k = key()
    assert store.put(k, src) == OK
    # A Block is its own registered region, so even the real client (which
    # checks the region's size) sees the buffer as too small.
    small = store.allocate(1024)
    small.as_ref().fill_(0x5A)

    assert store.get(k, small.view()) == GET_OBJECT_FAILED
    assert store.mget([k], [small.view()]) == [GET_OBJECT_FAILED]
    assert run(store.get_async(k, small.view())) == INVALID_ARGUMENT
    assert bool((small.as_ref() == 0x5A).all())


def test_delete_codes(store, mem, key, rand, release):
    """HEAD passes the server's code (775cea9); the tag's sync delete answered 0 always."""
    k = key()
    assert store.put(k, mem.holding(rand(64))[0]) == OK
    assert store.delete(k) == OK
    assert store.delete(k) == (DS_KEY_NOT_FOUND if release == "head" else OK)
    assert run(store.delete_async(k)) == DS_KEY_NOT_FOUND  # the async path passes it on both


def test_missing_key_codes(store, mem, key):
    dst, out = mem.view(64, fill=0x11)
    k = key("absent")
    assert store.exists(k) is False
    assert store.get(k, dst) == GET_OBJECT_FAILED
    assert store.mget([k], [dst]) == [GET_OBJECT_FAILED]
    assert run(store.get_async(k, dst)) == DS_KEY_NOT_FOUND
    assert run(store.delete_async(k)) == DS_KEY_NOT_FOUND
    assert run(store.exists_async(k)) is False
    assert bool((out == 0x11).all())


def test_delete_then_get_misses(store, mem, key, rand):
    src, _ = mem.holding(rand(100))
    dst, _ = mem.view(100)
    k = key()
    assert store.put(k, src) == OK
    assert store.delete(k) == OK
    assert store.exists(k) is False
    assert store.get(k, dst) == GET_OBJECT_FAILED


def test_sync_put_overwrites(store, mem, key, rand):
    first, second = rand(3000, seed=1), rand(1200, seed=2)
    k = key()
    assert store.put(k, mem.holding(first)[0]) == OK
    assert store.put(k, mem.holding(second)[0]) == OK
    dst, out = mem.view(4096)
    assert store.get(k, dst) == 1200
    assert torch.equal(out[:1200], second)


def test_mput_on_an_existing_key(store, mem, key, rand, release):
    """HEAD (dfe269a) deletes and re-puts it; the tag answered -4005 and kept the old object."""
    old, new = rand(2048, seed=1), rand(2048, seed=2)
    k_old, k_new = key("old"), key("new")
    assert store.put(k_old, mem.holding(old)[0]) == OK

    results = store.mput([k_old, k_new], [mem.holding(new)[0], mem.holding(new)[0]])
    dst, out = mem.view(2048)
    assert store.get(k_old, dst) == 2048
    if release == "head":
        assert results == [OK, OK]
        assert torch.equal(out, new)
    else:
        assert results == [DS_DATA_ALREADY_EXISTS, OK]
        assert torch.equal(out, old)


def test_mput_absent_skips_stored_keys_in_one_put(store, mem, key, rand):
    """Local store only: a backup's exists-then-put folded into one put."""
    if not hasattr(store, "mput_absent"):
        pytest.skip("mput_absent is a local-store-only extra")
    old, new = rand(2048, seed=1), rand(2048, seed=2)
    k_old, k_new = key("old"), key("new")
    assert store.put(k_old, mem.holding(old)[0]) == OK
    assert store.mput_absent([k_old, k_new], [mem.holding(new)[0], mem.holding(new)[0]]) == [
        DS_DATA_ALREADY_EXISTS, OK]
    for k, want in ((k_old, old), (k_new, new)):
        dst, out = mem.view(2048)
        assert store.get(k, dst) == 2048
        assert torch.equal(out, want)


def test_put_async_leaves_existing_object_alone(store, mem, key, rand):
    old, new = rand(512, seed=1), rand(512, seed=2)
    k = key()
    assert store.put(k, mem.holding(old)[0]) == OK
    assert run(store.put_async(k, mem.holding(new)[0])) == DS_DATA_ALREADY_EXISTS
    dst, out = mem.view(512)
    assert store.get(k, dst) == 512
    assert torch.equal(out, old)


def test_mput_mget_mexists(store, mem, key, rand):
    sizes = [1 + (i * 977) % 20000 for i in range(32)]
    datas = [rand(size, seed=i) for i, size in enumerate(sizes)]
    keys = [key(str(i)) for i in range(32)]
    srcs = [mem.holding(d)[0] for d in datas]

    results = store.mput(keys, srcs)
    assert results == [OK] * 32
    assert all(type(r) is int for r in results)

    absent = key("absent")
    exists = store.mexists(keys + [absent])
    assert exists == [True] * 32 + [False]
    assert all(type(e) is bool for e in exists)

    dsts = [mem.view(20000, fill=0) for _ in keys]
    got = store.mget(keys + [absent], [v for v, _ in dsts] + [mem.view(16)[0]])
    assert got[:32] == sizes and got[32] == GET_OBJECT_FAILED
    assert all(type(r) is int for r in got)
    for data, (_, out) in zip(datas, dsts):
        assert torch.equal(out[: data.numel()], data)


def test_mget_partial_hits_fill_only_the_hits(store, mem, key, rand):
    data = rand(256, seed=9)
    k_hit, k_miss = key("hit"), key("miss")
    assert store.put(k_hit, mem.holding(data)[0]) == OK
    (v1, o1), (v2, o2) = mem.view(256, fill=0), mem.view(256, fill=0x33)
    assert store.mget([k_miss, k_hit], [v2, v1]) == [GET_OBJECT_FAILED, 256]
    assert torch.equal(o1, data)
    assert bool((o2 == 0x33).all())


def test_empty_batches(store):
    assert store.mput([], []) == []
    assert store.mget([], []) == []
    assert store.mexists([]) == []


def test_return_types(store, mem, key):
    src, _ = mem.holding(torch.ones(8, dtype=torch.uint8))
    k = key()
    assert type(store.put(k, src)) is int
    assert type(store.get(k, src)) is int
    assert type(store.exists(k)) is bool
    assert type(store.delete(k)) is int
