"""Attach, re-registration and close: memory and clients released exactly once,
never while a data-path call can still use them."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from pages import fill_random, hashes, page, raw, slots, tiny
from sglang_simm.local_store import _kv as kv_layer


def _live_regions() -> int:
    return len(kv_layer._regions)


def _wait(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def build_pool(geom, tokens):
    from sglang_simm_dev.pools import build_host_pool

    return build_host_pool(geom, tokens=tokens)


def test_registering_several_regions_is_all_or_none():
    """A pool of several regions (a Mamba pool's) whose last region fails
    to register leaves none registered."""
    from sglang_simm.binding import register_regions

    live, gone = [], []

    class Client:
        def register(self, tensor):
            if len(live) == 2:
                raise MemoryError("no room for the last region")
            live.append(tensor)
            return tensor

        def deregister(self, mr):
            gone.append(mr)

    regions = [torch.zeros(8) for _ in range(3)]
    with pytest.raises(MemoryError):
        register_regions(Client(), regions)
    assert [id(t) for t in gone] == [id(t) for t in live] == [id(t) for t in regions[:2]]


def test_a_failed_attach_closes_the_client_it_opened(attach, monkeypatch):
    from sglang_simm import backend as backend_module
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
    from sglang_simm_dev.pools import build_host_pool

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

    from sglang_simm_dev.pools import build_host_pool

    backend, kv = attach(tiny(), tokens=16)
    geom = tiny(layer_num=1, name="swa-layers")
    old = kv if which == "kv" else build_host_pool(geom, tokens=16)
    if which == "side":
        backend.register_mem_host_pool_v2(old, PoolName.SWA)
    binding = backend.pools.kv if which == "kv" else backend.pools.side["swa"]
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

    real_mget = backend.client.mget_views
    started, proceed = threading.Event(), threading.Event()

    def held_mget(obj_keys, views):
        started.set()
        assert proceed.wait(10)
        return real_mget(obj_keys, views)

    backend.client.mget_views = held_mget
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
    backend.client.mget_views = real_mget
    proceed.set()
    reader.join(10)
    assert result["got"] == [True, True]
    assert all(torch.equal(page(old, 4 + p), want[p]) for p in range(2))
    assert _wait(lambda: binding.mrs == [])  # released once the get was done




def _held_client(backend, events):
    """Wrap the backend's client: ``mget`` waits for the calling thread's
    event in ``gates`` (when it has one); deregistrations and the close are
    recorded in ``events`` with the thread that ran them."""
    client = backend.client
    real_mget, real_dereg, real_close = client.mget_views, client.deregister, client.close
    gates: dict[str, threading.Event] = {}
    started: dict[str, threading.Event] = {}

    def mget(keys, views):
        name = threading.current_thread().name
        if name in gates:
            started[name].set()
            assert gates[name].wait(10)
        events.append(("mget", name))
        return real_mget(keys, views)

    def deregister(mr):
        events.append(("deregister", threading.current_thread().name))
        return real_dereg(mr)

    def close():
        events.append(("close", threading.current_thread().name))
        return real_close()

    client.mget_views, client.deregister, client.close = mget, deregister, close

    def hold(name):
        gates[name], started[name] = threading.Event(), threading.Event()
        return gates[name], started[name]

    return hold


def test_close_lets_calls_in_flight_finish_then_deregisters_then_closes_the_client(attach, caplog):
    """SGLang closes the backend on every runtime detach. A get still in
    flight then reads every byte; a call that starts after close() began
    misses at once, logging nothing; the memory is deregistered after the
    get, and the client closed after that, by the closing thread."""
    import logging

    backend, host = attach(tiny())
    fill_random(host, 61)
    keys = hashes(2)
    want = [page(host, p) for p in range(2)]
    assert backend.batch_set_v1(keys, slots(host, 0, 2)) == [True, True]
    fill_random(host, 62)
    events: list = []
    hold = _held_client(backend, events)
    gate, started = hold("prefetch-io")
    result = {}
    reader = threading.Thread(
        target=lambda: result.setdefault("got", backend.batch_get_v1(keys, slots(host, 4, 2))), name="prefetch-io")
    closer = threading.Thread(target=backend.close, name="detach")
    with caplog.at_level(logging.DEBUG, logger="sglang_simm"):
        reader.start()
        assert started.wait(10)
        closer.start()
        assert _wait(lambda: backend.pools.closed)
        assert backend.batch_get_v1(keys, slots(host, 6, 2)) == [False, False]  # no new call starts
        assert backend.batch_exists(keys) == 0 and backend.batch_set_v1(keys, slots(host, 6, 2)) == [False] * 2
        assert closer.is_alive() and events == []  # memory stays registered while the get reads
        gate.set()
        reader.join(10)
        closer.join(20)
    assert result["got"] == [True, True]
    assert all(torch.equal(page(host, 4 + p), want[p]) for p in range(2))
    assert events == [("mget", "prefetch-io"), ("deregister", "detach"), ("close", "detach")]
    assert backend.stats()["errors"] == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def test_a_replaced_pool_is_released_when_its_own_calls_end_never_by_a_data_thread(attach):
    """The old pool's get ends while a get on the new pool is still in
    flight (there is never a moment with no call at all): the old pool is
    deregistered anyway, by a thread of the backend's, not the data thread."""
    backend, old = attach(tiny(), tokens=16)
    keys = hashes(2)
    fill_random(old, 63)
    assert backend.batch_set_v1(keys, slots(old, 0, 2)) == [True, True]
    old_binding = backend.pools.kv
    events: list = []
    hold = _held_client(backend, events)
    old_gate, old_started = hold("io-old")
    new_gate, new_started = hold("io-new")
    got = {}

    def read(name, pool):
        got[name] = backend.batch_get_v1(keys, slots(pool, 4, 2))

    first = threading.Thread(target=read, args=("io-old", old), name="io-old")
    first.start()
    assert old_started.wait(10)
    new = build_pool(tiny(), 16)
    backend.register_mem_pool_host(new)
    second = threading.Thread(target=read, args=("io-new", new), name="io-new")
    second.start()
    assert new_started.wait(10)
    assert old_binding.mrs  # its get still reads into it
    old_gate.set()
    first.join(10)
    assert _wait(lambda: old_binding.mrs == [])  # while the new pool's get is in flight
    assert second.is_alive() and backend.pools.kv.mrs
    new_gate.set()
    second.join(10)
    assert got == {"io-old": [True, True], "io-new": [True, True]}
    deregistered_by = [who for what, who in events if what == "deregister"]
    assert deregistered_by and not set(deregistered_by) & {"io-old", "io-new"}


def test_a_new_kv_pool_through_v2_replaces_the_bound_one_like_v1(attach):
    """register_mem_host_pool_v2(pool, KV) with a pool other than the bound
    one: pages then move to and from the new pool only, and the old one's
    memory is deregistered."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, old = attach(tiny(), tokens=16)
    old_binding = backend.pools.kv
    backend.register_mem_host_pool_v2(old, PoolName.KV)  # the same pool: nothing changes
    assert backend.pools.kv is old_binding
    new = build_pool(tiny(), 16)
    backend.register_mem_host_pool_v2(new, PoolName.KV)
    assert backend.pools.kv.pool is new and backend.mem_pool_host is new
    assert _wait(lambda: old_binding.mrs == [])
    fill_random(new, 71)
    fill_random(old, 72)
    keys = hashes(2)
    want = [page(new, p) for p in range(2)]
    assert backend.batch_set_v1(keys, slots(new, 0, 2)) == [True, True]
    fill_random(new, 73)
    old_bytes = raw(old)
    assert backend.batch_get_v1(keys, slots(new, 4, 2)) == [True, True]
    assert all(torch.equal(page(new, 4 + p), want[p]) for p in range(2))
    assert torch.equal(raw(old), old_bytes)


def test_the_objects_the_backend_keeps_stay_bounded_however_many_pages_it_touches(attach, monkeypatch):
    """Touching every page of a pool leaves no object per page (nor per
    object) for the garbage collector to walk: views are made per batch."""
    backend, host = attach(tiny(), tokens=2048 * tiny().page_size)
    pages = host.size // host.page_size
    fill_random(host, 81)
    keys = hashes(pages)
    gc.collect()
    before = len(gc.get_objects())
    for lo in range(0, pages, 128):
        n = min(128, pages - lo)
        assert all(backend.batch_set_v1(keys[lo:lo + n], slots(host, lo, n)))
        assert backend.batch_exists(keys[lo:lo + n]) == n
        assert all(backend.batch_get_v1(keys[lo:lo + n], slots(host, lo, n)))
    gc.collect()
    assert len(gc.get_objects()) - before < 200, f"{pages} pages touched"


def _store_clients(store_name):
    """Process ids with a connection to the local store, asked over a
    connection of its own (which the store leaves out)."""
    from sglang_simm.local_store._handle import StoreHandle

    probe = StoreHandle(store_name, root=os.environ["SGLANG_SIMM_STORE_DIR"], capacity=1 << 20, spawn=False)
    probe.open()
    try:
        return probe.status()["clients"]
    finally:
        probe.close()


def test_sglang_runtime_detach_closes_cleanly_and_a_reattach_finds_the_pages(store_name, caplog):
    """SGLang 0.5.23's own controller, its backup, prefetch and prefetch-IO
    threads running: pages backed up, the backend detached as
    ``DELETE /hicache/storage-backend`` does (``detach_storage_backend``),
    then attached again: the new backend finds and loads the same bytes.
    After the detach this process holds no connection to the store."""
    import logging

    from sglang_simm.local_store import reset_servers
    from sglang_simm_dev.demo.common import PageHasher
    from sglang_simm_dev.demo.drivers import ControllerDriver

    geom = tiny()
    ps = geom.page_size
    extra = {"manager_address": f"local://{store_name}"}
    hasher = PageHasher()
    driver = ControllerDriver(geom, "page_first", 64, extra, hasher, timeout_s=60.0)
    try:
        tokens = list(range(1000, 1000 + 6 * ps))
        keys = hasher(tokens, ps)
        indices = driver.alloc(len(tokens))
        fill_random(driver.host, 91)
        first = indices[::ps].tolist()
        want = [page(driver.host, s // ps) for s in first]
        stored, _ = driver.write(keys, tokens, indices, lambda n: None)
        assert stored == 6
        backend = driver.backend
        bindings = [backend.pools.kv]
        assert os.getpid() in _store_clients(store_name)
        with caplog.at_level(logging.WARNING):
            driver.cc.detach_storage_backend()
        assert backend.pools.closed and backend.client.closed and bindings[0].mrs == []
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert os.getpid() not in _store_clients(store_name)

        driver.cc.attach_storage_backend("simm", prefetch_threshold=ps, model_name=geom.name,
                                         storage_backend_extra_config=dict(extra))
        driver.backend = driver.cc.storage_backend
        assert driver.backend is not backend
        fill_random(driver.host, 92)
        hits, loaded, got, _, _ = driver.fetch("after-reattach", tokens, keys, None, lambda n: None)
        assert hits == loaded == 6
        assert all(torch.equal(page(driver.host, s // ps), want[i])
                   for i, s in enumerate(got[::ps].tolist()))
    finally:
        driver.close()
        reset_servers(store_name)


def test_after_the_last_backend_closes_the_process_holds_no_connection(attach, store_name):
    one, _ = attach(tiny())
    two, _ = attach(tiny())
    assert os.getpid() in _store_clients(store_name)
    one.close()
    assert os.getpid() in _store_clients(store_name)  # the other backend still uses it
    assert two.batch_exists(hashes(1)) == 0 and two.stats()["errors"] == {}
    two.close()
    assert os.getpid() not in _store_clients(store_name)
    three, host = attach(tiny())  # a later backend connects again
    fill_random(host, 93)
    assert three.batch_set_v1(hashes(1), slots(host, 0, 1)) == [True]
