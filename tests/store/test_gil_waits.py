"""A host-store call lets the GIL go, and waits, only where it must (issue
20): in a server the backup and prefetch threads share the GIL with a busy
scheduler thread, and every release may cost up to the 5 ms switch
interval to get it back. Counted with the bench's own harness
(``tools/bench/backup_gil``) on a store in its own process."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
import uuid

import pytest

from sglang_simm.embedded import _copy
from sglang_simm.embedded._host import HostServer, StoreUnreachable
from sglang_simm.errors import DS_KEY_NOT_FOUND, OK, SEND_RPC_FAILED
from sglang_simm.tools.bench.backup_gil import Counts, CountingSocket, _install_counters

from raw_peer import StoreProc, wait_for

pytestmark = pytest.mark.host


def test_the_counting_socket_counts_a_reply_read_in_pieces_as_one_wait():
    a, b = socket.socketpair()
    try:
        counts = Counts()
        sock = CountingSocket(a, counts)
        sock.sendall(b"request")
        b.sendall(b"rep")
        assert sock.recv(3) == b"rep"
        b.sendall(b"ly")
        assert sock.recv(2) == b"ly"
        assert (counts.releases, counts.waits) == (3, 1)  # a send, two receives; one reply waited for
        b.sendall(b"unasked")
        assert sock.recv(16) == b"unasked"  # nothing was asked since: no wait
        assert (counts.releases, counts.waits) == (4, 1)
        sock.sent_held()  # a request sent holding the GIL: its reply is still waited for
        b.sendall(b"x")
        sock.recv(1)
        assert (counts.releases, counts.waits) == (5, 2)
    finally:
        a.close()
        b.close()


# -- on a store process -------------------------------------------------------------


@pytest.fixture
def store(host_store_dir):
    s = StoreProc(host_store_dir, f"gil-{uuid.uuid4().hex[:8]}", capacity=64 << 20)
    yield s
    s.stop()


def client_of(store: StoreProc, timeout_s: float = 10.0) -> HostServer:
    c = HostServer(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=timeout_s)
    c.open()
    return c


def counted(client: HostServer, fn):
    """``fn()``'s result, and the GIL releases and waits it made on
    ``client``'s connection and in the copies (the bench's counters)."""
    counts = Counts()
    undo = _install_counters(client, counts)
    try:
        return fn(), (counts.releases, counts.waits)
    finally:
        undo()


OBJECT = 128 << 10  # half a page of the bench's model: its K or its V


@pytest.mark.parametrize("n", [1, 8, 64])
def test_a_restore_lets_the_gil_go_only_to_wait_for_its_reply(store, n):
    client = client_of(store)
    src = [ctypes.create_string_buffer(bytes([i + 1]) * OBJECT, OBJECT) for i in range(n)]
    keys = [f"r{n}-{i}" for i in range(n)]
    assert client.put_from([(k, ctypes.addressof(b), OBJECT) for k, b in zip(keys, src)], True) == [OK] * n
    out = [ctypes.create_string_buffer(OBJECT) for _ in range(n)]
    got, (releases, waits) = counted(
        client, lambda: client.get_into([(k, ctypes.addressof(b), OBJECT) for k, b in zip(keys, out)]))
    assert got == [OBJECT] * n
    assert [b.raw for b in out] == [b.raw for b in src]
    # before: a send, the receive, a memmove per object and the RELEASE's send
    assert (releases, waits) == (1, 1)
    client.close()


def test_a_backups_copies_and_sends_keep_the_gil(store):
    client = client_of(store)
    n = 8
    src = [ctypes.create_string_buffer(bytes([i + 1]) * OBJECT, OBJECT) for i in range(n)]
    items = [(f"b-{i}", ctypes.addressof(b), OBJECT) for i, b in enumerate(src)]
    codes, (releases, waits) = counted(client, lambda: client.put_from(items, True))
    assert codes == [OK] * n
    # before: 2 sends, 2 receives and 8 memmoves; what is left is waiting for replies
    assert releases == waits
    client.close()


def test_small_copies_keep_the_gil_and_large_ones_let_it_go():
    """A thread that wants the GIL runs only when the copying thread lets it
    go: with the switch interval made huge, the interpreter never takes the
    GIL away, so any step of the watcher during a copy is a release."""
    size, n = 64 << 10, 64
    src = ctypes.create_string_buffer(b"\x07" * (size * n), size * n)
    dst = ctypes.create_string_buffer(size * n)
    small = [(ctypes.addressof(dst) + i * size, ctypes.addressof(src) + i * size, size) for i in range(n)]
    big_size = getattr(_copy, "HELD_COPY_MAX", 1 << 20) * 2
    big_src = ctypes.create_string_buffer(big_size)
    big_dst = ctypes.create_string_buffer(big_size)
    big = [(ctypes.addressof(big_dst), ctypes.addressof(big_src), big_size)]
    steps = [0]
    stop = threading.Event()

    def watcher():
        while not stop.is_set():
            steps[0] += 1
            time.sleep(0.0005)  # lets the GIL go; wants it back half a millisecond later

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    t = threading.Thread(target=watcher, daemon=True)
    try:
        t.start()
        time.sleep(0.05)

        def steps_during(copies, rounds):
            before = steps[0]
            for _ in range(rounds):
                _copy.copy_many(copies)
            return steps[0] - before

        assert steps_during(small, 100) == 0  # 400 MiB in 64 KiB copies, the GIL held throughout
        assert dst.raw == src.raw
        assert steps_during(big, 200) > 0  # 2 MiB copies: the watcher got in
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        t.join()


def test_a_request_bigger_than_the_socket_buffer_to_a_stalled_store_keeps_the_time_limit(store):
    """The send that keeps the GIL never blocks: what the socket has no room
    for goes by the blocking send, which the kernel's limit ends."""
    client = client_of(store, timeout_s=0.5)
    client.lookup(["warm"])
    keys = [f"{i:08d}-" + "k" * 200 for i in range(8000)]  # a 1.7 MB LOOKUP frame
    os.kill(store.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnreachable) as exc:
            client.lookup(keys)
        assert exc.value.code == SEND_RPC_FAILED and "did not answer within 0.5 s" in str(exc.value)
    finally:
        os.kill(store.pid, signal.SIGCONT)
    wait_for(lambda: _lookup(client, ["warm"]) == [DS_KEY_NOT_FOUND], what="the client to reconnect")
    client.close()


def _lookup(client, keys):
    try:
        return client.lookup(keys)
    except StoreUnreachable:
        return None
