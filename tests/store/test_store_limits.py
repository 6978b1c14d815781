"""The store process's limits, tried with raw same-uid peers against a
store process of the test's own (issue 17, findings 1-3)."""

from __future__ import annotations

import ctypes
import os
import socket
import uuid

import pytest

from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._protocol import HEADER, PROTOCOL_VERSION, Op, encode_keys, frame, pack_ints, pack_json
from sglang_simm.errors import INVALID_ARGUMENT, MAX_VALUE_BYTES, OK, TARGET_UNAVAILABLE

from raw_peer import Peer, StoreProc
from polling import until

pytestmark = pytest.mark.host


@pytest.fixture
def spawn_store(host_store_dir):
    made = []

    def make(**kw) -> StoreProc:
        s = StoreProc(host_store_dir, f"lim-{uuid.uuid4().hex[:8]}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


# -- 1. out of file descriptors ------------------------------------------------


def test_out_of_fds_on_accept_refuses_and_keeps_serving(spawn_store):
    store = spawn_store(nofile=64)  # accept() fails with EMFILE long before max_connections
    idle = []
    try:
        for _ in range(120):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(store.paths.socket)  # the kernel's backlog takes it; accept may not
            s.send(frame(Op.HELLO, pack_json({"version": PROTOCOL_VERSION, "pid": os.getpid()})))  # idle, not silent
            idle.append(s)
        # A newcomer is told why, not left hanging, and the store lives on.
        until(lambda: "out of file descriptors" in _hello_refusal(store), what="a refusal for lack of fds")
        assert store.alive()
    finally:
        for s in idle:
            s.close()
    # The idle connections gone, the store serves again, its data intact.
    def serves():
        try:
            with Peer(store.paths, timeout=2) as p:
                return p.lookup(["x"]) == [-4003]
        except OSError:
            return False
    until(serves, what="the store to serve again")
    assert store.alive() and store.status()["refused_fds"] >= 1


def _hello_refusal(store: StoreProc) -> str:
    try:
        Peer(store.paths, timeout=2).close()
    except AssertionError as exc:
        return str(exc)
    except OSError:
        pass
    return ""


def test_connections_past_max_connections_get_a_code(spawn_store):
    store = spawn_store(limits={"max_connections": 4})
    peers = [Peer(store.paths) for _ in range(4)]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(store.paths.socket)
        head = s.recv(HEADER.size)
        length, op = HEADER.unpack(head)
        import json
        body = json.loads(s.recv(length))
        assert op == Op.ERROR and body["code"] == TARGET_UNAVAILABLE and "max_connections" in body["error"]
        s.close()
        client = StoreHandle(store.paths.name, root=store.paths.root, capacity=1 << 20, spawn=False, timeout_s=5)
        with pytest.raises(StoreUnreachable) as exc:
            client.open(wait_s=1)
        assert exc.value.code == TARGET_UNAVAILABLE and "max_connections" in str(exc.value)
    finally:
        for p in peers:
            p.close()
    assert store.status()["refused_connections"] >= 2


# -- 2. memory without bound ---------------------------------------------------


def test_replies_a_peer_never_reads_do_not_pile_up(spawn_store):
    store = spawn_store()
    before = store.rss_kib()
    p = Peer(store.paths)
    p.sock.setblocking(False)
    request = frame(Op.LOOKUP, encode_keys([f"k{i}" for i in range(1000)]))  # 8 KiB of reply each
    sent = 0
    try:
        while sent < 48 << 20:  # the 48 MiB of replies; the store stops reading long before
            sent += p.sock.send(request)
    except BlockingIOError:
        pass
    # The peer is stuck (the store stopped reading it); the store serves others.
    with Peer(store.paths) as other:
        assert other.lookup(["x"]) == [-4003]
    growth = store.rss_kib() - before
    assert sent < 48 << 20 and growth < 16 << 10, (sent, growth)
    p.close()


def test_a_huge_frame_is_refused_before_it_is_buffered(spawn_store):
    store = spawn_store()
    p = Peer(store.paths)
    p.send(HEADER.pack(200 << 20, Op.LOOKUP) + b"\0" * 4096)
    assert p.closed_by_store()
    assert store.status()["refused_frame"] == 1


def test_buffered_requests_over_all_connections_are_bounded(spawn_store):
    store = spawn_store(limits={"input_budget_bytes": 4 << 20})
    before = store.rss_kib()
    peers = [Peer(store.paths) for _ in range(8)]
    for p in peers:  # 8 unfinished frames of 1 MiB each: past the 4 MiB budget
        try:
            p.send(HEADER.pack(2 << 20, Op.LOOKUP) + b"\0" * (1 << 20))
        except OSError:
            pass
    until(lambda: store.status()["refused_input_budget"] >= 4, what="connections over the budget dropped")
    assert store.status()["buffered_request_bytes"] <= 4 << 20
    assert store.rss_kib() - before < 16 << 10
    for p in peers:
        p.close()


def test_keys_past_256_bytes_are_refused_by_the_store(spawn_store):
    store = spawn_store()
    with Peer(store.paths) as p:
        lease, codes, _ = p.put(["k" * 257, "ok"], [10, 10])
        assert codes == [INVALID_ARGUMENT, OK]
        assert p.commit(lease)[1] == [OK]
        assert p.lookup(["k" * 257, "ok"]) == [-4003, OK]
        assert p.get(["k" * 300], [10])[2] == [INVALID_ARGUMENT]
        # the 41 keys of 10 MB: one frame far past max_frame_bytes
        p.send(HEADER.pack(41 * 10_000_000, Op.PUT) + b"\1")
        assert p.closed_by_store()
    s = store.status()
    assert s["refused_key"] >= 2 and s["refused_frame"] == 1 and s["used_bytes"] == 10


@pytest.mark.parametrize("size", [-1, -(2**40), MAX_VALUE_BYTES + 1])
def test_sizes_outside_simms_limit_are_refused(spawn_store, size):
    store = spawn_store()
    with Peer(store.paths) as p:
        lease, codes, offsets = p.put(["neg"], [size])
        assert (lease, codes, offsets) == (0, [INVALID_ARGUMENT], [-1])
        assert p.get(["neg"], [1 << 20])[2] == [-4003]
    s = store.status()
    assert s["used_bytes"] == 0 and s["reserved_bytes"] == 0 and s["refused_size"] == 1


def test_index_memory_is_bounded_by_the_object_cap(spawn_store):
    store = spawn_store(capacity=64 << 20, limits={"max_objects": 20_000})
    client = StoreHandle(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=10)
    client.open()
    buf = ctypes.create_string_buffer(1)
    before = store.rss_kib()
    for batch in range(6):  # 96k one-byte objects into a store of 20k
        items = [(f"b{batch}-{i}", ctypes.addressof(buf), 1) for i in range(16_000)]
        assert set(client.put_from(items, True)) == {OK}
    s = client.status()
    assert s["objects"] == 20_000 and s["evictions"] == 96_000 - s["objects"]
    assert store.rss_kib() - before < 32 << 10  # ~20k index entries, not 96k
    client.close()


# -- 3. one request stalls everyone ----------------------------------------------


def test_a_batch_past_max_batch_is_refused_with_a_code(spawn_store):
    store = spawn_store(limits={"max_batch": 1000})
    with Peer(store.paths) as p:
        op, body = p.call(Op.LOOKUP, encode_keys([f"k{i}" for i in range(1001)]))
        import json
        err = json.loads(body)
        assert op == Op.ERROR and err["code"] == INVALID_ARGUMENT and "max_batch" in err["error"]
        assert p.lookup(["x"]) == [-4003]  # the connection goes on
        # the 16M-key LOOKUP: a frame past max_frame_bytes, dropped unread
        p.send(HEADER.pack(16 << 24, Op.LOOKUP) + pack_ints([]))
        assert p.closed_by_store()
    assert store.status()["refused_batch"] == 1


def test_the_client_splits_batches_at_the_stores_max_batch(spawn_store):
    store = spawn_store(limits={"max_batch": 100})
    client = StoreHandle(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=10)
    client.open()
    buf = ctypes.create_string_buffer(b"x" * 8)
    items = [(f"s{i}", ctypes.addressof(buf), 8) for i in range(250)]
    assert client.put_from(items, True) == [OK] * 250
    assert client.lookup([k for k, _, _ in items]) == [OK] * 250
    out = ctypes.create_string_buffer(8)
    assert client.get_into([(k, ctypes.addressof(out), 8) for k, _, _ in items]) == [8] * 250
    assert store.status()["refused_batch"] == 0
    client.close()
