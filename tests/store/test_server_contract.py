"""The server contract (``embedded.contract.StoreServer``): both servers, and
the fault wrapper in front of either, have every member it declares, with
its signature; and the one setting a client
gives its store through it, the warm-up key prefixes the store counts apart
(the store knows none of its own)."""

from __future__ import annotations

import ctypes
import inspect
import time
import uuid

import pytest

from sglang_simm import local_store
from sglang_simm.local_store import _kv as _client
from sglang_simm.local_store._faults import FaultSettings, FaultyServer
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._index import StoreIndex
from sglang_simm.local_store._limits import MAX_WARMUP_PREFIXES
from sglang_simm.local_store._server import EmbeddedServer
from sglang_simm.local_store.contract import StoreServer
from sglang_simm.simm_rules import MAX_KEY_BYTES, OK

SERVERS = (EmbeddedServer, StoreHandle, FaultyServer)


def members(protocol: type) -> dict[str, str]:
    """The protocol's members: name -> "method", "property" or "attribute"."""
    out = {}
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out[name] = "property"
        elif inspect.isfunction(value):
            out[name] = "method"
    out.update({name: "attribute" for name in protocol.__annotations__})
    return out


def differences(cls: type, instance: object, protocol: type = StoreServer) -> list[str]:
    """What ``cls`` (and ``instance`` of it, for attributes set in
    ``__init__``) lacks of ``protocol``, or declares otherwise."""
    out = []
    for name, kind in members(protocol).items():
        if kind == "attribute":
            try:
                inspect.getattr_static(instance, name)
            except AttributeError:
                out.append(f"{name}: missing")
            continue
        try:
            have = inspect.getattr_static(cls, name)
        except AttributeError:
            out.append(f"{name}: missing")
            continue
        want = vars(protocol)[name]
        if kind == "property":
            if not isinstance(have, property):
                out.append(f"{name}: not a property")
            elif inspect.signature(have.fget) != inspect.signature(want.fget):
                out.append(f"{name}: {inspect.signature(have.fget)} != {inspect.signature(want.fget)}")
        elif not inspect.isfunction(have):
            out.append(f"{name}: not a method")
        elif inspect.signature(have) != inspect.signature(want):
            out.append(f"{name}: {inspect.signature(have)} != {inspect.signature(want)}")
    return out


@pytest.fixture
def instances(host_store_dir):
    """One of each server; the host store's handle connects to nothing."""
    made = {
        EmbeddedServer: EmbeddedServer(f"contract-{uuid.uuid4().hex[:8]}", 1 << 20),
        StoreHandle: StoreHandle(f"contract-{uuid.uuid4().hex[:8]}", root=host_store_dir, capacity=1, spawn=False),
    }
    made[FaultyServer] = FaultyServer(made[EmbeddedServer], FaultSettings(down=True))
    yield made
    made[StoreHandle].close()


@pytest.mark.parametrize("cls", SERVERS, ids=lambda c: c.__name__)
def test_every_server_has_every_member_of_the_contract_with_its_signature(cls, instances):
    assert set(members(StoreServer)) >= {
        "put_from", "get_into", "lookup", "delete", "delete_prefix", "clear", "keys", "stats",
        "capacity_bytes", "used_bytes", "set_capacity", "set_policy", "add_warmup_prefix", "name"}
    assert differences(cls, instances[cls]) == []


def test_the_check_sees_a_missing_member_and_another_signature(instances):
    class Short(EmbeddedServer):
        lookup = None  # type: ignore[assignment]

        def delete(self, key: str, *, quiet: bool = False) -> int:  # type: ignore[override]
            return super().delete(key)

    server = Short("contract-short", 1 << 20)
    assert sorted(d.split(":")[0] for d in differences(Short, server)) == ["delete", "lookup"]


def test_the_in_process_server_is_an_instance_and_the_client_holds_the_contract():
    assert isinstance(EmbeddedServer("contract-isinstance", 1 << 20), StoreServer)
    assert inspect.signature(_client.get_server).return_annotation == "StoreServer"
    assert inspect.signature(_client.Store.server.fget).return_annotation == "StoreServer"


# -- warm-up key prefixes ---------------------------------------------------------


def test_warm_up_prefixes_are_keys_and_bounded():
    index = StoreIndex(capacity=10_000, arena_bytes=1 << 20)
    server = EmbeddedServer("contract-prefixes", 1 << 20)
    for bad in ("", "x" * (MAX_KEY_BYTES + 1), "a\0b"):
        with pytest.raises(ValueError, match="warm-up key prefix"):
            server.add_warmup_prefix(bad)
        with pytest.raises(ValueError, match="warm-up key prefix"):
            index.add_warmup_prefix(bad.encode())
    for i in range(MAX_WARMUP_PREFIXES):
        index.add_warmup_prefix(f"p{i}/".encode())
        server.add_warmup_prefix(f"p{i}/")
    index.add_warmup_prefix(b"p0/")  # held already: no new one
    server.add_warmup_prefix("p0/")
    with pytest.raises(ValueError, match=f"at most {MAX_WARMUP_PREFIXES}"):
        index.add_warmup_prefix(b"one-too-many/")
    with pytest.raises(ValueError, match=f"at most {MAX_WARMUP_PREFIXES}"):
        server.add_warmup_prefix("one-too-many/")
    assert len(index.warmup_prefixes) == MAX_WARMUP_PREFIXES


def _put_and_get(server: StoreServer, keys: list[str]) -> None:
    buf = ctypes.create_string_buffer(100)
    ptr = ctypes.addressof(buf)
    assert server.put_from([(k, ptr, 100) for k in keys], True) == [OK] * len(keys)
    assert server.get_into([(k, ptr, 100) for k in keys]) == [100] * len(keys)


def test_a_store_made_by_the_client_with_the_flag_counts_that_prefix_apart():
    name = f"contract-flag-{uuid.uuid4().hex[:8]}"
    assert not local_store.set_flag("local_store_warmup_key_prefix", "x" * (MAX_KEY_BYTES + 1))
    assert local_store.set_flag("cm_primary_node_ip", name)
    plain = local_store.Store().server  # no prefix: nothing is counted apart
    _put_and_get(plain, ["w/1", "page/1"])
    assert (plain.stats()["warmup_puts"], plain.stats()["warmup_hits"]) == (0, 0)
    assert local_store.set_flag("local_store_warmup_key_prefix", "w/")
    assert local_store.Store().server is plain  # a Store() joining tells its store
    _put_and_get(plain, ["w/2", "page/2"])
    stats = plain.stats()
    assert (stats["puts"], stats["warmup_puts"], stats["hits"], stats["warmup_hits"]) == (4, 1, 4, 1)
    local_store.reset_servers(name)


def _retry(call, timeout: float = 20.0):
    """``call()``, again while the store it reaches is restarting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except StoreUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.host
def test_a_host_store_counts_apart_what_its_clients_declare_and_hears_it_again_after_a_crash(host_store_dir):
    from raw_peer import StoreProc

    name = f"contract-host-{uuid.uuid4().hex[:8]}"
    store = StoreProc(host_store_dir, name, capacity=1 << 20)
    client = StoreHandle(name, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
    try:
        client.open()
        _put_and_get(client, ["w/1", "page/1"])
        assert client.stats()["warmup_puts"] == 0  # none declared: nothing is counted apart
        client.add_warmup_prefix("w/")  # told at once, on the open connection
        _put_and_get(client, ["w/2", "page/2"])
        stats = client.stats()
        assert (stats["puts"], stats["warmup_puts"], stats["hits"], stats["warmup_hits"]) == (4, 1, 4, 1)
        other = StoreHandle(name, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        other.open()
        _put_and_get(other, ["w/3"])  # one client's prefix counts for every client's keys
        assert other.stats()["warmup_puts"] == 2
        other.close()

        store.kill9()
        store = StoreProc(host_store_dir, name, capacity=1 << 20)  # takes every object over, knows no prefix
        _retry(lambda: _put_and_get(client, ["w/4", "page/4"]))  # the handshake declares it again
        stats = client.stats()
        assert stats["recovered"] > 0 and (stats["warmup_puts"], stats["warmup_hits"]) == (1, 1)
    finally:
        client.close()
        store.stop()
