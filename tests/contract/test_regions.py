"""Registered memory regions (``register_mr``), views, blocks."""

from __future__ import annotations

import pytest
import torch

from sglang_simm.errors import GET_OBJECT_FAILED, INVALID_ARGUMENT, OK, REGISTER_MR_FAILED


def test_register_and_deregister(kv):
    tensor = torch.zeros(4096, dtype=torch.uint8)
    mr = kv.register_mr(tensor)
    assert mr is not None
    assert kv.deregister_mr(mr) is True
    assert kv.deregister_mr(mr) is False  # already undone


def test_register_mr_counts_bytes_not_elements(kv, store, key, rand):
    data = rand(4096, seed=1)
    tensor = data.view(torch.float32).clone()  # 1024 elements, 4096 bytes
    mr = kv.register_mr(tensor)
    try:
        view = kv.BlockView.from_tensor(tensor, mr)
        k = key()
        assert store.put(k, view) == OK
        out = torch.zeros(4096, dtype=torch.uint8)
        mr_out = kv.register_mr(out)
        assert store.get(k, kv.BlockView.from_tensor(out, mr_out)) == 4096
        assert torch.equal(out, data)
        kv.deregister_mr(mr_out)
    finally:
        kv.deregister_mr(mr)


@pytest.mark.parametrize("thing", [b"bytes", [1, 2, 3], None], ids=["bytes", "list", "None"])
def test_register_mr_needs_a_tensor(kv, local_store_only, thing):
    with pytest.raises(TypeError):
        kv.register_mr(thing)


def test_register_mr_needs_a_host_tensor(kv, local_store_only):
    with pytest.raises(TypeError):
        kv.register_mr(torch.empty(16, dtype=torch.uint8, device="meta"))


def test_register_empty_tensor_returns_none(kv, local_store_only):
    assert kv.register_mr(torch.empty(0, dtype=torch.uint8)) is None


def test_from_buffer_needs_an_mr(kv):
    tensor = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TypeError):
        kv.BlockView.from_buffer(tensor.data_ptr(), 16, None)
    with pytest.raises(TypeError):
        kv.BlockView.from_tensor(tensor, None)


def test_from_buffer_rejects_negative_numbers(kv, mem):
    with pytest.raises(TypeError):
        kv.BlockView.from_buffer(-1, 16, mem.mr)
    with pytest.raises(TypeError):
        kv.BlockView.from_buffer(mem.view(16)[1].data_ptr(), -16, mem.mr)


def test_view_as_ref_aliases_the_memory(kv, mem):
    view, tensor = mem.view(32, fill=0)
    ref = view.as_ref()
    assert ref.dtype == torch.uint8 and ref.numel() == 32
    ref[5] = 77
    assert tensor[5].item() == 77


def test_block_view_as_ref_aliases_the_block(store):
    block = store.allocate(64)
    block.as_ref().fill_(9)
    ref = block.view().as_ref()
    assert ref.numel() == 64 and bool((ref == 9).all())


def test_view_outside_registered_region_fails(kv, store, mem, key, rand, local_store_only):
    loose = rand(256)  # never registered
    view = kv.BlockView.from_buffer(loose.data_ptr(), 256, mem.mr)
    assert store.put(key(), view) == REGISTER_MR_FAILED
    assert store.get(key(), view) == REGISTER_MR_FAILED


def test_view_overrunning_its_region_fails(kv, store, key, rand, local_store_only):
    tensor = rand(4096)
    mr = kv.register_mr(tensor)
    try:
        view = kv.BlockView.from_buffer(tensor.data_ptr() + 4000, 200, mr)
        assert store.put(key(), view) == REGISTER_MR_FAILED
        inside = kv.BlockView.from_buffer(tensor.data_ptr() + 3896, 200, mr)
        assert store.put(key(), inside) == OK
    finally:
        kv.deregister_mr(mr)


def test_view_in_another_region_than_its_mr_fails(kv, store, key, rand, local_store_only):
    a, b = rand(1024, seed=1), rand(1024, seed=2)
    mr_a, mr_b = kv.register_mr(a), kv.register_mr(b)
    try:
        assert store.put(key(), kv.BlockView.from_tensor(b, mr_a)) == REGISTER_MR_FAILED
    finally:
        kv.deregister_mr(mr_a)
        kv.deregister_mr(mr_b)


def test_views_after_deregister_mr(kv, store, key, rand, local_store_only):
    tensor = rand(1024)
    mr = kv.register_mr(tensor)
    before = kv.BlockView.from_tensor(tensor, mr)
    k = key()
    assert store.put(k, before) == OK
    assert kv.deregister_mr(mr) is True

    # A view made earlier refers to a region that is gone.
    assert store.put(key("again"), before) == REGISTER_MR_FAILED
    assert store.get(k, before) == REGISTER_MR_FAILED
    # A view made from the deregistered handle has no region at all
    # (the real client's "memblock has no descr ptr").
    after = kv.BlockView.from_tensor(tensor, mr)
    assert store.put(key("after"), after) == INVALID_ARGUMENT
    assert store.get(k, after) == INVALID_ARGUMENT


def test_view_from_deregistered_mr_is_invalid_argument(kv, store, key, rand):
    tensor = rand(1024)
    mr = kv.register_mr(tensor)
    assert kv.deregister_mr(mr) is True
    view = kv.BlockView.from_tensor(tensor, mr)
    assert store.put(key(), view) == INVALID_ARGUMENT


def test_bad_region_fails_only_its_entry_of_a_batch(kv, store, mem, key, rand, local_store_only):
    loose = rand(64)
    keys = [key("a"), key("b"), key("c")]
    views = [
        mem.holding(rand(64, seed=1))[0],
        kv.BlockView.from_buffer(loose.data_ptr(), 64, mem.mr),
        mem.holding(rand(64, seed=3))[0],
    ]
    assert store.mput(keys, views) == [OK, REGISTER_MR_FAILED, OK]
    assert store.mexists(keys) == [True, False, True]
    dsts = [mem.view(64)[0], views[1], mem.view(64)[0]]
    assert store.mget(keys, dsts) == [64, REGISTER_MR_FAILED, 64]


def test_registered_memory_outlives_the_callers_reference(kv, store, key, local_store_only):
    tensor = torch.full((4096,), 42, dtype=torch.uint8)
    mr = kv.register_mr(tensor)
    view = kv.BlockView.from_tensor(tensor, mr)
    del tensor  # the registration keeps the memory, as RDMA registration pins it
    k = key()
    assert store.put(k, view) == OK
    out = store.allocate(4096)
    assert store.get(k, out.view()) == 4096
    assert bool((out.as_ref() == 42).all())
    assert kv.deregister_mr(mr)


def test_region_bound_writes_past_the_view_like_simm(kv, store, mem, key, rand, local_store_only):
    """``local_store_get_bound=region``: SiMM's client bounds a get by the view's
    registered region, not by the view, so a longer object runs over the
    memory after the view and get answers the object's length."""
    data = rand(4096, seed=3)
    k = key()
    assert store.put(k, mem.holding(data)[0]) == OK
    view, chunk = mem.view(1024, fill=0)
    after, tail = mem.view(3072, fill=0xEE)  # the next 3 KiB of the same region
    assert store.get(k, view) == GET_OBJECT_FAILED  # the default bound: the view
    assert bool((tail == 0xEE).all())

    assert kv.set_flag("local_store_get_bound", "region")
    assert store.get(k, view) == 4096
    assert torch.equal(chunk, data[:1024]) and torch.equal(tail, data[1024:])  # overwritten


def test_region_bound_stops_at_the_regions_end(kv, store, key, rand, local_store_only):
    region = torch.zeros(2048, dtype=torch.uint8)
    mr = kv.register_mr(region)
    k = key()
    src = store.allocate(4096)
    src.as_ref().copy_(rand(4096))
    assert store.put(k, src.view()) == OK
    assert kv.set_flag("local_store_get_bound", "region")
    view = kv.BlockView.from_buffer(region.data_ptr() + 1024, 512, mr)
    assert store.get(k, view) == GET_OBJECT_FAILED  # on SiMM, an RDMA access error
    assert bool((region == 0).all())
    assert kv.deregister_mr(mr)
