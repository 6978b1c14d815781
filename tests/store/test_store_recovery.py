"""A crash that loses nothing, and nothing left behind (issue 17, findings
7 and 8): kill -9 of the store process mid-write, settings that persist,
idle exit, dead stores' memory freed, clear giving memory back, names."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("rich")

from sglang_simm.local_store._segments import ArenaMap, lease_table_bytes  # noqa: E402
from sglang_simm.local_store._handle import StoreHandle, pid_alive  # noqa: E402
from sglang_simm.local_store._paths import StorePaths, check_name, files_bytes  # noqa: E402
from sglang_simm.errors import OK  # noqa: E402
from sglang_simm.tools.cli import main  # noqa: E402

from polling import until  # noqa: E402
from raw_peer import Peer, StoreProc, env  # noqa: E402

pytestmark = pytest.mark.host

SIZE = 64 << 10

WRITER = """
import ctypes, sys
from sglang_simm.local_store._handle import StoreHandle
name, root = sys.argv[1], sys.argv[2]
c = StoreHandle(name, root=root, capacity=1, spawn=False, timeout_s=5)
c.open()
size = int(sys.argv[3])
bufs = [ctypes.create_string_buffer(bytes([i % 251 + 1]) * size, size) for i in range(251)]
i = 0
while True:
    batch = [(f"w{j}", ctypes.addressof(bufs[j % 251]), size) for j in range(i, i + 8)]
    try:
        c.put_from(batch, True)
    except Exception:
        pass
    i += 8
    if i == 64:
        print("writing", flush=True)
"""


def name() -> str:
    return f"rec-{uuid.uuid4().hex[:8]}"


def read_all(client: StoreHandle) -> tuple[int, int]:
    """(objects read, wrong bytes) over every key the store lists."""
    keys = client.keys()
    out = ctypes.create_string_buffer(SIZE)
    wrong = 0
    for k in keys:
        assert client.get_into([(k, ctypes.addressof(out), SIZE)]) == [SIZE]
        want = int(k[1:]) % 251 + 1
        wrong += SIZE - out.raw.count(bytes([want]))
    return len(keys), wrong


def test_kill_9_mid_write_loses_no_published_object_and_serves_no_torn_one(host_store_dir):
    n = name()
    store = StoreProc(host_store_dir, n, capacity=32 << 20)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, n, host_store_dir, str(SIZE)], env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        until(lambda: store.status()["evictions"] > 0, what="the store to fill and evict")
        store.kill9()  # mid-write: the writer never stops
        before = store.paths
        assert files_bytes(before) > 16 << 20  # the arena's memory is still there
    finally:
        writer.kill()
        writer.wait(timeout=10)
    again = StoreProc(host_store_dir, n, capacity=1 << 20)  # other settings asked: the store's own win
    try:
        s = again.status()
        assert s["recovered"] > 0 and s["objects"] == s["recovered"]
        assert s["capacity_bytes"] == 32 << 20
        client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=10)
        client.open()
        objects, wrong = read_all(client)
        assert objects == s["recovered"] and wrong == 0
        # the recovered store takes new writes beside the old objects
        buf = ctypes.create_string_buffer(b"\x03" * SIZE, SIZE)
        assert client.put_from([("w2", ctypes.addressof(buf), SIZE)], True) == [OK]
        client.close()
    finally:
        again.stop()
    assert not os.path.exists(again.paths.index) and files_bytes(again.paths) == 0  # a stop frees it all


def test_settings_persist_and_a_client_asking_for_others_is_warned(host_store_dir, caplog):
    n = name()
    store = StoreProc(host_store_dir, n, capacity=32 << 20, policy="lru")
    store.kill9()
    client = StoreHandle(n, root=host_store_dir, capacity=1 << 20, policy="fifo", timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="sglang_simm.local_store"):
        client.open()  # starts the next store process: it comes back with the operator's settings
    s = client.status()
    assert (s["capacity_bytes"], s["policy"]) == (32 << 20, "lru")
    assert any("32.0 MiB and lru" in r.getMessage() for r in caplog.records)
    assert client.stop()


# -- 8. left-overs --------------------------------------------------------------------


def test_an_idle_store_exits_and_frees_its_memory(host_store_dir):
    n = name()
    client = StoreHandle(n, root=host_store_dir, capacity=8 << 20, idle_exit_s=0.3, timeout_s=5)
    client.open()
    pid = client.pid
    buf = ctypes.create_string_buffer(1 << 20)
    assert client.put_from([("a", ctypes.addressof(buf), 1 << 20)], True) == [OK]
    assert pid_alive(pid)  # a client is connected: no idle exit
    client.close()
    until(lambda: not pid_alive(pid), what="the idle store to exit")
    paths = StorePaths(host_store_dir, n)
    assert files_bytes(paths) == 0 and not os.path.exists(paths.settings) and not os.path.exists(paths.socket)


def test_a_dead_store_shows_in_status_and_stop_frees_its_memory(host_store_dir, capsys):
    n = name()
    store = StoreProc(host_store_dir, n, capacity=16 << 20)
    client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
    client.open()
    buf = ctypes.create_string_buffer(4 << 20)
    assert client.put_from([("a", ctypes.addressof(buf), 4 << 20)], True) == [OK]
    client.close()
    store.kill9()
    assert main(["store", "status", n, "--dir", host_store_dir, "--json"]) == 1
    (status,) = json.loads(capsys.readouterr().out)
    assert status["dead"] and status["files_bytes"] >= 4 << 20
    assert main(["store", "status", n, "--dir", host_store_dir, "--prometheus"]) == 1
    text = capsys.readouterr().out
    assert f'sglang_simm:store_up{{store="{n}"}} 0' in text
    assert main(["store", "stop", n, "--dir", host_store_dir]) == 0
    assert "freed" in capsys.readouterr().out
    assert files_bytes(StorePaths(host_store_dir, n)) == 0
    assert n not in os.listdir(host_store_dir) and not StorePaths(host_store_dir, n).arenas()


def test_clear_gives_the_committed_memory_back(host_store_dir, capsys):
    n = name()
    store = StoreProc(host_store_dir, n, capacity=64 << 20)
    try:
        client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        client.open()
        buf = ctypes.create_string_buffer(1 << 20)
        assert client.put_from([(f"k{i}", ctypes.addressof(buf), 1 << 20) for i in range(32)], True) == [OK] * 32
        # its thread faulting the arena in behind the puts is done, so it
        # backs no page the clear gives back (that race has its own test:
        # ``test_memory_a_lagging_client_faults_in_after_a_clear_goes_back``)
        client._conn.arena.wait_behind(30)
        held = files_bytes(store.paths)
        assert held >= 32 << 20
        # A put being copied lies above these objects: the memory under it
        # goes back all the same, and the put's stays its writer's.
        writer = Peer(store.paths)
        lease, codes, _ = writer.put(["held"], [4 << 20])
        assert codes == [OK]
        assert main(["store", "clear", n, "--dir", host_store_dir]) == 0
        assert "removed 32 objects" in capsys.readouterr().out
        assert files_bytes(store.paths) < held - (24 << 20)  # 32 MiB of objects gone; the put's 4 MiB stays
        status = client.status()
        assert status["open_leases"] == 1
        # the put's memory lies past the committed prefix now: the files say so
        assert files_bytes(store.paths) >= status["committed_bytes"] + status["reserved_bytes"] > 0
        # and it still serves, every byte: puts into memory given back and
        # committed again, read by a second client
        ctypes.memset(buf, 0x5A, 1 << 20)
        small = ctypes.create_string_buffer(b"\xa5" * 65536, 65536)
        assert client.put_from([("small", ctypes.addressof(small), 65536)], True) == [OK]
        assert client.put_from([(f"again{i}", ctypes.addressof(buf), 1 << 20) for i in range(8)], True) == [OK] * 8
        other = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        out = ctypes.create_string_buffer(1 << 20)
        for i in range(8):
            ctypes.memset(out, 0, 1 << 20)
            assert other.get_into([(f"again{i}", ctypes.addressof(out), 1 << 20)]) == [1 << 20]
            assert out.raw == buf.raw
        assert other.get_into([("small", ctypes.addressof(out), 65536)]) == [65536]
        assert out.raw[:65536] == small.raw
        other.close()
        # once the put is given back, the next clear gives back the memory
        # it held too (it lay past the prefix counted committed)
        writer.release(lease)
        writer.close()
        client.close()
        assert main(["store", "clear", n, "--dir", host_store_dir]) == 0
        out = capsys.readouterr().out
        assert files_bytes(store.paths) < (4 << 20) + lease_table_bytes(65536)  # the lease table: 3 MiB
        assert "of shared memory still held" in out
    finally:
        store.stop()


def _store_with_32_objects(root: str, hold: bool = False) -> tuple[str, StoreProc, StoreHandle, ctypes.Array]:
    """A 64 MiB store process, and a client (faulting nothing in itself)
    that put 32 objects of 1 MiB of 0x5A there (the buffer too); with
    ``hold``, a put of 4 MiB above them being copied (``client.writer``)."""
    n = name()
    store = StoreProc(root, n, capacity=64 << 20)
    try:
        client = StoreHandle(n, root=root, capacity=1, spawn=False, timeout_s=5, fault_in=False)
        buf = ctypes.create_string_buffer(b"\x5a" * (1 << 20), 1 << 20)
        assert client.put_from([(f"k{i}", ctypes.addressof(buf), 1 << 20) for i in range(32)], True) == [OK] * 32
        if hold:
            client.writer = Peer(store.paths)
            client.lease, codes, _ = client.writer.put(["held"], [4 << 20])
            assert codes == [OK]
    except BaseException:
        store.stop()
        raise
    return n, store, client, buf


def test_memory_a_lagging_client_faults_in_after_a_clear_goes_back(host_store_dir, capsys):
    """A client's thread faulting the arena in behind its puts may still run
    on a target set before the clear; the pages it touches past what the
    store committed are backed again. The store gives them back."""
    n, store, client, buf = _store_with_32_objects(host_store_dir)
    try:
        client.close()
        assert main(["store", "clear", n, "--dir", host_store_dir]) == 0
        assert files_bytes(store.paths) < (4 << 20) + lease_table_bytes(65536)  # the lease table: 3 MiB
        status = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, fault_in=False).status()
        lag = ArenaMap(status["arena"], status["arena_bytes"])
        try:
            lag.populate(32 << 20)  # the target it had: what was committed before the clear
            assert files_bytes(store.paths) >= 30 << 20
            until(lambda: files_bytes(store.paths) < (4 << 20) + lease_table_bytes(65536), timeout=30,
                     what="the memory to go back")
        finally:
            lag.retire()
        assert store.status()["stale_released_bytes"] >= 28 << 20  # counted, for a scrape
        # and the store still serves, every byte
        client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        assert client.put_from([("after", ctypes.addressof(buf), 1 << 20)], True) == [OK]
        out = ctypes.create_string_buffer(1 << 20)
        assert client.get_into([("after", ctypes.addressof(out), 1 << 20)]) == [1 << 20]
        assert out.raw == buf.raw
        client.close()
        with open(store.paths.log) as f:
            assert "a client faulted in past the committed arena" in f.read()
    finally:
        store.stop()


def test_memory_a_lagging_client_backs_below_a_held_put_after_a_clear_goes_back(host_store_dir):
    """Where a put being copied lies above the objects a clear removed, the
    free memory below it is past the committed prefix but below what the
    store backs: what a lagging fault-in backs there goes back too, and
    the store keeps serving."""
    n, store, client, buf = _store_with_32_objects(host_store_dir, hold=True)
    try:
        assert client.status()["open_leases"] == 1
        assert main(["store", "clear", n, "--dir", host_store_dir]) == 0
        status = client.status()
        assert status["open_leases"] == 1 and status["committed_bytes"] < 4 << 20
        cleared = files_bytes(store.paths)
        assert cleared < 12 << 20
        lag = ArenaMap(status["arena"], status["arena_bytes"])
        try:
            lag.populate(32 << 20)  # below the held put, which lies above the 32 MiB of objects
            assert files_bytes(store.paths) >= cleared + (24 << 20)
            until(lambda: files_bytes(store.paths) <= cleared + (1 << 20), timeout=30,
                     what="the memory below the held put to go back")
        finally:
            lag.retire()
        # the store still serves: a backup, read back by another client
        small = ctypes.create_string_buffer(b"\xa5" * 65536, 65536)
        assert client.put_from([("small", ctypes.addressof(small), 65536)], True) == [OK]
        other = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5, fault_in=False)
        out = ctypes.create_string_buffer(65536)
        assert other.get_into([("small", ctypes.addressof(out), 65536)]) == [65536]
        assert out.raw == small.raw
        other.close()
        client.writer.release(client.lease)
        client.writer.close()
        client.close()
    finally:
        store.stop()


def test_a_client_that_moves_no_data_faults_nothing_in(host_store_dir):
    """``store status`` and ``clear`` connect with ``fault_in=False``; a
    server's client faults the committed arena in behind from its connect."""
    n = name()
    store = StoreProc(host_store_dir, n, capacity=64 << 20)
    try:
        writer = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        buf = ctypes.create_string_buffer(1 << 20)
        assert writer.put_from([(f"k{i}", ctypes.addressof(buf), 1 << 20) for i in range(8)], True) == [OK] * 8
        for fault_in, faulted in ((False, False), (True, True)):
            client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5, fault_in=fault_in)
            client.open()
            arena = client._conn.arena
            arena.wait_behind(10)
            assert (arena._populated > 0) is faulted
            client.close()
        writer.close()
    finally:
        store.stop()


def test_prometheus_text_names_the_stores_counters(host_store_dir, capsys):
    n = name()
    store = StoreProc(host_store_dir, n)
    try:
        client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        client.open()
        buf = ctypes.create_string_buffer(4096)
        client.put_from([("a", ctypes.addressof(buf), 4096)], True)
        client.get_into([("a", ctypes.addressof(buf), 4096), ("zz", ctypes.addressof(buf), 4096)])
        client.close()
        assert main(["store", "status", n, "--dir", host_store_dir, "--prometheus"]) == 0
        text = capsys.readouterr().out
    finally:
        store.stop()
    label = f'store="{n}"'
    for line in (f"sglang_simm:store_up{{{label}}} 1", f"sglang_simm:store_objects{{{label}}} 1",
                 f"sglang_simm:store_hits_total{{{label}}} 1", f"sglang_simm:store_misses_total{{{label}}} 1",
                 f"sglang_simm:store_stale_released_bytes_total{{{label}}} 0",
                 f'sglang_simm:store_refusals_total{{{label},reason="batch"}} 0'):
        assert line in text, line
    assert "# TYPE sglang_simm:store_hits_total counter" in text


@pytest.mark.parametrize("bad", ["-x", "--capacity", ".hidden", "a/b", ""])
def test_store_names_are_checked_the_same_everywhere(bad, host_store_dir):
    with pytest.raises(ValueError, match="store name"):
        check_name(bad)
    with pytest.raises(ValueError, match="store name"):
        StoreHandle(bad, root=host_store_dir, capacity=1)
    from sglang_simm.config import SiMMConfig

    with pytest.raises(Exception, match="store name"):
        SiMMConfig(manager_address=f"local://{bad}")
