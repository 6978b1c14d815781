"""Leases belong to the connection that took them, and expire (issue 17,
findings 4 and 5), tried with raw same-uid peers and a stopped client."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from sglang_simm.embedded import _host
from sglang_simm.embedded._host import HostServer
from sglang_simm.embedded._protocol import Op
from sglang_simm.errors import DS_CACHE_POOL_ALLOC_FAILED, DS_KEY_NOT_FOUND, INVALID_ARGUMENT, OK, SEND_RPC_FAILED

from raw_peer import Peer, StoreProc, env, wait_for

pytestmark = pytest.mark.host


@pytest.fixture
def store(host_store_dir):
    s = StoreProc(host_store_dir, f"lease-{uuid.uuid4().hex[:8]}", capacity=64 << 20)
    yield s
    s.stop()


def client_of(store: StoreProc, **kw) -> HostServer:
    c = HostServer(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=10, **kw)
    c.open()
    return c


# -- 4. leases belong to nobody ---------------------------------------------------


def test_another_connections_commit_is_refused(store):
    with Peer(store.paths) as writer, Peer(store.paths) as thief:
        lease, codes, _ = writer.put(["half-a", "half-b"], [4096, 4096])
        assert codes == [OK, OK]
        op, err = thief.commit(lease)
        assert op == Op.ERROR and err["code"] == INVALID_ARGUMENT and "another connection" in err["error"]
        assert thief.lookup(["half-a", "half-b"]) == [DS_KEY_NOT_FOUND] * 2  # nothing half-written published
        assert writer.commit(lease) == (Op.COMMIT, [OK, OK])  # still the writer's to publish
    assert store.status()["refused_lease_owner"] == 1


def test_another_connections_release_leaves_the_pin(store):
    with Peer(store.paths) as writer:
        lease, _, _ = writer.put(["pinned"], [4096])
        writer.commit(lease)
    with Peer(store.paths) as reader, Peer(store.paths) as thief:
        lease, _, sizes, _ = reader.get(["pinned"], [4096])
        assert sizes == [4096]
        thief.release(lease)  # one-way: the status request after it on the same connection is served after it
        assert thief.admin("status")["pinned_objects"] == 1
        reader.release(lease)
        assert reader.admin("status")["pinned_objects"] == 0
    assert store.status()["refused_lease_owner"] == 1


# -- 5. a stopped client holds capacity forever ------------------------------------


READER = """
import ctypes, json, sys, time
from sglang_simm.embedded._host import HostServer
from sglang_simm.embedded import _copy
name, root = sys.argv[1], sys.argv[2]
c = HostServer(name, root=root, capacity=1, spawn=False, timeout_s=30)
c.open()
buf = ctypes.create_string_buffer(60 << 20)
real = _copy.copy_many
import sglang_simm.embedded._host as h
def stalled(copies):
    print("copying", flush=True)
    sys.stdin.readline()  # the test stops us here (SIGSTOP), then lets us go on
    real(copies)
h.copy_many = stalled
print(json.dumps(c.get_into([("big", ctypes.addressof(buf), 60 << 20)])), flush=True)
"""


def test_a_stopped_reader_loses_its_pins_and_reads_a_miss(host_store_dir):
    store = StoreProc(host_store_dir, f"lease-{uuid.uuid4().hex[:8]}", capacity=64 << 20,
                      limits={"lease_timeout_s": 1.0})
    try:
        writer = client_of(store)
        data = ctypes.create_string_buffer(b"\x07" * (60 << 20), 60 << 20)
        assert writer.put_from([("big", ctypes.addressof(data), 60 << 20)], True) == [OK]
        reader = subprocess.Popen([sys.executable, "-c", READER, store.paths.name, store.paths.root], env=env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert reader.stdout.readline().strip() == "copying"
        os.kill(reader.pid, signal.SIGSTOP)  # pins 60 of 64 MiB, and stops
        try:
            assert writer.status()["pinned_objects"] == 1
            # Another writer's batch needs that room: it gets it once the lease expires.
            small = ctypes.create_string_buffer(8 << 20)
            items = [(f"new{i}", ctypes.addressof(small), 8 << 20) for i in range(6)]
            wait_for(lambda: writer.put_from(items, True) == [OK] * 6, timeout=30,
                     what="the stopped reader's lease to expire")
            s = writer.status()
            assert s["pinned_objects"] == 0 and s["refused_lease_expired"] >= 1
        finally:
            os.kill(reader.pid, signal.SIGCONT)
        out, err = reader.communicate("go\n", timeout=30)
        # It copied after its lease expired (its bytes may have been reused): a miss, not data.
        assert json.loads(out.strip().splitlines()[-1]) == [DS_KEY_NOT_FOUND], err
        writer.close()
    finally:
        store.stop()


def test_a_reader_whose_lease_expires_mid_copy_reports_a_miss(store, monkeypatch):
    client = client_of(store)
    data = ctypes.create_string_buffer(b"\x05" * 4096, 4096)
    assert client.put_from([("k", ctypes.addressof(data), 4096)], True) == [OK]
    real = _host.copy_many

    def expiring(copies):
        with Peer(store.paths) as admin:
            # this get's lease, and the room the client holds for its next backups
            assert admin.admin("expire_leases", older_than_s=0)["expired"] == 2
        real(copies)

    monkeypatch.setattr(_host, "copy_many", expiring)
    out = ctypes.create_string_buffer(4096)
    assert client.get_into([("k", ctypes.addressof(out), 4096)]) == [DS_KEY_NOT_FOUND]
    monkeypatch.setattr(_host, "copy_many", real)
    assert client.get_into([("k", ctypes.addressof(out), 4096)]) == [4096]  # unexpired: a hit
    client.close()


def test_an_expired_writers_room_is_quarantined_until_it_closes(store):
    with Peer(store.paths) as writer:
        lease, codes, offsets = writer.put(["slow"], [32 << 20])
        assert codes == [OK]
        with Peer(store.paths) as admin:
            assert admin.admin("expire_leases", older_than_s=0)["expired"] == 1
            s = admin.admin("status")
            # the capacity is free for others, but not its bytes: the writer may still be copying
            assert s["reserved_bytes"] == 0 and s["quarantined_bytes"] == 32 << 20
            lease2, codes2, offsets2 = admin.put(["other"], [30 << 20])
            assert codes2 == [OK] and not (offsets[0] <= offsets2[0] < offsets[0] + (32 << 20))
            admin.commit(lease2)
        op, err = writer.commit(lease)
        assert op == Op.ERROR and err["code"] == SEND_RPC_FAILED and "expired" in err["error"]
    s = store.status()
    assert s["quarantined_bytes"] == 0 and s["objects"] == 1  # freed when its connection closed


def test_leases_past_max_leases_are_refused(host_store_dir):
    store = StoreProc(host_store_dir, f"lease-{uuid.uuid4().hex[:8]}", limits={"max_leases": 2})
    try:
        with Peer(store.paths) as p:
            assert p.put(["a"], [10])[0] and p.put(["b"], [10])[0]
            lease, codes, _ = p.put(["c"], [10])
            assert lease == 0 and codes == [DS_CACHE_POOL_ALLOC_FAILED]
        assert store.status()["refused_leases"] == 1
    finally:
        store.stop()
