"""The client's side of the local store: time limits that hold on reconnect,
no store started on a mere timeout (issue 17, finding 6), and answers from
the store checked before a byte is copied (finding 9)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid

import pytest

from sglang_simm.local_store import _host
from sglang_simm.local_store import _protocol as wire
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._protocol import Op, Reader, frame, pack_ints, pack_json
from sglang_simm.errors import INTERNAL_ERROR, SEND_RPC_FAILED

from raw_peer import StoreProc, env
from polling import until

pytestmark = pytest.mark.host


@pytest.fixture
def store(host_store_dir):
    s = StoreProc(host_store_dir, f"trust-{uuid.uuid4().hex[:8]}")
    yield s
    s.stop()


# -- 6. the time limit is the limit ------------------------------------------------


def test_every_call_on_a_stopped_store_keeps_the_time_limit(store, monkeypatch):
    client = StoreHandle(store.paths.name, root=store.paths.root, capacity=16 << 20, timeout_s=0.3)
    client.open()
    limits = []
    real = _host._Connection.exchange

    def watched(self, data, *, reply=True, timeout_s=None):
        limits.append(self.timeout_s if timeout_s is None else timeout_s)
        return real(self, data, reply=reply, timeout_s=timeout_s)

    monkeypatch.setattr(_host._Connection, "exchange", watched)
    monkeypatch.setattr(_host, "RETRY_FIRST_S", 0.0)
    monkeypatch.setattr(_host, "RETRY_MAX_S", 0.0)
    os.kill(store.pid, signal.SIGSTOP)
    try:
        codes = []
        for _ in range(4):  # the first times out on its request, the rest reconnect
            with pytest.raises(StoreUnreachable) as exc:
                client.lookup(["x"])
            codes.append(exc.value.code)
        assert client._spawned == []  # a stalled store holds its lock: nobody starts another
    finally:
        os.kill(store.pid, signal.SIGCONT)
    assert len(limits) >= 4 and max(limits) <= 0.3, limits  # handshakes included
    # SendRPCFailed (as SiMM HEAD reports a timed-out request) or a failed connection; never Timeout
    assert set(codes) <= {SEND_RPC_FAILED, -2301}, codes
    until(lambda: _lookup(client) == [-4003], what="the client to reconnect")
    client.close()


def _lookup(client):
    try:
        return client.lookup(["x"])
    except StoreUnreachable:
        return None


def test_a_client_starts_no_store_while_one_holds_the_lock(store):
    os.kill(store.pid, signal.SIGSTOP)
    try:
        os.unlink(store.paths.socket)  # as if it were gone, though its process holds the name
        client = StoreHandle(store.paths.name, root=store.paths.root, capacity=16 << 20, timeout_s=0.3)
        with pytest.raises(StoreUnreachable):
            client.open(wait_s=0.5)
        assert client._spawned == []
    finally:
        os.kill(store.pid, signal.SIGCONT)


# -- 9. the client trusts the store ---------------------------------------------------


class FakeStore:
    """A store process that lies: its HELLO is sound, its PUT and GET
    answers point outside the arena it announced."""

    def __init__(self, root: str, name: str, *, bad: str) -> None:
        self.arena = os.path.join(root, f"{name}.fake.arena")
        fd = os.open(self.arena, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 1 << 20)
        os.close(fd)
        self.sock_path = os.path.join(root, f"{name}.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self.listener.listen(4)
        self.bad = bad
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            while True:
                try:
                    head = conn.recv(wire.HEADER.size, socket.MSG_WAITALL)
                except ConnectionResetError:  # the client dropped a connection it no longer trusts
                    return
                if len(head) < wire.HEADER.size:
                    return
                length, op = wire.HEADER.unpack(head)
                body = conn.recv(length, socket.MSG_WAITALL) if length else b""
                if op == Op.HELLO:
                    info = {"name": "fake", "pid": os.getpid(), "arena": self.arena, "arena_bytes": 1 << 20,
                            "data_start": 4096, "committed_bytes": 1 << 20, "capacity_bytes": 1 << 19,
                            "policy": "fifo", "max_batch": 100, "version": wire.PROTOCOL_VERSION}
                    conn.sendall(frame(Op.HELLO, pack_json(info)))
                elif op == Op.GET:
                    sizes = [1 << 30] if self.bad == "size" else [4096]
                    offset = [1 << 40] if self.bad == "offset" else [8192]
                    slot = 1 << 30 if self.bad == "slot" else 1
                    conn.sendall(frame(Op.GET, pack_ints([1, slot]), pack_ints(sizes), pack_ints(offset)))
                elif op == Op.PUT:
                    n = Reader(body[1:]).keys()
                    offset = -(1 << 40)
                    conn.sendall(frame(Op.PUT, pack_ints([1, 1 << 20]), pack_ints([0] * len(n)),
                                       pack_ints([offset] * len(n))))
                elif op == Op.COMMIT:
                    conn.sendall(frame(Op.COMMIT, pack_ints([0])))
                elif op == Op.LOOKUP:
                    conn.sendall(frame(Op.LOOKUP, pack_ints([0, 0, 0])))  # 3 answers for 1 key

    def close(self) -> None:
        self.listener.close()
        for path in (self.sock_path, self.arena):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


CLIENT = """
import ctypes, json, sys
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
name, root, op = sys.argv[1:4]
c = StoreHandle(name, root=root, capacity=1, spawn=False, timeout_s=5)
c.open(wait_s=5)
buf = ctypes.create_string_buffer(1 << 20)
try:
    if op == "get":
        c.get_into([("k", ctypes.addressof(buf), 1 << 20)])
    elif op == "put":
        c.put_from([("k", ctypes.addressof(buf), 4096)], True)
    else:
        c.lookup(["k"])
    print(json.dumps({"code": None}))
except StoreUnreachable as exc:
    print(json.dumps({"code": exc.code, "why": str(exc)}))
"""


@pytest.mark.parametrize("op,bad", [("get", "offset"), ("get", "size"), ("get", "slot"), ("put", "offset"),
                                    ("lookup", "count")])
def test_a_store_answering_outside_the_arena_fails_the_call_not_the_client(host_store_dir, op, bad):
    name = f"fake-{uuid.uuid4().hex[:8]}"
    fake = FakeStore(host_store_dir, name, bad=bad)
    try:
        done = subprocess.run([sys.executable, "-c", CLIENT, name, host_store_dir, op], env=env(),
                              capture_output=True, text=True, timeout=60)
    finally:
        fake.close()
    assert done.returncode == 0, f"the client died ({done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"] == INTERNAL_ERROR, out
