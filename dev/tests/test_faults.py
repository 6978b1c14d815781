"""The fault instrument (``sglang_simm_dev.faults``): a faulty network in
front of the local store, set per store for this process. An outage fails
whole calls with the store unreachable, an error rate fails that share of
the entries with its code (seeded: the same entries every time), latency
delays each call, corrupt reads flip the bytes a hit copied while still
reporting the hit; ``"*"`` reaches every store without settings of its own.
The store itself never sees any of it: clearing a fault finds every object
as it was. Settings are checked before anything changes, in Python and in
``SGLANG_SIMM_FAULTS``; the wrapper is called as the handle's own methods are.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import uuid

import pytest
import torch

from sglang_simm import local_store as kv
from sglang_simm.local_store import StoreHandle, StoreUnreachable
from sglang_simm.simm_rules import (
    BUILD_CONNECTION_FAILED,
    DS_KEY_NOT_FOUND,
    GET_OBJECT_FAILED,
    OK,
    SEND_RPC_FAILED,
    TARGET_UNAVAILABLE,
    TIMEOUT,
)
from sglang_simm_dev import faults as instrument
from sglang_simm_dev.faults import ENV, FaultSettings, configure_faults, injected, install_from_env

SIZE = 2048


class Memory:
    """Registered host memory handing out views, as a backend carves its host pool."""

    def __init__(self) -> None:
        self.arena = torch.zeros(8 << 20, dtype=torch.uint8)
        self.mr = kv.register_mr(self.arena)
        self.offset = 0

    def view(self, size: int, fill: int = 0):
        """``(view, tensor)`` over ``size`` fresh bytes, each ``fill``."""
        chunk = self.arena[self.offset:self.offset + size]
        self.offset += (size + 63) // 64 * 64
        chunk.fill_(fill)
        return kv.BlockView.from_tensor(chunk, self.mr), chunk

    def holding(self, data: torch.Tensor):
        view, chunk = self.view(data.numel())
        chunk.copy_(data)
        return view, chunk

    def close(self) -> None:
        kv.deregister_mr(self.mr)


def random_bytes(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def mem():
    memory = Memory()
    yield memory
    memory.close()


@pytest.fixture
def faults():
    """``faults(name, **changes)``: ``configure_faults``, every store it named
    (``"*"`` too) given back its defaults after the test."""
    named: set[str] = set()

    def configure(name: str, **changes):
        named.add(name)
        return configure_faults(name, **changes)

    yield configure
    for name in named:
        configure_faults(name, **vars(FaultSettings()))


@pytest.fixture
def open_store():
    """``open_store()`` -> ``(name, Store)``: a fresh store on a thread of this
    process (``local_store_scope=process``), stopped after the test."""
    made: list[tuple[str, kv.Store]] = []

    def make():
        name = f"faults-{uuid.uuid4().hex[:10]}"
        assert kv.set_flag("local_store_scope", "process") and kv.set_flag("cm_primary_node_ip", name)
        made.append((name, kv.Store()))
        return made[-1]

    yield make
    for name, store in made:
        store.close()
    kv.reset_servers(*(name for name, _ in made))


@pytest.fixture
def stored(open_store, mem):
    """``(name, store, keys, datas)``: three objects written before any fault."""
    name, store = open_store()
    keys = [f"obj-{i}" for i in range(3)]
    datas = [random_bytes(SIZE, seed=i) for i in range(3)]
    assert store.mput(keys, [mem.holding(d)[0] for d in datas]) == [OK] * 3
    return name, store, keys, datas


def all_readable(store, mem, keys, datas) -> None:
    """Every object reads back whole and unchanged."""
    for key, data in zip(keys, datas):
        view, out = mem.view(data.numel())
        assert store.get(key, view) == data.numel()
        assert torch.equal(out, data), key


def every_call_fails(store, mem, keys, code) -> None:
    """Every data call of the client, sync, batch and async, fails every entry with ``code``."""
    views = [mem.view(SIZE)[0] for _ in keys]
    fresh = [f"{k}-new" for k in keys]
    assert store.put(fresh[0], views[0]) == code
    assert store.get(keys[0], views[0]) == code
    assert store.delete(keys[0]) == code
    assert store.mput(fresh, views) == [code] * len(keys)
    assert store.mget(keys, views) == [code] * len(keys)
    assert store.mexists_codes(keys) == [code] * len(keys)
    assert store.exists(keys[0]) is False and store.mexists(keys) == [False] * len(keys)
    assert asyncio.run(store.put_async(fresh[0], views[0])) == code
    assert asyncio.run(store.get_async(keys[0], views[0])) == code
    assert asyncio.run(store.delete_async(keys[0])) == code
    assert asyncio.run(store.exists_async(keys[0])) is False


# -- outage ---------------------------------------------------------------------------


def test_an_outage_fails_every_call_with_the_store_unreachable_and_heals_when_cleared(stored, mem, faults):
    name, store, keys, datas = stored
    handle = kv.get_server(name)
    seen_before = {k: handle.stats()[k] for k in ("puts", "gets", "deletes")}
    faults(name, down=True)

    every_call_fails(store, mem, keys, SEND_RPC_FAILED)
    with pytest.raises(StoreUnreachable) as unreachable:  # the handle: a whole batch refused at once
        handle.get_into([(k, 0, SIZE) for k in keys])
    assert unreachable.value.code == SEND_RPC_FAILED and repr(name) in str(unreachable.value)
    with pytest.raises(StoreUnreachable):
        kv.get_server(name)  # nor can the store be joined
    with pytest.raises(RuntimeError, match="Init client messenger failed"):
        kv.Store()
    assert injected(name) > 0
    # the calls never reached the store
    assert {k: handle.stats()[k] for k in seen_before} == seen_before

    faults(name, down=False)
    all_readable(store, mem, keys, datas)
    assert isinstance(kv.Store(), kv.Store)
    assert store.put("after", mem.view(64, fill=1)[0]) == OK


# -- error rate -------------------------------------------------------------------------


@pytest.mark.parametrize("code", [SEND_RPC_FAILED, TIMEOUT, BUILD_CONNECTION_FAILED],
                         ids=["send-rpc-failed", "timeout", "build-connection-failed"])
def test_an_error_rate_of_one_fails_every_entry_with_its_transport_code(stored, mem, faults, code):
    name, store, keys, datas = stored
    faults(name, error_rate=1.0, error_code=code)
    every_call_fails(store, mem, keys, code)
    faults(name, error_rate=0.0)
    all_readable(store, mem, keys, datas)  # nothing was lost or changed


def test_an_injected_code_reaches_the_handle_as_the_stores_answer(stored, mem, faults):
    """Codes other than transport failures are what the store would have
    answered: the handle returns them as they are, and the client maps them
    as it maps the store's own (a sync get's failure is GetObjectFailed)."""
    name, store, keys, _ = stored
    faults(name, error_rate=1.0, error_code=TARGET_UNAVAILABLE)
    handle = kv.get_server(name)
    assert handle.lookup(keys) == [TARGET_UNAVAILABLE] * len(keys)
    assert handle.delete(keys[0]) == TARGET_UNAVAILABLE
    assert store.get(keys[0], mem.view(SIZE)[0]) == GET_OBJECT_FAILED
    faults(name, error_code=DS_KEY_NOT_FOUND)
    assert handle.lookup(keys[:1]) == [DS_KEY_NOT_FOUND]


def test_an_error_rate_fails_that_share_of_the_entries_and_a_seed_fails_the_same_ones(open_store, mem, faults):
    def pattern(seed: int) -> tuple[str, kv.Store, list[str], list[int]]:
        name, store = open_store()
        faults(name, error_rate=0.5, seed=seed)
        keys = [f"k-{i}" for i in range(200)]
        return name, store, keys, store.mput(keys, [mem.view(16, fill=i % 256)[0] for i in range(200)])

    name, store, keys, first = pattern(1234)
    assert set(first) == {OK, SEND_RPC_FAILED}
    failed = first.count(SEND_RPC_FAILED)
    assert 60 < failed < 140, f"rate 0.5 failed {failed} of 200"
    assert injected(name) == failed
    assert pattern(1234)[3] == first  # the same seed: the same entries
    assert pattern(4321)[3] != first  # another seed: others
    faults(name, error_rate=0.0)
    # a failed put stored nothing, every other one its object
    assert store.mexists(keys) == [code == OK for code in first]


def test_an_error_rate_of_zero_fails_nothing(stored, mem, faults):
    name, store, keys, datas = stored
    faults(name, error_rate=0.0, error_code=TIMEOUT, seed=5)  # a code and a seed alone inject nothing
    more = [f"more-{i}" for i in range(50)]
    more_datas = [random_bytes(100, seed=i) for i in range(50)]
    assert store.mput(more, [mem.holding(d)[0] for d in more_datas]) == [OK] * 50
    all_readable(store, mem, keys + more, datas + more_datas)
    assert injected(name) == 0


# -- latency -----------------------------------------------------------------------------


def test_latency_delays_each_call_once_whatever_its_entries(stored, mem, faults):
    name, store, keys, _ = stored
    faults(name, latency_us=50_000)
    views = [mem.view(SIZE)[0] for _ in keys]
    started = time.perf_counter()
    for _ in range(4):
        assert store.get(keys[0], views[0]) == SIZE
    assert time.perf_counter() - started >= 4 * 0.050 * 0.9

    batch = [keys[i % len(keys)] for i in range(40)]
    started = time.perf_counter()
    assert store.mexists(batch) == [True] * 40
    elapsed = time.perf_counter() - started
    # one delay for the batch, not one per entry (40 would be 2 s)
    assert 0.050 * 0.9 <= elapsed < 1.0, elapsed


# -- corrupt reads -----------------------------------------------------------------------


def test_corrupt_reads_flip_every_byte_a_hit_copied_and_still_report_the_hit(stored, mem, faults):
    name, store, keys, datas = stored
    faults(name, corrupt_rate=1.0)
    targets = [mem.view(SIZE) for _ in keys]
    assert store.mget(keys, [view for view, _ in targets]) == [SIZE] * len(keys)  # silent, as a bad link is
    for (_, out), data in zip(targets, datas):
        assert torch.equal(out, data ^ 0x80)  # every byte's top bit
    # a view longer than the object: only the bytes read are flipped
    view, out = mem.view(SIZE + 64, fill=7)
    assert store.get(keys[0], view) == SIZE
    assert torch.equal(out[:SIZE], datas[0] ^ 0x80) and bool((out[SIZE:] == 7).all())

    faults(name, corrupt_rate=0.0)
    all_readable(store, mem, keys, datas)  # the stored objects were never touched


def test_corrupt_reads_leave_misses_and_writes_alone(stored, mem, faults):
    name, store, _, _ = stored
    faults(name, corrupt_rate=1.0)
    data = random_bytes(512, seed=3)
    assert store.put("written", mem.holding(data)[0]) == OK
    miss_view, miss_out = mem.view(512, fill=7)
    assert store.get("absent", miss_view) == GET_OBJECT_FAILED
    assert bool((miss_out == 7).all())  # a miss copies nothing, and nothing is flipped
    faults(name, corrupt_rate=0.0)
    all_readable(store, mem, ["written"], [data])  # the write stored the true bytes


def test_a_corrupt_rate_flips_that_share_of_the_hits_whole(stored, mem, faults):
    name, store, keys, datas = stored
    faults(name, corrupt_rate=0.5, seed=11)
    flipped = 0
    for i in range(60):
        view, out = mem.view(SIZE)
        assert store.get(keys[i % 3], view) == SIZE
        data = datas[i % 3]
        assert torch.equal(out, data) or torch.equal(out, data ^ 0x80)  # a read is flipped whole or not at all
        flipped += not torch.equal(out, data)
    assert 10 < flipped < 50, f"rate 0.5 flipped {flipped} of 60"


def test_corrupt_reads_of_a_store_process_leave_its_objects_whole(store_name, mem, faults):
    """The same on a store in a process of its own (the suite's ``store_name``:
    ``local_store_scope=host``): the flip happens in this client's memory."""
    assert kv.set_flag("cm_primary_node_ip", store_name)
    store = kv.Store()
    try:
        data = random_bytes(SIZE, seed=8)
        assert store.put("k", mem.holding(data)[0]) == OK
        faults(store_name, corrupt_rate=1.0)
        view, out = mem.view(SIZE)
        assert store.get("k", view) == SIZE and torch.equal(out, data ^ 0x80)
        faults(store_name, corrupt_rate=0.0)
        all_readable(store, mem, ["k"], [data])
    finally:
        store.close()
        kv.reset_servers(store_name)


# -- which stores ---------------------------------------------------------------------------


def test_a_stores_faults_leave_every_other_store_alone(stored, open_store, mem, faults):
    name, store, keys, _ = stored
    faults(name, down=True)
    _, neighbour = open_store()
    view = mem.view(16, fill=1)[0]
    assert neighbour.put(keys[0], view) == OK
    assert store.put(keys[0], view) == SEND_RPC_FAILED


def test_star_reaches_every_store_without_settings_of_its_own(open_store, mem, faults):
    (a, store_a), (b, store_b), (own, store_own) = open_store(), open_store(), open_store()
    faults(own, latency_us=0)  # settings of its own, injecting nothing
    faults("*", error_rate=1.0)
    view = mem.view(16, fill=1)[0]
    assert store_a.put("x", view) == SEND_RPC_FAILED and store_b.mput(["x", "y"], [view, view]) == [SEND_RPC_FAILED] * 2
    assert store_own.put("x", view) == OK
    assert injected("*") == 3  # counted under "*", the settings that failed them
    assert injected(a) == injected(b) == 0
    faults("*", error_rate=0.0)
    assert store_a.put("x", view) == OK and store_b.put("x", view) == OK


def test_star_down_keeps_a_store_from_being_joined(faults):
    faults("*", down=True)
    assert kv.set_flag("local_store_scope", "process")
    assert kv.set_flag("cm_primary_node_ip", f"never-{uuid.uuid4().hex[:8]}")
    with pytest.raises(RuntimeError, match="down"):
        kv.Store()


# -- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, error, words", [
    pytest.param({"error_rate": 1.5}, ValueError, "error_rate must be within 0..1, got 1.5", id="rate-above-one"),
    pytest.param({"error_rate": float("nan")}, ValueError, "error_rate must be within 0..1", id="rate-nan"),
    pytest.param({"error_rate": "0.5"}, TypeError, "error_rate must be a number, got '0.5'", id="rate-a-string"),
    pytest.param({"corrupt_rate": True}, TypeError, "corrupt_rate must be a number, got True", id="corrupt-a-bool"),
    pytest.param({"corrupt_rate": -0.1}, ValueError, "corrupt_rate must be within 0..1", id="corrupt-negative"),
    pytest.param({"error_code": 0}, ValueError, "error_code must be a negative int16, got 0", id="code-zero"),
    pytest.param({"error_code": -40000}, ValueError, "error_code must be a negative int16", id="code-past-int16"),
    pytest.param({"error_code": -2300.0}, TypeError, "error_code must be an int", id="code-a-float"),
    pytest.param({"latency_us": -1}, ValueError, "latency_us must be a number >= 0, got -1", id="latency-negative"),
    pytest.param({"latency_us": float("nan")}, ValueError, "latency_us must be a number >= 0", id="latency-nan"),
    pytest.param({"down": "yes"}, TypeError, "down must be a bool, got 'yes'", id="down-a-string"),
    pytest.param({"seed": 1.5}, TypeError, "seed must be an int or None, got 1.5", id="seed-a-float"),
    pytest.param({"flakiness": 0.1}, TypeError, "flakiness", id="unknown-field"),
])
def test_settings_are_checked_naming_the_field_and_value_and_change_nothing(faults, changes, error, words):
    name = f"checked-{uuid.uuid4().hex[:8]}"
    before = faults(name, latency_us=5)
    with pytest.raises(error, match=re.escape(words)):
        faults(name, **changes)
    assert faults(name) == before


def test_settings_say_what_they_inject():
    assert FaultSettings().describe() == "none" and not FaultSettings().injects
    both = FaultSettings(down=True, error_rate=0.25, error_code=TIMEOUT, latency_us=1500)
    assert both.describe() == "down error_rate=0.25 error_code=Timeout(-1002) latency_us=1500"
    assert FaultSettings(error_code=TIMEOUT, seed=3).injects is False  # a code and a seed alone inject nothing


def test_changes_keep_the_other_settings(faults):
    name = f"kept-{uuid.uuid4().hex[:8]}"
    faults(name, error_rate=0.5, seed=7)
    assert faults(name, latency_us=10) == FaultSettings(error_rate=0.5, seed=7, latency_us=10)


# -- SGLANG_SIMM_FAULTS ------------------------------------------------------------------------


def test_the_environment_sets_each_named_store_and_star(open_store, mem, faults):
    (down, store_down), (other, store_other) = open_store(), open_store()
    faults(down), faults("*")  # given back their defaults after the test
    install_from_env({ENV: json.dumps({down: {"down": True}, "*": {"error_rate": 1, "error_code": TIMEOUT}})})
    assert configure_faults(down) == FaultSettings(down=True)
    view = mem.view(16)[0]
    assert store_down.get("x", view) == SEND_RPC_FAILED
    assert store_other.get("x", view) == TIMEOUT


@pytest.mark.parametrize("environ", [{}, {ENV: ""}], ids=["unset", "empty"])
def test_no_environment_sets_nothing(environ, stored, mem):
    name, store, keys, datas = stored
    install_from_env(environ)
    assert configure_faults(name) == FaultSettings()
    all_readable(store, mem, keys, datas)


@pytest.mark.parametrize("value, words", [
    pytest.param("{down: true}", f"{ENV} is not JSON", id="not-json"),
    pytest.param(["s"], f'{ENV} must map store names (or "*") to settings', id="a-list"),
    pytest.param({"s": True}, f'{ENV} must map store names (or "*") to settings', id="not-settings"),
    pytest.param({"s": {"error_rate": 2}}, f"{ENV}: store 's': error_rate must be within 0..1, got 2",
                 id="out-of-range"),
    pytest.param({"s": {"flakiness": 1}}, f"{ENV}: store 's': ", id="unknown-field"),
])
def test_a_bad_environment_is_refused_naming_the_variable_and_changes_no_store(faults, value, words):
    name = f"env-{uuid.uuid4().hex[:8]}"
    faults(name)
    # a good store named first: refused all the same, before anything changed
    text = value if isinstance(value, str) else json.dumps({name: {"down": True}, **value}) \
        if isinstance(value, dict) else json.dumps(value)
    with pytest.raises(ValueError, match=re.escape(words)):
        install_from_env({ENV: text})
    assert configure_faults(name) == FaultSettings()


# -- the wrapper --------------------------------------------------------------------------------


def test_the_wrapper_is_called_as_the_handles_own_methods_keywords_included(stored, mem, faults):
    """(Its signatures against the store's contract: tests/store/test_server_contract.py.)"""
    name, _, keys, _ = stored
    faults(name, latency_us=1)  # a fault set: every call goes through the wrapper
    handle = kv.get_server(name)
    data = random_bytes(64, seed=9)
    _, source = mem.holding(data)
    _, out = mem.view(64)
    assert handle.put_from(items=[("kw", source.data_ptr(), 64)], overwrite=True) == [OK]
    assert handle.lookup(keys=["kw", keys[0], "absent"]) == [OK, OK, DS_KEY_NOT_FOUND]
    assert handle.get_into(items=[("kw", out.data_ptr(), 64)]) == [64] and torch.equal(out, data)
    assert handle.delete(key="kw") == OK
    with pytest.raises(TypeError):
        handle.lookup(names=["kw"])  # a name the method does not take, refused as the method refuses it
    assert StoreHandle.lookup.__name__ == "lookup" and "keys" in inspect.signature(StoreHandle.lookup).parameters
    # with a share of the entries failed, the others still reach the store, by keyword too
    faults(name, error_rate=0.5, seed=2)
    assert set(handle.lookup(keys=keys * 10)) == {OK, SEND_RPC_FAILED}


def test_install_is_done_once(stored, faults):
    name, _, keys, _ = stored
    instrument.install()
    first = StoreHandle.lookup
    instrument.install()
    assert StoreHandle.lookup is first  # wrapped once, not once per call
    faults(name, error_rate=1.0)
    assert injected(name) == 0
    assert kv.get_server(name).lookup(keys) == [SEND_RPC_FAILED] * 3
    assert injected(name) == 3  # each entry failed once, not once per layer of wrapping
