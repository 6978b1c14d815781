"""The client's side of the local store: time limits that hold on every
call and every reconnection to a stalled store, no store started on a mere
timeout, and the store's answers (its handshake, offsets, sizes, segments,
counts) checked before a byte is copied."""

from __future__ import annotations

import array
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from polling import until
from raw_peer import env
from sglang_simm.local_store import _handle
from sglang_simm.local_store import _protocol as wire
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._protocol import Op, Reader, frame, pack_ints, pack_json
from sglang_simm.simm_rules import BUILD_CONNECTION_FAILED, DS_KEY_NOT_FOUND, INTERNAL_ERROR, SEND_RPC_FAILED

pytestmark = pytest.mark.host


def _lookup(client: StoreHandle):
    try:
        return client.lookup(["x"])
    except StoreUnreachable:
        return None


def _launches(caplog) -> list[str]:
    """The client's "starting local store" lines: each is a store process it started."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting local store")]


# -- the time limit is the limit ----------------------------------------------------


def test_every_call_on_a_stopped_store_keeps_the_time_limit(store, monkeypatch, caplog):
    """Requests and the handshakes of reconnections alike wait at most the
    client's time limit on a store that takes connections and never answers
    (SIGSTOP); none starts another store (the stalled one holds its name)."""
    caplog.set_level(logging.INFO, logger="sglang_simm.local_store")
    proc = store()
    client = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=16 << 20, timeout_s=0.3)
    client.open()
    limits = []
    exchange, hello = _handle._Connection.exchange, _handle._Connection.hello

    def watched_exchange(self, data, *, reply=True, timeout_s=None):
        limits.append(("request", self.timeout_s if timeout_s is None else timeout_s))
        return exchange(self, data, reply=reply, timeout_s=timeout_s)

    def watched_hello(self, data, timeout_s):
        limits.append(("handshake", timeout_s))
        return hello(self, data, timeout_s)

    monkeypatch.setattr(_handle._Connection, "exchange", watched_exchange)
    monkeypatch.setattr(_handle._Connection, "hello", watched_hello)
    monkeypatch.setattr(_handle, "RETRY_FIRST_S", 0.0)
    monkeypatch.setattr(_handle, "RETRY_MAX_S", 0.0)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        codes = []
        for _ in range(4):  # the first times out on its request, the rest on their handshakes
            with pytest.raises(StoreUnreachable) as exc:
                client.lookup(["x"])
            codes.append(exc.value.code)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert {kind for kind, _ in limits} == {"request", "handshake"}, limits
    assert max(limit for _, limit in limits) <= 0.3, limits
    # SendRPCFailed (as SiMM HEAD reports a timed-out request) or a failed connection; never Timeout
    assert set(codes) <= {SEND_RPC_FAILED, BUILD_CONNECTION_FAILED}, codes
    assert _launches(caplog) == []
    until(lambda: _lookup(client) == [DS_KEY_NOT_FOUND], what="the client to reconnect")
    assert proc.status()["pid"] == proc.pid
    client.close()


def test_a_client_starts_no_store_while_one_holds_the_lock(store, caplog):
    caplog.set_level(logging.INFO, logger="sglang_simm.local_store")
    proc = store()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        os.unlink(proc.paths.socket)  # as if it were gone, though its process holds the name
        client = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=16 << 20, timeout_s=0.3)
        with pytest.raises(StoreUnreachable, match="did not answer"):
            client.open(wait_s=0.5)
        assert _launches(caplog) == []
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # resumed, it finds its socket gone and listens again: the same process serves
    until(lambda: _lookup(client) == [DS_KEY_NOT_FOUND], what="the stalled store to listen again")
    assert client.pid == proc.pid
    client.close()


# -- the client trusts the store ---------------------------------------------------------

SEGMENT_BYTES, DATA_START = 1 << 20, 64 << 10


class FakeStore:
    """A store process that lies in one way (``bad``): a handshake whose
    descriptors or segments do not add up, or PUT, GET and LOOKUP answers
    that point outside the segment it handed over or count wrong."""

    def __init__(self, root: str, name: str, *, bad: str) -> None:
        self.segment = os.path.join(root, f"{name}.fake.seg")
        self.fd = os.open(self.segment, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, SEGMENT_BYTES)
        self.sock_path = os.path.join(root, f"{name}.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self.listener.listen(4)
        self.bad = bad
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _hello(self, conn: socket.socket) -> None:
        size = SEGMENT_BYTES * 2 if self.bad == "segment-size" else SEGMENT_BYTES
        segments = [{"gen": "fa4e", "size": size, "data_start": DATA_START}]
        if self.bad == "descriptors":
            segments.append({"gen": "fa4f", "size": SEGMENT_BYTES, "data_start": DATA_START})
        info = {"name": "fake", "pid": os.getpid(), "gen": "fa4e", "medium": "memory", "capacity_bytes": 1 << 19,
                "policy": "fifo", "max_batch": 100, "version": wire.PROTOCOL_VERSION, "row": 0,
                "segments": segments}
        conn.sendmsg([frame(Op.HELLO, pack_json(info))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd]))])

    def _answer(self, conn: socket.socket) -> None:
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
                self._hello(conn)
            elif op == Op.GET:
                size = {"size": SEGMENT_BYTES, "past-buffer": 8192}.get(self.bad, 4096)
                offset = {"offset": 1 << 40, "into-head": 0}.get(self.bad, DATA_START)
                seg = 1 if self.bad == "segment" else 0
                conn.sendall(frame(Op.GET, pack_ints([7]), pack_ints([size]), pack_ints([seg]), pack_ints([offset]),
                                   pack_ints([0])))
            elif op == Op.PUT:
                n = len(Reader(body[1:]).keys())
                offset = {"offset": -(1 << 40), "into-head": 4096}.get(self.bad, DATA_START)
                conn.sendall(frame(Op.PUT, pack_ints([7, SEGMENT_BYTES, 0]), pack_ints([0] * n),
                                   pack_ints([offset] * n)))
            elif op == Op.COMMIT:
                conn.sendall(frame(Op.COMMIT, pack_ints([0])))
            elif op == Op.LOOKUP:
                if self.bad == "op":
                    conn.sendall(frame(Op.GET, pack_ints([0])))  # the answer to another request
                else:
                    conn.sendall(frame(Op.LOOKUP, pack_ints([0, 0, 0])))  # 3 answers for 1 key
            # ABORT and RELEASE: one way, no answer

    def close(self) -> None:
        self.listener.close()
        os.close(self.fd)
        for path in (self.sock_path, self.segment):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


CLIENT = """
import ctypes, json, sys
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
name, root, op = sys.argv[1:4]
c = StoreHandle(name, root=root, capacity=1, spawn=False, timeout_s=5)
buf = ctypes.create_string_buffer(1 << 20)
try:
    c.open(wait_s=0.5)
    if op == "get":
        c.get_into([("k", ctypes.addressof(buf), 4096)])
    elif op == "put":
        c.put_from([("k", ctypes.addressof(buf), 4096)], True)
    else:
        c.lookup(["k"])
    print(json.dumps({"code": None}))
except StoreUnreachable as exc:
    print(json.dumps({"code": exc.code, "why": str(exc)}))
"""


@pytest.mark.parametrize("op,bad,code", [
    ("get", "offset", INTERNAL_ERROR),  # past the segment's end
    ("get", "into-head", INTERNAL_ERROR),  # into the segment's header and client table
    ("get", "size", INTERNAL_ERROR),  # an object running past the segment's end
    ("get", "past-buffer", INTERNAL_ERROR),  # an object larger than the reader's buffer
    ("get", "segment", INTERNAL_ERROR),  # a segment it never handed over
    ("put", "offset", INTERNAL_ERROR),  # before the segment
    ("put", "into-head", INTERNAL_ERROR),  # over the client table
    ("lookup", "count", INTERNAL_ERROR),  # three answers for one key
    ("lookup", "op", INTERNAL_ERROR),  # the answer to another request
    ("lookup", "descriptors", BUILD_CONNECTION_FAILED),  # two segments announced, one descriptor sent
    ("lookup", "segment-size", BUILD_CONNECTION_FAILED),  # a segment larger than its file
])
def test_a_store_answering_outside_what_it_handed_over_fails_the_call_not_the_client(root, op, bad, code):
    fake = FakeStore(root, "fake", bad=bad)
    try:
        done = subprocess.run([sys.executable, "-c", CLIENT, "fake", root, op], env=env(),
                              capture_output=True, text=True, timeout=60)
    finally:
        fake.close()
    assert done.returncode == 0, f"the client died ({done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"] == code, out
    if code == BUILD_CONNECTION_FAILED:
        assert "handshake failed" in out["why"], out
