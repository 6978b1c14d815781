"""A client process's handle on a local store (``kv.Store`` reaches its store
through it: the ``contract.StoreServer`` surface).

Per batch one control request (two for a put: room, then publish), and the
handle copies the bytes itself, through the segments the store handed it
(``_maps``). Its part of the memory rule (docs/local-store-design.md): a
copy is counted in this process's row of the store's client table
(``_maps.Busy``) from before the request that grants its memory until the
copy is over, so the handle may drop a connection at any time. It trusts no
answer (offsets, sizes and segments are checked against what it mapped),
reads an object that fails its checksum as a miss, and turns a store gone,
stalled or restarting into transport codes within the call's time limit.
A reply is first waited for keeping the GIL (``HELD_WAIT_S``): letting it
go beside a busy scheduler may cost 5 ms to get it back.
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from sglang_simm.local_store._copy import checksum, held_libc, human_bytes
from sglang_simm.local_store.contract import StoreUnreachable
from sglang_simm.local_store._maps import Busy, SegmentMap
from sglang_simm.local_store._paths import StorePaths, check_file, ensure_dir, lock_held, pid_alive, read_pid, store_dir
from sglang_simm.local_store._protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    Reader,
    encode_keys,
    frame,
    pack_i64,
    pack_ints,
    pack_json,
    whole_frame,
)
from sglang_simm.simm_rules import (
    BUILD_CONNECTION_FAILED,
    DS_KEY_NOT_FOUND,
    INTERNAL_ERROR,
    OK,
    OUT_OF_MEMORY,
    SEND_RPC_FAILED,
)

logger = logging.getLogger("sglang_simm.local_store")

START_TIMEOUT_S = 15.0  # how long ``open`` waits for a store to answer
START_GRACE_S = 45.0  # and beyond it, while a store process it started is still starting
MAX_SPAWNS, RESPAWN_AFTER_S = 3, 1.0  # launches per ``open``, and how far apart
#: After a launch that brought no store up, the next waits this long, doubling.
LAUNCH_BACKOFF_FIRST_S, LAUNCH_BACKOFF_MAX_S = 1.0, 60.0
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 2.0  # between reconnection attempts from the data path
ADMIN_TIMEOUT_S = 30.0
DEFAULT_MAX_BATCH = 16384
#: An auto-started store exits after this long with no client.
DEFAULT_IDLE_EXIT_S = 600.0
#: How long a reply is waited for keeping the GIL before a blocking receive.
HELD_WAIT_S = 0.0005
_SEND_NOW = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_SEND_LATER = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ENOBUFS)


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_send_held = held_libc("send", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_recv_held = held_libc("recv", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_ppoll_held = held_libc("ppoll", ctypes.c_int, ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.POINTER(_Timespec),
                        ctypes.c_void_p)


def _kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Sends and receives on ``sock`` fail with EAGAIN after ``seconds`` (a
    Python timeout would poll before each, two more system calls a request)."""
    tv = struct.pack("ll", int(seconds), int((seconds - int(seconds)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# -- this process's state, made afresh in a forked child ---------------------------------

_LOCK = threading.Lock()
_HANDLES: dict[tuple[str, str], StoreHandle] = {}  # one per store per process (``get_or_open``)
_EVERY: weakref.WeakSet[StoreHandle] = weakref.WeakSet()  # every handle: a forked child resets them all
_BUSY: dict[tuple[str, str, str], Busy] = {}  # (dir, name, store generation) -> this process's row
_LAUNCHES: dict[str, _Launches] = {}  # socket path -> this process's launches of that store


class _Launches:
    """One launcher at a time per store in this process, and after a launch
    that brought no store up, the next only after a back-off."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | Any = None
        self.failures, self.not_before = 0, 0.0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _after_fork() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    for handle in list(_EVERY):
        handle._reset()
    for busy in _BUSY.values():
        busy.inherited()
    _BUSY.clear()
    _LAUNCHES.clear()


os.register_at_fork(after_in_child=_after_fork)


def _busy_for(key: tuple[str, str, str], fd: int, data_start: int, row: int) -> Busy:
    with _LOCK:
        busy = _BUSY.get(key)
        if busy is None or not busy.mapped or busy.row != row:
            busy = _BUSY[key] = Busy(fd, data_start, row)
        busy.acquire()
        return busy


class _Connection:
    """One socket to the store process, the segments it handed over, and this
    process's row of its client table."""

    def __init__(self, paths: StorePaths, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._unread = b""
        self._scratch = ctypes.create_string_buffer(1 << 16)
        self._held_until = 0.0
        self.lock = threading.Lock()  # one request and its reply at a time
        self.broken = False
        self.info: dict[str, Any] = {}
        self.maps: list[SegmentMap] = []
        self.busy: Busy | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            check_file(paths.socket)
            sock.settimeout(timeout_s)
            sock.connect(paths.socket)
            _kernel_timeout(sock, timeout_s)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._pollfd = _PollFd(sock.fileno(), 0x001, 0)  # POLLIN

    def hello(self, data: bool, timeout_s: float) -> tuple[dict[str, Any], list[int]]:
        """The handshake: the store's description and the descriptors it sent."""
        _kernel_timeout(self.sock, timeout_s)
        self.sock.sendall(frame(Op.HELLO, pack_json({"version": PROTOCOL_VERSION, "data": data})))
        fds, buf = array.array("i"), b""
        while not whole_frame(buf):
            data_, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(64 * fds.itemsize),
                                                 getattr(socket, "MSG_CMSG_CLOEXEC", 0))
            if not data_:
                raise ConnectionResetError("the store process closed the connection")
            buf += data_
            for level, kind, payload in anc:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        _kernel_timeout(self.sock, self.timeout_s)
        length, op = HEADER.unpack_from(buf)
        self._unread = buf[HEADER.size + length:]
        info = Reader(buf[HEADER.size:HEADER.size + length]).json()
        if op == Op.ERROR:
            raise StoreUnreachable(int(info.get("code", INTERNAL_ERROR)), info.get("error", "refused"), refused=True)
        return info, list(fds)

    def _read_frame(self) -> tuple[int, bytes]:
        if not whole_frame(self._unread):
            self._wait_held()
        head, self._unread = self._unread, b""
        while len(head) < HEADER.size:
            more = self.sock.recv(1 << 16)
            if not more:
                raise ConnectionResetError("the store process closed the connection")
            head += more
        length, op = HEADER.unpack_from(head)
        end = HEADER.size + length
        while len(head) < end:
            more = self.sock.recv(max(end - len(head), 1 << 16))
            if not more:
                raise ConnectionResetError("the store process closed the connection")
            head += more
        self._unread = head[end:]
        return op, head[HEADER.size:end]

    def _wait_held(self) -> None:
        """Until a whole reply is in or ``HELD_WAIT_S`` is over, wait for bytes
        keeping the GIL, and take them (the blocking receive waits for the rest)."""
        if _ppoll_held is None or _recv_held is None or not _SEND_NOW:
            return
        fd, buf, size = self.sock.fileno(), self._scratch, len(self._scratch)
        while not whole_frame(self._unread):
            left = self._held_until - time.monotonic()
            if left <= 0 or _ppoll_held(ctypes.byref(self._pollfd), 1, ctypes.byref(
                    _Timespec(int(left), int((left - int(left)) * 1e9))), None) <= 0:
                return
            n = _recv_held(fd, buf, size, socket.MSG_DONTWAIT)
            if n <= 0:  # readable with nothing to read: the peer closed
                return
            self._unread += ctypes.string_at(buf, n)

    def exchange(self, data: bytes, *, reply: bool = True, timeout_s: float | None = None) -> tuple[int, bytes]:
        """Send a frame and read its reply (the caller holds ``lock``)."""
        if timeout_s is not None:
            _kernel_timeout(self.sock, timeout_s)
        try:
            n = _send_held(self.sock.fileno(), data, len(data), _SEND_NOW) if _send_held and _SEND_NOW else 0
            if n < 0:
                err = ctypes.get_errno()
                if err not in _SEND_LATER:
                    raise OSError(err, os.strerror(err))
                n = 0
            if n < len(data):
                self.sock.sendall(memoryview(data)[n:])
            if not reply:
                return 0, b""
            self._held_until = time.monotonic() + HELD_WAIT_S
            op, body = self._read_frame()
            if self._unread:
                raise ConnectionResetError("the store process sent more than one reply")
            return op, body
        except BlockingIOError as exc:  # the kernel's time limit ran out
            raise socket.timeout("timed out") from exc
        finally:
            if timeout_s is not None:
                _kernel_timeout(self.sock, self.timeout_s)

    def close(self) -> None:
        """No more requests: the store ends this connection's grants once this
        process has no copy in flight, so the socket may close at once."""
        with self.lock:
            if self.broken:
                return
            self.broken = True
        self.sock.close()
        if self.busy is not None:
            self.busy.release()


class StoreHandle:
    """This process's handle on the local store ``name`` in ``root``.
    ``capacity`` and ``policy`` apply when it starts the store; a store
    that runs or has run keeps its own. ``data``: whether it moves data (the
    operator's commands do not: no segment, no row)."""

    def __init__(self, name: str, *, root: str | None = None, capacity: int, policy: str = "fifo",
                 timeout_s: float = 1.0, spawn: bool = True, idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
                 started_by: str = "client", limits: dict[str, Any] | None = None, data: bool = True,
                 force: bool = False) -> None:
        self.paths = StorePaths(store_dir(root), name)  # a bad name or path fails before anything is made
        self.root = ensure_dir(self.paths.root, create=spawn)
        self.name = name
        self.capacity_requested, self.policy_requested = capacity, policy
        self.timeout_s, self.spawn_allowed, self.idle_exit_s = timeout_s, spawn, idle_exit_s
        self.started_by, self.limits, self.data = started_by, dict(limits or {}), data
        self.force = force
        self._reset()
        _EVERY.add(self)
        self.closed = False
        self.reconnects = 0

    def _reset(self) -> None:
        """A handle with no connection (and, in a forked child, none of its parent's state)."""
        for seg in getattr(self, "_maps", {}).values():
            seg.inherited()
        self._conn: _Connection | None = None
        self._maps: dict[str, SegmentMap] = {}
        self._conn_lock = threading.Lock()
        self._retry_at, self._retry_s = 0.0, RETRY_FIRST_S
        self.max_batch = DEFAULT_MAX_BATCH
        self._warned = False

    # -- connecting --------------------------------------------------------------------

    def open(self, wait_s: float = START_TIMEOUT_S) -> None:
        """Connect now, starting the store if allowed; StoreUnreachable with the
        reason (and the store's log) if it does not answer within ``wait_s``
        (plus ``START_GRACE_S`` while a store process this handle started is
        still coming up)."""
        start = now = time.monotonic()
        spawned_at: list[float] = []
        last = "not tried"
        while True:
            try:
                self._connect()
                return
            except StoreUnreachable as exc:
                last = str(exc)
                if exc.refused:
                    raise
                now = time.monotonic()
                starting = self._starting()
                if exc.no_store and not starting and self.spawn_allowed and len(spawned_at) < MAX_SPAWNS and \
                        (not spawned_at or now - spawned_at[-1] >= RESPAWN_AFTER_S):
                    if self._spawn(backoff=False):
                        spawned_at.append(now)
                elif exc.no_store and len(spawned_at) >= MAX_SPAWNS and not starting and \
                        now - spawned_at[-1] >= RESPAWN_AFTER_S:
                    break  # every launch failed: the log says why
            now = time.monotonic()
            if now >= start + wait_s and not (spawned_at and now < start + wait_s + START_GRACE_S
                                              and self._starting()):
                break
            time.sleep(0.02)
        tail = _log_tail(self.paths.log)
        started = (f"; started a store process {len(spawned_at)} time(s), the last {now - spawned_at[-1]:.1f} s ago"
                   f" ({'still starting' if self._starting() else 'it is not running'})" if spawned_at else "")
        raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"local store {self.name!r} at {self.paths.socket} did not "
                               f"answer within {now - start:.0f} s ({last}){started}" +
                               (f"; its log {self.paths.log} says: {tail}" if tail else
                                f"; see its log {self.paths.log}" if spawned_at else ""))

    def _starting(self) -> bool:
        """A store process is on its way: a launcher of this process runs, or
        some process holds the name's lock."""
        return self._launches().running() or lock_held(self.paths)

    def _launches(self) -> _Launches:
        with _LOCK:
            return _LAUNCHES.setdefault(self.paths.socket, _Launches())

    def _connect(self) -> _Connection:
        """A new connection with its handshake done, made current, within the time limit."""
        deadline = time.monotonic() + self.timeout_s
        try:
            conn = _Connection(self.paths, self.timeout_s)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "no store process is running", no_store=True) from exc
        except OSError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"the store process does not accept ({exc})") from exc
        fds: list[int] = []
        try:
            info, fds = conn.hello(self.data, max(deadline - time.monotonic(), 0.001))
            self._adopt(conn, info, fds)
        except BaseException as exc:
            for fd in fds:  # those not taken yet
                if fd >= 0:
                    os.close(fd)
            conn.close()
            if isinstance(exc, StoreUnreachable):
                raise
            if isinstance(exc, Exception):
                raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"handshake failed: {type(exc).__name__}: {exc}") \
                    from exc
            raise
        with self._conn_lock:
            old, self._conn = self._conn, conn
        if old is not None:
            old.close()
            self.reconnects += 1
        with _LOCK:  # a store serves: a later launch is a first launch, not a retry of a failed one
            launches = _LAUNCHES.setdefault(self.paths.socket, _Launches())
            launches.proc, launches.failures, launches.not_before = None, 0, 0.0
        if self.spawn_allowed and not self._warned and \
                (self.capacity_requested, self.policy_requested) != (info["capacity_bytes"], info["policy"]):
            self._warned = True
            logger.info("local store %r runs with capacity %s and %s eviction (started by %s); this process would "
                        "have started it with %s and %s", self.name, human_bytes(info["capacity_bytes"]),
                        info["policy"], info.get("started_by", "?"), human_bytes(self.capacity_requested),
                        self.policy_requested)
        self._retry_s = RETRY_FIRST_S
        return conn

    def _adopt(self, conn: _Connection, info: dict[str, Any], fds: list[int]) -> None:
        """Check the handshake and map the segments it handed over (each
        descriptor taken is set to -1 in ``fds``)."""
        for field in ("name", "pid", "gen", "medium", "capacity_bytes", "policy"):
            if field not in info:
                raise ValueError(f"a handshake without {field!r}")
        conn.info = info
        self.max_batch = max(1, int(info.get("max_batch", DEFAULT_MAX_BATCH)))
        if not self.data:
            return
        segments = info.get("segments") or []
        if len(fds) != len(segments) or not segments or segments[0]["gen"] != info["gen"]:
            raise ValueError(f"a handshake with {len(segments)} segments and {len(fds)} descriptors")
        memory = info["medium"] == "memory"
        for i, seg in enumerate(segments):
            have = self._maps.get(seg["gen"])
            if have is None or have.retired or have.size != seg["size"]:
                have = self._maps[seg["gen"]] = SegmentMap(fds[i], seg["gen"], int(seg["size"]),
                                                            int(seg["data_start"]), memory)
            else:
                os.close(fds[i])
            fds[i] = -1
            conn.maps.append(have)
        for gen in [g for g, m in self._maps.items() if m not in conn.maps]:
            self._maps.pop(gen).retire()  # a store gone: its segments go once no copy uses them
        own = conn.maps[0]
        conn.busy = _busy_for((self.root, self.name, info["gen"]), own.fd, own.data_start, int(info["row"]))
        own.populate_behind()

    def _spawn(self, backoff: bool = True) -> bool:
        """Start the store, unless a process holds the name's lock (it runs,
        starts, stops or is stalled); whether one was started."""
        launches = self._launches()
        with _LOCK:
            if launches.running() or lock_held(self.paths):
                return False
            now = time.monotonic()
            if launches.proc is not None:  # the last launch is over and no store holds the name: it failed
                launches.proc = None
                launches.failures += 1
                launches.not_before = now + min(LAUNCH_BACKOFF_FIRST_S * 2 ** (launches.failures - 1),
                                                LAUNCH_BACKOFF_MAX_S)
                logger.warning("local store %r: the store process this process started exited without serving (%d "
                               "time(s)); starting it again in %.0f s at the soonest; its log %s says: %s", self.name,
                               launches.failures, launches.not_before - now, self.paths.log,
                               _log_tail(self.paths.log))
            if backoff and now < launches.not_before:
                return False
            launches.proc = self._launch()
        return True

    def _launch(self) -> Any:
        cmd = [sys.executable, "-m", "sglang_simm.local_store._server", "--detach", "--dir", self.root, "--name",
               self.name, "--capacity", str(self.capacity_requested), "--policy", self.policy_requested,
               "--idle-exit", str(self.idle_exit_s), "--started-by", self.started_by]
        if self.limits:
            cmd += ["--limits", json.dumps(self.limits)]
        if self.force:
            cmd.append("--force")
        env = dict(os.environ)
        # the store process imports this very package, wherever it came from
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        logger.info("starting local store %r (%s, capacity %s, eviction %s)", self.name, self.paths.socket,
                    human_bytes(self.capacity_requested), self.policy_requested)
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                close_fds=True, start_new_session=True, env=env)

    def _current(self) -> _Connection:
        """The live connection, or one reconnection attempt (rate-limited, so a
        store that is down costs the data path nothing but the attempt)."""
        conn = self._conn
        if conn is not None and not conn.broken:
            return conn
        if self.closed:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "this handle is closed")
        now = time.monotonic()
        with self._conn_lock:
            conn = self._conn
            if conn is not None and not conn.broken:
                return conn
            if now < self._retry_at:
                raise StoreUnreachable(BUILD_CONNECTION_FAILED, "reconnecting to the store process" +
                                       self._launch_note())
            self._retry_at = now + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
        try:
            return self._connect()
        except StoreUnreachable as exc:
            if self.spawn_allowed and exc.no_store:
                self._spawn()  # the next attempt finds it up
                note = self._launch_note()
                if note:
                    raise StoreUnreachable(exc.code, f"{exc}{note}", no_store=True) from exc
            raise

    def _launch_note(self) -> str:
        failures = self._launches().failures if self.spawn_allowed else 0
        return f"; the store process failed to start {failures} time(s): see its log {self.paths.log}" if failures \
            else ""

    def _request(self, op: Op, *parts: bytes, conn: _Connection | None = None, timeout_s: float | None = None,
                 reply: bool = True) -> tuple[_Connection, Reader]:
        conn = conn or self._current()
        try:
            with conn.lock:
                if conn.broken:
                    raise StoreUnreachable(SEND_RPC_FAILED, "the connection to the store process was lost")
                rop, body = conn.exchange(frame(op, *parts), reply=reply, timeout_s=timeout_s)
        except socket.timeout as exc:
            conn.close()  # a late reply would answer the next request
            raise StoreUnreachable(SEND_RPC_FAILED, f"the store process did not answer within "
                                                    f"{timeout_s or self.timeout_s:g} s") from exc
        except OSError as exc:
            conn.close()
            raise StoreUnreachable(SEND_RPC_FAILED, f"the connection to the store process was lost ({exc})") from exc
        r = Reader(body)
        if reply and rop == Op.ERROR:
            try:
                err = r.json()
                code, why = int(err.get("code", INTERNAL_ERROR)), err.get("error")
            except (ValueError, TypeError, AttributeError, ProtocolError):
                conn.close()
                code, why = INTERNAL_ERROR, "an unreadable error"
            raise StoreUnreachable(code, f"the store process refused {op.name}: {why}", refused=True)
        if reply and rop != op:
            conn.close()
            raise StoreUnreachable(INTERNAL_ERROR, f"the store process answered {rop} to {op.name}")
        return conn, r

    def _one_way(self, conn: _Connection, op: Op, *parts: bytes) -> None:
        """ABORT or RELEASE: the client is done with the memory. Lost with the
        connection, it is said all the same: the store ends that
        connection's grants once this process has no copy in flight."""
        try:
            self._request(op, *parts, conn=conn, reply=False)
        except StoreUnreachable:
            pass

    # -- the data path (server codes; StoreUnreachable on transport faults) ------------------

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(i, min(i + self.max_batch, n)) for i in range(0, n, self.max_batch)] or [(0, 0)]

    def lookup(self, keys: Sequence[str]) -> list[int]:
        out: list[int] = []
        for a, b in self._chunks(len(keys)):
            out += _ints(self._request(Op.LOOKUP, encode_keys(keys[a:b]))[1], b - a)
        return out

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        """Store ``(key, ptr, size)`` entries, copying from ``ptr``: per entry OK
        or a data server's code (``contract.StoreServer``)."""
        out: list[int] = []
        for a, b in self._chunks(len(items)):
            out += self._put_batch(items[a:b], overwrite)
        return out

    def _put_batch(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        conn = self._current()
        busy = conn.busy
        if busy is None:
            raise StoreUnreachable(INTERNAL_ERROR, "this handle moves no data")
        keys = [k for k, _, _ in items]
        busy.enter()  # from before the PUT: the memory it grants is ours until the copy is over
        try:
            _, r = self._request(Op.PUT, bytes((int(overwrite),)), encode_keys(keys),
                                 pack_ints([s for _, _, s in items]), conn=conn)
            grant, _, _ = _ints(r, 3)
            codes, offsets = _ints(r, len(items)), _ints(r, len(items))
            if not grant:
                return codes
            granted = [i for i, code in enumerate(codes) if code == OK]
            own = conn.maps[0]
            if not all(own.holds(offsets[i], items[i][2]) for i in granted):
                self._one_way(conn, Op.ABORT, pack_i64(grant))
                raise _bad_answer("PUT", "an offset outside the segment")
            if not own.enter():
                raise StoreUnreachable(SEND_RPC_FAILED, "the store's segment was let go")
            try:
                own.write([(offsets[i], items[i][1], items[i][2]) for i in granted])
                own.populate_behind()
                crcs = [checksum(keys[i].encode("utf-8", "surrogatepass"), items[i][1], items[i][2])
                        for i in granted]
            except OSError as exc:  # a disk full, or a quota: the put is refused, not the process
                logger.warning("local store %r: writing a put failed (%s): it reads as OutOfMemory", self.name, exc)
                self._one_way(conn, Op.ABORT, pack_i64(grant))
                return [OUT_OF_MEMORY if code == OK else code for code in codes]
            finally:
                own.leave()
        finally:
            busy.leave()
        try:  # the copy is over: publish it
            final = _ints(self._request(Op.COMMIT, pack_i64(grant), pack_ints(crcs), conn=conn)[1], len(granted))
        except StoreUnreachable as exc:
            final = [exc.code] * len(granted)  # its room comes back once the store sees the connection gone
        for i, code in zip(granted, final):
            codes[i] = code
        return codes

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        """Copy objects into ``(key, ptr, capacity)`` buffers: per entry the
        object's size, DS_KEY_NOT_FOUND or INVALID_ARGUMENT (buffer too small)."""
        out: list[int] = []
        for a, b in self._chunks(len(items)):
            out += self._get_batch(items[a:b])
        return out

    def _get_batch(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        n = len(items)
        conn = self._current()
        busy = conn.busy
        if busy is None:
            raise StoreUnreachable(INTERNAL_ERROR, "this handle moves no data")
        busy.enter()  # from before the GET: the pinned bytes stay until the copy is over
        try:
            _, r = self._request(Op.GET, encode_keys([k for k, _, _ in items]), pack_ints([c for _, _, c in items]),
                                 conn=conn)
            grant = _ints(r, 1)[0]
            results, segs, offsets, verify = (_ints(r, n) for _ in range(4))
            if not grant:
                return results
            hits = [i for i in range(n) if results[i] >= 0]
            maps = conn.maps
            if not all(0 <= segs[i] < len(maps) and maps[segs[i]].holds(offsets[i], results[i])
                       and results[i] <= items[i][2] for i in hits):
                self._one_way(conn, Op.RELEASE, pack_i64(grant), pack_ints([]))
                raise _bad_answer("GET", "an offset, size or segment outside what this client mapped")
            failed = []
            for seg in sorted({segs[i] for i in hits}):
                m = maps[seg]
                mine = [i for i in hits if segs[i] == seg]
                if not m.enter():
                    failed += mine
                    continue
                try:
                    m.read([(items[i][1], offsets[i], results[i]) for i in mine])
                except OSError as exc:
                    logger.warning("local store %r: reading a get failed (%s): misses", self.name, exc)
                    failed += mine
                finally:
                    m.leave()
            for i in hits:
                if verify[i] and i not in failed and \
                        checksum(items[i][0].encode("utf-8", "surrogatepass"), items[i][1], results[i]) != verify[i]:
                    failed.append(i)
            for i in failed:
                results[i] = DS_KEY_NOT_FOUND
            self._one_way(conn, Op.RELEASE, pack_i64(grant), pack_ints([i for i in failed if verify[i]]))
            return results
        finally:
            busy.leave()

    def removed_since(self, cursor: tuple[str, int] | None) -> tuple[tuple[str, int], bool, list[str], list[str]]:
        """What left the store since ``cursor`` (this call's last answer;
        None: from now): ``(cursor, lost, keys, prefixes cleared)``."""
        conn = self._current()
        gen = conn.info["gen"]
        at = -1 if cursor is None else cursor[1] if cursor[0] == gen else 0  # a new store process: all of it
        r = self._request(Op.REMOVED, pack_i64(at), conn=conn)[1]
        end, lost = _ints(r, 2)
        keys, prefixes = ([k.decode("utf-8", "surrogatepass") for k in r.keys()] for _ in range(2))
        return (gen, end), bool(lost), keys, prefixes

    def delete(self, key: str) -> int:
        return self._request(Op.DELETE, encode_keys([key]))[1].ints()[0]

    def delete_prefix(self, prefix: str) -> int:
        return self._request(Op.DELETE_PREFIX, encode_keys([prefix]), timeout_s=ADMIN_TIMEOUT_S)[1].ints()[0]

    # -- the operator's surface ------------------------------------------------------------

    def admin(self, cmd: str, **args: Any) -> dict[str, Any]:
        out = self._request(Op.ADMIN, pack_json({"cmd": cmd, **args}), timeout_s=ADMIN_TIMEOUT_S)[1].json()
        if "error" in out:
            raise (TypeError if out.get("type") == "TypeError" else ValueError)(out["error"])
        return out

    def status(self) -> dict[str, Any]:
        return self.admin("status")

    def stats(self) -> dict[str, Any]:
        return self.status()

    @property
    def capacity_bytes(self) -> int:
        return int(self.status()["capacity_bytes"])

    @property
    def used_bytes(self) -> int:
        return int(self.status()["used_bytes"])

    @property
    def policy(self) -> str:
        return str(self.status()["policy"])

    @property
    def pid(self) -> int | None:
        conn = self._conn
        return int(conn.info["pid"]) if conn is not None and conn.info else read_pid(self.paths)

    def set_capacity(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        self.admin("set_capacity", bytes=capacity_bytes)

    def set_policy(self, policy: str) -> None:
        """Evict "fifo" (oldest put first) or "lru" (least recently used) from now on."""
        self.admin("set_policy", policy=policy)

    def clear(self) -> None:
        self.admin("clear")

    def keys(self) -> list[str]:
        """Keys, the next to be evicted first."""
        return list(self.admin("keys")["keys"])

    def stop(self, wait_s: float = 10.0, *, discard: bool = False) -> bool:
        """Stop the store process (its objects stay for the next one unless
        ``discard``); True once it is gone."""
        pid = self.pid
        try:
            self.admin("stop", discard=discard)
        except (StoreUnreachable, ValueError):
            pass
        self.close()
        return wait_gone(self.paths, pid, wait_s)

    def disconnect(self) -> None:
        """Drop the connection; the next request connects again at once."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
            self._retry_at = 0.0
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Drop the connection and let the segments go once no copy uses them."""
        self.closed = True
        self.disconnect()
        for m in self._maps.values():
            m.retire()
        self._maps.clear()

    def __len__(self) -> int:
        return int(self.status()["objects"])

    def __repr__(self) -> str:
        try:
            s = self.status()
            usage = (f"used={human_bytes(s['used_bytes'])}/{human_bytes(s['capacity_bytes'])} objects={s['objects']} "
                     f"pid={s['pid']}")
        except (StoreUnreachable, ValueError):
            usage = "unreachable"
        return f"<StoreHandle {self.name!r} {usage}>"


def _ints(r: Reader, n: int) -> list[int]:
    try:
        values = r.ints()
    except ProtocolError as exc:
        raise _bad_answer("a reply", str(exc)) from exc
    if len(values) != n:
        raise _bad_answer("a reply", f"{len(values)} values where {n} were due")
    return values


def _bad_answer(what: str, why: str) -> StoreUnreachable:
    logger.error("local store answered %s with %s: failing the call (a store bug; its log may say more)", what, why)
    return StoreUnreachable(INTERNAL_ERROR, f"the store process answered {what} with {why}")


def _log_tail(path: str, lines: int = 3) -> str:
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return ""


def wait_gone(paths: StorePaths, pid: int | None, wait_s: float) -> bool:
    """Whether the store (process ``pid``, or a thread of this one) let its
    name's lock go, and its process ended, within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while lock_held(paths) or (pid != os.getpid() and pid_alive(pid)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


# -- one handle per store per process -------------------------------------------------------


def get_or_open(name: str, *, root: str | None, capacity: int, policy: str, timeout_s: float,
                idle_exit_s: float = DEFAULT_IDLE_EXIT_S, spawn: bool = True) -> StoreHandle:
    """This process's handle on local store ``name``, connected (the store
    started if needed) on first use."""
    key = (store_dir(root), name)
    with _LOCK:
        handle = _HANDLES.get(key)
    if handle is not None and not handle.closed:
        return handle
    handle = StoreHandle(name, root=root, capacity=capacity, policy=policy, timeout_s=timeout_s,
                         idle_exit_s=idle_exit_s, spawn=spawn)
    handle.open()
    with _LOCK:
        current = _HANDLES.get(key)
        if current is not None and not current.closed:  # another thread won: use its handle
            handle.close()
            return current
        _HANDLES[key] = handle
    return handle


def open_running(root: str, name: str, wait_s: float = 1.0) -> StoreHandle:
    """A handle on the running store ``name`` that never starts one and moves
    no data (status, clear, stop, a scrape)."""
    paths = StorePaths(root, name)
    if not os.path.exists(paths.socket) and not lock_held(paths):
        raise StoreUnreachable(BUILD_CONNECTION_FAILED, "no store process is running", no_store=True)
    handle = StoreHandle(name, root=root, capacity=1, spawn=False, timeout_s=5.0, data=False)
    handle.open(wait_s=wait_s)
    return handle


def running_status(root: str, name: str) -> dict[str, Any]:
    """The running store's status, with the memory its files hold; StoreUnreachable where none answers."""
    from sglang_simm.local_store._paths import files_bytes

    handle = open_running(root, name)
    try:
        status = handle.status()
    finally:
        handle.close()
    status.update(name=name, running=True, files_bytes=files_bytes(StorePaths(root, name)))
    return status


def forget(*names: str, root: str | None = None, stop: bool = True) -> None:
    """Close this process's handles (all, or the named ones) and, with
    ``stop``, stop their stores, discarding their objects (tests and tools:
    the next ``Store()`` of such a name starts afresh)."""
    with _LOCK:
        picked = [(k, h) for k, h in _HANDLES.items()
                  if (not names or k[1] in names) and (root is None or k[0] == store_dir(root))]
        for k, _ in picked:
            del _HANDLES[k]
    for _, handle in picked:
        handle.stop(discard=True) if stop else handle.close()


def handle_names() -> list[str]:
    with _LOCK:
        return sorted({name for _, name in _HANDLES})
