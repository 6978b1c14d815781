"""Attach, re-registration and close: memory and clients released exactly once,
never while a data-path call can still use them."""

from __future__ import annotations

import threading

import pytest
import torch

from pages import fill_random, hashes, page, slots, tiny
from sglang_simm.embedded import _client as embedded_client


def _live_regions() -> int:
    return len(embedded_client._regions)


def test_a_failure_after_registration_deregisters_the_pools_memory(attach, monkeypatch):
    from sglang_simm import binding

    class Broken:
        def __init__(self, *args, **kwargs):
            raise MemoryError("no room for the view table")

    monkeypatch.setattr(binding, "ViewTable", Broken)
    before = _live_regions()
    with pytest.raises(MemoryError):
        attach(tiny())
    assert _live_regions() == before


def test_a_failed_attach_closes_the_client_it_opened(attach, monkeypatch):
    from sglang_simm import lifecycle as backend_module
    from sglang_simm.errors import UnsupportedPoolError

    opened = []

    def connect(config, **kwargs):
        opened.append(backend_module_connect(config, **kwargs))
        return opened[-1]

    backend_module_connect = backend_module.connect
    monkeypatch.setattr(backend_module, "connect", connect)
    with pytest.raises(UnsupportedPoolError):
        attach(tiny(), layout="layer_first")
    assert len(opened) == 1 and opened[0].closed


def test_registering_with_a_closed_backend_is_refused(attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from sglang_simm.errors import BackendClosedError
    from sglang_simm.tools.pools import build_host_pool

    backend, _ = attach(tiny())
    backend.close()
    before = _live_regions()
    other = build_host_pool(tiny(), tokens=16)
    with pytest.raises(BackendClosedError, match="closed"):
        backend.register_mem_pool_host(other)
    with pytest.raises(BackendClosedError, match="closed"):
        backend.register_mem_host_pool_v2(build_host_pool(tiny(layer_num=1), tokens=16), PoolName.SWA)
    with pytest.raises(BackendClosedError, match="closed"):
        backend.register_mem_host_pool_v2(other, PoolName.KV)
    assert _live_regions() == before
    assert backend.batch_get_v1(hashes(1), slots(other, 0, 1)) == [False]  # the data path still never raises


@pytest.mark.parametrize("which", ["side", "kv"])
def test_a_replaced_pool_stays_registered_until_the_calls_using_it_end(attach, which):
    """A get is in flight into the old pool when SGLang re-registers the
    name with a new pool: the old pool's memory stays registered until that
    get is done (it reads every byte), then it is deregistered."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    from sglang_simm.tools.pools import build_host_pool

    backend, kv = attach(tiny(), tokens=16)
    geom = tiny(layer_num=1, name="swa-layers")
    old = kv if which == "kv" else build_host_pool(geom, tokens=16)
    if which == "side":
        backend.register_mem_host_pool_v2(old, PoolName.SWA)
    binding = backend._kv if which == "kv" else backend._side["swa"]
    fill_random(old, 51)
    keys = hashes(2)
    want = [page(old, p) for p in range(2)]

    def transfer(pool_slots):
        return PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=pool_slots, hit_policy=PoolHitPolicy.ALL_PAGES)

    if which == "kv":
        assert backend.batch_set_v1(keys, slots(old, 0, 2)) == [True, True]
    else:
        assert backend.batch_set_v2([transfer(slots(old, 0, 2))])[PoolName.SWA] == [True, True]
    fill_random(old, 52)

    real_mget = backend.client.mget
    started, proceed = threading.Event(), threading.Event()

    def held_mget(obj_keys, views):
        started.set()
        assert proceed.wait(10)
        return real_mget(obj_keys, views)

    backend.client.mget = held_mget
    result = {}

    def get():
        if which == "kv":
            result["got"] = backend.batch_get_v1(keys, slots(old, 4, 2))
        else:
            result["got"] = backend.batch_get_v2([transfer(slots(old, 4, 2))])[PoolName.SWA]

    reader = threading.Thread(target=get)
    reader.start()
    assert started.wait(10)
    replacement = build_host_pool(tiny() if which == "kv" else geom, tokens=16)
    if which == "kv":
        backend.register_mem_pool_host(replacement)
    else:
        backend.register_mem_host_pool_v2(replacement, PoolName.SWA)
    assert binding.mrs, "deregistered while a get was still reading into it"
    backend.client.mget = real_mget
    proceed.set()
    reader.join(10)
    assert result["got"] == [True, True]
    assert all(torch.equal(page(old, 4 + p), want[p]) for p in range(2))
    assert binding.mrs == []  # released once the get was done


def test_views_are_made_on_first_use_and_kept_up_to_the_limit(attach, monkeypatch):
    from sglang_simm import binding as binding_module

    backend, host = attach(tiny())
    table = backend._kv.views
    assert len(table) == 0  # attach makes no view
    fill_random(host, 53)
    keys = hashes(6)
    want = [page(host, p) for p in range(6)]
    assert all(backend.batch_set_v1(keys, slots(host, 0, 6)))
    assert len(table) == 6
    fill_random(host, 54)
    assert all(backend.batch_get_v1(keys, slots(host, 0, 6)))  # the views kept
    assert all(torch.equal(page(host, p), want[p]) for p in range(6))

    monkeypatch.setattr(binding_module, "VIEW_TABLE_LIMIT", 2 * 3)  # 3 pages of 2 objects
    small, shost = attach(tiny())
    keys = hashes(6, salt="small")  # not the pages the first backend stored
    fill_random(shost, 55)
    want = [page(shost, p) for p in range(6)]
    assert all(small.batch_set_v1(keys[:2], slots(shost, 0, 2)))
    assert all(small.batch_set_v1(keys[2:], slots(shost, 2, 4)))  # past the limit: made per call
    assert len(small._kv.views) == 2
    fill_random(shost, 56)
    assert all(small.batch_get_v1(keys, slots(shost, 8, 6)))
    assert all(torch.equal(page(shost, 8 + p), want[p]) for p in range(6))
    assert len(small._kv.views) <= 3
