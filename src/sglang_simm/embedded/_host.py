"""A client process's side of a host store: one store process per name per
user, shared by every process on the host (all TP ranks of a server,
several servers, the tools).

``HostServer`` has the in-process server's surface (``put_from``,
``get_into``, ``lookup``, ``delete``, ...) so the ``simm.kv`` layer in
``_client`` serves both the same way. Per batch it sends one control
request (two for a put: reserve, then publish), and copies the bytes
itself, between the caller's memory and the shared arena, with the GIL
released (``_copy.copy_many``).

Faults never raise into the caller's data path: a store that is gone,
stalled or restarting turns a call into transport codes
(``StoreUnreachable.code``), and the next calls reconnect, starting the
store process again if nobody else did. A connection is closed only when
no copy under its leases is in flight, so the store never hands out
memory this process may still be writing or reading.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from sglang_simm.embedded import _protocol as wire
from sglang_simm.embedded._arena import ArenaMap
from sglang_simm.embedded._copy import copy_many, human_bytes
from sglang_simm.embedded._faults import FaultInjector
from sglang_simm.embedded._paths import StorePaths, check_file, ensure_dir, read_pid, store_dir
from sglang_simm.embedded._protocol import Op, Reader, encode_keys, frame, pack_i64, pack_ints, pack_json
from sglang_simm.errors import (
    BUILD_CONNECTION_FAILED,
    INTERNAL_ERROR,
    OK,
    SEND_RPC_FAILED,
    TIMEOUT,
    code_name,
)

logger = logging.getLogger("sglang_simm.embedded")

#: How long ``Store()`` waits for a store process it started.
START_TIMEOUT_S = 15.0
#: Between reconnection attempts from the data path, at first and at most.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0
#: Operator commands (clear, stop, status) may take longer than a batch.
ADMIN_TIMEOUT_S = 30.0


class StoreUnreachable(ConnectionError):
    """The store process could not serve a call; ``code`` is what the
    entries of that call fail with (a transport code, as the real client's
    RPC failures)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(f"{code_name(code)}: {why}")
        self.code = code


def _kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Sends and receives on ``sock`` fail with EAGAIN after ``seconds``."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Connection:
    """One socket to the store process, and the arena it announced."""

    def __init__(self, paths: StorePaths, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            check_file(paths.socket)
            sock.settimeout(timeout_s)
            sock.connect(paths.socket)
            # From here the kernel keeps the time limit (SO_RCVTIMEO and
            # SO_SNDTIMEO) and Python's socket blocks: a Python timeout polls
            # before every send and receive, two more system calls a request,
            # and a system call costs 10-20 us on a VM (README, local store).
            _kernel_timeout(sock, timeout_s)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.lock = threading.Lock()  # one request and its reply at a time
        self._state = threading.Lock()
        self.inflight = 0
        self.broken = False
        self._closed = False
        self.info: dict[str, Any] = {}
        self.arena: ArenaMap | None = None

    # -- framing ------------------------------------------------------------

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("the store process closed the connection")
            got += k
        return bytes(buf)

    def exchange(self, data: bytes, *, reply: bool = True, timeout_s: float | None = None) -> tuple[int, bytes]:
        """Send a frame and read the reply (the caller holds ``lock``)."""
        if timeout_s is not None:
            _kernel_timeout(self.sock, timeout_s)
        try:
            self.sock.sendall(data)
            if not reply:
                return 0, b""
            # One receive gets the header and, nearly always, the whole reply.
            head = self.sock.recv(1 << 16)
            while len(head) < wire.HEADER.size:
                more = self.sock.recv(1 << 16)
                if not more:
                    raise ConnectionResetError("the store process closed the connection")
                head += more
            length, op = wire.HEADER.unpack_from(head)
            body = head[wire.HEADER.size:]
            if len(body) < length:
                body += self._recv_exact(length - len(body))
            elif len(body) > length:
                raise ConnectionResetError("the store process sent more than one reply")
            return op, body
        except BlockingIOError as exc:  # the kernel's time limit ran out
            raise socket.timeout("timed out") from exc
        finally:
            if timeout_s is not None:
                _kernel_timeout(self.sock, self.timeout_s)

    # -- copies in flight, and closing ------------------------------------------

    def enter(self) -> None:
        with self._state:
            self.inflight += 1
        self.arena.enter()

    def leave(self) -> None:
        self.arena.leave()
        with self._state:
            self.inflight -= 1
            close = self.broken and self.inflight == 0
        if close:
            self._close_socket()

    def break_off(self) -> None:
        """No more requests; the socket closes (and the store releases this
        connection's leases) once no copy under them is in flight."""
        with self._state:
            self.broken = True
            close = self.inflight == 0
        if close:
            self._close_socket()

    def _close_socket(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class HostServer:
    """This process's handle on the host store ``name`` in ``root``.

    ``capacity`` and ``policy`` apply when this handle has to start the
    store process; a running store keeps its own.
    """

    def __init__(
        self,
        name: str,
        *,
        root: str | None = None,
        capacity: int,
        policy: str = "fifo",
        timeout_s: float = 1.0,
        spawn: bool = True,
    ) -> None:
        self.root = ensure_dir(store_dir(root), create=spawn)
        self.paths = StorePaths(self.root, name)
        self.name = name
        self.capacity_requested = capacity
        self.policy_requested = policy
        self.timeout_s = timeout_s
        self.spawn_allowed = spawn
        #: The network between this process and the store (see ``_faults``).
        self.faults = FaultInjector()
        self._conn: _Connection | None = None
        self._conn_lock = threading.Lock()
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._spawned: list[subprocess.Popen] = []
        self._old_arenas: list[ArenaMap] = []
        self.reconnects = 0
        self.closed = False

    # -- connecting ---------------------------------------------------------------

    def open(self, wait_s: float = START_TIMEOUT_S) -> None:
        """Connect now, starting the store process if allowed; raise
        StoreUnreachable with the reason (and the store's log) if it cannot
        be reached within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        started = False
        last = "not tried"
        while True:
            try:
                self._connect()
                return
            except StoreUnreachable as exc:
                last = str(exc)
                if exc.code == INTERNAL_ERROR:  # reachable, but it refused us
                    raise
            if self.spawn_allowed and not started:
                self._spawn()
                started = True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        tail = _log_tail(self.paths.log)
        raise StoreUnreachable(
            BUILD_CONNECTION_FAILED,
            f"host store {self.name!r} at {self.paths.socket} did not answer within {wait_s:.0f} s "
            f"({last})" + (f"; its log says: {tail}" if tail else ""),
        )

    def _connect(self) -> _Connection:
        """A new connection with its handshake done, made current."""
        try:
            conn = _Connection(self.paths, self.timeout_s)
        except FileNotFoundError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "no store process is running") from exc
        except (ConnectionRefusedError, socket.timeout) as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"the store process does not accept ({exc})") from exc
        except OSError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"{type(exc).__name__}: {exc}") from exc
        hello = pack_json({"version": wire.PROTOCOL_VERSION, "pid": os.getpid()})
        try:
            with conn.lock:
                op, body = conn.exchange(frame(Op.HELLO, hello), timeout_s=max(self.timeout_s, 5.0))
            info = Reader(body).json()
            if op == Op.ERROR:
                conn.break_off()
                raise StoreUnreachable(INTERNAL_ERROR, info.get("error", "refused"))
            arena = self._arena_for(info)
        except StoreUnreachable:
            raise
        except Exception as exc:
            conn.break_off()
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"handshake failed: {type(exc).__name__}: {exc}") from exc
        conn.info = info
        conn.arena = arena
        arena.populate(int(info.get("committed_bytes", 0)))
        with self._conn_lock:
            old, self._conn = self._conn, conn
        if old is not None:
            old.break_off()
            self.reconnects += 1
        if self.capacity_requested != info["capacity_bytes"] and self.spawn_allowed and not self._spawned:
            logger.info(
                "host store %r is running with capacity %s (asked for %s: the running store keeps its own)",
                self.name, human_bytes(info["capacity_bytes"]), human_bytes(self.capacity_requested),
            )
        self._retry_s = RETRY_FIRST_S
        return conn

    def _arena_for(self, info: dict[str, Any]) -> ArenaMap:
        current = self._conn.arena if self._conn is not None else None
        if current is not None and current.path == info["arena"] and not current.retired:
            return current
        arena = ArenaMap(info["arena"], int(info["arena_bytes"]))
        if current is not None:
            current.retire()  # a restarted store: the old arena goes once unused
        return arena

    def _spawn(self) -> None:
        for proc in self._spawned:
            proc.poll()  # reap the short-lived launchers
        self._spawned = [p for p in self._spawned if p.returncode is None]
        cmd = [
            sys.executable, "-m", "sglang_simm.embedded._daemon", "--detach",
            "--dir", self.root, "--name", self.name,
            "--capacity", str(self.capacity_requested), "--policy", self.policy_requested,
        ]
        env = dict(os.environ)
        # The store process must import this very package, wherever it came from.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        logger.info("starting host store %r (%s, capacity %s, eviction %s)",
                    self.name, self.paths.socket, human_bytes(self.capacity_requested), self.policy_requested)
        self._spawned.append(subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True, env=env,
        ))

    def _current(self) -> _Connection:
        """The live connection, or a reconnection attempt (rate-limited, so a
        store that is down costs the data path nothing but the attempt)."""
        conn = self._conn
        if conn is not None and not conn.broken:
            return conn
        if self.closed:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "this handle is closed")
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "reconnecting to the store process")
        with self._conn_lock:
            conn = self._conn
            if conn is not None and not conn.broken:
                return conn
            self._retry_at = now + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
        try:
            return self._connect()
        except StoreUnreachable as exc:
            if self.spawn_allowed and exc.code == BUILD_CONNECTION_FAILED:
                self._spawn()  # the next attempt finds it up
            raise

    def _request(
        self, op: Op, *parts: bytes, conn: _Connection | None = None, timeout_s: float | None = None
    ) -> tuple[_Connection, Reader]:
        conn = conn or self._current()
        try:
            with conn.lock:
                if conn.broken:
                    raise StoreUnreachable(SEND_RPC_FAILED, "the connection to the store process was lost")
                rop, body = conn.exchange(frame(op, *parts), timeout_s=timeout_s)
        except socket.timeout as exc:
            conn.break_off()  # a late reply would answer the next request
            raise StoreUnreachable(TIMEOUT, f"the store process did not answer within {self.timeout_s:g} s") from exc
        except OSError as exc:
            conn.break_off()
            raise StoreUnreachable(SEND_RPC_FAILED, f"the connection to the store process was lost ({exc})") from exc
        reader = Reader(body)
        if rop == Op.ERROR:
            raise StoreUnreachable(INTERNAL_ERROR, f"the store process failed: {reader.json().get('error')}")
        if rop != op:
            conn.break_off()
            raise StoreUnreachable(INTERNAL_ERROR, f"the store process answered {rop} to {op.name}")
        return conn, reader

    def _send_one_way(self, conn: _Connection, op: Op, lease: int) -> None:
        try:
            with conn.lock:
                if not conn.broken:
                    conn.exchange(frame(op, pack_i64(lease)), reply=False)
        except OSError:
            conn.break_off()  # the store releases the lease when it sees the close

    # -- the data path (server codes; StoreUnreachable on transport faults) ----

    def lookup(self, keys: Sequence[str]) -> list[int]:
        part = encode_keys(keys)
        _, r = self._request(Op.LOOKUP, part)
        return r.ints()

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        """Store ``(key, ptr, size)`` entries, copying from ``ptr``: the same
        codes as the in-process server's ``put_from``."""
        part = encode_keys([k for k, _, _ in items])
        conn, r = self._request(Op.PUT, bytes((int(overwrite),)), part, pack_ints([s for _, _, s in items]))
        lease, committed = r.ints()
        codes = r.ints()
        offsets = r.ints()
        if not lease:
            return codes
        reserved = [i for i, code in enumerate(codes) if code == OK]
        conn.arena.populate(committed)
        base = conn.arena.base
        copies = [(base + offsets[i], items[i][1], items[i][2]) for i in reserved]
        conn.enter()
        try:
            copy_many(copies)
        except BaseException:
            conn.leave()
            self._send_one_way(conn, Op.ABORT, lease)
            raise
        conn.leave()
        try:
            _, r = self._request(Op.COMMIT, pack_i64(lease), conn=conn)
            final = r.ints()
        except StoreUnreachable as exc:
            final = [exc.code] * len(reserved)  # the lease died with the connection
        for i, code in zip(reserved, final):
            codes[i] = code
        return codes

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        """Copy objects into ``(key, ptr, capacity)`` buffers: the object's
        size, ``DS_KEY_NOT_FOUND`` or ``INVALID_ARGUMENT`` (buffer too small)."""
        part = encode_keys([k for k, _, _ in items])
        conn, r = self._request(Op.GET, part, pack_ints([c for _, _, c in items]))
        (lease,) = r.ints()
        results = r.ints()
        offsets = r.ints()
        if not lease:
            return results
        base = conn.arena.base
        copies = [(items[i][1], base + offsets[i], size) for i, size in enumerate(results) if size >= 0]
        conn.enter()
        try:
            copy_many(copies)
        finally:
            conn.leave()
            self._send_one_way(conn, Op.RELEASE, lease)
        return results

    def delete(self, key: str) -> int:
        part = encode_keys([key])
        _, r = self._request(Op.DELETE, part)
        return r.ints()[0]

    def delete_prefix(self, prefix: str) -> int:
        part = encode_keys([prefix])
        _, r = self._request(Op.DELETE_PREFIX, part, timeout_s=ADMIN_TIMEOUT_S)
        return r.ints()[0]

    # -- operator surface ------------------------------------------------------------

    def admin(self, cmd: str, **args: Any) -> dict[str, Any]:
        _, r = self._request(Op.ADMIN, pack_json({"cmd": cmd, **args}), timeout_s=ADMIN_TIMEOUT_S)
        out = r.json()
        if "error" in out:
            raise {"TypeError": TypeError}.get(out.get("type"), ValueError)(out["error"])
        return out

    def status(self) -> dict[str, Any]:
        return self.admin("status")

    def stats(self) -> dict[str, int]:
        """The store's counters (the in-process server's names, plus
        ``clients``, ``pinned_objects``, ...) and ``injected_errors`` here."""
        out = self.status()
        out["injected_errors"] = self.faults.injected
        return out

    @property
    def capacity_bytes(self) -> int:
        return int(self.status()["capacity_bytes"])

    @property
    def used_bytes(self) -> int:
        return int(self.status()["used_bytes"])

    @property
    def pid(self) -> int | None:
        conn = self._conn
        return int(conn.info["pid"]) if conn is not None and conn.info else read_pid(self.paths)

    def set_capacity(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        self.admin("set_capacity", bytes=capacity_bytes)

    @property
    def policy(self) -> str:
        return str(self.status()["policy"])

    def set_policy(self, policy: str) -> None:
        """Evict "fifo" (oldest put first) or "lru" (least recently used) from now on."""
        self.admin("set_policy", policy=policy)

    def clear(self) -> None:
        self.admin("clear")

    def keys(self) -> list[str]:
        """Keys, oldest (next to be evicted) first."""
        return list(self.admin("keys")["keys"])

    def stop(self, wait_s: float = 10.0) -> bool:
        """Stop the store process (its objects are gone); True once it is."""
        pid = self.pid
        try:
            self.admin("stop")
        except (StoreUnreachable, ValueError):
            pass
        self.close()
        return wait_gone(self.paths, pid, wait_s)

    def disconnect(self) -> None:
        """Drop the connection but keep the handle usable: the next request
        connects again at once (a deliberate disconnect is no failure to
        back off from). For a process whose last client of the store closed."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
            self._retry_at = 0.0
        if conn is not None:
            conn.break_off()

    def close(self) -> None:
        """Drop this handle's connection (the store keeps running)."""
        self.closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.break_off()

    def __len__(self) -> int:
        return int(self.status()["objects"])

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.lookup([key]) == [OK]

    def __repr__(self) -> str:
        try:
            s = self.status()
            usage = (f"used={human_bytes(s['used_bytes'])}/{human_bytes(s['capacity_bytes'])} "
                     f"objects={s['objects']} pid={s['pid']}")
        except (StoreUnreachable, ValueError):
            usage = "unreachable"
        down = " down" if self.faults.down else ""
        return f"<HostServer {self.name!r} {usage}{down}>"


def _log_tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return ""


def pid_alive(pid: int | None) -> bool:
    """True while process ``pid`` runs (a zombie waiting to be reaped does not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_gone(paths: StorePaths, pid: int | None, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not pid_alive(pid) and not os.path.exists(paths.socket):
            return True
        time.sleep(0.02)
    return not pid_alive(pid)


# -- one handle per store per process ------------------------------------------

_HANDLES: dict[tuple[str, str], HostServer] = {}
_HANDLES_LOCK = threading.Lock()


def get_or_open(name: str, *, root: str | None, capacity: int, policy: str, timeout_s: float) -> HostServer:
    """This process's handle on host store ``name``, connected (the store
    process started if needed) on first use."""
    key = (store_dir(root), name)
    with _HANDLES_LOCK:
        handle = _HANDLES.get(key)
        if handle is not None and not handle.closed:
            return handle
        handle = HostServer(name, root=root, capacity=capacity, policy=policy, timeout_s=timeout_s)
        handle.open()
        _HANDLES[key] = handle
        return handle


def existing(name: str, root: str | None = None) -> HostServer | None:
    return _HANDLES.get((store_dir(root), name))


def forget(*names: str, root: str | None = None, stop: bool = True) -> None:
    """Close this process's handles (all, or the named ones) and, with
    ``stop``, stop their store processes, so the next ``Store()`` of such a
    name starts a fresh, empty store."""
    with _HANDLES_LOCK:
        picked = [
            (k, h) for k, h in _HANDLES.items()
            if (not names or k[1] in names) and (root is None or k[0] == store_dir(root))
        ]
        for k, _ in picked:
            del _HANDLES[k]
    for _, handle in picked:
        if stop:
            handle.stop()
        else:
            handle.close()


def handle_names() -> list[str]:
    with _HANDLES_LOCK:
        return sorted({name for _, name in _HANDLES})
