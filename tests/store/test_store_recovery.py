"""What a store keeps and what it gives back: kill -9, stop, idle exit, clear,
discard; damaged index entries, segments and settings; checksums. Each
against store processes of the test's own (docs/local-store-design.md,
"Recovery")."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

from polling import until
from raw_peer import Peer, StoreProc, wait_status
from sglang_simm.local_store._metrics import render_metrics
from sglang_simm.local_store._paths import StorePaths, check_name, files_bytes
from sglang_simm.local_store._table import ENTRY, HEADER_BYTES
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK

pytestmark = pytest.mark.host

SIZE = 64 << 10


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def segments(paths: StorePaths) -> dict[str, str]:
    return paths.segments()


def entries(paths: StorePaths) -> np.memmap:
    """The index file's entries, as the store writes them."""
    slots = (os.path.getsize(paths.index) - HEADER_BYTES) // ENTRY.itemsize
    return np.memmap(paths.index, dtype=ENTRY, mode="r+", offset=HEADER_BYTES, shape=(slots,))


def slot_of(paths: StorePaths, key: str) -> int:
    e = entries(paths)
    return int(np.flatnonzero((e["key"] == key.encode()) & (e["state"] != 0))[0])


def test_kill_9_mid_write_loses_no_published_object_and_serves_no_torn_one(store, child, objects, root):
    first = store(capacity=64 << 20)
    me = objects(size=SIZE)
    mine = keys("mine", 200)
    for i in range(0, 200, 50):
        assert me.put(mine[i:i + 50]) == [OK] * 50
    writer = child("churn", root=root, name="s", size=SIZE, batch=16, keyspace=100, seed=1,
                   spawn=False)  # a client that starts a store would race the test's second one
    writer.ready()
    until(lambda: first.status()["puts"] >= 200 + 64, what="the writer in the middle of its batches")
    first.kill9()
    writer.kill9()
    second = store(capacity=64 << 20)
    got, wrong = me.read(mine)
    assert got == [SIZE] * 200 and wrong == []  # every object published before the kill
    churned = [k for k in second.status() and me.handle.keys() if k.startswith("churn-")]
    got, wrong = me.read(churned)
    assert churned and wrong == [] and got == [SIZE] * len(churned)  # each whole: one version, never torn
    assert second.status()["recovered"] >= 200


def test_a_stop_keeps_the_objects_for_the_next_start(store, objects, root):
    first = store()
    me = objects(size=SIZE)
    assert me.put(keys("k", 20)) == [OK] * 20
    first.stop()  # SIGTERM, as `sglang-simm store stop` without --discard
    assert segments(first.paths) and os.path.exists(first.paths.index)
    second = store()
    got, wrong = me.read(keys("k", 20))
    assert got == [SIZE] * 20 and wrong == []
    status = second.status()
    assert status["recovered"] == 20 and status["checksum_failures"] == 0 and not status["earlier_held"]


def test_an_idle_memory_store_exits_and_gives_its_memory_back(store, objects):
    proc = store(idle_exit=0.5)
    me = objects(size=SIZE)
    assert me.put(keys("k", 8)) == [OK] * 8
    me.close()
    until(lambda: not proc.alive(), what="the idle store to exit")
    assert segments(proc.paths) == {} and not os.path.exists(proc.paths.index)
    assert "its objects discarded" in proc.log_tail()


def test_clear_and_discard_give_everything_back(store, objects):
    proc = store(capacity=64 << 20)
    me = objects(size=1 << 20)
    assert me.put(keys("k", 40)) == [OK] * 40
    before = files_bytes(proc.paths)
    assert before >= 40 << 20
    with Peer(proc.paths, data=False) as admin:
        assert admin.admin("clear")["removed"] == 40
    assert files_bytes(proc.paths) < 8 << 20  # at most the table, the index and a step ahead
    assert me.put(keys("again", 8)) == [OK] * 8
    with Peer(proc.paths, data=False) as admin:
        admin.admin("stop", discard=True)
    proc.proc.wait(timeout=10)
    assert segments(proc.paths) == {} and files_bytes(proc.paths) == 0


def test_a_client_started_store_keeps_the_settings_it_was_started_with(store, root):
    first = store(capacity=32 << 20, policy="lru", extra=("--started-by", "operator"))
    first.kill9()
    again = store(capacity=8 << 20, policy="fifo")  # a client's launch, asking for others
    status = again.status()
    assert (status["capacity_bytes"], status["policy"]) == (32 << 20, "lru")
    assert "not the launcher's" in open(again.paths.log).read()
    again.stop()
    operator = store(capacity=16 << 20, policy="fifo", extra=("--started-by", "operator"))
    assert (operator.status()["capacity_bytes"], operator.status()["policy"]) == (16 << 20, "fifo")


def test_damaged_index_entries_are_dropped_and_the_rest_kept(store, objects):
    first = store()
    me = objects(size=SIZE)
    assert me.put(keys("k", 10)) == [OK] * 10
    first.kill9()
    e = entries(first.paths)
    e["size"][slot_of(first.paths, "k0")] = 2**63 - 1
    e["size"][slot_of(first.paths, "k1")] = 2**62
    e["offset"][slot_of(first.paths, "k2")] = -(2**62)
    e["seq"][slot_of(first.paths, "k3")] = 2**64 - 1
    e["gen"][slot_of(first.paths, "k4")] = 12345  # a segment that is not there
    e.flush()
    second = store()
    assert second.status()["recovery_dropped"] == 5
    got, wrong = me.read(keys("k", 10))
    assert got == [DS_KEY_NOT_FOUND] * 5 + [SIZE] * 5 and wrong == []
    assert me.put(keys("new", 10)) == [OK] * 10


def test_damaged_bytes_and_an_entry_pointing_at_another_objects_bytes_read_as_misses(store, objects):
    """Bytes of a kept object changed while no store ran, and an index entry
    pointed at another object's bytes: each is a miss on its first read,
    counted and dropped; the rest are served."""
    first = store()
    me = objects(size=SIZE)
    assert me.put(keys("k", 10)) == [OK] * 10
    first.stop()
    e = entries(first.paths)
    (path,) = segments(first.paths).values()
    with open(path, "r+b") as f:
        for key in ("k0", "k1", "k2"):
            f.seek(int(e["offset"][slot_of(first.paths, key)]) + 100)
            f.write(b"\xff\xfe")
    e["offset"][slot_of(first.paths, "k3")] = e["offset"][slot_of(first.paths, "k9")]
    e["state"][slot_of(first.paths, "k9")] = 0  # k3's entry now names k9's bytes (and nothing overlaps)
    e.flush()
    second = store()
    got, wrong = me.read(keys("k", 9))
    assert wrong == [] and got == [DS_KEY_NOT_FOUND] * 4 + [SIZE] * 5
    status = second.status()
    assert status["checksum_failures"] == 4 and status["objects"] == 5
    assert me.handle.lookup(keys("k", 4)) == [DS_KEY_NOT_FOUND] * 4  # dropped, not read again


def test_a_truncated_segment_keeps_the_objects_inside_it(store, objects):
    first = store(capacity=32 << 20)
    me = objects(size=1 << 20)
    assert me.put(keys("k", 16)) == [OK] * 16
    first.kill9()
    e = entries(first.paths)
    cut = int(e["offset"][slot_of(first.paths, "k8")])
    (path,) = segments(first.paths).values()
    os.truncate(path, cut)
    second = store(capacity=32 << 20)
    got, wrong = me.read(keys("k", 16))
    assert wrong == [] and got == [1 << 20] * 8 + [DS_KEY_NOT_FOUND] * 8
    assert second.status()["recovery_dropped"] == 8


@pytest.mark.parametrize("damage", ["garbage header", "symlink", "missing"])
def test_an_index_that_proves_nothing_starts_empty_and_the_old_segments_go(store, objects, root, damage):
    first = store()
    me = objects(size=SIZE)
    assert me.put(keys("k", 4)) == [OK] * 4
    first.kill9()
    os.unlink(first.paths.index)
    if damage == "garbage header":
        with open(first.paths.index, "wb") as f:
            f.write(b"\x00" * 8192)
        os.chmod(first.paths.index, 0o600)
    elif damage == "symlink":
        os.symlink(os.path.join(root, "elsewhere"), first.paths.index)
    second = StoreProc(root, "s")
    assert not os.path.exists(os.path.join(root, "elsewhere"))  # never written through
    try:
        assert second.status()["objects"] == 0
        wait_status(second, lambda s: s["segments"] == 1, "the old segment to go")
        assert me.read(keys("k", 4))[0] == [DS_KEY_NOT_FOUND] * 4
    finally:
        second.stop()


def test_damaged_settings_keep_the_objects(store, objects):
    first = store(capacity=16 << 20)
    me = objects(size=SIZE)
    assert me.put(keys("k", 4)) == [OK] * 4
    first.kill9()
    with open(first.paths.settings, "w") as f:
        json.dump({"capacity": 0, "policy": "random", "limits": {"max_batch": -1}}, f)
    second = store(capacity=16 << 20)
    got, wrong = me.read(keys("k", 4))
    assert got == [SIZE] * 4 and wrong == []
    assert "are unusable (capacity_bytes must be > 0, got 0): the launcher's apply instead" in \
        open(second.paths.log).read()


def test_prometheus_text_names_the_stores_counters(store, objects):
    proc = store()
    me = objects(size=SIZE)
    assert me.put(keys("k", 3)) == [OK] * 3
    me.read(keys("k", 4))
    status = {**proc.status(), "running": True, "files_bytes": files_bytes(proc.paths)}
    text = render_metrics([status, {"name": "gone", "running": False, "files_bytes": 4096}])
    label = f'store="s",dir="{proc.paths.root}"'
    assert f"sglang_simm:store_up{{{label}}} 1" in text and 'sglang_simm:store_up{store="gone",dir=""} 0' in text
    assert f"sglang_simm:store_objects{{{label}}} 3" in text
    assert f"sglang_simm:store_hits_total{{{label}}} 3" in text
    assert f"sglang_simm:store_misses_total{{{label}}} 1" in text
    assert f'sglang_simm:store_refusals_total{{{label},reason="frame"}} 0' in text


@pytest.mark.parametrize("bad", ["", "-x", ".x", "a/b", "x" * 65])
def test_store_names_are_checked_the_same_everywhere(bad, root):
    from sglang_simm.config import SiMMConfig

    with pytest.raises(ValueError):
        check_name(bad)
    with pytest.raises(ValueError):
        SiMMConfig(manager_address=f"local://{bad}") if bad else check_name(bad)
    with pytest.raises((ValueError, AssertionError)):
        StoreProc(root, bad or f"x{uuid.uuid4().hex}/x")
