"""The store process's limits (``_limits.StoreLimits``), tried with raw
same-uid peers against a store process of the test's own: past each, a
SiMM code or a dropped connection, a ``refused_<reason>`` counter, and a
store that goes on serving everyone else."""

from __future__ import annotations

import ast
import ctypes
import json
import socket

import pytest

from polling import until
from raw_peer import Peer, StoreProc, wait_status
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._protocol import HEADER, PROTOCOL_VERSION, Op, encode_keys, frame, pack_ints, pack_json
from sglang_simm.simm_rules import (
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    MAX_VALUE_BYTES,
    OK,
    TARGET_UNAVAILABLE,
)

pytestmark = pytest.mark.host


def handle(proc: StoreProc, **kw) -> StoreHandle:
    client = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=1, spawn=False, timeout_s=10, **kw)
    client.open()
    return client


# -- descriptors and connections ----------------------------------------------------


def _hello_refusal(proc: StoreProc) -> str:
    """What the store tells a newcomer that it refuses; "" while the newcomer
    waits its turn in the listener's queue (behind the idle ones)."""
    try:
        Peer(proc.paths, timeout=2).close()
    except AssertionError as exc:  # a reply other than HELLO: the refusal
        return str(exc)
    except ConnectionResetError:
        pytest.fail("the store hung up on a newcomer without a word")
    except OSError:  # still queued
        pass
    return ""


def test_out_of_fds_on_accept_refuses_and_keeps_serving(store):
    proc = store(nofile=64)  # accept() runs out of descriptors long before max_connections
    idle = []
    try:
        for _ in range(120):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(proc.paths.socket)  # the kernel's backlog takes it; accept may not
            s.send(frame(Op.HELLO, pack_json({"version": PROTOCOL_VERSION, "data": False})))  # idle, not silent
            idle.append(s)
        # A newcomer is told why, not left hanging, and the store lives on.
        until(lambda: "out of file descriptors" in _hello_refusal(proc), what="a refusal for lack of fds")
        assert proc.alive()
    finally:
        for s in idle:
            s.close()

    def serves():  # the idle connections gone, the store serves again
        try:
            with Peer(proc.paths, timeout=2) as p:
                return p.lookup(["x"]) == [DS_KEY_NOT_FOUND]
        except (OSError, AssertionError):  # refused again while the backlog's connections drain
            return False

    until(serves, what="the store to serve again")
    assert proc.alive() and proc.status()["refused_fds"] >= 1


def test_connections_past_max_connections_get_a_code(store):
    proc = store(limits={"max_connections": 4})
    peers = [Peer(proc.paths) for _ in range(4)]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(proc.paths.socket)
        length, op = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
        body = json.loads(s.recv(length, socket.MSG_WAITALL))
        assert op == Op.ERROR and body["code"] == TARGET_UNAVAILABLE and "max_connections" in body["error"]
        s.close()
        client = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=1 << 20, spawn=False, timeout_s=5)
        with pytest.raises(StoreUnreachable) as exc:
            client.open(wait_s=1)
        assert exc.value.code == TARGET_UNAVAILABLE and "max_connections" in str(exc.value)
    finally:
        for p in peers:
            p.close()
    assert proc.status()["refused_connections"] >= 2


def test_client_processes_past_max_clients_are_refused_at_their_handshake(store, child, root):
    """Each process that moves data takes a row of the segment's client
    table; past ``max_clients`` a process is refused at its handshake, an
    admin-only connection (no row) still served, and a row comes back when
    its process is gone."""
    proc = store(limits={"max_clients": 1})
    other = child("idle", root=root, name="s", spawn=False)
    other.ready()  # its process holds the only row
    with pytest.raises(AssertionError) as refused:
        Peer(proc.paths)
    body = ast.literal_eval(str(refused.value).split("\n")[0])  # the reply the peer got instead of HELLO
    assert body["code"] == TARGET_UNAVAILABLE and "max_clients" in body["error"]
    with Peer(proc.paths, data=False) as admin:
        assert admin.admin("status")["refused_clients"] == 1
    other.kill9()

    def admitted():
        try:
            with Peer(proc.paths) as p:
                return p.lookup(["x"]) == [DS_KEY_NOT_FOUND]
        except AssertionError:
            return False

    until(admitted, what="the gone process's row to be taken by another")


# -- memory without bound ---------------------------------------------------------


def test_replies_a_peer_never_reads_do_not_pile_up(store):
    proc = store()
    before = proc.rss_kib()
    p = Peer(proc.paths)
    p.sock.setblocking(False)
    request = frame(Op.LOOKUP, encode_keys([f"k{i}" for i in range(1000)]))  # 8 KiB of reply each
    sent = 0
    try:
        while sent < 48 << 20:  # 48 MiB of replies asked for; the store stops reading long before
            sent += p.sock.send(request)
    except BlockingIOError:
        pass
    # The peer is stuck (the store stopped reading it); the store serves others.
    with Peer(proc.paths) as other:
        assert other.lookup(["x"]) == [DS_KEY_NOT_FOUND]
    growth = proc.rss_kib() - before
    assert sent < 48 << 20 and growth < 16 << 10, (sent, growth)
    p.close()


def test_a_huge_frame_is_refused_before_it_is_buffered(store):
    proc = store()
    p = Peer(proc.paths)
    p.send(HEADER.pack(200 << 20, Op.LOOKUP) + b"\0" * 4096)
    assert p.closed_by_store()
    assert proc.status()["refused_frame"] == 1


def test_buffered_requests_over_all_connections_are_bounded(store):
    proc = store(limits={"input_budget_bytes": 4 << 20})
    before = proc.rss_kib()
    peers = [Peer(proc.paths) for _ in range(8)]
    for p in peers:  # 8 unfinished frames of 1 MiB each: past the 4 MiB budget
        try:
            p.send(HEADER.pack(2 << 20, Op.LOOKUP) + b"\0" * (1 << 20))
        except OSError:
            pass
    wait_status(proc, lambda s: s["refused_input_budget"] >= 4, "connections over the budget dropped")
    assert proc.status()["buffered_request_bytes"] <= 4 << 20
    assert proc.rss_kib() - before < 16 << 10
    for p in peers:
        p.close()


def test_index_memory_is_bounded_by_the_object_cap(store):
    proc = store(capacity=64 << 20, limits={"max_objects": 20_000})
    client = handle(proc)
    buf = ctypes.create_string_buffer(1)
    before = proc.rss_kib()
    for batch in range(6):  # 96k one-byte objects into a store of 20k
        items = [(f"b{batch}-{i}", ctypes.addressof(buf), 1) for i in range(16_000)]
        assert set(client.put_from(items, True)) == {OK}
    s = client.status()
    assert s["objects"] == 20_000 and s["evictions"] == 96_000 - s["objects"]
    assert proc.rss_kib() - before < 32 << 10  # ~20k index entries, not 96k
    client.close()


# -- entries past SiMM's limits -------------------------------------------------------


def test_keys_past_256_bytes_are_refused_by_the_store(store):
    proc = store()
    with Peer(proc.paths) as p:
        grant, codes, _ = p.put(["k" * 257, "ok"], [10, 10])
        assert codes == [INVALID_ARGUMENT, OK]
        assert p.commit(grant, [0]) == (Op.COMMIT, [OK])  # one checksum: one entry granted
        assert p.lookup(["k" * 257, "ok"]) == [DS_KEY_NOT_FOUND, OK]
        assert p.get(["k" * 300], [10])[1] == [INVALID_ARGUMENT]
        # 41 keys of 10 MB: one frame far past max_frame_bytes, dropped unread
        p.send(HEADER.pack(41 * 10_000_000, Op.PUT) + b"\1")
        assert p.closed_by_store()
    s = proc.status()
    assert s["refused_key"] >= 2 and s["refused_frame"] == 1 and s["used_bytes"] == 10


@pytest.mark.parametrize("size", [-1, -(2**40), MAX_VALUE_BYTES + 1])
def test_sizes_outside_simms_limit_are_refused(store, size):
    proc = store()
    with Peer(proc.paths) as p:
        grant, codes, offsets = p.put(["neg"], [size])
        assert (grant, codes, offsets) == (0, [INVALID_ARGUMENT], [-1])
        assert p.get(["neg"], [1 << 20])[1] == [DS_KEY_NOT_FOUND]
    s = proc.status()
    assert s["used_bytes"] == 0 and s["reserved_bytes"] == 0 and s["refused_size"] == 1


def test_a_commit_with_too_few_checksums_is_refused_and_leaks_nothing(store):
    proc = store(capacity=64 << 20)
    with Peer(proc.paths) as p:
        grant, _, _ = p.put(["old"], [1 << 20])
        assert p.commit(grant, [0]) == (Op.COMMIT, [OK])
        before = p.admin("status")
        for _ in range(4):
            grant, codes, _ = p.put(["old", "new"], [1 << 20, 1 << 20], overwrite=True)
            assert codes == [OK, OK]
            op, answer = p.commit(grant, [0])  # two entries granted, one checksum
            assert op == Op.ERROR and answer["code"] == INVALID_ARGUMENT, answer
            p.abort(grant)  # whether or not the refusal ended it
    s = wait_status(proc, lambda s: s["open_grants"] == 0, "the refused grants to end")
    assert (s["objects"], s["used_bytes"], s["reserved_bytes"]) == (1, 1 << 20, 0)
    assert s["free_bytes"] == before["free_bytes"]  # every granted byte back
    assert s["refused_request"] >= 4
    with Peer(proc.paths) as p:
        assert p.lookup(["old", "new"]) == [OK, DS_KEY_NOT_FOUND]


# -- one request stalls everyone ------------------------------------------------------


def test_a_batch_past_max_batch_is_refused_with_a_code(store):
    proc = store(limits={"max_batch": 1000})
    with Peer(proc.paths) as p:
        op, body = p.call(Op.LOOKUP, encode_keys([f"k{i}" for i in range(1001)]))
        err = json.loads(body)
        assert op == Op.ERROR and err["code"] == INVALID_ARGUMENT and "max_batch" in err["error"]
        assert p.lookup(["x"]) == [DS_KEY_NOT_FOUND]  # the connection goes on
        # a 16M-key LOOKUP: a frame past max_frame_bytes, dropped unread
        p.send(HEADER.pack(16 << 24, Op.LOOKUP) + pack_ints([]))
        assert p.closed_by_store()
    assert proc.status()["refused_batch"] == 1


def test_the_client_splits_batches_at_the_stores_max_batch(store):
    proc = store(limits={"max_batch": 100})
    client = handle(proc)
    buf = ctypes.create_string_buffer(b"x" * 8)
    items = [(f"s{i}", ctypes.addressof(buf), 8) for i in range(250)]
    assert client.put_from(items, True) == [OK] * 250
    assert client.lookup([k for k, _, _ in items]) == [OK] * 250
    out = ctypes.create_string_buffer(8)
    assert client.get_into([(k, ctypes.addressof(out), 8) for k, _, _ in items]) == [8] * 250
    assert proc.status()["refused_batch"] == 0
    client.close()
