"""The memory rule as clients meet it, in separate processes: copies stalled
across a store's crash, stop and fresh start; connections dropped under a
copy; killed and stopped clients; grants of one connection used by another.
Every byte read is checked (docs/local-store-design.md)."""

from __future__ import annotations

import os
import signal

import pytest

from polling import until
from raw_peer import Peer, wait_status
from sglang_simm.simm_rules import DS_CACHE_POOL_ALLOC_FAILED, INVALID_ARGUMENT, OK, TARGET_UNAVAILABLE

pytestmark = pytest.mark.host

SIZE = 256 << 10


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_overlapping_grants_of_two_live_clients_across_a_crash_touch_no_one_elses_bytes(store, child, objects, root):
    """Two writers hold grants in one store process's segment, each half
    copied, when the store is killed; the next store serves the objects the
    first published, read-only, puts its own elsewhere, evicting, and the
    two late copies land in memory nobody else holds."""
    first = store(capacity=16 << 20)
    me = objects(size=SIZE)
    old = keys("old", 8)
    assert me.put(old) == [OK] * 8
    a = child("stall-put", root=root, name="s", keys=keys("a", 8), size=SIZE)
    b = child("stall-put", root=root, name="s", keys=keys("b", 8), size=SIZE)
    a.ready()
    b.ready()
    first.kill9()
    second = store(capacity=16 << 20)
    got, wrong = me.read(old)
    assert got == [SIZE] * 8 and wrong == []  # served from the dead store's segment
    assert second.status()["earlier_held"] is True  # two of its clients are still copying
    new = keys("new", 56)
    for i in range(0, 56, 8):  # more than the capacity holds with the old objects: evicting
        assert me.put(new[i:i + 8]) == [OK] * 8
    a.release()
    b.release()
    assert all(code != OK for code in a.result()["codes"] + b.result()["codes"])  # their store is gone
    got, wrong = me.read(old + new)
    assert wrong == [] and got[-8:] == [SIZE] * 8  # whatever was kept is whole; the newest all kept
    status = wait_status(second, lambda s: not s["earlier_held"], "the earlier segment to be let go")
    assert status["held_bytes"] == 0
    assert me.handle.lookup(keys("a", 8) + keys("b", 8)) == [-4003] * 16


def test_a_stop_and_a_fresh_start_in_the_middle_of_a_put_through_simm_kv(store, child, objects, root):
    """A server's client (``simm.kv``) in the middle of an mput when its store
    is stopped, its objects discarded, and a fresh one started: the late copy
    lands in the old segment, the put fails, the next one stores on the new
    store; another client's 64 objects are whole."""
    first = store()
    p = child("kv-put", root=root, name="s", keys=keys("p", 8), size=SIZE)
    p.ready()
    with Peer(first.paths, data=False) as peer:
        assert peer.admin("stop", discard=True)["discard"] is True
    first.proc.wait(timeout=10)
    assert [f for f in os.listdir(root) if f.endswith(".seg")] == []
    store(capacity=64 << 20)
    me = objects(size=SIZE)
    mine = keys("q", 64)
    assert me.put(mine) == [OK] * 64
    p.release()
    assert all(code != OK for code in p.result()["codes"])
    p.release(second=True)
    assert p.result()["codes"] == [OK] * 8
    got, wrong = me.read(mine + keys("p", 8))
    assert got == [SIZE] * 72 and wrong == []


def test_a_read_in_flight_at_a_crash_holds_the_earlier_segment_only_while_it_copies(store, child, objects, root):
    """A reader in the middle of a copy when the store dies keeps the dead
    store's segment from being given back, and only that long; a client
    merely connected holds nothing."""
    first = store(capacity=32 << 20)
    me = objects(size=SIZE)
    sixty = keys("o", 60)
    for i in range(0, 60, 20):
        assert me.put(sixty[i:i + 20]) == [OK] * 20
    reader = child("stall-get", root=root, name="s", keys=sixty[:2], size=SIZE)
    idle = child("idle", root=root, name="s")
    reader.ready()
    idle.ready()
    first.kill9()
    second = store(capacity=32 << 20)
    got, wrong = me.read(sixty)
    assert got == [SIZE] * 60 and wrong == []
    status = second.status()
    assert status["earlier_held"] is True and status["held_bytes"] > 0
    reader.release()
    assert reader.result() == {"results": [SIZE, SIZE], "problems": []}
    wait_status(second, lambda s: not s["earlier_held"], "the earlier segment to be let go")
    me.handle.clear()
    gone = until(lambda: not [f for f in os.listdir(root) if f.endswith(".seg") and second.status()["gen"] not in f],
                 what="the emptied earlier segment to be deleted")
    assert gone


def test_a_connection_the_store_drops_keeps_its_grant_until_the_copy_is_over(store, child, objects, root):
    """The store hangs up on a client (a bad frame) while a thread of it still
    copies into its grant: the grant stays until the client says no copy is
    in flight; another writer's objects never land there."""
    proc = store(capacity=8 << 20)
    w = child("stall-put", root=root, name="s", keys=keys("w", 4), size=SIZE, hang_up=True)
    w.ready()
    status = wait_status(proc, lambda s: s["orphaned_grants"] == 1, "the hung-up connection's grant kept")
    assert status["reserved_bytes"] == 4 * SIZE and status["refused_bad_frame"] == 1
    me = objects(size=SIZE)
    for round_ in range(4):  # the store at its capacity over and over: every free byte wanted
        assert me.put(keys(f"m{round_}-", 24)) == [OK] * 24
    w.release()
    assert all(code != OK for code in w.result()["codes"])  # its connection is gone: nothing published
    wait_status(proc, lambda s: s["orphaned_grants"] == 0 and s["reserved_bytes"] == 0, "the grant to end")
    got, wrong = me.read(keys("m3-", 24))
    assert wrong == [] and got == [SIZE] * 24


def test_a_killed_clients_grants_end_with_it(store, child, root):
    proc = store(capacity=8 << 20)
    w = child("stall-put", root=root, name="s", keys=keys("w", 8), size=SIZE)
    w.ready()
    assert proc.status()["reserved_bytes"] == 8 * SIZE
    w.kill9()
    wait_status(proc, lambda s: s["reserved_bytes"] == 0 and s["open_grants"] == 0, "the killed writer's room back")


def test_a_grant_is_its_connections_alone(store):
    proc = store()
    with Peer(proc.paths) as a, Peer(proc.paths) as b:
        grant, codes, _ = a.put(["k"], [100])
        assert grant and codes == [OK]
        op, body = b.commit(grant, [0])
        assert body["code"] == INVALID_ARGUMENT and "not this connection's" in body["error"]
        b.release(grant)  # one way: ignored
        assert a.commit(grant, [0])[1] == [OK]
        assert b.lookup(["k"]) == [OK]
    assert proc.status()["refused_grant_owner"] == 2


def test_a_stopped_client_holds_at_most_its_share(store, child, objects, root):
    """A client stopped with a batch granted holds no more than its share of
    the capacity (the rest of its batch is refused at once); the others
    store and read around it."""
    proc = store(capacity=512 << 20)
    share = proc.status()["client_share_bytes"]
    big = 4 << 20
    hog = child("stall-put", root=root, name="s", keys=keys("h", 40), size=big)
    hog.ready()
    hog.signal(signal.SIGSTOP)
    held = proc.status()["reserved_bytes"]
    assert 0 < held <= share < 40 * big
    me = objects(size=big)
    for round_ in range(4):
        assert me.put(keys(f"m{round_}-", 24)) == [OK] * 24
    got, wrong = me.read(keys("m3-", 24))
    assert wrong == [] and got == [big] * 24
    hog.signal(signal.SIGCONT)
    hog.release()
    codes = hog.result()["codes"]
    assert codes.count(OK) * big <= share and DS_CACHE_POOL_ALLOC_FAILED in codes


def test_one_connection_cannot_take_every_grant(store):
    proc = store(limits={"max_grants_per_connection": 3})
    with Peer(proc.paths) as a, Peer(proc.paths) as b:
        grant, _, _ = a.put(["k"], [100])
        assert a.commit(grant, [0])[1] == [OK]
        grants = [a.get(["k"], [100]) for _ in range(3)]
        assert all(g[0] for g in grants)
        assert a.get(["k"], [100])[1] == [TARGET_UNAVAILABLE]
        assert b.get(["k"], [100])[1] == [100]  # another connection is served
