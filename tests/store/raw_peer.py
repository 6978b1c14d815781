"""A store process of the test's own, and a raw same-uid peer that speaks
the wire protocol directly (what a buggy or hostile client can send)."""

from __future__ import annotations

import array
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from polling import until
from sglang_simm.local_store import _protocol as wire
from sglang_simm.local_store._paths import StorePaths, read_pid
from sglang_simm.local_store._protocol import Op, Reader, encode_keys, frame, pack_i64, pack_ints, pack_json

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
LOWFD = os.path.join(os.path.dirname(__file__), "daemon_lowfd.py")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, e.get("PYTHONPATH")) if p)
    return e


class StoreProc:
    """``python -m sglang_simm.local_store._server`` as a child of the test."""

    def __init__(self, root: str, name: str, *, capacity: int = 16 << 20, limits: dict | None = None,
                 idle_exit: float = 0.0, policy: str = "fifo", nofile: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.paths = StorePaths(root, name)
        args = ["--dir", root, "--name", name, "--capacity", str(capacity), "--policy", policy,
                "--idle-exit", str(idle_exit), "--limits", json.dumps(limits or {}), *extra]
        cmd = [sys.executable, LOWFD, str(nofile), *args] if nofile else \
            [sys.executable, "-m", "sglang_simm.local_store._server", *args]
        self.proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        until(lambda: read_pid(self.paths) == self.proc.pid or self.proc.poll() is not None, what="the store to start")
        if self.proc.poll() is not None:
            raise AssertionError(f"the store did not start: {self.proc.stderr.read().decode()}")
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """Private resident memory (anonymous pages, not the shared segments)."""
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    def status(self) -> dict[str, Any]:
        """The store's status, once it takes a connection."""
        def attempt():
            try:
                with Peer(self.paths, data=False) as p:
                    return p.admin("status")
            except (AssertionError, OSError):
                return None
        try:
            return until(attempt, what="the store to answer a status request")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its process {'runs' if self.alive() else 'exited'}; "
                                 f"its log ends: {self.log_tail()}") from None

    def log_tail(self, lines: int = 4) -> str:
        try:
            with open(self.paths.log) as f:
                return " | ".join(f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class Peer:
    """A raw connection: frames in, frames out, nothing checked. A data
    peer (``data``) gets the segments' descriptors and its process's row."""

    def __init__(self, paths: StorePaths, *, hello: bool = True, data: bool = True, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(paths.socket)
        self.info: dict[str, Any] = {}
        self.fds: list[int] = []
        if hello:
            self.send(frame(Op.HELLO, pack_json({"version": wire.PROTOCOL_VERSION, "data": data})))
            buf, fds = b"", array.array("i")
            while len(buf) < wire.HEADER.size or len(buf) < wire.HEADER.size + wire.HEADER.unpack_from(buf)[0]:
                got, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
                assert got, "the store closed the connection during the handshake"
                buf += got
                for _, _, payload in anc:
                    fds.frombytes(payload[: len(payload) - len(payload) % 4])
            length, op = wire.HEADER.unpack_from(buf)
            assert op == Op.HELLO, Reader(buf[wire.HEADER.size:]).json()
            self.info, self.fds = Reader(buf[wire.HEADER.size:wire.HEADER.size + length]).json(), list(fds)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frame(self) -> tuple[int, bytes]:
        length, op = wire.HEADER.unpack(self._exact(wire.HEADER.size))
        return op, self._exact(length)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            more = self.sock.recv(n - len(buf))
            if not more:
                raise ConnectionResetError("the store closed the connection")
            buf += more
        return buf

    def call(self, op: Op, *parts: bytes) -> tuple[int, bytes]:
        self.send(frame(op, *parts))
        return self.recv_frame()

    def closed_by_store(self) -> bool:
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True

    # -- the segments ------------------------------------------------------------

    def segment(self, index: int = 0) -> mmap.mmap:
        """The ``index``-th segment the store handed over, mapped."""
        return mmap.mmap(self.fds[index], self.info["segments"][index]["size"])

    def set_busy(self, value: int) -> None:
        """This process's row of the store's client table: copies in flight."""
        with self.segment(0) as seg:
            seg[4096 + 32 * self.info["row"] + 16:4096 + 32 * self.info["row"] + 24] = value.to_bytes(8, "little")

    # -- requests ------------------------------------------------------------------

    def admin(self, cmd: str, **args: Any) -> dict[str, Any]:
        op, body = self.call(Op.ADMIN, pack_json({"cmd": cmd, **args}))
        assert op == Op.ADMIN, Reader(body).json()
        return Reader(body).json()

    def lookup(self, keys: list[str]) -> list[int]:
        op, body = self.call(Op.LOOKUP, encode_keys(keys))
        assert op == Op.LOOKUP, Reader(body).json()
        return Reader(body).ints()

    def put(self, keys: list[str], sizes: list[int], overwrite: bool = True) -> tuple[int, list[int], list[int]]:
        op, body = self.call(Op.PUT, bytes((int(overwrite),)), encode_keys(keys), pack_ints(sizes))
        assert op == Op.PUT, Reader(body).json()
        r = Reader(body)
        grant = r.ints()[0]
        return grant, r.ints(), r.ints()

    def commit(self, grant: int, crcs: list[int] | None = None) -> tuple[int, Any]:
        op, body = self.call(Op.COMMIT, pack_i64(grant), pack_ints(crcs or []))
        r = Reader(body)
        return op, (r.json() if op == Op.ERROR else r.ints())

    def get(self, keys: list[str], caps: list[int]) -> tuple[int, list[int], list[int], list[int]]:
        op, body = self.call(Op.GET, encode_keys(keys), pack_ints(caps))
        assert op == Op.GET, Reader(body).json()
        r = Reader(body)
        grant, results, segs, offsets, _verify = r.ints()[0], r.ints(), r.ints(), r.ints(), r.ints()
        return grant, results, segs, offsets

    def release(self, grant: int, failed: list[int] | None = None) -> None:
        self.send(frame(Op.RELEASE, pack_i64(grant), pack_ints(failed or [])))

    def abort(self, grant: int) -> None:
        self.send(frame(Op.ABORT, pack_i64(grant)))


def wait_status(proc: StoreProc, predicate, what: str, timeout: float = 30.0) -> dict[str, Any]:
    return until(lambda: s if predicate(s := proc.status()) else None, what=what, timeout=timeout)
