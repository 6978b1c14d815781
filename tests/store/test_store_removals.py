"""What left the store, as the clients that follow it read it
(``removed_since``): the channel a publishing server announces the store's
own removals through (docs/kv-events.md)."""

from __future__ import annotations

from raw_peer import Peer
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK

MIB = 1 << 20


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def put(me, names: list[str]) -> list[int]:
    """Four at a time: a batch larger than the store cannot evict for itself."""
    return [code for i in range(0, len(names), 4) for code in me.put(names[i:i + 4])]


def follow(me, cursor=None):
    """Everything reported since ``cursor``: ``(cursor, lost, keys, prefixes)``."""
    return me._call(me.handle.removed_since, cursor)


def test_evicted_deleted_and_cleared_objects_are_reported_once(store, objects):
    proc = store(capacity=16 * MIB)
    me = objects(size=MIB)
    cursor, lost, gone, cleared = follow(me)
    assert (lost, gone, cleared) == (False, [], [])  # from now: nothing before it
    assert put(me, keys("k", 24)) == [OK] * 24  # FIFO: the first ones make room for the last
    absent = [k for k, code in zip(keys("k", 24), me.handle.lookup(keys("k", 24))) if code == DS_KEY_NOT_FOUND]
    assert absent and absent == keys("k", len(absent))
    cursor, lost, gone, cleared = follow(me, cursor)
    assert (lost, gone, cleared) == (False, absent, [])
    assert me.handle.delete("k23") == OK
    assert me.handle.delete_prefix("k2") == 3  # k20..k22
    cursor, lost, gone, cleared = follow(me, cursor)
    assert (lost, gone, cleared) == (False, ["k23"], ["k2"])
    with Peer(proc.paths, data=False) as admin:
        admin.admin("clear")
    cursor, lost, gone, cleared = follow(me, cursor)
    assert (lost, gone, cleared) == (False, [], [""])
    assert follow(me, cursor)[1:] == (False, [], [])  # each once


def test_a_key_stored_again_is_not_reported(store, objects):
    store(capacity=16 * MIB)
    me = objects(size=MIB)
    cursor = follow(me)[0]
    assert put(me, keys("k", 20)) == [OK] * 20
    evicted = [k for k, code in zip(keys("k", 20), me.handle.lookup(keys("k", 20))) if code != OK]
    assert me.put(evicted[:1]) == [OK]  # back, and evicting another
    _, _, gone, _ = follow(me, cursor)
    assert evicted[0] not in gone and set(evicted[1:]) <= set(gone)


def test_a_follower_left_behind_is_told_it_lost_some(store, objects):
    store(capacity=16 * MIB, limits={"removals_kept": 4})
    me = objects(size=MIB)
    cursor = follow(me)[0]
    assert put(me, keys("k", 30)) == [OK] * 30  # 14 evictions, 4 kept
    cursor, lost, gone, _ = follow(me, cursor)
    assert lost and len(gone) == 4
    assert follow(me, cursor)[1:] == (False, [], [])


def test_a_new_store_process_reports_only_what_it_did_not_keep(store, objects):
    first = store(capacity=16 * MIB)
    me = objects(size=MIB)
    cursor = follow(me)[0]
    assert me.put(keys("k", 4)) == [OK] * 4
    first.kill9()
    second = store(capacity=16 * MIB)  # keeps the objects: nothing left
    cursor, lost, gone, cleared = follow(me, cursor)
    assert (lost, gone, cleared) == (False, [], []) and me.read(keys("k", 4)) == ([MIB] * 4, [])
    with Peer(second.paths, data=False) as admin:
        admin.admin("stop", discard=True)
    second.proc.wait(timeout=10)
    store(capacity=16 * MIB)  # starts empty: everything left
    cursor, lost, gone, cleared = follow(me, cursor)
    assert (lost, cleared) == (False, [""])
