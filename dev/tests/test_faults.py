"""Fault injection on the local store: error rate, latency, outage,
corrupt reads; and the wrapper that injects them, there only while a fault
is set.

Injected failures stand for transport failures, which the real client
returns unchanged on every path.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from sglang_simm.errors import DS_KEY_NOT_FOUND, GET_OBJECT_FAILED, OK, SEND_RPC_FAILED, TARGET_UNAVAILABLE


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def stored(store, mem, key, rand):
    """Three objects written before any fault: ``(keys, datas)``."""
    keys = [key(str(i)) for i in range(3)]
    datas = [rand(2048, seed=i) for i in range(3)]
    assert store.mput(keys, [mem.holding(d)[0] for d in datas]) == [OK] * 3
    return keys, datas


def every_call(store, mem, keys, code):
    """Assert that every data call on ``keys`` fails with ``code``."""
    views = [mem.view(2048)[0] for _ in keys]
    fresh = [k + "-new" for k in keys]
    assert store.put(fresh[0], views[0]) == code
    assert store.get(keys[0], views[0]) == code
    assert store.delete(keys[0]) == code
    assert store.mput(fresh, views) == [code] * len(keys)
    assert store.mget(keys, views) == [code] * len(keys)
    assert store.exists(keys[0]) is False
    assert store.mexists(keys) == [False] * len(keys)
    assert run(store.put_async(fresh[0], views[0])) == code
    assert run(store.get_async(keys[0], views[0])) == code
    assert run(store.delete_async(keys[0])) == code
    assert run(store.exists_async(keys[0])) is False


def all_readable(store, mem, keys, datas):
    for k, data in zip(keys, datas):
        view, out = mem.view(data.numel())
        assert store.get(k, view) == data.numel()
        assert torch.equal(out, data)


@pytest.mark.parametrize("code", [SEND_RPC_FAILED, TARGET_UNAVAILABLE], ids=["send-rpc-failed", "target-unavailable"])
def test_error_rate_one_fails_every_entry(store, mem, faults, stored, code):
    keys, datas = stored
    faults.configure(error_rate=1.0, error_code=code)
    every_call(store, mem, keys, code)
    faults.configure(error_rate=0.0)
    all_readable(store, mem, keys, datas)  # nothing was lost or changed


def test_error_rate_zero_fails_nothing(store, mem, faults, key, rand):
    faults.configure(error_rate=0.0)
    keys = [key(str(i)) for i in range(50)]
    datas = [rand(100, seed=i) for i in range(50)]
    assert store.mput(keys, [mem.holding(d)[0] for d in datas]) == [OK] * 50
    all_readable(store, mem, keys, datas)
    assert faults.injected == 0


def test_seeded_partial_rate_is_deterministic(kv, mem, key, rand):
    def pattern(server_name: str) -> list[int]:
        assert kv.set_flag("cm_primary_node_ip", server_name)
        kv.configure_faults(server_name, error_rate=0.5, seed=1234)
        store = kv.Store()
        keys = [key(f"{server_name}-{i}") for i in range(200)]
        views = [mem.view(16, fill=i % 256)[0] for i in range(200)]
        return store.mput(keys, views)

    first, second = pattern("seeded-a"), pattern("seeded-b")
    assert first == second
    failed = first.count(SEND_RPC_FAILED)
    assert failed + first.count(OK) == 200
    assert 60 < failed < 140, f"rate 0.5 failed {failed} of 200"
    assert kv.get_server("seeded-a").stats()["injected_errors"] == failed


def test_injected_put_failure_stores_nothing(store, mem, faults, key, rand):
    faults.configure(error_rate=0.5, seed=7)
    keys = [key(str(i)) for i in range(40)]
    codes = store.mput(keys, [mem.view(32, fill=1)[0] for _ in keys])
    faults.configure(error_rate=0.0)
    assert store.mexists(keys) == [c == OK for c in codes]


def test_latency_adds_time(store, mem, faults, stored):
    keys, _ = stored
    view = mem.view(2048)[0]
    faults.configure(latency_us=20_000)
    started = time.perf_counter()
    for _ in range(5):
        store.get(keys[0], view)
    store.mget(keys, [mem.view(2048)[0] for _ in keys])  # one batch call: one delay
    elapsed = time.perf_counter() - started
    assert elapsed >= 6 * 0.020 * 0.9  # generous lower bound only


def test_down_fails_calls_and_store_creation(kv, store, mem, faults, stored):
    keys, datas = stored
    faults.configure(down=True)
    with pytest.raises(RuntimeError):
        kv.Store()
    every_call(store, mem, keys, SEND_RPC_FAILED)
    assert faults.injected > 0

    faults.configure(down=False)
    all_readable(store, mem, keys, datas)  # back up, data intact
    assert isinstance(kv.Store(), kv.Store)
    view = mem.holding(torch.ones(64, dtype=torch.uint8))[0]
    assert store.put(keys[0] + "-after", view) == OK


def test_fault_flags_apply_to_the_current_server(kv, store, mem, server, stored):
    keys, datas = stored
    assert kv.set_flag("local_store_down", "true")
    assert kv.configure_faults(server.name).down is True
    with pytest.raises(RuntimeError):
        kv.Store()
    assert store.get(keys[0], mem.view(2048)[0]) == SEND_RPC_FAILED
    assert kv.set_flag("local_store_down", "false")

    assert kv.set_flag("local_store_error_code", "-1901")
    assert kv.set_flag("local_store_error_rate", "1")
    assert store.get(keys[0], mem.view(2048)[0]) == TARGET_UNAVAILABLE
    assert kv.set_flag("local_store_error_rate", "0")
    all_readable(store, mem, keys, datas)

    assert kv.set_flag("local_store_latency_us", "1500")
    assert kv.configure_faults(server.name).latency_us == 1500.0
    assert kv.set_flag("local_store_seed", "9")
    assert kv.configure_faults(server.name).seed == 9


def test_fault_flags_apply_to_a_server_created_later(kv):
    assert kv.set_flag("local_store_down", "true")
    assert kv.set_flag("cm_primary_node_ip", "created-down")
    with pytest.raises(RuntimeError):
        kv.Store()
    assert kv.configure_faults("created-down").down is True
    assert kv.set_flag("local_store_down", "false")
    assert kv.configure_faults("created-down").down is False
    kv.Store()


def test_faults_are_per_server(kv, store, mem, faults, stored):
    keys, _ = stored
    faults.configure(down=True)
    assert kv.set_flag("cm_primary_node_ip", "healthy-neighbour")
    other = kv.Store()
    view = mem.holding(torch.ones(16, dtype=torch.uint8))[0]
    assert other.put(keys[0], view) == OK
    assert store.put(keys[0], view) == SEND_RPC_FAILED


def test_fault_settings_are_validated(faults):
    with pytest.raises(ValueError):
        faults.configure(error_rate=1.5)
    with pytest.raises(ValueError):
        faults.configure(error_code=0)
    with pytest.raises(ValueError):
        faults.configure(latency_us=-1)
    with pytest.raises(TypeError):
        faults.configure(down="yes")
    with pytest.raises(TypeError):
        faults.configure(flakiness=0.1)
    assert faults.settings.error_rate == 0.0 and faults.settings.down is False


def test_corrupt_reads_flip_bytes_after_a_successful_copy(store, mem, faults, stored):
    keys, datas = stored
    faults.configure(corrupt_rate=1.0)
    targets = [mem.view(2048) for _ in keys]
    # the reads still succeed: the corruption is silent, as on a bad link
    assert store.mget(keys, [view for view, _ in targets]) == [2048] * len(keys)
    for (_, out), data in zip(targets, datas):
        assert torch.equal(out, data ^ 0x80)  # every byte's top bit flipped
    view, out = mem.view(2048)
    assert store.get(keys[0], view) == 2048
    assert torch.equal(out, datas[0] ^ 0x80)
    assert faults.corrupted == len(keys) + 1

    faults.configure(corrupt_rate=0.0)
    all_readable(store, mem, keys, datas)  # the stored objects were never touched


def test_corrupt_reads_leave_misses_and_writes_alone(store, mem, faults, key, rand):
    faults.configure(corrupt_rate=1.0)
    data = rand(512, seed=3)
    view, _ = mem.holding(data)
    assert store.put(key("w"), view) == OK
    miss_view, miss_out = mem.view(512, fill=7)
    assert store.get(key("absent"), miss_view) < 0
    assert torch.equal(miss_out, torch.full((512,), 7, dtype=torch.uint8))  # a miss copies nothing
    assert faults.corrupted == 0
    faults.configure(corrupt_rate=0.0)
    all_readable(store, mem, [key("w")], [data])


def test_corrupt_reads_flag_reaches_the_server(kv, store, mem, server, stored):
    keys, datas = stored
    assert kv.set_flag("local_store_corrupt_reads", "1")
    assert kv.configure_faults(server.name).corrupt_rate == 1.0
    view, out = mem.view(2048)
    assert store.get(keys[1], view) == 2048
    assert torch.equal(out, datas[1] ^ 0x80)
    assert not kv.set_flag("local_store_corrupt_reads", "2")  # outside 0..1: refused
    assert kv.set_flag("local_store_corrupt_reads", "0")
    all_readable(store, mem, keys, datas)


def test_corrupt_rate_is_validated(kv, faults):
    with pytest.raises(ValueError, match="corrupt_rate"):
        faults.configure(corrupt_rate=1.5)
    with pytest.raises(TypeError, match="corrupt_rate"):
        faults.configure(corrupt_rate=True)
    assert faults.settings.corrupt_rate == 0.0
    faults.configure(corrupt_rate=0.5)
    assert "corrupt_rate=0.5" in repr(kv.get_server(faults.name))
    faults.configure(corrupt_rate=0.0)
    assert faults.settings == kv.FaultSettings()


# -- the wrapper: there only while a fault is set ---------------------------------------


def test_with_no_fault_set_a_store_reaches_its_server_directly(kv, store, server, mem, stored):
    keys, datas = stored
    assert store.server is server and not isinstance(server, kv.FaultyServer)
    all_readable(store, mem, keys, datas)
    # the error code and the seed alone inject nothing: still no wrapper
    assert kv.set_flag("local_store_error_code", "-1901") and kv.set_flag("local_store_seed", "5")
    assert store.server is server
    assert server.stats()["injected_errors"] == 0


def test_a_fault_flag_set_at_run_time_reaches_an_existing_store(kv, store, server, mem, stored):
    keys, datas = stored
    other = kv.Store()  # a second client of the same store
    assert kv.set_flag("local_store_error_rate", "1")
    assert isinstance(store.server, kv.FaultyServer) and store.server is other.server
    assert store.server.store is server
    assert store.get(keys[0], mem.view(2048)[0]) == SEND_RPC_FAILED
    assert other.mget(keys, [mem.view(2048)[0] for _ in keys]) == [SEND_RPC_FAILED] * len(keys)
    assert store.server.stats()["injected_errors"] == 1 + len(keys)
    # back to its default: the wrapper is gone, and nothing was lost
    assert kv.set_flag("local_store_error_rate", "0.0")
    assert store.server is server and other.server is server
    all_readable(store, mem, keys, datas)
    assert server.stats()["injected_errors"] == 0


def test_each_fault_unset_takes_the_wrapper_away_only_once_none_is_left(kv, store, server, faults, stored):
    faults.configure(down=True, latency_us=1.0)
    assert isinstance(store.server, kv.FaultyServer)
    faults.configure(down=False)
    assert isinstance(store.server, kv.FaultyServer)  # the latency is still set
    assert kv.set_flag("local_store_latency_us", "0")  # the flags name this store too
    assert store.server is server


def test_a_store_made_while_a_fault_flag_is_set_gets_the_wrapper(kv, mem, key):
    assert kv.set_flag("local_store_corrupt_reads", "1")
    assert kv.set_flag("cm_primary_node_ip", "made-corrupt")
    store = kv.Store()
    assert isinstance(store.server, kv.FaultyServer)
    data = torch.arange(64, dtype=torch.uint8)
    assert store.put(key("x"), mem.holding(data)[0]) == OK
    view, out = mem.view(64)
    assert store.get(key("x"), view) == 64
    assert torch.equal(out, data ^ 0x80)
    assert kv.set_flag("local_store_corrupt_reads", "0")
    assert not isinstance(store.server, kv.FaultyServer)


def test_injected_codes_pass_through_where_the_stores_own_refusals_are_mapped(store, mem, faults, key, stored):
    """A sync get maps the store's miss to GetObjectFailed but passes the
    same code through when the network injected it."""
    keys, _ = stored
    assert store.get(key("absent"), mem.view(64)[0]) == GET_OBJECT_FAILED
    faults.configure(error_rate=1.0, error_code=DS_KEY_NOT_FOUND)
    assert store.get(keys[0], mem.view(2048)[0]) == DS_KEY_NOT_FOUND
    assert store.put(key("new"), mem.view(64)[0]) == DS_KEY_NOT_FOUND
    faults.configure(error_rate=0.0)
