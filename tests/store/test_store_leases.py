"""Memory the store grants to a client, for a put or a read, is never
granted to anyone else until that client has said it is done with it or
its process is gone: not on a timer, not when the store drops the
connection, not across a store crash (docs/local-store.md, the rule at the
top; issue 27). Each test stands for a finding of the audit, against a
store process of its own, with raw same-uid peers, kill -9 and SIGSTOP;
every byte read is checked against a per-key pattern (``store_child``)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from sglang_simm.local_store import _host
from sglang_simm.local_store import _protocol as wire
from sglang_simm.local_store._segments import LEASE_WORDS, ArenaMap
from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.local_store._protocol import Op
from sglang_simm.errors import (
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_KEY_NOT_FOUND,
    INVALID_ARGUMENT,
    OK,
    SEND_RPC_FAILED,
    TARGET_UNAVAILABLE,
)

from raw_peer import Peer, StoreProc, env
from store_child import check, fill, pattern
from polling import until

pytestmark = pytest.mark.host

MIB = 1 << 20
CHILD = os.path.join(os.path.dirname(__file__), "store_child.py")


def new_store(root: str, **kw) -> StoreProc:
    return StoreProc(root, f"lease-{uuid.uuid4().hex[:8]}", capacity=kw.pop("capacity", 64 << 20), **kw)


@pytest.fixture
def store(host_store_dir):
    s = new_store(host_store_dir)
    yield s
    s.stop()


def restarted(store: StoreProc) -> StoreProc:
    """The next store process of ``store``'s name (it takes over), serving."""
    again = StoreProc(store.paths.root, store.paths.name, capacity=64 << 20)
    again.status()
    return again


def client_of(store: StoreProc, **kw) -> StoreHandle:
    c = StoreHandle(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=10, **kw)
    c.open()
    return c


def put_pattern(client: StoreHandle, keys: list[str], size: int, version: int = 1) -> list[int]:
    bufs = [ctypes.create_string_buffer(size) for _ in keys]
    for key, buf in zip(keys, bufs):
        fill(buf, key, version)
    return client.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)


def wrong_objects(client: StoreHandle, keys: list[str], size: int) -> tuple[int, int]:
    """``(objects read back whole, objects read back with wrong bytes)``."""
    out = ctypes.create_string_buffer(size)
    whole = wrong = 0
    for key in keys:
        n = client.get_into([(key, ctypes.addressof(out), size)])[0]
        if n == size:
            if check(out, key, size) is None:
                whole += 1
            else:
                wrong += 1
    return whole, wrong


def late_copy(arena: ArenaMap, offsets: list[int], size: int) -> None:
    """A stalled thread of the first writer ends its copy."""
    for off in offsets:
        ctypes.memset(arena.base + off, 0xEE, size)


def others_kept_past_a_late_copy(store: StoreProc, arena: ArenaMap, offsets: list[int], size: int,
                                 n: int) -> StoreHandle:
    """Another writer stores ``n`` objects, then the first writer's late
    copy lands at ``offsets``: every one of the other's objects reads back
    whole. The other writer's client, still open."""
    other = client_of(store)
    keys = [f"o{i}" for i in range(n)]
    assert put_pattern(other, keys, size) == [OK] * n
    late_copy(arena, offsets, size)
    assert wrong_objects(other, keys, size) == (n, 0)
    return other


# -- who may end a lease -------------------------------------------------------


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


def test_a_fence_of_another_processs_connection_is_refused(store):
    """A fence ends a connection's leases only for the process that held
    them (the peer's pid, from the socket)."""
    child = subprocess.Popen([sys.executable, CHILD, "hold-put", json.dumps(
        {"root": store.paths.root, "name": store.paths.name, "keys": ["c0"], "size": 4096})],
        env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        s = store.status()
        assert s["open_leases"] == 1
        with Peer(store.paths) as p:
            for conn in range(1, 8):  # the child's connection is one of these
                p.fence(s["epoch"], conn)
            assert p.admin("status")["open_leases"] == 1
        assert store.status()["refused_lease_owner"] >= 1
    finally:
        child.kill()
        child.wait()
    # its process is gone: the store's housekeeping ends its lease
    until(lambda: store.status()["open_leases"] == 0, what="the dead child's lease to end")
    assert store.status()["reaped"] == 1


# -- finding 1: the store drops a connection while its client still copies ------------


@pytest.mark.parametrize("why", ["bad_frame", "input_budget"])
def test_a_put_lease_outlives_a_connection_the_store_drops(host_store_dir, why):
    """The store drops a connection itself (a bad frame, the input budget
    crossed) while another thread of its client still copies into its put
    lease: that memory stays the client's, another writer's objects go
    elsewhere, and the client's fence gives it back."""
    store = new_store(host_store_dir, limits={"input_budget_bytes": 1 << 20})
    try:
        _dropped_while_copying(store, why)
    finally:
        store.stop()


def _dropped_while_copying(store: StoreProc, why: str) -> None:
    size = MIB
    with Peer(store.paths) as w:
        lease, codes, offsets = w.put([f"w{i}" for i in range(8)], [size] * 8)
        assert codes == [OK] * 8
        info = w.info
        if why == "bad_frame":
            w.send(wire.HEADER.pack(0, 250))  # an op that does not exist
        else:  # a request announced at 2 MiB, of which 1.5 MiB are sent: past the 1 MiB budget
            try:
                w.send(wire.HEADER.pack(2 << 20, Op.LOOKUP) + bytes(3 << 19))
            except (BrokenPipeError, ConnectionResetError):
                pass  # dropped while sending
        assert w.closed_by_store()
    arena = ArenaMap(info["arena"], info["arena_bytes"])
    try:
        other = others_kept_past_a_late_copy(store, arena, offsets, size, 40)
        s = store.status()
        assert s["closed_leases"] == 1 and s["closed_files_bytes"] == 8 * size and s[f"refused_{why}"] == 1
        # the client's next connection says its copies are over
        with Peer(store.paths) as again:
            again.fence(info["epoch"], info["conn"])
            assert again.admin("status")["closed_leases"] == 0
        assert store.status()["fenced"] == 1
        other.close()
    finally:
        arena.retire()


def test_a_killed_clients_leases_end_with_its_process(store):
    child = subprocess.Popen([sys.executable, CHILD, "hold-put", json.dumps(
        {"root": store.paths.root, "name": store.paths.name, "keys": ["k0", "k1"], "size": MIB})],
        env=env(), stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    until(lambda: store.status()["reserved_bytes"] == 0, what="the killed writer's room to come back")
    assert store.status()["open_leases"] == 0


# -- finding 2 and 9: a writer stalled across a store crash; puts after a takeover ----------


def test_a_writer_stalled_across_a_store_crash_keeps_its_memory(host_store_dir):
    """A writer holds a put lease when the store is killed; the next store
    process keeps that span out of use (its owner lives) however long it
    serves, and gives it back at the writer's fence. ``lease_timeout_s``
    is what the old store quarantined for: it is no setting any more."""
    store = new_store(host_store_dir, limits={"lease_timeout_s": 1.0})
    size = MIB
    try:
        w = Peer(store.paths)
        lease, codes, offsets = w.put([f"w{i}" for i in range(8)], [size] * 8)
        assert codes == [OK] * 8
        info = w.info
        arena = ArenaMap(info["arena"], info["arena_bytes"])
        store.kill9()
        w.close()
        store = restarted(store)
        time.sleep(1.5)  # past the old quarantine
        other = others_kept_past_a_late_copy(store, arena, offsets, size, 48)
        s = store.status()
        assert s["held_at_takeover"] == 1 and s["closed_leases"] == 1 and s["epoch"] == info["epoch"] + 1
        with Peer(store.paths) as again:
            again.fence(info["epoch"], info["conn"])  # naming the dead store process's epoch
            assert again.admin("status")["closed_leases"] == 0
        other.close()
        arena.retire()
    finally:
        store.stop()


def test_puts_succeed_at_once_after_a_takeover_following_a_clear(host_store_dir):
    """Finding 9: the old takeover quarantined every free byte below the
    dead store's high water for a lease time (30.6 s of refused puts after
    a clear). Now only live holders' spans are kept: none here."""
    store = new_store(host_store_dir)
    try:
        c = client_of(store)
        assert put_pattern(c, [f"k{i}" for i in range(64)], MIB) == [OK] * 64
        c.clear()
        c.close()
        store.kill9()
        store = restarted(store)
        t0 = time.monotonic()
        c = client_of(store)
        keys = [f"n{i}" for i in range(48)]
        codes = put_pattern(c, keys, MIB)
        took = time.monotonic() - t0
        assert codes == [OK] * 48, codes
        assert wrong_objects(c, keys, MIB) == (48, 0)
        print(f"puts succeeded {took:.3f} s after the takeover (connect included)")
        assert took < 5
        c.close()
    finally:
        store.stop()


# -- finding 3: a reader stalled across a store crash --------------------------------


def test_a_reader_stalled_across_a_store_crash_never_passes_its_check_on_reused_bytes(host_store_dir):
    store = new_store(host_store_dir)
    size = MIB
    try:
        c = client_of(store)
        assert put_pattern(c, ["a"], size) == [OK]
        c.close()
        reader = Peer(store.paths)
        lease, slot, sizes, (offset,) = reader.get(["a"], [size])
        assert sizes == [size]
        info = reader.info
        arena = ArenaMap(info["arena"], info["arena_bytes"])
        store.kill9()
        reader.close()
        store = restarted(store)
        # the next store process serves on: "a" overwritten, then a new
        # object being written (its lease open) where "a" was, if it may
        w = Peer(store.paths)
        for i, key in enumerate(["a", "n1"]):
            l2, codes, offs = w.put([key], [size])
            buf = ctypes.create_string_buffer(size)
            fill(buf, key, 2)
            ctypes.memmove(arena.base + offs[0], buf, size)
            if i == 0:
                assert w.commit(l2) == (Op.COMMIT, [OK])
        # the reader wakes up: copies, then checks its lease
        out = ctypes.create_string_buffer(size)
        ctypes.memmove(out, arena.base + offset, size)
        passed = ctypes.c_int64.from_address(arena.base + 8 * LEASE_WORDS * slot).value == lease
        wrong = int(passed and check(out, "a", size) is not None)
        assert wrong == 0
        assert passed and check(out, "a", size) is None  # its object was kept for it: a hit, whole
        w.close()
        arena.retire()
    finally:
        store.stop()


def test_lease_ids_are_unique_across_store_processes(host_store_dir):
    store = new_store(host_store_dir)
    try:
        with Peer(store.paths) as p:
            first, _, _ = p.put(["x"], [10])
        store.kill9()
        store = restarted(store)
        with Peer(store.paths) as p:
            second, _, _ = p.put(["x"], [10])
        assert second != first and second >> 40 == (first >> 40) + 1
    finally:
        store.stop()


def test_lease_ids_stay_new_when_the_lease_tables_head_is_lost(host_store_dir):
    """The epoch is kept twice, in the lease table's head and in the
    settings: a dead store's arena whose head was zeroed (a truncation, a
    stray write) does not make the next store process number its leases
    from epoch 1 again."""
    store = new_store(host_store_dir)
    try:
        with Peer(store.paths) as p:
            first, _, _ = p.put(["x"], [10])
        store.kill9()
        (arena,) = store.paths.arenas()
        with open(arena, "r+b") as f:
            f.write(bytes(8 * LEASE_WORDS))  # the header slot: its epoch
        store = restarted(store)
        with Peer(store.paths) as p:
            second, _, _ = p.put(["x"], [10])
        assert second >> 40 == (first >> 40) + 1
    finally:
        store.stop()


def test_a_takeover_reads_the_lease_table_at_its_own_size_when_another_limit_is_damaged(host_store_dir):
    """The lease table's size is ``max_leases``, a setting: a damaged limit
    in the settings falls back alone, so the next store process still
    reads the dead one's table where it lies and keeps a live writer's
    grant."""
    store = new_store(host_store_dir, limits={"max_leases": 1024})
    try:
        w = Peer(store.paths)
        lease, codes, offsets = w.put([f"w{i}" for i in range(8)], [MIB] * 8)
        assert codes == [OK] * 8
        info = w.info
        store.kill9()
        w.close()
        with open(store.paths.settings) as f:
            settings = json.load(f)
        settings["limits"]["max_frame_bytes"] = 5  # below its floor: the launcher's
        with open(store.paths.settings, "w") as f:
            json.dump(settings, f)
        store = restarted(store)
        s = store.status()
        assert s["limits"]["max_leases"] == 1024 and s["held_at_takeover"] == 1 and s["closed_leases"] == 1
        arena = ArenaMap(info["arena"], info["arena_bytes"])
        try:
            others_kept_past_a_late_copy(store, arena, offsets, MIB, 48).close()
        finally:
            arena.retire()
    finally:
        store.stop()


# -- finding 5: the client's own window between a reply and its copy --------------------


def test_a_disconnect_between_a_put_reply_and_its_copy_frees_nothing_under_it(store, monkeypatch):
    """Another thread's ``disconnect()`` (or a timeout) between the PUT's
    reply and the copy: the copy was counted in flight from before the
    PUT, so the socket stays open until it ends; the put then fails with a
    transport code, the key keeps its previous value (a refused COMMIT is
    no miss: the put failed, as SiMM's does), and the next call fences."""
    size = MIB
    client = client_of(store)
    assert put_pattern(client, [f"w{i}" for i in range(8)], size, version=1) == [OK] * 8
    real = _host._in_arena
    foreign = [f"f{i}" for i in range(8)]
    armed = [True]

    def checked_then_disconnected(conn, offsets, sizes):
        """The reply was read and checked; the copy has not begun."""
        ok = real(conn, offsets, sizes)
        if armed and conn is client._conn:
            armed.clear()
            client.disconnect()  # as another thread would
            other = client_of(store)  # another writer, meanwhile
            assert put_pattern(other, foreign, size) == [OK] * 8
            other.close()
        return ok

    monkeypatch.setattr(_host, "_in_arena", checked_then_disconnected)
    codes = put_pattern(client, [f"w{i}" for i in range(8)], size, version=2)
    monkeypatch.setattr(_host, "_in_arena", real)
    assert codes == [SEND_RPC_FAILED] * 8
    reader = client_of(store)
    assert wrong_objects(reader, foreign, size) == (8, 0)
    out = ctypes.create_string_buffer(size)
    assert reader.get_into([("w0", ctypes.addressof(out), size)]) == [size]
    assert check(out, "w0", size) is None and out.raw[:8] == (1).to_bytes(8, "little")  # the previous value
    assert client.lookup(["w0"]) == [OK]  # the next call, on a new connection
    until(lambda: reader.status()["closed_leases"] == 0, what="the fence")
    client.close()
    reader.close()


CLOSER = """
import ctypes, sys, threading, time
from sglang_simm.local_store import _host
from sglang_simm.local_store._handle import StoreHandle
c = StoreHandle(sys.argv[1], root=sys.argv[2], capacity=1, spawn=False, timeout_s=10)
c.open()
real = _host._in_arena
started, go = threading.Event(), threading.Event()
def stalled(conn, offsets, sizes):  # the PUT's reply was read; its copy has not begun
    started.set()
    go.wait()
    return real(conn, offsets, sizes)
_host._in_arena = stalled
buf = ctypes.create_string_buffer(1 << 20)
t = threading.Thread(target=lambda: print(c.put_from([("k", ctypes.addressof(buf), 1 << 20)], True), flush=True))
t.start()
started.wait()
closer = threading.Thread(target=c.close)
closer.start()  # between the PUT's reply and the copy
time.sleep(0.3)
go.set()
t.join()
closer.join()
print("survived", flush=True)
"""


def test_close_between_a_put_reply_and_its_copy_waits_for_the_copy(store):
    done = subprocess.run([sys.executable, "-c", CLOSER, store.paths.name, store.paths.root], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the client died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.splitlines()[-1] == "survived"


# -- findings 7, 8, 11: what one client can hold -------------------------------------------


def test_a_client_backing_up_in_bursts_leaks_nothing(store):
    """Finding 7: rooms leaked into quarantine across idle gaps longer than
    the lease time. Nothing is held between backups now."""
    bursty = client_of(store)
    for gap in range(10):
        assert put_pattern(bursty, [f"b{gap}-{i}" for i in range(2)], 64 << 10) == [OK, OK]
        time.sleep(1.05)
    s = store.status()
    assert (s["open_leases"], s["reserved_bytes"], s["closed_leases"]) == (0, 0, 0)
    other = client_of(store)
    keys = [f"o{i}" for i in range(60)]
    assert put_pattern(other, keys, MIB) == [OK] * 60
    kept = wrong_objects(other, keys, MIB)
    print(f"another writer keeps {kept[0]} of 60 objects after ten idle gaps")
    assert kept == (60, 0)
    bursty.close()
    other.close()


def test_a_stopped_writer_and_a_hoarding_peer_hold_a_bounded_share(store):
    """Finding 8: a stopped writer, or a live peer that puts without
    committing, could quarantine the whole arena. A stopped writer holds
    its batch; a peer holding put room gets more only within a quarter of
    the capacity; everyone else keeps the rest."""
    child = subprocess.Popen([sys.executable, CHILD, "hold-put", json.dumps(
        {"root": store.paths.root, "name": store.paths.name, "keys": [f"s{i}" for i in range(16)], "size": MIB})],
        env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        with Peer(store.paths) as hog:
            assert hog.put(["h0"], [8 * MIB])[1] == [OK]
            grants = [hog.put([f"h{i}"], [4 * MIB])[1][0] for i in range(1, 8)]
            assert grants[:2] == [OK, OK] and set(grants[2:]) == {DS_CACHE_POOL_ALLOC_FAILED}  # 16 MiB: its share
            other = client_of(store)
            keys = [f"o{i}" for i in range(64)]
            for i in range(0, 64, 8):
                put_pattern(other, keys[i:i + 8], MIB)
            kept = wrong_objects(other, keys, MIB)
            print(f"another writer keeps {kept[0]} objects beside a stopped writer (16 MiB) "
                  f"and a hoarding peer (16 MiB) in 64 MiB")
            assert kept[1] == 0 and kept[0] >= 30
            other.close()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_one_connection_cannot_take_every_lease_slot(host_store_dir):
    """Finding 11: past ``max_leases_per_connection`` a connection's gets
    are refused; others' go on."""
    store = new_store(host_store_dir, limits={"max_leases_per_connection": 4})
    try:
        with Peer(store.paths) as w:
            lease, _, _ = w.put(["x"], [4096])
            w.commit(lease)
        with Peer(store.paths) as hog, Peer(store.paths) as other:
            for _ in range(4):
                assert hog.get(["x"], [4096])[0]
            lease, _, results, _ = hog.get(["x"], [4096])
            assert lease == 0 and results == [TARGET_UNAVAILABLE]
            lease, _, results, _ = other.get(["x"], [4096])
            assert lease and results == [4096]
        assert store.status()["refused_leases"] >= 1
    finally:
        store.stop()


def test_leases_past_max_leases_are_refused(host_store_dir):
    store = new_store(host_store_dir, capacity=16 << 20, limits={"max_leases": 2})
    try:
        with Peer(store.paths) as p:
            assert p.put(["a"], [10])[0] and p.put(["b"], [10])[0]
            lease, codes, _ = p.put(["c"], [10])
            assert lease == 0 and codes == [DS_CACHE_POOL_ALLOC_FAILED]
        assert store.status()["refused_leases"] == 1
    finally:
        store.stop()


def test_patterns_differ_per_key():
    assert pattern("a", 1) != pattern("b", 1)
