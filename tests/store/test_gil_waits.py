"""A local-store call beside a thread that runs Python all the time, as a
server's backup and prefetch threads run beside its scheduler: how long
that thread is held back, which copies and fault-ins keep the GIL and which
let it go, and the calls' own guarantees when the store stalls or dies
mid-call (time limits, COMMITs, torn bytes never served). On a store in its
own process."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

import pytest

import numpy as np
from polling import until
from raw_peer import Peer, StoreProc, env
from sglang_simm.local_store import _handle, _maps
from sglang_simm.local_store._copy import HELD_COPY_MAX
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._maps import SegmentMap
from sglang_simm.local_store._protocol import Op
from sglang_simm.local_store._segments import COMMIT_STEP_MAX
from sglang_simm.simm_rules import DS_DATA_ALREADY_EXISTS, DS_KEY_NOT_FOUND, OK, SEND_RPC_FAILED

pytestmark = pytest.mark.host


@pytest.fixture
def proc(store) -> StoreProc:
    return store(capacity=64 << 20)


def client_of(proc: StoreProc, timeout_s: float = 10.0) -> StoreHandle:
    c = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=1, spawn=False, timeout_s=timeout_s)
    c.open()
    return c


OBJECT = 128 << 10  # half a page of the bench's model: its K or its V


@pytest.mark.parametrize("n", [1, 8, 64])
def test_a_backup_is_read_back_whole_by_another_client(proc, n):
    client = client_of(proc)
    src = [ctypes.create_string_buffer(bytes([i + 1]) * OBJECT, OBJECT) for i in range(n)]
    items = [(f"b{n}-{i}", ctypes.addressof(b), OBJECT) for i, b in enumerate(src)]
    assert client.put_from(items, True) == [OK] * n
    other = client_of(proc)
    out = [ctypes.create_string_buffer(OBJECT) for _ in range(n)]
    assert other.get_into([(k, ctypes.addressof(b), OBJECT) for (k, _, _), b in zip(items, out)]) == [OBJECT] * n
    assert [b.raw for b in out] == [b.raw for b in src]
    client.close()
    other.close()


def test_a_busy_python_thread_is_held_back_for_a_small_part_of_a_backup_or_a_restore(store):
    """A thread running Python nonstop (the scheduler) beside backups and
    restores of 256 MiB (2,048 objects of 128 KiB, half a page of the
    bench's model; and 256 of 1 MiB, the largest copied holding the GIL):
    its longest stall during a call, over the call's time, the least of
    five, against the same for one copy of the same bytes that holds the
    GIL throughout (about 1), measured side by side in a fresh process (in
    this one, pytest's own threads take the GIL too). A stall the call
    causes shows in each of the five; one the machine causes (the busy
    thread descheduled on a loaded host, as in a full test run) in some. A
    call that held the GIL for its whole length would score like the held
    copy."""
    s = store(capacity=600 << 20, limits={"client_share": 1.0})  # a batch of 256 MiB in one grant
    for size, n in ((128 << 10, 2048), (1 << 20, 256)):
        out = subprocess.run([sys.executable, "-c", _BUSY, s.paths.root, s.paths.name, str(size), str(n)],
                             capture_output=True, text=True, timeout=300, env=env())
        assert out.returncode == 0, out.stderr[-3000:]
        got = dict(zip(*[iter(out.stdout.split())] * 2))
        assert got.pop("bytes") == "ok", out.stdout
        ratios = {k: float(v) for k, v in got.items()}
        assert ratios["held"] > 0.5, ratios  # the ruler: a held copy stops the busy thread
        assert ratios["backup"] < ratios["held"] / 3 and ratios["restore"] < ratios["held"] / 3, (size, ratios)


#: argv: store root, name, object size, objects. Prints the busy thread's
#: longest stall over the call's time (least of 5) for a copy holding the
#: GIL, a backup (put_from) and a restore (get_into), and whether the bytes
#: read back whole.
_BUSY = """
import ctypes, sys, threading, time
from sglang_simm.local_store._handle import StoreHandle
root, name, size, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = StoreHandle(name, root=root, capacity=1, spawn=False, timeout_s=30.0)
client.open()
src = [ctypes.create_string_buffer(bytes([i % 251 + 1]) * size, size) for i in range(n)]
dst = [ctypes.create_string_buffer(size) for _ in range(n)]
puts = [(f"busy-{i}", ctypes.addressof(b), size) for i, b in enumerate(src)]
gets = [(f"busy-{i}", ctypes.addressof(b), size) for i, b in enumerate(dst)]
whole_src, whole_dst = bytearray(b"\x05") * (size * n), bytearray(size * n)
longest, turns, stop = [0.0], [0], threading.Event()

def busy():
    last = time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter()
        if now - last > longest[0]:
            longest[0] = now - last
        last = now
        turns[0] += 1

def busy_ran_again():
    seen = turns[0]
    while turns[0] < seen + 2:
        time.sleep(0.001)

def held_back(fn):
    longest[0] = 0.0
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    busy_ran_again()  # a stall is seen by the busy thread when it runs again
    return longest[0] / took

def copy_holding_the_gil():
    whole_dst[:] = whole_src

assert client.put_from(puts, True) == [0] * n
t = threading.Thread(target=busy, daemon=True)
t.start()
busy_ran_again()
ratios = {"held": [], "backup": [], "restore": []}
for _ in range(5):
    ratios["held"].append(held_back(copy_holding_the_gil))
    ratios["backup"].append(held_back(lambda: client.put_from(puts, True)))
    ratios["restore"].append(held_back(lambda: client.get_into(gets)))
stop.set()
t.join()
ok = all(b.raw == c.raw for b, c in zip(dst, src))
client.close()
print(" ".join(f"{k} {min(v):.3f}" for k, v in ratios.items()), "bytes", "ok" if ok else "wrong")
"""


def test_a_request_bigger_than_the_socket_buffer_to_a_stalled_store_keeps_the_time_limit(proc):
    """The send that keeps the GIL never blocks: what the socket has no room
    for goes by the blocking send, which the kernel's limit ends."""
    client = client_of(proc, timeout_s=0.5)
    client.lookup(["warm"])
    keys = [f"{i:08d}-" + "k" * 200 for i in range(8000)]  # a 1.7 MB LOOKUP frame
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnreachable) as exc:
            client.lookup(keys)
        assert exc.value.code == SEND_RPC_FAILED and "did not answer within 0.5 s" in str(exc.value)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    until(lambda: _lookup(client, ["warm"]) == [DS_KEY_NOT_FOUND], what="the client to reconnect")
    client.close()


def _lookup(client, keys):
    try:
        return client.lookup(keys)
    except StoreUnreachable:
        return None


# -- a backup's COMMIT, not waited for ------------------------------------------------


def test_a_store_stalled_then_killed_before_a_commit_fails_that_backup_and_serves_a_miss(store, monkeypatch):
    proc = store("gil-kill", capacity=64 << 20)
    client = client_of(proc, timeout_s=2.0)
    data = ctypes.create_string_buffer(b"\x07" * 4096, 4096)
    assert client.put_from([("kept", ctypes.addressof(data), 4096)], True) == [OK]
    real = _maps.copy_many

    def copy_then_stop(copies, **kw):  # the store stops once the put's copy is done: its COMMIT waits unread
        real(copies, **kw)
        os.kill(proc.pid, signal.SIGSTOP)

    monkeypatch.setattr(_maps, "copy_many", copy_then_stop)
    # the COMMIT waits for the stopped store until the time limit: the put fails
    assert client.put_from([("lost", ctypes.addressof(data), 4096)], True) == [SEND_RPC_FAILED]
    monkeypatch.setattr(_maps, "copy_many", real)
    proc.kill9()  # its COMMIT still unread in the socket
    again = store("gil-kill", capacity=64 << 20)  # serves the dead store's objects from its segment
    other = client_of(again)
    out = ctypes.create_string_buffer(4096)
    assert other.get_into([("lost", ctypes.addressof(out), 4096)]) == [DS_KEY_NOT_FOUND]  # a miss, no torn bytes
    assert other.get_into([("kept", ctypes.addressof(out), 4096)]) == [4096] and out.raw == data.raw
    assert again.status()["recovered"] == 1
    other.close()
    client.close()


def test_a_put_without_overwrite_still_gets_the_commits_code(proc, monkeypatch):
    """Without overwrite another put of the key may publish first, and the
    caller is owed that code: such a put still waits for its COMMIT."""
    client = client_of(proc)
    data = ctypes.create_string_buffer(b"\x08" * 4096, 4096)
    real = _maps.copy_many
    with Peer(proc.paths) as rival:
        grant, codes, _ = rival.put(["race"], [4096], overwrite=False)
        assert codes == [OK]

        def copy_then_rival_publishes(copies, **kw):
            real(copies, **kw)
            assert rival.commit(grant, [0]) == (Op.COMMIT, [OK])

        monkeypatch.setattr(_maps, "copy_many", copy_then_rival_publishes)
        assert client.put_from([("race", ctypes.addressof(data), 4096)], False) == [DS_DATA_ALREADY_EXISTS]
    assert proc.status()["reserved_bytes"] == 0  # the loser's room back
    client.close()


CHILD_LOOKUP = """
import sys
from sglang_simm.local_store._handle import StoreHandle
c = StoreHandle(sys.argv[1], root=sys.argv[2], capacity=1, spawn=False, timeout_s=10)
c.open()
print("ready", flush=True)
for line in sys.stdin:
    print(c.lookup([line.strip()])[0], flush=True)
"""


def test_a_backup_is_seen_at_once_by_another_process(proc):
    """The store serves each connection's requests in order, not across
    connections: a lookup another process sends once a backup returned must
    still find it (the COMMIT, sent before the return, is read first)."""
    client = client_of(proc)
    data = ctypes.create_string_buffer(b"\x09" * 4096, 4096)
    reader = subprocess.Popen([sys.executable, "-c", CHILD_LOOKUP, proc.paths.name, proc.paths.root],
                              env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    same_process = client_of(proc)
    try:
        assert reader.stdout.readline().strip() == "ready"
        seen = []
        for i in range(200):
            key = f"seen-{i}"
            assert client.put_from([(key, ctypes.addressof(data), 4096)], True) == [OK]
            if i % 2:
                seen.append(same_process.lookup([key])[0])
            else:
                reader.stdin.write(key + "\n")
                reader.stdin.flush()
                seen.append(int(reader.stdout.readline()))
        assert seen == [OK] * 200
    finally:
        reader.kill()
        reader.wait(timeout=10)
        same_process.close()
        client.close()


# -- a reply waited for holding the GIL, then not ------------------------------------


def test_the_held_wait_is_bounded_then_the_time_limit_is_kept(proc, monkeypatch):
    client = client_of(proc, timeout_s=0.5)
    client.lookup(["warm"])
    monkeypatch.setattr(_handle, "HELD_WAIT_S", 0.05)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # after the held wait, the blocking receive, which the kernel's limit ends
        with pytest.raises(StoreUnreachable) as exc:
            client.lookup(["x"])
        assert exc.value.code == SEND_RPC_FAILED and "did not answer within 0.5 s" in str(exc.value)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    until(lambda: _lookup(client, ["warm"]) == [DS_KEY_NOT_FOUND], what="the client to reconnect")
    client.close()


def test_backups_and_restores_sharing_a_connection_from_two_threads_keep_every_byte(proc):
    """A server's backup and prefetch threads share the process's one
    connection, one request and its reply at a time: every byte read back
    right."""
    client = client_of(proc)
    size, rounds = 16 << 10, 300
    problems: list[str] = []

    def data(i: int) -> ctypes.Array:
        return ctypes.create_string_buffer(bytes([i % 251 + 1]) * size, size)

    def backups():
        for i in range(rounds):
            buf = data(i)
            codes = client.put_from([(f"t-{i}", ctypes.addressof(buf), size)], True)
            if codes != [OK]:
                problems.append(f"put {i}: {codes}")

    def restores():
        out = ctypes.create_string_buffer(size)
        for i in range(rounds):
            k = f"t-{i // 2}"
            if client.lookup([k]) == [OK]:
                n = client.get_into([(k, ctypes.addressof(out), size)])[0]
                if n == size and out.raw != bytes([(i // 2) % 251 + 1]) * size:
                    problems.append(f"get {k}: wrong bytes")
                elif n not in (size, DS_KEY_NOT_FOUND):
                    problems.append(f"get {k}: {n}")

    threads = [threading.Thread(target=backups), threading.Thread(target=restores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    other = client_of(proc)
    assert other.lookup([f"t-{i}" for i in range(rounds)]) == [OK] * rounds
    other.close()
    client.close()


# -- faulting the segment in ------------------------------------------------------------


@pytest.fixture
def faults(monkeypatch):
    """Every fault-in of a segment this process maps, as ``(thread, start,
    end, hold)``: ``hold`` keeps the GIL."""
    seen: list[tuple[str, int, int, bool]] = []
    real = SegmentMap._fault

    def recorded(self, start, end, *, hold):
        seen.append((threading.current_thread().name, start, end, hold))
        real(self, start, end, hold=hold)

    monkeypatch.setattr(SegmentMap, "_fault", recorded)
    return seen


def test_a_put_faults_in_only_its_own_pages_and_the_committed_rest_is_faulted_in_behind(store, faults):
    """Faulting a segment in costs about 0.45 ms a MiB, twice the copy it
    spares: what the store has backed (a step ahead of its grants) is
    faulted in by a thread of the client's own, letting the GIL go, and a
    put that gets ahead of it faults in only the pages it writes, keeping
    the GIL only for a small span."""
    proc = store(capacity=2 << 30)  # backed in steps of COMMIT_STEP_MAX
    client = client_of(proc)
    src = np.full(OBJECT, 7, dtype=np.uint8)
    ptr = src.ctypes.data
    me = threading.current_thread().name
    start = proc.status()

    def faulted_behind(end: int):
        def reached() -> bool:
            if max((b for name, _, b, _ in faults if name != me), default=0) >= end:
                return True
            # a thread behind that looked before the store backed the last
            # step stopped short: the next put starts it again
            assert client.put_from([("nudge", ptr, OBJECT)], True) == [OK]
            return False
        return reached

    assert client.put_from([("first", ptr, OBJECT)], True) == [OK]
    # the put backed a step at least: the thread behind faults it in
    until(faulted_behind(start["committed_bytes"] + COMMIT_STEP_MAX), every=0.2,
          what="the thread behind to fault in what the first put had backed")
    # then puts as fast as they go, past what is faulted in, into the steps beyond
    keys = [f"k{i}" for i in range(2 * COMMIT_STEP_MAX // OBJECT)]
    for i in range(0, len(keys), 64):
        batch = keys[i:i + 64]
        assert client.put_from([(k, ptr, OBJECT) for k in batch], True) == [OK] * len(batch)
    mine = [(a, b, hold) for name, a, b, hold in faults if name == me]
    # the putting thread faulted in at most its own batches' bytes (64 objects each)
    assert all(b - a <= 64 * OBJECT + (1 << 20) for a, b, _ in mine), mine
    assert sum(b - a for a, b, _ in mine) <= len(keys) * OBJECT
    # it kept the GIL for a small span only (getting it back could cost the
    # 5 ms switch interval); the thread behind always let it go
    assert all(hold == (b - a <= HELD_COPY_MAX) for a, b, hold in mine), mine
    assert not any(hold for name, _, _, hold in faults if name != me)
    until(faulted_behind(start["committed_bytes"] + 2 * COMMIT_STEP_MAX), every=0.2,
          what="the thread behind to fault in the steps the puts crossed into")
    got = np.zeros(OBJECT, dtype=np.uint8)
    assert client.get_into([(keys[-1], got.ctypes.data, OBJECT)]) == [OBJECT] and (got == 7).all()
    client.close()


def test_a_client_connecting_to_a_full_store_does_not_wait_for_the_segment_to_fault_in(store, faults, monkeypatch):
    """Faulting in what the store has backed at connect, holding the GIL,
    costs seconds on a big store, on a server's scheduler thread when it
    attaches: a client's handshake faults in nothing, the thread behind
    does, and reads work meanwhile."""
    proc = store(capacity=1 << 30)
    keys = [f"c{i}" for i in range(512)]  # 64 MiB, written by a raw peer: no fault-in of this process's
    with Peer(proc.paths) as writer, writer.segment() as seg:
        for i in range(0, len(keys), 64):
            grant, codes, offsets = writer.put(keys[i:i + 64], [OBJECT] * 64)
            assert codes == [OK] * 64
            for offset in offsets:
                seg[offset:offset + OBJECT] = b"\x03" * OBJECT
            assert writer.commit(grant, [0] * 64) == (Op.COMMIT, [OK] * 64)
    committed = proc.status()["committed_bytes"]
    assert committed >= 64 << 20
    go = threading.Event()
    real = SegmentMap._fault_in_behind

    def held_back(self):
        go.wait(30)
        real(self)

    monkeypatch.setattr(SegmentMap, "_fault_in_behind", held_back)
    second = client_of(proc)
    try:
        assert faults == []  # open() returned with nothing faulted in: the thread behind has it
        got = np.zeros(OBJECT, dtype=np.uint8)  # and reads work meanwhile
        assert second.get_into([(keys[-1], got.ctypes.data, OBJECT)]) == [OBJECT] and (got == 3).all()
        assert faults == []  # a read faults nothing in for later
        go.set()
        until(lambda: max((b for _, _, b, _ in faults), default=0) >= committed,
              what="the thread behind to fault in what the store had backed")
        assert not any(hold for *_, hold in faults)
    finally:
        go.set()
        second.close()
