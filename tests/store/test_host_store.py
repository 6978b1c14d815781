"""The local store across processes: sharing, faults, security.

Every store process here lives in the session's private store directory
(see tests/suite.py) or in a directory of the test's own, and is stopped
by its pid when the test ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from sglang_simm.local_store import _handle as _host
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable, pid_alive
from sglang_simm.local_store._paths import StoreAccessError, StorePaths, check_name, read_pid
from sglang_simm.errors import BUILD_CONNECTION_FAILED, OK, OUT_OF_MEMORY, SEND_RPC_FAILED
from polling import until
from raw_peer import env as child_env

pytestmark = pytest.mark.host

class Buf:
    """A plain host buffer and its address."""

    def __init__(self, size: int, fill: int | None = None) -> None:
        self.raw = ctypes.create_string_buffer(size)
        self.size = size
        if fill is not None:
            ctypes.memset(self.raw, fill, size)

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.raw)

    def bytes(self) -> bytes:
        return self.raw.raw


@pytest.fixture
def handle(host_store_dir):
    """A client of a store of the test's own, started by it, stopped and its
    objects discarded after."""
    server = StoreHandle(f"ht-{uuid.uuid4().hex[:10]}", root=host_store_dir, capacity=64 << 20, timeout_s=5.0)
    server.open()
    yield server
    server.stop(discard=True)


def put(server, key: str, buf: Buf) -> int:
    return server.put_from([(key, buf.ptr, buf.size)], True)[0]


def get(server, key: str, size: int) -> tuple[int, bytes]:
    out = Buf(size, fill=0)
    n = server.get_into([(key, out.ptr, size)])[0]
    return n, out.bytes()


# -- sharing ----------------------------------------------------------------------


def test_first_client_starts_the_store_and_it_outlives_its_clients(host_store_dir):
    name = f"ht-{uuid.uuid4().hex[:10]}"
    paths = StorePaths(host_store_dir, name)
    assert not os.path.exists(paths.socket)
    first = StoreHandle(name, root=host_store_dir, capacity=16 << 20)
    first.open()
    pid = first.pid
    assert pid_alive(pid) and pid != os.getpid()
    assert put(first, "k", Buf(4096, fill=7)) == OK
    first.close()
    assert pid_alive(pid)  # no client left: the store lives on
    second = StoreHandle(name, root=host_store_dir, capacity=16 << 20)
    second.open()
    assert second.pid == pid
    assert get(second, "k", 4096) == (4096, b"\x07" * 4096)  # a restarted client finds its pages
    assert second.stop(discard=True) and not pid_alive(pid)
    assert not os.path.exists(paths.socket)
    assert not paths.segments()


def test_another_process_reads_what_one_wrote(handle):
    keys = [f"k{i}" for i in range(8)]
    data = Buf(65536, fill=0x5A)
    assert handle.put_from([(k, data.ptr, data.size) for k in keys], True) == [OK] * 8
    script = (
        "import ctypes, json, sys\n"
        "from sglang_simm.local_store._handle import StoreHandle\n"
        "s = StoreHandle(sys.argv[1], root=sys.argv[2], capacity=1 << 20); s.open()\n"
        "bufs = [ctypes.create_string_buffer(65536) for _ in range(8)]\n"
        "got = s.get_into([(f'k{i}', ctypes.addressof(b), 65536) for i, b in enumerate(bufs)])\n"
        "print(json.dumps([got, [b.raw.count(b'Z') for b in bufs]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, handle.name, handle.root], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    got, zs = json.loads(out.stdout)
    assert got == [65536] * 8 and zs == [65536] * 8


def test_two_clients_starting_at_once_get_one_store(host_store_dir):
    name = f"ht-{uuid.uuid4().hex[:10]}"
    script = (
        "import sys\n"
        "from sglang_simm.local_store._handle import StoreHandle\n"
        "s = StoreHandle(sys.argv[1], root=sys.argv[2], capacity=1 << 20); s.open(); print(s.pid)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, name, host_store_dir], stdout=subprocess.PIPE,
                              text=True, env=child_env()) for _ in range(4)]
    pids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(pids) == 1
    StoreHandle(name, root=host_store_dir, capacity=1 << 20, spawn=False).stop()


# -- faults -------------------------------------------------------------------------


def test_a_writer_killed_mid_batch_leaves_no_object_visible(handle, child):
    keys = [f"torn-{i}" for i in range(8)]
    writer = child("stall-put", root=handle.root, name=handle.name, keys=keys, size=1 << 20)
    writer.ready()
    status = handle.status()
    assert status["reserved_bytes"] == 8 << 20 and status["open_grants"] == 1
    assert handle.lookup(keys) == [-4003] * 8  # half copied, nothing visible
    writer.kill9()
    until(lambda: handle.status()["open_grants"] == 0, what="the grant to be dropped")
    status = handle.status()
    assert status["reserved_bytes"] == 0 and status["aborted"] == 8 and status["objects"] == 0
    assert handle.lookup(keys) == [-4003] * 8
    # the reserved room is back: a full-capacity batch still fits
    big = Buf(1 << 20, fill=1)
    assert handle.put_from([(f"after-{i}", big.ptr, big.size) for i in range(60)], True) == [OK] * 60


def test_a_reader_killed_mid_get_leaks_no_pin(handle, child):
    data = Buf(1 << 20, fill=3)
    assert put(handle, "pinned", data) == OK
    reader = child("stall-get", root=handle.root, name=handle.name, keys=["pinned"], size=1 << 20)
    reader.ready()
    assert handle.status()["pinned_objects"] == 1
    assert handle.delete("pinned") == OK  # gone from the index; its memory waits for the reader
    free_while_pinned = handle.status()["free_bytes"]
    reader.kill9()
    until(lambda: handle.status()["pinned_objects"] == 0, what="the pin to be released")
    assert handle.status()["free_bytes"] > free_while_pinned


def test_objects_written_by_a_writer_killed_at_random_are_whole(handle, child):
    """A writer killed again and again in the middle of its batches: every
    object a reader can see is one whole version, never torn."""
    from store_child import check  # noqa: PLC0415 (the children's own checker)

    for seed in range(3):
        writer = child("churn", root=handle.root, name=handle.name, size=256 << 10, batch=16, keyspace=40,
                       seed=seed)
        writer.ready()
        until(lambda: handle.status()["puts"] >= 16 * (seed + 2), what="the writer's next batches")
        writer.kill9()
    until(lambda: handle.status()["open_grants"] == 0, what="the writers' grants to be dropped")
    keys = [f"churn-{i}" for i in range(40)]
    bufs = [Buf(256 << 10, fill=0) for _ in keys]
    got = handle.get_into([(k, b.ptr, b.size) for k, b in zip(keys, bufs)])
    whole = [k for k, n in zip(keys, got) if n == 256 << 10]
    assert whole, "the writers stored nothing"
    problems = [check(b.raw, k, 256 << 10) for k, b, n in zip(keys, bufs, got) if n == 256 << 10]
    assert [p for p in problems if p] == []
    assert handle.status()["reserved_bytes"] == 0


def test_eight_processes_on_shared_and_own_keys_every_byte_checked(handle, child):
    workers = [child("worker", root=handle.root, name=handle.name, id=i, rounds=6, size=64 << 10, own=12,
                     shared=24) for i in range(8)]
    results = []
    for worker in workers:
        out, err = worker.proc.communicate(timeout=180)
        assert worker.proc.returncode == 0, f"{out} {err}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["got"] for r in results) > 8 * 6 * 12
    assert all(not r["problems"] for r in results)
    assert handle.status()["open_grants"] == 0


def test_store_process_killed_calls_fail_with_transport_codes_then_recover_its_objects(handle):
    data = Buf(4096, fill=9)
    assert put(handle, "before", data) == OK
    old_pid = handle.pid
    os.kill(old_pid, signal.SIGKILL)
    until(lambda: not pid_alive(old_pid), what="the store process to die")
    with pytest.raises(StoreUnreachable) as exc:
        handle.lookup(["before"])
    assert exc.value.code in (SEND_RPC_FAILED, BUILD_CONNECTION_FAILED)

    def back() -> bool:
        try:
            return handle.lookup(["before"]) is not None
        except StoreUnreachable:
            return False

    until(back, timeout=15, what="the client to start a new store and reconnect")
    assert handle.pid != old_pid and pid_alive(handle.pid)
    # the new store process took the dead one's objects over
    assert get(handle, "before", 4096) == (4096, b"\x09" * 4096)
    assert put(handle, "after", data) == OK
    assert get(handle, "after", 4096) == (4096, b"\x09" * 4096)
    assert handle.reconnects >= 1


def test_a_store_this_process_started_and_that_died_is_started_again_by_the_next_call_at_once(handle, caplog):
    """The launch that started a store that served is no failed launch: the
    first call that finds that store gone starts the next one, with no
    launch back-off and no "exited without serving" warning (a breaker's
    probes, seconds apart, would each have found no store)."""
    old_pid = handle.pid
    os.kill(old_pid, signal.SIGKILL)
    until(lambda: not pid_alive(old_pid), what="the store process to die")
    codes = []
    with caplog.at_level("WARNING", logger="sglang_simm.local_store"):
        while BUILD_CONNECTION_FAILED not in codes and len(codes) < 3:  # the first finds the connection lost
            with pytest.raises(StoreUnreachable) as exc:
                handle.lookup(["x"])
            codes.append(exc.value.code)
    assert codes[-1] == BUILD_CONNECTION_FAILED, codes  # found no store process: started one
    assert not [r for r in caplog.records if "without serving" in r.getMessage()]
    paths = StorePaths(handle.root, handle.name)
    # no further call: the last one above started it
    until(lambda: read_pid(paths) not in (None, old_pid) and pid_alive(read_pid(paths)),
             timeout=30, what="a new store process started by that one call")


def test_a_stalled_store_times_out_and_the_client_reconnects(handle, host_store_dir):
    client = StoreHandle(handle.name, root=host_store_dir, capacity=64 << 20, timeout_s=0.3)
    client.open()
    assert client.pid == handle.pid  # a second client of the same store process
    os.kill(handle.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnreachable, match="did not answer") as raised:
            client.lookup(["x"])
        # SendRPCFailed, as SiMM HEAD reports a timed-out request (the client never says Timeout)
        assert raised.value.code == SEND_RPC_FAILED
    finally:
        os.kill(handle.pid, signal.SIGCONT)
    until(lambda: _try(client.lookup, ["x"]) == [-4003], what="a new connection")
    assert client.reconnects == 1
    client.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except StoreUnreachable:
        return None


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 24 MiB tmpfs of the test's own (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "shm"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield str(mount)
    finally:
        _stop_all(str(mount))
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _stop_all(root: str) -> None:
    for entry in os.listdir(root):
        if entry.endswith(".sock"):
            try:
                StoreHandle(entry[:-5], root=root, capacity=1, spawn=False).stop()
            except (StoreUnreachable, OSError):
                pass


def test_shared_memory_full_fails_puts_with_out_of_memory_and_nothing_else_breaks(small_tmpfs):
    server = StoreHandle("full", root=small_tmpfs, capacity=256 << 20, timeout_s=5.0)
    server.open()
    data = Buf(1 << 20, fill=4)
    codes = [put(server, f"k{i}", data) for i in range(40)]
    assert OUT_OF_MEMORY in codes, codes  # a 24 MiB tmpfs cannot hold 40 MiB
    first_oom = codes.index(OUT_OF_MEMORY)
    assert codes[:first_oom] == [OK] * first_oom and first_oom >= 10
    status = server.status()
    assert status["out_of_memory"] >= 1 and "No space" in status["memory_error"]
    assert status["memory_limited"] and status["capacity_bytes"] < 24 << 20
    # the store goes on within the memory it has: later puts evict, reads work
    assert codes[first_oom + 1:] == [OK] * (len(codes) - first_oom - 1)
    assert get(server, "k39", 1 << 20) == (1 << 20, b"\x04" * (1 << 20))
    server.stop()



def test_files_are_the_owners_alone(handle):
    paths = handle.paths
    assert os.stat(handle.root).st_mode & 0o777 == 0o700
    for path in (paths.socket, paths.lock, paths.pid, paths.log, paths.index, *paths.segments().values()):
        st = os.stat(path)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0, path


def test_a_directory_open_to_others_is_refused(tmp_path):
    root = tmp_path / "open"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(StoreAccessError, match="lets other users in"):
        StoreHandle("x", root=str(root), capacity=1 << 20)


def test_another_users_directory_is_refused_with_the_fix(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(StoreAccessError) as exc:
        StoreHandle("x", root=str(root), capacity=1 << 20)
    assert "uid 12345" in str(exc.value) and "SGLANG_SIMM_STORE_DIR" in str(exc.value)


def test_another_user_cannot_reach_the_store(handle):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    script = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except OSError as e:\n"
        "    print('refused', e.errno); sys.exit(0)\n"
        "s.sendall(b'x' * 10); print('answered', s.recv(10))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, handle.paths.socket], capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.startswith("refused"), out.stdout + out.stderr


def test_the_store_refuses_a_connection_from_another_uid(handle):
    """Even past the file modes (opened up here on purpose), the store
    checks its peer's uid and hangs up."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    os.chmod(handle.root, 0o711)
    os.chmod(handle.paths.socket, 0o777)
    try:
        script = (
            "import os, socket, struct, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
            "body = b'{\"version\": 1}'\n"
            "try:\n"
            "    s.sendall(struct.pack('<IB', len(body), 1) + body)\n"
            "    print('reply', len(s.recv(100)))\n"
            "except OSError:\n"
            "    print('reply 0')\n"
        )
        out = subprocess.run([sys.executable, "-c", script, handle.paths.socket], capture_output=True,
                             text=True, timeout=30)
        assert out.stdout.strip() == "reply 0", out.stdout + out.stderr  # closed without a word
    finally:
        os.chmod(handle.root, 0o700)
        os.chmod(handle.paths.socket, 0o600)
    assert "refused a connection from uid 65534" in open(handle.paths.log).read()


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 65, "sp ace", "a\0b"])
def test_bad_store_names_are_refused(name):
    with pytest.raises(ValueError, match="not valid"):
        check_name(name)


def test_a_socket_path_too_long_for_unix_is_refused_before_any_process_starts(host_store_dir):
    # Before: the store process failed to bind, three were started, and the
    # caller waited 15 s for "did not answer".
    deep = os.path.join(host_store_dir, "d" * 40)
    name = "n" * 64
    with pytest.raises(ValueError, match=r"socket path .* is \d+ bytes.*at most 107.*shorter store name"):
        StoreHandle(name, root=deep, capacity=1 << 20)
    assert not os.path.exists(deep)
    assert len(StorePaths(deep, "n" * 8).socket) <= 107  # a short name in the same place is fine


def test_a_store_nobody_runs_is_reported_without_starting_one(host_store_dir):
    server = StoreHandle(f"ht-{uuid.uuid4().hex[:10]}", root=host_store_dir, capacity=1 << 20, spawn=False)
    with pytest.raises(StoreUnreachable, match="did not answer") as exc:
        server.open(wait_s=0.2)
    assert exc.value.code == BUILD_CONNECTION_FAILED
    assert not os.path.exists(server.paths.socket)


def test_handles_are_one_per_store_per_process(host_store_dir):
    name = f"ht-{uuid.uuid4().hex[:10]}"
    a = _host.get_or_open(name, root=host_store_dir, capacity=1 << 20, policy="fifo", timeout_s=1.0)
    b = _host.get_or_open(name, root=host_store_dir, capacity=1 << 20, policy="fifo", timeout_s=1.0)
    assert a is b and name in _host.handle_names()
    pid = a.pid
    _host.forget(name, root=host_store_dir)
    assert name not in _host.handle_names() and not pid_alive(pid or 0)


def test_a_writer_stalled_mid_batch_blocks_nobody(handle, child):
    """A writer stopped (SIGSTOP) between its grant and its publish holds only
    its own room: other writers and readers go on (a store with one global
    write lock, such as LMDB's, would make them all wait)."""
    writer = child("stall-put", root=handle.root, name=handle.name, keys=[f"s-{i}" for i in range(4)],
                   size=1 << 20)
    writer.ready()
    writer.signal(signal.SIGSTOP)
    data = Buf(1 << 20, fill=8)
    assert handle.put_from([(f"other-{i}", data.ptr, data.size) for i in range(8)], True) == [OK] * 8
    assert get(handle, "other-3", 1 << 20) == (1 << 20, b"\x08" * (1 << 20))
    assert handle.status()["open_grants"] == 1  # the stalled writer's, still held


def _launcher(tmp_path, body: str) -> str:
    """An executable standing in for the Python a client starts its store
    process with: it records each start, then does ``body``."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho started >> {tmp_path / 'starts'}\n{body}\n")
    script.chmod(0o700)
    return str(script)


def test_a_store_process_slow_to_start_is_waited_for(host_store_dir, tmp_path, monkeypatch):
    # On a host whose cores are all busy a Python process can take seconds
    # to start: the client waits for the one it started, past its own limit.
    monkeypatch.setattr(_host.sys, "executable", _launcher(tmp_path, f'sleep 2; exec {sys.executable} "$@"'))
    server = StoreHandle(f"ht-{uuid.uuid4().hex[:10]}", root=host_store_dir, capacity=1 << 20)
    try:
        server.open(wait_s=0.5)
        assert put(server, "k", Buf(4096, fill=3)) == OK
        assert get(server, "k", 4096) == (4096, b"\x03" * 4096)
        assert (tmp_path / "starts").read_text().count("started") == 1
    finally:
        server.stop()


def test_a_store_slow_after_its_launcher_exits_is_not_started_twice(host_store_dir, tmp_path, monkeypatch):
    # The launcher forks and exits at once; on a loaded host the store
    # process it leaves can take a while to go on. It holds the name's lock
    # from before the fork, so the client never takes the launcher's exit
    # for a death and starts a second one (it did, under load).
    slow_child = ("import os, runpy, sys, time; os.register_at_fork(after_in_child=lambda: time.sleep(2)); "
                  "sys.argv = ['_daemon', *sys.argv[1:]]; runpy.run_module('sglang_simm.local_store._server', "
                  "run_name='__main__')")
    monkeypatch.setattr(_host.sys, "executable", _launcher(tmp_path, f'shift 2; exec {sys.executable} -c "{slow_child}" "$@"'))
    server = StoreHandle(f"ht-{uuid.uuid4().hex[:10]}", root=host_store_dir, capacity=1 << 20)
    try:
        server.open(wait_s=0.5)
        assert put(server, "k", Buf(4096, fill=5)) == OK
        assert (tmp_path / "starts").read_text().count("started") == 1
    finally:
        server.stop()


def test_a_store_process_that_dies_starting_is_started_again_then_reported(host_store_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(_host.sys, "executable", _launcher(tmp_path, "exit 1"))
    server = StoreHandle(f"ht-{uuid.uuid4().hex[:10]}", root=host_store_dir, capacity=1 << 20)
    with pytest.raises(StoreUnreachable, match=r"started a store process 3 time\(s\).*it is not running") as exc:
        server.open(wait_s=3.5)
    assert exc.value.code == BUILD_CONNECTION_FAILED
    assert (tmp_path / "starts").read_text().count("started") == _host.MAX_SPAWNS
