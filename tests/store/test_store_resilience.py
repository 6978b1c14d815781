"""A store that starts small, refuses what it cannot be, always comes back,
and stands files changed under it: each against store processes of the
test's own, with raw peers, planted files and forks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from polling import until
from raw_peer import Peer, env
from sglang_simm.local_store import _handle
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._paths import StorePaths
from sglang_simm.local_store._protocol import Op, Reader, encode_keys
from sglang_simm.simm_rules import INVALID_ARGUMENT, OK

pytestmark = pytest.mark.host

SIZE = 64 << 10


def run_store(root: str, name: str, *args: str) -> subprocess.CompletedProcess:
    """The store process to its end (one that refuses to start, or exits)."""
    return subprocess.run([sys.executable, "-m", "sglang_simm.local_store._server", "--dir", root, "--name", name,
                           *args], env=env(), capture_output=True, text=True, timeout=60)


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_an_empty_store_of_a_terabyte_starts_with_a_few_mib(store):
    """--force: this host cannot back 1 TiB of memory, and the store says so,
    but starts; the index and the segment are sparse, untouched."""
    proc = store(capacity=1 << 40, extra=("--force",))
    status = proc.status()
    assert status["capacity_bytes"] == 1 << 40 and status["max_objects"] == (1 << 40) // 4096
    assert proc.rss_kib() < 64 << 10, proc.rss_kib()  # private memory: MiB, not GB
    assert os.lstat(proc.paths.index).st_blocks * 512 < 4 << 20
    assert "more than this host can back" in open(proc.paths.log).read()
    with Peer(proc.paths) as p:  # and it serves
        grant, codes, _ = p.put(["a", "b"], [100, 100])
        assert codes == [OK, OK] and p.commit(grant, [0, 0])[1] == [OK, OK]


@pytest.mark.parametrize("how", [("--started-by", "operator", "--force"), ("--started-by", "client")],
                         ids=["operator-forced", "client"])
def test_a_capacity_no_client_can_map_is_refused_with_the_reason_forced_or_not(root, how):
    done = run_store(root, "s", "--capacity", str(100 << 40), *how)
    assert done.returncode == 1
    assert "maps a segment" in done.stderr and "a client can map" in done.stderr, done.stderr
    paths = StorePaths(root, "s")
    assert not paths.segments() and not os.path.exists(paths.index)  # refused before anything was made


def test_a_capacity_beyond_the_host_is_refused_to_an_operator_unless_forced(root):
    done = run_store(root, "s", "--capacity", str(2 << 40), "--started-by", "operator")
    assert done.returncode == 1 and "more than this host can back" in done.stderr, done.stderr


def test_a_client_backs_off_a_store_that_fails_to_start_and_names_its_log(root, monkeypatch):
    """A store process that exits without serving: ``open`` gives up once its
    launches failed (not at its deadline), naming the log; the data path's
    later attempts launch again only after a back-off that doubles."""
    paths = StorePaths(root, "s")
    launches = []
    real = subprocess.Popen

    def failing(cmd, *a, **kw):
        if "sglang_simm.local_store._server" in cmd:
            launches.append(time.monotonic())
            return real([sys.executable, "-c", "import sys; sys.exit(1)"])
        return real(cmd, *a, **kw)

    monkeypatch.setattr(_handle.subprocess, "Popen", failing)
    client = StoreHandle("s", root=root, capacity=8 << 20, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as err:
        client.open(wait_s=15)
    assert time.monotonic() - t0 < 10 and paths.log in str(err.value)
    del launches[:]
    deadline, last = time.monotonic() + 6, None
    while time.monotonic() < deadline:  # the data path's calls, each allowed to try
        try:
            client.lookup(["x"])
        except StoreUnreachable as exc:
            last = exc
        time.sleep(0.05)
    monkeypatch.undo()
    assert len(launches) <= 2, len(launches)
    assert paths.log in str(last)
    client.close()


def test_one_client_process_runs_one_launcher_at_a_time(root, monkeypatch):
    started = []
    real = subprocess.Popen

    def slow_launch(cmd, *a, **kw):  # a launcher still running while the other threads ask
        started.append(1)
        time.sleep(0.2)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(_handle.subprocess, "Popen", slow_launch)
    handles = [StoreHandle("s", root=root, capacity=8 << 20, timeout_s=2) for _ in range(4)]
    go = threading.Barrier(len(handles))

    def open_(h):
        go.wait()
        h.open()

    threads = [threading.Thread(target=open_, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert len(started) == 1 and len({h.pid for h in handles}) == 1
    handles[0].stop(discard=True)
    for h in handles:
        h.close()


def test_a_removed_lock_file_lets_no_second_store_take_over_a_live_one(store, objects, root):
    proc = store(capacity=32 << 20)
    me = objects(size=SIZE)
    assert me.put(keys("k", 40)) == [OK] * 40
    os.unlink(proc.paths.lock)  # an operator's cleanup, a tmp cleaner
    second = run_store(root, "s", "--capacity", str(32 << 20))
    assert second.returncode == 1 and "another live store process holds" in second.stderr, second.stderr
    assert proc.alive() and proc.status()["pid"] == proc.pid
    got, wrong = me.read(keys("k", 40))
    assert got == [SIZE] * 40 and wrong == []


@pytest.mark.parametrize("planted", ["index", "settings.tmp", "pid"])
def test_a_store_file_planted_as_a_symlink_is_never_written_through(store, objects, root, planted):
    first = store(capacity=32 << 20)
    me = objects(size=SIZE)
    assert me.put(keys("k", 16)) == [OK] * 16
    first.kill9()
    victim = os.path.join(root, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious\n" * 1000)
    path = {"index": first.paths.index, "settings.tmp": first.paths.settings + ".tmp", "pid": first.paths.pid}[planted]
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(victim, path)
    again = store(capacity=32 << 20)
    status = again.status()
    with open(victim, "rb") as f:
        assert f.read() == b"precious\n" * 1000
    if planted == "index":  # no index to prove the objects by: an empty store, saying why
        assert status["recovered"] == 0 and "symlink" in open(again.paths.log).read()
    else:
        assert status["recovered"] == 16


def test_a_log_planted_as_a_symlink_is_refused_with_a_message(root):
    victim = os.path.join(root, "victim")
    with open(victim, "w") as f:
        f.write("precious\n")
    os.symlink(victim, StorePaths(root, "s").log)
    done = run_store(root, "s", "--capacity", str(8 << 20))
    assert done.returncode == 1 and "symlink" in done.stderr, done.stderr
    with open(victim) as f:
        assert f.read() == "precious\n"


def test_malformed_requests_get_invalid_argument_with_a_reason(store):
    proc = store()
    bad = [(Op.ADMIN, b"{not json"), (Op.ADMIN, b"\xff\xfe"), (Op.ADMIN, b"[" * 100_000),
           (Op.DELETE_PREFIX, encode_keys(["a", "b"])), (Op.DELETE_PREFIX, encode_keys([]))]
    with Peer(proc.paths) as p:
        for op, body in bad:
            got, reply = p.call(op, body)
            err = Reader(reply).json()
            assert got == Op.ERROR and err["code"] == INVALID_ARGUMENT, (op, err)
            assert "Error" not in err["error"] and len(err["error"]) < 300, err
        assert p.lookup(["x"]) == [-4003]  # the connection goes on
    with Peer(proc.paths, hello=False) as p:  # a HELLO that is no JSON
        got, reply = p.call(Op.HELLO, b"\x00garbage")
        assert got == Op.ERROR and Reader(reply).json()["code"] == INVALID_ARGUMENT
    assert proc.status()["refused_request"] >= len(bad) + 1


def test_connections_that_never_say_hello_are_dropped_and_counted(store):
    proc = store()
    silent = [Peer(proc.paths, hello=False, timeout=15) for _ in range(40)]
    for p in silent:
        assert p.closed_by_store()  # within its 15 s receive limit
        p.close()
    status = proc.status()
    assert status["refused_hello"] == 40 and status["connections"] == 1


def test_evicted_zero_size_objects_leak_no_room(store):
    proc = store(capacity=1 << 20)
    with Peer(proc.paths) as p:
        empty = p.admin("status")["free_bytes"]
        grant, codes, _ = p.put(keys("z", 100), [0] * 100)
        assert codes == [OK] * 100 and p.commit(grant, [0] * 100)[1] == [OK] * 100
        for i in range(8):  # batches that evict the oldest, the empty objects among them
            grant, codes, _ = p.put([f"big{i}a", f"big{i}b"], [256 << 10, 256 << 10])
            assert codes == [OK, OK] and p.commit(grant, [0, 0])[1] == [OK, OK]
        assert p.lookup(keys("z", 100)) == [-4003] * 100
        p.admin("clear")
        assert p.admin("status")["free_bytes"] == empty


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_a_segment_removed_or_replaced_under_a_running_store_changes_nothing_for_its_clients(
        store, objects, root, change):
    """Clients get their segments as open descriptors: a segment file removed
    or replaced under a running store is no path anyone reads again."""
    proc = store(capacity=32 << 20)
    me = objects(size=SIZE)
    assert me.put(keys("k", 10)) == [OK] * 10
    (path,) = proc.paths.segments().values()
    os.unlink(path)
    if change == "replaced":
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        os.chmod(path, 0o600)
    late = objects(size=SIZE)  # a client that connects afterwards
    got, wrong = late.read(keys("k", 10))
    assert got == [SIZE] * 10 and wrong == []
    assert late.put(keys("n", 10)) == [OK] * 10
    got, wrong = me.read(keys("n", 10))
    assert got == [SIZE] * 10 and wrong == []


def test_a_removed_socket_is_bound_again(store, objects):
    proc = store()
    os.unlink(proc.paths.socket)  # a tmp cleaner
    until(lambda: os.path.exists(proc.paths.socket), what="the store to listen again")
    assert objects(size=SIZE).put(["k"]) == [OK]


def test_a_forked_child_uses_its_parents_store_on_its_own_connection(root, host_store_dir):
    """A child forked by a process that uses a local store (through
    ``simm.kv``, as a server does) reaches the store on its own connection,
    with locks of its own; the parent's goes on untouched."""
    script = f"""
import ctypes, json, os, sys
from sglang_simm import local_store as kv
for flag, value in (("local_store_scope", "host"), ("local_store_dir", {root!r}), ("cm_primary_node_ip", "s")):
    assert kv.set_flag(flag, value)
import torch
store = kv.Store()
region = torch.frombuffer(bytearray(b"\\x05" * 4096), dtype=torch.uint8)
mr = kv.register_mr(region)
view = kv.BlockView.from_buffer(region.data_ptr(), 4096, mr)
assert store.put("parent", view) == 0
out = []
for round_ in range(3):
    pid = os.fork()
    if pid == 0:
        ok = store.put(f"child{{round_}}", view) == 0 and store.get("parent", view) == 4096
        os._exit(0 if ok else 3)
    out.append(os.waitpid(pid, 0)[1] >> 8)
    out.append(store.exists(f"child{{round_}}"))
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script], env={**env(), "SGLANG_SIMM_STORE_DIR": host_store_dir},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, True] * 3
    StoreHandle("s", root=root, capacity=1, spawn=False, data=False).stop(discard=True)
