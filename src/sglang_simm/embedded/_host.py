"""A client process's side of a local store: one store process per name per
user, shared by every process on the host (all TP ranks of a server,
several servers, the tools).

``HostServer`` has the in-process server's surface (``put_from``,
``get_into``, ``lookup``, ``delete``, ...) so the ``simm.kv`` layer in
``_client`` serves both the same way. Per batch it sends one control
request (two for a put: reserve, then publish; a batch above the store's
``max_batch`` goes in several), and copies the bytes itself, between the
caller's memory and the shared arena (``_copy.copy_many``).

A server's backup and prefetch threads share the GIL with a scheduler
thread that runs Python all the time, and every call that lets the GIL go
may wait up to the switch interval (5 ms) to get it back. So a call waits
only where it must: requests are sent without letting the GIL go (a
non-blocking send through ``ctypes.PyDLL``; the blocking send, under the
kernel's time limit, only when the socket has no room), small copies keep
it (``_copy``). A backup waits twice (the PUT's reply, the COMMIT's), a
restore once (the GET's); the RELEASE or ABORT that ends a lease gets no
reply.

It trusts nothing the store answers: every offset and size is checked
against the arena it mapped before a byte is copied (a bad answer fails
that call with ``INTERNAL_ERROR``), and after a get's copy the lease's id
in the arena's lease table is checked, so a lease the store no longer
knows (a store process that died and was not told of it) reads as a miss.

Faults never raise into the caller's data path: a store that is gone,
stalled or restarting turns a call into transport codes
(``StoreUnreachable.code``) within the call's time limit (``timeout_s``,
reconnect and handshake included), and the next calls reconnect. A client
starts a store process only when no process holds the name's lock (none
is running, not even a stalled one).

The store never hands out memory this process may still be writing or
reading (docs/local-store.md, the rule at the top). This side's part: a
copy is counted in flight from *before* the request that grants its
memory (``_Connection.enter``), a connection's socket closes only once no
copy under it is in flight, ``close`` unmaps the arena only then, and a
connection lost with leases (``_Connection.lost``) is *fenced*: once its
copies are done this process tells the store so, on the connection
itself if it can, else on its next one (``FENCE``, naming the store
process and the connection). Until then the store keeps that memory.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from operator import add, gt
from typing import Any

from sglang_simm.embedded import _protocol as wire
from sglang_simm.embedded._arena import LEASE_WORDS, POPULATE_CHUNK, ArenaMap
from sglang_simm.embedded._copy import copy_many, held_libc, human_bytes
from sglang_simm.embedded._limits import RateLimitedLog, check_warmup_prefix
from sglang_simm.embedded._paths import StorePaths, check_file, ensure_dir, lock_held, pid_alive, read_pid, store_dir
from sglang_simm.embedded._protocol import Op, Reader, encode_keys, frame, pack_i64, pack_ints, pack_json
from sglang_simm.embedded.simm_rules import (
    BUILD_CONNECTION_FAILED,
    DS_KEY_NOT_FOUND,
    INTERNAL_ERROR,
    OK,
    SEND_RPC_FAILED,
    code_name,
)

logger = logging.getLogger("sglang_simm.embedded")

#: How long ``Store()`` waits for a store to answer.
START_TIMEOUT_S = 15.0
#: Beyond that, how much longer it waits while a store process it started
#: is still starting (alive, not yet listening): on a host whose cores are
#: all busy, a Python process can take that long to come up.
START_GRACE_S = 45.0
#: A store process that died before listening is started again, this many
#: times at most, no sooner than ``RESPAWN_AFTER_S`` after the last.
MAX_SPAWNS = 3
RESPAWN_AFTER_S = 1.0
#: How long ``close`` waits for the thread faulting the arena in to stop
#: (it stops after the chunk in flight, ``_arena.POPULATE_CHUNK``).
CLOSE_FAULT_IN_WAIT_S = 1.0
#: After a launch of the store process that brought no store up (it
#: exited: a damaged file it could not get past, a capacity refused), the
#: next launch from this process waits this long, doubling each time up to
#: the most, instead of one per reconnection attempt.
LAUNCH_BACKOFF_FIRST_S = 1.0
LAUNCH_BACKOFF_MAX_S = 60.0
#: Between reconnection attempts from the data path, at first and at most.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0
#: Operator commands (clear, stop, status) may take longer than a batch.
ADMIN_TIMEOUT_S = 30.0
#: Until a store says its own (HELLO), batches are split at this size.
DEFAULT_MAX_BATCH = 16384
#: An auto-started store exits after this long with no client (flag
#: ``local_store_idle_exit_s``): long enough to outlive a server's restart.
DEFAULT_IDLE_EXIT_S = 600.0


class _Launches:
    """This process's launches of one store (by socket path), shared by all
    its handles and threads: one launcher at a time (single flight), and
    after a launch that brought no store up, the next only after a back-off
    that doubles (``LAUNCH_BACKOFF_*``)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        self.not_before = 0.0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


_LAUNCHES: dict[str, _Launches] = {}
_LAUNCHES_LOCK = threading.Lock()


def _launches(paths: StorePaths) -> _Launches:
    with _LAUNCHES_LOCK:
        return _LAUNCHES.setdefault(paths.socket, _Launches())


class StoreUnreachable(ConnectionError):
    """The store process could not serve a call; ``code`` is what the
    entries of that call fail with (a transport code, as the real client's
    RPC failures). ``no_store``: nothing listens on the socket (starting
    one may help); ``refused``: the store answered and said no."""

    def __init__(self, code: int, why: str, *, no_store: bool = False, refused: bool = False) -> None:
        super().__init__(f"{code_name(code)}: {why}")
        self.code = code
        self.no_store = no_store
        self.refused = refused


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# send, receive and wait keeping the GIL
_send_held = held_libc("send", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_recv_held = held_libc("recv", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_ppoll_held = held_libc("ppoll", ctypes.c_int, ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.POINTER(_Timespec),
                        ctypes.c_void_p)
_POLLIN = 0x001

#: How long a call waits for a reply holding the GIL before it lets the GIL
#: go for a blocking receive. A reply takes 0.1-0.2 ms here (an empty round
#: trip, docs/benchmarks.md); letting the GIL go for it costs a thread
#: beside a busy scheduler up to the 5 ms switch interval to get it back,
#: while holding it stops the other threads for no longer than this.
#: Measured in docs/benchmarks.md ("GIL releases and waits").
HELD_WAIT_S = 0.0005
#: never blocks, and a peer gone raises EPIPE rather than a signal
_SEND_NOW = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_SEND_LATER = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ENOBUFS)


def _send(sock: socket.socket, data: bytes) -> None:
    """All of ``data``, holding the GIL while the socket has room (a
    request is small and the store reads it at once: nearly always); what
    is left goes by the blocking send, which lets the GIL go and fails with
    EAGAIN at the kernel's time limit (SO_SNDTIMEO)."""
    send = _send_held
    if send is None or not _SEND_NOW:
        sock.sendall(data)
        return
    n = send(sock.fileno(), data, len(data), _SEND_NOW)
    if n == len(data):
        return
    if n < 0:
        err = ctypes.get_errno()
        if err not in _SEND_LATER:
            raise OSError(err, os.strerror(err))
        n = 0
    sock.sendall(memoryview(data)[n:])


def _kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Sends and receives on ``sock`` fail with EAGAIN after ``seconds``."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Connection:
    """One socket to the store process, and the arena it announced."""

    def __init__(self, paths: StorePaths, timeout_s: float, lost: list | None = None) -> None:
        self.timeout_s = timeout_s
        self.committed = 0  # the store's committed arena bytes, as last announced
        #: where this connection goes once broken, until it is fenced (its
        #: handle's list: the next connection fences it)
        self.lost = lost if lost is not None else []
        self.fenced = False
        self._unread = b""  # bytes received past the last reply read
        self._scratch: ctypes.Array[ctypes.c_char] | None = None  # for receives that keep the GIL
        self._pollfd: _PollFd | None = None
        self._held_until = 0.0  # the exchange in progress waits keeping the GIL until then
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
        self.data_start = 0  # objects lie in [data_start, arena.size)

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

    def _read_frame(self) -> tuple[int, bytes]:
        """The next reply on the connection: one receive gets the header and,
        nearly always, the whole reply (with any earlier ones still unread)."""
        if not _whole_frame(self._unread):
            self._wait_held()
        head, self._unread = self._unread, b""
        while len(head) < wire.HEADER.size:
            more = self.sock.recv(1 << 16)
            if not more:
                raise ConnectionResetError("the store process closed the connection")
            head += more
        length, op = wire.HEADER.unpack_from(head)
        end = wire.HEADER.size + length
        if len(head) < end:
            return op, head[wire.HEADER.size:] + self._recv_exact(end - len(head))
        self._unread = head[end:]
        return op, head[wire.HEADER.size:end]

    def _take_received(self) -> None:
        """Add what the socket holds already to ``_unread``, keeping the GIL
        (the held wait found it readable: a receive that let the GIL go
        could wait the switch interval to get it back)."""
        recv = _recv_held
        if recv is None or not _SEND_NOW:
            return
        if self._scratch is None:
            self._scratch = ctypes.create_string_buffer(1 << 16)
        buf, size = self._scratch, len(self._scratch)
        fd = self.sock.fileno()
        while True:
            n = recv(fd, buf, size, socket.MSG_DONTWAIT)
            if n <= 0:  # nothing yet, or the peer closed: the blocking receive finds out
                return
            self._unread += ctypes.string_at(buf, n)
            if n < size:
                return

    def _wait_held(self) -> None:
        """Until a whole reply is in ``_unread`` or the exchange's held wait
        (``HELD_WAIT_S`` from its send) is over, wait for bytes keeping the
        GIL, and take them (the blocking receive waits for the rest)."""
        wait = _ppoll_held
        if wait is None or _recv_held is None or not _SEND_NOW:
            return
        if self._pollfd is None:
            self._pollfd = _PollFd(self.sock.fileno(), _POLLIN, 0)
        while not _whole_frame(self._unread):
            left = self._held_until - time.monotonic()
            if left <= 0:
                return
            whole = int(left)
            ready = wait(ctypes.byref(self._pollfd), 1, ctypes.byref(_Timespec(whole, int((left - whole) * 1e9))),
                         None)
            if ready <= 0:  # the time is up, or a signal: the blocking receive takes over
                return
            before = len(self._unread)
            self._take_received()
            if len(self._unread) == before:  # readable with nothing to read: the peer closed
                return

    def exchange(self, data: bytes, *, reply: bool = True, timeout_s: float | None = None) -> tuple[int, bytes]:
        """Send a frame and read the reply (the caller holds ``lock``)."""
        if timeout_s is not None:
            _kernel_timeout(self.sock, timeout_s)
        try:
            _send(self.sock, data)
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

    def end_lease(self, op: Op, lease: int) -> None:
        """Send ABORT or RELEASE of ``lease``, which get no reply, unless the
        connection is broken (the store then ends the lease with it; the
        caller holds ``lock``)."""
        if not self.broken:
            self.exchange(frame(op, pack_i64(lease)), reply=False)

    # -- copies in flight, and closing ------------------------------------------

    def enter(self) -> None:
        """A copy under this connection's leases is in flight from now: call
        it *before* the request that grants the memory (a disconnect or a
        timeout may come between the reply and the copy)."""
        with self._state:
            if self.broken:
                raise StoreUnreachable(SEND_RPC_FAILED, "the connection to the store process was lost")
            self.inflight += 1
        if not self.arena.enter():
            with self._state:
                self.inflight -= 1
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "this handle is closed")

    def leave(self) -> None:
        self.arena.leave()
        with self._state:
            self.inflight -= 1
            close = self.broken and self.inflight == 0
        if close:
            self._close_socket()

    def break_off(self) -> None:
        """No more requests; the socket closes once no copy under this
        connection's leases is in flight, and the connection is then
        fenced (``_close_socket``)."""
        with self._state:
            if not self.broken and self.info:
                self.lost.append(self)  # fenced by the next connection if not by itself
            self.broken = True
            close = self.inflight == 0
        if close:
            self._close_socket()

    def fence_frame(self) -> bytes:
        """The FENCE that ends this connection's leases at the store."""
        return frame(Op.FENCE, pack_i64(int(self.info.get("epoch", 0))), pack_i64(int(self.info.get("conn", 0))))

    def _close_socket(self) -> None:
        """No copy under this connection is in flight: say so on the socket
        itself if it takes it at once (else the next connection says it),
        and close it."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        if self.info and _send_held is not None and _SEND_NOW:
            data = self.fence_frame()
            try:
                self.fenced = _send_held(self.sock.fileno(), data, len(data), _SEND_NOW) == len(data)
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self._closed


class HostServer:
    """This process's handle on the local store ``name`` in ``root``.

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
        idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
        started_by: str = "client",
        limits: dict[str, Any] | None = None,
        fault_in: bool = True,
        force: bool = False,
    ) -> None:
        self.paths = StorePaths(store_dir(root), name)  # a bad name or path fails before anything is made
        #: fault the committed arena in behind, from the connect on (a client
        #: that moves no data, such as ``store status`` or ``clear``, does
        #: not: it would take back, page by page, memory a clear gives up)
        self.fault_in = fault_in
        self.root = ensure_dir(self.paths.root, create=spawn)
        self.name = name
        self.capacity_requested = capacity
        self.policy_requested = policy
        self.timeout_s = timeout_s
        self.spawn_allowed = spawn
        self.idle_exit_s = idle_exit_s
        self.started_by = started_by
        self.limits = dict(limits or {})
        #: a store this handle starts starts even beyond what the host can back
        self.force = force
        self.max_batch = DEFAULT_MAX_BATCH
        #: key prefixes the store counts apart as warm-ups (``add_warmup_prefix``)
        self.warmup_prefixes: tuple[str, ...] = ()
        self._conn: _Connection | None = None
        self._conn_lock = threading.Lock()
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._spawned: list[subprocess.Popen] = []
        self._old_arenas: list[ArenaMap] = []
        self.reconnects = 0
        self.closed = False
        self._warned = False
        #: this handle's connections lost with leases, not fenced yet
        self._lost: list[_Connection] = []
        self._log = RateLimitedLog(logger)

    # -- connecting ---------------------------------------------------------------

    def open(self, wait_s: float = START_TIMEOUT_S) -> None:
        """Connect now, starting the store process if allowed; raise
        StoreUnreachable with the reason (and the store's log) if it cannot
        be reached within ``wait_s`` (plus ``START_GRACE_S`` while a store
        process this handle started is still coming up)."""
        start = time.monotonic()
        deadline = start + wait_s
        spawned_at: list[float] = []
        last = "not tried"
        while True:
            try:
                self._connect()
                return
            except StoreUnreachable as exc:
                last = str(exc)
                if exc.refused:  # reachable, but it refused us
                    raise
                if (exc.no_store and self.spawn_allowed and len(spawned_at) < MAX_SPAWNS
                        and (not spawned_at or time.monotonic() - spawned_at[-1] >= RESPAWN_AFTER_S)
                        and not self._starting()):
                    if self._spawn(backoff=False):  # its own policy: MAX_SPAWNS, RESPAWN_AFTER_S apart
                        spawned_at.append(time.monotonic())
                elif (exc.no_store and len(spawned_at) >= MAX_SPAWNS and not self._starting()
                        and time.monotonic() - spawned_at[-1] >= RESPAWN_AFTER_S):
                    now = time.monotonic()
                    break  # every launch failed: the log says why, and waiting longer changes nothing
            now = time.monotonic()
            if now >= deadline and not (spawned_at and now < deadline + START_GRACE_S and self._starting()):
                break
            time.sleep(0.02)
        tail = _log_tail(self.paths.log)
        started = (f"; started a store process {len(spawned_at)} time(s), the last {now - spawned_at[-1]:.1f} s ago"
                   f" ({'still starting' if self._starting() else 'it is not running'})" if spawned_at else "")
        raise StoreUnreachable(
            BUILD_CONNECTION_FAILED,
            f"local store {self.name!r} at {self.paths.socket} did not answer within {now - start:.0f} s "
            f"({last}){started}" + (f"; its log {self.paths.log} says: {tail}" if tail else
                                    f"; see its log {self.paths.log}" if spawned_at else ""),
        )

    def _starting(self) -> bool:
        """Whether a store process is on its way: a launcher this handle
        started is still running, or some process holds the name's lock."""
        for proc in self._spawned:
            if proc.poll() is None:
                return True
        return _launches(self.paths).running() or lock_held(self.paths)

    def _connect(self) -> _Connection:
        """A new connection with its handshake done, made current, within
        this handle's time limit (connect and handshake together)."""
        deadline = time.monotonic() + self.timeout_s
        try:
            conn = _Connection(self.paths, self.timeout_s, self._lost)
        except FileNotFoundError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "no store process is running", no_store=True) from exc
        except ConnectionRefusedError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"the store process does not accept ({exc})",
                                   no_store=True) from exc
        except socket.timeout as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"the store process does not accept ({exc})") from exc
        except OSError as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"{type(exc).__name__}: {exc}") from exc
        hello = {"version": wire.PROTOCOL_VERSION, "pid": os.getpid()}
        if self.warmup_prefixes:  # declared in every handshake: a store process that restarts hears them again
            hello["warmup_prefixes"] = list(self.warmup_prefixes)
        hello = pack_json(hello)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no time left for the handshake")
            with conn.lock:
                op, body = conn.exchange(frame(Op.HELLO, hello), timeout_s=left)
            info = Reader(body).json()
            if op == Op.ERROR:
                conn.break_off()
                raise StoreUnreachable(int(info.get("code", INTERNAL_ERROR)), info.get("error", "refused"),
                                       refused=True)
            _check_hello(info)
            arena = self._arena_for(info)
        except StoreUnreachable:
            raise
        except Exception as exc:
            conn.break_off()
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, f"handshake failed: {type(exc).__name__}: {exc}") from exc
        conn.info = info
        conn.arena = arena
        conn.data_start = int(info["data_start"])
        self.max_batch = max(1, int(info.get("max_batch", DEFAULT_MAX_BATCH)))
        conn.committed = int(info.get("committed_bytes", 0))
        if self.fault_in:
            arena.populate_behind(int(info.get("committed_bytes", 0)))  # a big store's: seconds
        with self._conn_lock:
            old, self._conn = self._conn, conn
        if old is not None:
            old.break_off()
            self.reconnects += 1
        launches = _launches(self.paths)
        with _LAUNCHES_LOCK:
            # A store serves: the launch that started it (if any) succeeded, so
            # a later one, after this store is gone, is a first launch, not a
            # retry of a failed one (no back-off, no "exited without serving").
            launches.proc, launches.failures, launches.not_before = None, 0, 0.0
        self._fence_lost(conn)
        asked = (self.capacity_requested, self.policy_requested)
        if self.spawn_allowed and asked != (info["capacity_bytes"], info["policy"]) and not self._warned:
            self._warned = True
            logger.warning(
                "local store %r runs with capacity %s and %s eviction (started by %s); this process asked for "
                "%s and %s: the store keeps its own (stop it to change them)",
                self.name, human_bytes(info["capacity_bytes"]), info["policy"], info.get("started_by", "?"),
                human_bytes(self.capacity_requested), self.policy_requested,
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

    def _spawn(self, backoff: bool = True) -> bool:
        """Start the store process, unless one holds the name's lock (it is
        running, starting, stopping or stalled: starting another would only
        wait on the lock); whether one was started. One launcher at a time
        in this process; with ``backoff``, after a launch that brought no
        store up, none before its back-off ends (``_Launches``)."""
        for proc in self._spawned:
            proc.poll()  # reap the short-lived launchers
        self._spawned = [p for p in self._spawned if p.returncode is None]
        launches = _launches(self.paths)
        with _LAUNCHES_LOCK:  # one launch at a time in this process, whichever handle or thread asks
            if launches.running() or lock_held(self.paths):
                return False
            now = time.monotonic()
            if launches.proc is not None:  # the last launch is over, and no store holds the name: it failed
                launches.proc = None
                launches.failures += 1
                launches.not_before = now + min(LAUNCH_BACKOFF_FIRST_S * 2 ** (launches.failures - 1),
                                                LAUNCH_BACKOFF_MAX_S)
                self._log.warning("launch", "local store %r: the store process this process started exited "
                                  "without serving (%d time(s)); starting it again in %.0f s at the soonest; "
                                  "its log %s says: %s", self.name, launches.failures,
                                  launches.not_before - now, self.paths.log, _log_tail(self.paths.log))
            if backoff and now < launches.not_before:
                return False
            launches.proc = self._launch()
            self._spawned.append(launches.proc)
        return True

    def _launch(self) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "sglang_simm.embedded._daemon", "--detach",
            "--dir", self.root, "--name", self.name,
            "--capacity", str(self.capacity_requested), "--policy", self.policy_requested,
            "--idle-exit", str(self.idle_exit_s), "--started-by", self.started_by,
        ]
        if self.limits:
            cmd += ["--limits", json.dumps(self.limits)]
        if self.force:
            cmd.append("--force")
        env = dict(os.environ)
        # The store process must import this very package, wherever it came from.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        logger.info("starting local store %r (%s, capacity %s, eviction %s)",
                    self.name, self.paths.socket, human_bytes(self.capacity_requested), self.policy_requested)
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True, env=env,
        )

    def _fence_lost(self, conn: _Connection) -> None:
        """Tell the store, on ``conn``, that this process is done with the
        leases of its lost connections whose copies are over (those still
        copying are told of later)."""
        done = [old for old in self._lost if old.closed]
        if not done:
            return
        try:
            with conn.lock:
                for old in done:
                    if not old.fenced and not conn.broken:
                        conn.exchange(old.fence_frame(), reply=False)
                        old.fenced = True
        except OSError:
            conn.break_off()
        for old in done:
            if old.fenced:
                self._lost.remove(old)  # one at a time: a thread may append meanwhile

    def _current(self) -> _Connection:
        """The live connection, or a reconnection attempt (rate-limited, so a
        store that is down costs the data path nothing but the attempt)."""
        conn = self._conn
        if conn is not None and not conn.broken:
            if self._lost:
                self._fence_lost(conn)
            return conn
        if self.closed:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "this handle is closed")
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, "reconnecting to the store process" + self._launch_note())
        with self._conn_lock:
            conn = self._conn
            if conn is not None and not conn.broken:
                return conn
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
        """What to add to an error while this process's launches of the
        store fail: how often, and where its log is."""
        failures = _launches(self.paths).failures if self.spawn_allowed else 0
        if not failures:
            return ""
        return f"; the store process failed to start {failures} time(s): see its log {self.paths.log}"

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
            # SendRPCFailed, as SiMM HEAD reports a timed-out request (never Timeout)
            raise StoreUnreachable(SEND_RPC_FAILED,
                                   f"the store process did not answer within {timeout_s or self.timeout_s:g} s") from exc
        except OSError as exc:
            conn.break_off()
            raise StoreUnreachable(SEND_RPC_FAILED, f"the connection to the store process was lost ({exc})") from exc
        reader = Reader(body)
        if rop == Op.ERROR:
            try:
                err = reader.json()
                code, why = int(err.get("code", INTERNAL_ERROR)), err.get("error")
            except (ValueError, TypeError, AttributeError):
                conn.break_off()
                code, why = INTERNAL_ERROR, "an unreadable error"
            raise StoreUnreachable(code, f"the store process refused {op.name}: {why}", refused=True)
        if rop != op:
            conn.break_off()
            raise StoreUnreachable(INTERNAL_ERROR, f"the store process answered {rop} to {op.name}")
        return conn, reader

    def _send_one_way(self, conn: _Connection, op: Op, lease: int) -> None:
        try:
            with conn.lock:
                conn.end_lease(op, lease)
        except OSError:
            conn.break_off()  # the store releases the lease when it sees the close

    # -- the data path (server codes; StoreUnreachable on transport faults) ----

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = self.max_batch
        return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]

    def lookup(self, keys: Sequence[str]) -> list[int]:
        out: list[int] = []
        for a, b in self._chunks(len(keys)):
            _, r = self._request(Op.LOOKUP, encode_keys(keys[a:b]))
            out += _ints(r, b - a)
        return out

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        """Store ``(key, ptr, size)`` entries, copying from ``ptr``: the same
        codes as the in-process server's ``put_from``."""
        if len(items) <= self.max_batch:
            return self._put_batch(items, overwrite)
        out: list[int] = []
        for a, b in self._chunks(len(items)):
            out += self._put_batch(items[a:b], overwrite)
        return out

    def _put_batch(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        n = len(items)
        part = encode_keys([k for k, _, _ in items])
        conn = self._current()
        conn.enter()  # from before the PUT: its memory is ours until the copy is over
        try:
            conn, r = self._request(Op.PUT, bytes((int(overwrite),)), part, pack_ints([s for _, _, s in items]),
                                    conn=conn)
            lease, committed = _ints(r, 2)
            codes = _ints(r, n)
            offsets = _ints(r, n)
            if not lease:
                return codes
            # a backup: every entry reserved (counted in C, not picked one by one)
            reserved = range(n) if codes.count(OK) == n else [i for i, code in enumerate(codes) if code == OK]
            offs = _pick(offsets, reserved)
            sizes = _pick([s for _, _, s in items], reserved)
            ptrs = _pick([p for _, p, _ in items], reserved)
            if not _in_arena(conn, offs, sizes):
                self._send_one_way(conn, Op.ABORT, lease)
                conn.break_off()
                raise _bad_answer("PUT", "an offset outside the arena")
            conn.committed = max(conn.committed, committed)
            try:
                self._copy_in(conn, offs, sizes, ptrs)
            except BaseException:
                self._send_one_way(conn, Op.ABORT, lease)
                raise
        finally:
            conn.leave()
        # The copy is over: the COMMIT publishes it (or, with no overwrite,
        # another put of a key wins).
        try:
            _, r = self._request(Op.COMMIT, pack_i64(lease), conn=conn)
            final = _ints(r, len(reserved))
        except StoreUnreachable as exc:
            final = [exc.code] * len(reserved)  # the connection was lost: the lease ends with its fence
        for i, code in zip(reserved, final):
            codes[i] = code
        return codes

    def _copy_in(self, conn: _Connection, offs: list[int], sizes: list[int], ptrs: list[int]) -> None:
        """Copy a put's objects into its room in the arena (the caller
        counts the copy in flight: ``_Connection.enter``)."""
        arena = conn.arena
        base = arena.base
        # What the store committed (a step ahead) is faulted in behind the
        # puts; this one faults in its own pages where it got there first
        # (unless they lie scattered among others: its copies fault them).
        arena.populate_behind(conn.committed)
        if offs:
            lo, hi = min(offs), max(map(int.__add__, offs, sizes))
            if hi - lo <= 2 * sum(sizes) + POPULATE_CHUNK:
                arena.populate(hi, lo)
        copy_many(list(zip([base + o for o in offs], ptrs, sizes)))

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        """Copy objects into ``(key, ptr, capacity)`` buffers: the object's
        size, ``DS_KEY_NOT_FOUND`` or ``INVALID_ARGUMENT`` (buffer too small)."""
        if len(items) <= self.max_batch:
            return self._get_batch(items)
        out: list[int] = []
        for a, b in self._chunks(len(items)):
            out += self._get_batch(items[a:b])
        return out

    def _get_batch(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        n = len(items)
        part = encode_keys([k for k, _, _ in items])
        conn = self._current()
        conn.enter()  # from before the GET: the pinned bytes are ours until the copy is over
        try:
            conn, r = self._request(Op.GET, part, pack_ints([c for _, _, c in items]), conn=conn)
            lease, slot = _ints(r, 2)
            results = _ints(r, n)
            offsets = _ints(r, n)
            if not lease:
                return results
            # a restore: every entry there
            hits = range(n) if min(results) >= 0 else [i for i, size in enumerate(results) if size >= 0]
            offs, sizes = _pick(offsets, hits), _pick(results, hits)
            caps = _pick([c for _, _, c in items], hits)
            ptrs = _pick([p for _, p, _ in items], hits)
            if (not _in_arena(conn, offs, sizes)
                    or any(map(gt, sizes, caps))
                    or not 0 < slot < conn.data_start // (8 * LEASE_WORDS)):
                self._send_one_way(conn, Op.RELEASE, lease)
                conn.break_off()
                raise _bad_answer("GET", "an offset, size or lease slot outside what this client mapped")
            base = conn.arena.base
            try:
                copy_many(list(zip(ptrs, [base + o for o in offs], sizes)))
                # The lease must still be the store's after the copy: a store
                # process that died meanwhile and whose successor was never
                # told of it (no record) may have reused those bytes.
                if ctypes.c_int64.from_address(base + 8 * LEASE_WORDS * slot).value != lease:
                    for i in hits:
                        results[i] = DS_KEY_NOT_FOUND
            finally:
                self._send_one_way(conn, Op.RELEASE, lease)
            return results
        finally:
            conn.leave()

    def delete(self, key: str) -> int:
        part = encode_keys([key])
        _, r = self._request(Op.DELETE, part)
        return r.ints()[0]

    def delete_prefix(self, prefix: str) -> int:
        part = encode_keys([prefix])
        _, r = self._request(Op.DELETE_PREFIX, part, timeout_s=ADMIN_TIMEOUT_S)
        return r.ints()[0]

    def add_warmup_prefix(self, prefix: str) -> None:
        """Have the store count keys that start with ``prefix`` apart as
        well (``warmup_puts``, ``warmup_hits``): told now, and in every
        handshake after, so a store process that restarts hears it again.
        ValueError for a prefix that is no key; a store that cannot take it
        (unreachable, too many prefixes) is logged, not raised."""
        check_warmup_prefix(prefix, self.warmup_prefixes)
        if prefix in self.warmup_prefixes:
            return
        self.warmup_prefixes += (prefix,)
        try:
            self.admin("warmup_prefix", prefix=prefix)
        except StoreUnreachable:
            pass  # the next connection's handshake declares it
        except (TypeError, ValueError) as exc:
            logger.warning("host store %r does not count warm-up keys %r apart: %s", self.name, prefix, exc)

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
        ``clients``, ``pinned_objects``, ...), and ``injected_errors`` (0:
        a store injects nothing; a ``FaultyServer`` in front counts its own)."""
        out = self.status()
        out["injected_errors"] = 0
        out["unfenced_connections"] = len(self._lost)
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
        """Drop this handle's connection (the store keeps running) and its
        mapping of the arena, once no copy into it is in flight (the last
        copy unmaps it; a new one is refused). The thread
        faulting the arena in behind stops at its next chunk; it is waited
        for (briefly), so a closed handle no longer takes memory back that
        the store gives up (a clear)."""
        self.closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.break_off()
            arena = conn.arena
            if arena is not None:
                arena.retire()
                arena.wait_behind(CLOSE_FAULT_IN_WAIT_S)

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
        return f"<HostServer {self.name!r} {usage}>"


def _ints(r: Reader, n: int) -> list[int]:
    """An int list of exactly ``n`` from a reply."""
    try:
        values = r.ints()
    except wire.ProtocolError as exc:
        raise _bad_answer("a reply", str(exc)) from exc
    if len(values) != n:
        raise _bad_answer("a reply", f"{len(values)} values where {n} were due")
    return values


def _whole_frame(buf: bytes) -> bool:
    """Whether ``buf`` starts with a whole frame."""
    if len(buf) < wire.HEADER.size:
        return False
    length, _ = wire.HEADER.unpack_from(buf)
    return len(buf) >= wire.HEADER.size + length


def _pick(values: list[int], chosen: Sequence[int]) -> list[int]:
    """``values`` at the ascending indices ``chosen`` (all of them: as is)."""
    return values if len(chosen) == len(values) else [values[i] for i in chosen]


def _in_arena(conn: _Connection, offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """Every extent ``offsets[i], sizes[i]`` lies in the object part of the
    mapped arena (bulk builtins: a batch's check costs no per-entry bytecode)."""
    if not offsets:
        return True
    return (min(offsets) >= conn.data_start and min(sizes) >= 0
            and max(map(add, offsets, sizes)) <= conn.arena.size)


def _bad_answer(what: str, why: str) -> StoreUnreachable:
    logger.error("local store answered %s with %s: failing the call (a store bug; its log may say more)", what, why)
    return StoreUnreachable(INTERNAL_ERROR, f"the store process answered {what} with {why}")


def _check_hello(info: Any) -> None:
    if not isinstance(info, dict):
        raise ValueError("a handshake that is not a JSON object")
    for name in ("arena", "arena_bytes", "data_start", "capacity_bytes", "policy", "pid"):
        if name not in info:
            raise ValueError(f"a handshake without {name!r}")
    if not 0 < int(info["data_start"]) < int(info["arena_bytes"]):
        raise ValueError(f"data_start {info['data_start']} outside an arena of {info['arena_bytes']} bytes")


def _log_tail(path: str, lines: int = 3) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return ""


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


def get_or_open(name: str, *, root: str | None, capacity: int, policy: str, timeout_s: float,
                idle_exit_s: float = DEFAULT_IDLE_EXIT_S) -> HostServer:
    """This process's handle on local store ``name``, connected (the store
    process started if needed) on first use."""
    key = (store_dir(root), name)
    with _HANDLES_LOCK:
        handle = _HANDLES.get(key)
        if handle is not None and not handle.closed:
            return handle
        handle = HostServer(name, root=root, capacity=capacity, policy=policy, timeout_s=timeout_s,
                            idle_exit_s=idle_exit_s)
        handle.open()
        _HANDLES[key] = handle
        return handle


def open_running(root: str, name: str, wait_s: float = 1.0) -> HostServer:
    """A handle on the running store ``name`` that never starts one (for
    status, clear, stop, a scrape): ``StoreUnreachable`` at once where
    nothing listens and no process holds the name's lock."""
    paths = StorePaths(root, name)
    if not os.path.exists(paths.socket) and not lock_held(paths):
        raise StoreUnreachable(BUILD_CONNECTION_FAILED, "no store process is running", no_store=True)
    handle = HostServer(name, root=root, capacity=1, spawn=False, timeout_s=5.0, fault_in=False)
    handle.open(wait_s=wait_s)
    return handle


def running_status(root: str, name: str) -> dict[str, Any]:
    """The running store's status, with the memory its files hold
    (``held_bytes``) and ``running``; ``StoreUnreachable`` where none answers."""
    from sglang_simm.embedded._paths import held_bytes

    handle = open_running(root, name)
    try:
        status = handle.status()
    finally:
        handle.close()
    status.setdefault("name", name)
    status["running"] = True
    status["held_bytes"] = held_bytes(StorePaths(root, name))
    return status


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
