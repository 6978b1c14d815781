"""The local store's process: one per store name per user, serving every
client process on the host over a Unix socket.

It owns the index (``_index``, kept crash-consistently in ``_table``) and
the arena file (``_arena``), and never touches object bytes: clients copy
them. Single-threaded (a ``selectors`` loop), so the index needs no lock
and a batch is one step; batches are bounded (``StoreLimits.max_batch``)
so that no step holds the others up for long. A client's connection owns
its leases; another connection cannot end them. When it closes, for
whatever reason (the store may close it itself: a bad frame, the input
budget), its leases stay held by its process until that process fences
them (``FENCE``, on its next connection) or is gone (its pid checked each
housekeeping tick, with its start time against a reused pid).

Every input is checked (``_limits``): a limit passed is a SiMM code to that
client, a rate-limited log line and a ``refused_<reason>`` counter, never a
crash; running out of file descriptors pauses accepting, not serving.

Started by the first client that finds no store (``_host``), or by
``sglang-simm store start``, it outlives its clients, so a restarted SGLang
server finds its pages. It ends, freeing its shared memory, on
``sglang-simm store stop`` (an ADMIN ``stop``), SIGTERM or SIGINT, or
after ``idle_exit_s`` with no client. If it dies instead (kill -9, OOM),
arena, index and settings stay, and the next store process of the name
takes every published object over, with the settings the store was started
with (``NAME.json``). Imports no torch: it starts in well under a second.

    python -m sglang_simm.embedded._daemon --dir DIR --name NAME --capacity BYTES [--policy fifo|lru]
        [--idle-exit S] [--started-by client|operator] [--limits JSON] [--detach]
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import itertools
import json
import logging
import logging.handlers
import os
import resource
import secrets
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.embedded import _protocol as wire
from sglang_simm.embedded._arena import (
    LEASE_WORDS,
    ArenaFile,
    Backing,
    arena_bytes_for,
    arena_held,
    lease_table_bytes,
    lock_arena,
)
from sglang_simm.embedded._index import EVICTION_POLICIES, LeaseError, StoreIndex, lease_records
from sglang_simm.embedded._limits import REFUSALS, RateLimitedLog, StoreLimits
from sglang_simm.embedded._paths import StoreAccessError, StorePaths, ensure_dir, held_bytes, open_private
from sglang_simm.embedded._protocol import Op, ProtocolError, Reader, frame, pack_ints, pack_json
from sglang_simm.embedded._table import IndexTable
from sglang_simm.embedded.simm_rules import INTERNAL_ERROR, INVALID_ARGUMENT, TARGET_UNAVAILABLE
from sglang_simm.embedded._http import store_metrics_from_env

logger = logging.getLogger("sglang_simm.embedded.daemon")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: File descriptors kept for the store's own files and the log.
_FD_RESERVE = 32
#: After accept() fails for lack of descriptors, accepting waits this long.
_ACCEPT_BACKOFF_S = 0.1
#: After a clear, free memory past the committed prefix is looked at each
#: housekeeping tick until this long after the last tick that gave some
#: back: a client's thread faulting the arena in may still be on its way
#: to a target set before the clear (at 0.45 ms a MiB and the lowest CPU
#: priority, a big store's arena takes it seconds to minutes).
REFAULT_WINDOW_S = 60.0
#: A connection that has not said HELLO this long after it was accepted is
#: dropped (``refused_hello``): a peer that connects and says nothing holds
#: a connection slot and a descriptor.
HELLO_DEADLINE_S = 5.0
#: The operator commands that walk every object, and may take a while.
_SLOW_ADMIN = frozenset({"clear", "keys"})


@dataclass
class StoreSettings:
    """What a store process was started with; persisted in ``NAME.json`` so
    the next store process of the name (after a crash) keeps them."""

    capacity: int
    policy: str = "fifo"
    limits: StoreLimits = field(default_factory=StoreLimits)
    #: "operator" (``store start``) or "client" (started on first use)
    started_by: str = "client"
    arena: str = ""  # the arena file, once created
    #: the arena file's size (the capacity can change at run time, the
    #: arena cannot: recovery goes by this, and by the file's real size)
    arena_bytes: int = 0
    #: the epoch of the store process serving this arena (lease ids carry
    #: it), beside the lease table's own copy: the next process numbers on
    #: from the larger, so its ids are new even where the table's head was lost
    epoch: int = 0

    def save(self, path: str) -> None:
        data = {"capacity": self.capacity, "policy": self.policy, "limits": self.limits.as_dict(),
                "started_by": self.started_by, "arena": self.arena, "arena_bytes": self.arena_bytes,
                "epoch": self.epoch}
        tmp = f"{path}.tmp"
        try:
            os.unlink(tmp)  # whatever is there, a symlink included: never written through
        except FileNotFoundError:
            pass
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # atomic: a crash leaves the old or the new

    @classmethod
    def load(cls, path: str, fallback: StoreSettings) -> StoreSettings | None:
        """The settings in ``path``, each field checked on its own: one that
        is missing or out of range (a capacity of 0, an unknown policy, a
        limit below its floor) is ``fallback``'s, with a log line. None when
        the file is absent or holds no JSON object."""
        try:
            fd = open_private(path, os.O_RDONLY)
            with os.fdopen(fd) as f:
                data = json.loads(f.read(1 << 20))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeError, RecursionError) as exc:
            logger.warning("ignoring unreadable store settings %s (%s)", path, exc)
            return None
        out = StoreSettings(capacity=fallback.capacity, policy=fallback.policy, limits=fallback.limits,
                            started_by=fallback.started_by)
        bad = []
        capacity = data.get("capacity")
        if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
            out.capacity = capacity
        else:
            bad.append(f"capacity {capacity!r}")
        if data.get("policy") in EVICTION_POLICIES:
            out.policy = data["policy"]
        else:
            bad.append(f"policy {data.get('policy')!r}")
        # limit by limit: the lease table's size (max_leases) must be the
        # dead store's for its grants to be read, whatever another limit holds
        limits = fallback.limits.as_dict()
        kept_limits = data.get("limits")
        if kept_limits is not None and not isinstance(kept_limits, dict):
            bad.append(f"limits {kept_limits!r}")
        for key, value in (kept_limits.items() if isinstance(kept_limits, dict) else ()):
            try:
                StoreLimits.from_dict({**limits, key: value})
            except (TypeError, ValueError) as exc:
                bad.append(f"limit {key} ({exc})")
            else:
                limits[key] = value
        out.limits = StoreLimits.from_dict(limits)
        if data.get("started_by") in ("client", "operator"):
            out.started_by = data["started_by"]
        arena_bytes = data.get("arena_bytes", 0)
        if isinstance(arena_bytes, int) and not isinstance(arena_bytes, bool) and arena_bytes > 0:
            out.arena_bytes = arena_bytes
        arena = data.get("arena")
        out.arena = arena if isinstance(arena, str) else ""
        epoch = data.get("epoch", 0)
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0:
            out.epoch = epoch
        if bad:
            logger.warning("store settings %s: %s out of range: the launcher's kept instead", path, ", ".join(bad))
        return out


class _Conn:
    __slots__ = ("accepted", "counted", "id", "inbuf", "outbuf", "paused", "pid", "sock", "start", "started",
                 "writing")

    def __init__(self, sock: socket.socket, conn_id: int, pid: int, start: int) -> None:
        self.accepted = time.monotonic()
        self.sock = sock
        self.id = conn_id
        self.pid = pid
        self.start = start  # the peer process's start time: its pid, once reused, is another's
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.started = False  # HELLO done
        self.writing = False  # registered for EVENT_WRITE
        self.paused = False  # its replies back up: its requests wait
        self.counted = 0  # bytes of inbuf counted in the daemon's ``buffered``


def _stat(pid: int) -> tuple[bytes, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot,
    ``/proc/PID/stat`` field 22), or None when there is no such process.
    Any other failure (no descriptor left) raises: it says nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        fields = stat[stat.rindex(b")") + 2:].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def proc_start(pid: int) -> int | None:
    got = _stat(pid) if pid > 0 else None
    return got[1] if got is not None else None


def proc_alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a
    zombie has no memory mapped: gone; a reused pid is another process).
    When /proc cannot be read (no descriptor left), alive: a lease is
    never ended on a guess."""
    try:
        got = _stat(pid) if pid > 0 else None
    except OSError:
        return True
    return got is not None and got[1] == start and got[0] != b"Z"


def _fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class StoreDaemon:
    def __init__(self, paths: StorePaths, settings: StoreSettings, *, takeover: bool = False,
                 arena_fd: int | None = None) -> None:
        """``takeover``: the arena ``settings.arena`` (open and locked as
        ``arena_fd``) and the index are a dead store process's: its sound
        objects are taken over."""
        self.paths = paths
        self.settings = settings
        limits = self.limits = settings.limits
        self.generation = secrets.token_hex(6)
        self.data_start = lease_table_bytes(limits.max_leases)
        arena_size = max(self.data_start + arena_bytes_for(settings.capacity), settings.arena_bytes if takeover else 0)
        reuse = takeover and bool(settings.arena)
        arena_path = settings.arena if reuse else paths.arena(self.generation)
        self.arena = ArenaFile(arena_path, arena_size, reuse=reuse, fd=arena_fd if reuse else None)
        settings.arena = self.arena.path
        settings.arena_bytes = self.arena.size
        space = self.arena.size - self.data_start
        if settings.capacity > space:  # an arena the capacity outgrew (damaged settings)
            logger.warning("store %r: capacity %d is more than its arena holds (%d bytes): lowered to it",
                           paths.name, settings.capacity, space)
            settings.capacity = space
        self.table = IndexTable(paths.index, limits.objects_for(settings.capacity), self.arena.size,
                                adopt=self.arena.reused)
        if not self.arena.reused and not self.table.fresh:
            self.table.clear()  # an index of another arena: nothing in it is here
        # The lease table: a dead store process's grants whose holders still
        # live stay held (their records kept); the others are void.
        words = self.arena.lease_words(self.data_start)
        old_epoch, records = lease_records(words, limits.max_leases + 1) if self.arena.reused else (0, [])
        holds = [r for r in records if proc_alive(r[2], r[3])]
        kept = {r[0] for r in holds}
        for slot, *_ in records:
            if slot not in kept:
                words[slot * LEASE_WORDS] = 0
        if self.arena.reused:
            old_epoch = max(old_epoch, settings.epoch)
        self.epoch = old_epoch + 1 if 0 < old_epoch < (1 << 22) else 1
        settings.epoch = self.epoch
        self.index = StoreIndex(
            capacity=settings.capacity, arena_bytes=self.arena.size, policy=settings.policy,
            commit=self.arena.commit, limits=limits, data_start=self.data_start,
            lease_words=words, table=self.table, max_objects=self.table.slots, epoch=self.epoch,
        )
        self.recovered = self.dropped = 0
        #: memory clients faulted in past the committed arena, given back
        self.stale_released = 0
        #: until when free memory past the committed prefix is looked at each
        #: tick (``_release_refaulted``; 0: no clear since the window closed)
        self._refault_until = 0.0
        self.takeover_s = 0.0
        if self.arena.reused:
            t0 = time.monotonic()
            # no object of the dead store lies past what its file held
            bound = min(self.arena.found_size, self.arena.size)
            found, self.dropped = self.table.recover(self.data_start, bound, self.index.alloc.align)
            self.recovered = self.index.restore(found, holds)
            self.index.memory_released(self.arena.release_after(self.index.alloc.high_water(), upto=self.arena.size))
            self.takeover_s = time.monotonic() - t0
        self.held_at_takeover = len(holds)
        settings.save(paths.settings)
        self.started = time.time()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self.running = True
        self.stop_reason = ""
        self.served = 0  # connections accepted since start
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.log = RateLimitedLog(logger)
        self.buffered = 0  # unfinished request bytes over all connections
        self.max_connections = max(1, min(limits.max_connections, _fd_limit() - _FD_RESERVE))
        self._scratch = bytearray(1 << 20)  # one receive buffer for every connection
        self._scratch_view = memoryview(self._scratch)
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._accept_paused_until = 0.0
        self._listening = False
        self._next_tick = 0.0
        self._next_hello_check = 0.0
        self.idle_since: float | None = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is born 0600
        try:
            self.listener.bind(paths.socket)
        finally:
            os.umask(old_umask)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self._listen(True)

    # -- the loop -----------------------------------------------------------

    def _listen(self, on: bool) -> None:
        if on != self._listening:
            if on:
                self.sel.register(self.listener, selectors.EVENT_READ, None)
            else:
                self.sel.unregister(self.listener)
            self._listening = on

    def serve_forever(self) -> None:
        while self.running:
            # while accepting is paused, wake when it resumes (a backlog of
            # newcomers is refused one per pause, not one per tick)
            wait = 0.25 if self._listening else min(0.25, max(self._accept_paused_until - time.monotonic(), 0.0))
            for key, events in self.sel.select(timeout=wait):
                if key.data is None:
                    self._accept()
                    continue
                conn: _Conn = key.data
                if events & selectors.EVENT_READ and conn.id in self.conns:
                    self._read(conn)
                if events & selectors.EVENT_WRITE and conn.id in self.conns:
                    self._flush(conn)
            self._housekeeping()

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if not self._listening and now >= self._accept_paused_until:
            self._listen(True)
        if now >= self._next_tick:
            self._next_tick = now + 0.25
            reaped = self.index.reap(proc_alive)
            if reaped:
                self.log.info("reaped", "%d leases of closed connections ended: their processes are gone", reaped)
            stale = self.arena.release_stale()
            if self._refault_until:
                stale += self._release_refaulted(now)
            if stale:
                self.stale_released += stale
                self.log.info("stale_memory", "gave back %d bytes a client faulted in past the committed "
                              "arena after memory was given back", stale)
        if now >= self._next_hello_check:
            self._next_hello_check = now + min(1.0, HELLO_DEADLINE_S / 4)
            self._drop_silent(now)
        idle = self.limits.idle_exit_s
        if idle and self.idle_since is not None and now - self.idle_since >= idle:
            logger.info("no client for %g s (idle exit): stopping", idle)
            self.stop_reason = "idle"
            self.running = False

    def _drop_silent(self, now: float) -> None:
        """Drop the connections that have not said HELLO within
        ``HELLO_DEADLINE_S`` of being accepted: they hold a connection slot
        and a descriptor, and 1,024 of them kept every client out."""
        late = [c for c in self.conns.values() if not c.started and now - c.accepted >= HELLO_DEADLINE_S]
        for conn in late:
            self._refuse("hello", "client pid %d said no HELLO within %g s of connecting: dropped",
                         conn.pid, HELLO_DEADLINE_S)
            self._drop(conn, "no hello")

    def _release_refaulted(self, now: float) -> int:
        """After a clear, memory a client's fault-in backs again in free
        extents past the committed prefix, given back; the window stays
        open ``REFAULT_WINDOW_S`` past the last tick that found some."""
        if now >= self._refault_until:
            self._refault_until = 0.0
            return 0
        # the arena keeps to what lies past its committed prefix
        freed = self.arena.release_refaulted(self.index.alloc.free_extents(below=self.index.alloc.high_water()))
        if freed:
            self._refault_until = now + REFAULT_WINDOW_S
        return freed

    def _refuse(self, reason: str, msg: str, *args: object) -> None:
        self.refused[reason] += 1
        self.log.warning(reason, msg, *args)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._refuse("fds", "accept failed (%s): accepting again in %g s", exc, _ACCEPT_BACKOFF_S)
                    self._pause_accepting()
                    return
                self._shed_one(exc)
                return
            self._admit(sock)

    def _pause_accepting(self) -> None:
        self._listen(False)
        self._accept_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S

    def _shed_one(self, exc: OSError) -> None:
        """Out of descriptors: use the spare one to accept and refuse the
        waiting client (it gets a reason, not a hang), then pause accepting."""
        self._refuse("fds", "out of file descriptors accepting a client (%s, %d connections open): "
                     "refusing and pausing accepts for %g s; raise the fd limit (ulimit -n) or "
                     "lower max_connections", exc, len(self.conns), _ACCEPT_BACKOFF_S)
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            try:
                sock, _ = self.listener.accept()
            except OSError:
                sock = None
            if sock is not None:
                self._send_refusal(sock, TARGET_UNAVAILABLE, "the local store is out of file descriptors")
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._spare_fd = None
        self._pause_accepting()

    @staticmethod
    def _send_refusal(sock: socket.socket, code: int, why: str) -> None:
        try:
            sock.setblocking(False)
            sock.send(frame(Op.ERROR, pack_json({"error": why, "code": code})))
        except OSError:
            pass
        sock.close()

    def _admit(self, sock: socket.socket) -> None:
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.geteuid():
            logger.warning("refused a connection from uid %d (pid %d): this store is uid %d's", uid, pid, os.geteuid())
            sock.close()
            return
        if len(self.conns) >= self.max_connections:
            self._refuse("connections", "refused client pid %d: %d connections open (max_connections)",
                         pid, len(self.conns))
            self._send_refusal(sock, TARGET_UNAVAILABLE,
                               f"the local store has {len(self.conns)} connections open, its limit "
                               f"(max_connections {self.max_connections})")
            return
        try:
            start = self._proc_start(pid)
        except OSError as exc:  # no descriptor left to read /proc with: refused as accept() would be
            self._refuse("fds", "out of file descriptors admitting client pid %d (%s, %d connections open): "
                         "refusing and pausing accepts for %g s", pid, exc, len(self.conns), _ACCEPT_BACKOFF_S)
            self._send_refusal(sock, TARGET_UNAVAILABLE, "the local store is out of file descriptors")
            self._pause_accepting()
            return
        if start is None:  # gone already: nothing it could hold outlives it
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, next(self._ids), pid, start)
        self.index.connect(conn.id, pid, start)
        self.conns[conn.id] = conn
        self.served += 1
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def _proc_start(self, pid: int) -> int | None:
        """``proc_start``, with the spare descriptor lent for it when none is
        left (the connection just accepted may have taken the last)."""
        try:
            return proc_start(pid)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or self._spare_fd is None:
                raise
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            return proc_start(pid)
        finally:
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._spare_fd = None

    def _drop(self, conn: _Conn, why: str) -> None:
        if self.conns.pop(conn.id, None) is None:
            return
        self.buffered -= conn.counted
        conn.counted = 0
        held = self.index.disconnect(conn.id)
        if held:
            logger.info("client pid %d: connection %d closed (%s) with %d open leases: held for its process "
                        "until it fences them or is gone", conn.pid, conn.id, why, held)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if not any(c.started for c in self.conns.values()):
            self.idle_since = time.monotonic()

    def _read(self, conn: _Conn) -> None:
        try:
            got = conn.sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        if not got:
            self._drop(conn, "closed")
            return
        conn.inbuf += self._scratch_view[:got]
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Serve the whole frames buffered for ``conn``, as long as its
        replies do not back up; account for what is left."""
        buf = conn.inbuf
        pos = 0
        backlog = self.limits.reply_backlog_bytes
        try:
            while len(buf) - pos >= wire.HEADER.size:
                if len(conn.outbuf) > backlog:
                    self._pause(conn)
                    break
                length, op = wire.HEADER.unpack_from(buf, pos)
                if length > self.limits.max_frame_bytes:
                    self._refuse("frame", "client pid %d sent a frame of %d bytes (max_frame_bytes %d): dropped",
                                 conn.pid, length, self.limits.max_frame_bytes)
                    self._drop(conn, "frame too large")
                    return
                end = pos + wire.HEADER.size + length
                if len(buf) < end:
                    break
                reply = self._handle(conn, op, bytes(buf[pos + wire.HEADER.size: end]))
                pos = end
                if reply is not None:
                    conn.outbuf += reply
                if conn.id not in self.conns:
                    return
        except ProtocolError as exc:
            self._refuse("bad_frame", "client pid %d sent a bad frame (%s): dropped", conn.pid, exc)
            self._drop(conn, "bad frame")
            return
        del buf[:pos]
        self.buffered += len(buf) - conn.counted
        conn.counted = len(buf)
        if self.buffered > self.limits.input_budget_bytes:
            self._refuse("input_budget", "client pid %d: %d unfinished request bytes buffered over all "
                         "connections (input_budget_bytes %d): dropped", conn.pid, self.buffered,
                         self.limits.input_budget_bytes)
            self._drop(conn, "input budget")
            return
        if conn.outbuf:
            self._flush(conn)

    def _pause(self, conn: _Conn) -> None:
        if not conn.paused:
            conn.paused = True
            self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        events = (0 if conn.paused else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.writing else 0)
        self.sel.modify(conn.sock, events or selectors.EVENT_WRITE, conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        del conn.outbuf[:sent]
        # Watch for writability only while a reply is left over (rare: a
        # reply is small and the socket buffer empty), not on every reply.
        writing = bool(conn.outbuf)
        resume = conn.paused and len(conn.outbuf) <= self.limits.reply_backlog_bytes
        if writing != conn.writing or resume:
            conn.writing = writing
            if resume:
                conn.paused = False
            self._watch(conn)
            if resume:
                self._process(conn)

    # -- requests ---------------------------------------------------------------

    def _handle(self, conn: _Conn, op: int, body: bytes) -> bytes | None:
        try:
            op = Op(op)
        except ValueError:
            raise ProtocolError(f"unknown op {op}") from None
        if not conn.started and op != Op.HELLO:
            raise ProtocolError("the first request must be HELLO")
        r = Reader(body)
        try:
            return self._dispatch(conn, op, r)
        except ProtocolError:
            raise
        except _Refused as exc:
            return None if op in wire.ONE_WAY else _error(exc.code, str(exc))
        except LeaseError as exc:
            if op in wire.ONE_WAY:
                self._refuse("lease_owner", "client pid %d: %s %s: ignored", conn.pid, op.name, exc)
                return None
            if exc.code == INVALID_ARGUMENT:
                self._refuse("lease_owner", "client pid %d: %s %s: refused", conn.pid, op.name, exc)
            return _error(exc.code, f"{op.name}: {exc}")
        except _BadRequest as exc:
            # a body that parses into something this request cannot take:
            # a JSON body that is none, a field of the wrong type or out of range
            self._refuse("request", "client pid %d: a malformed %s request (%s): refused", conn.pid, op.name,
                         _short(exc))
            if op in wire.ONE_WAY:
                return None
            return _error(INVALID_ARGUMENT, f"{op.name}: a malformed request ({_short(exc)})")
        except Exception as exc:  # a bug here must not take the store down
            logger.exception("op %s from pid %d failed", op.name, conn.pid)
            if op in wire.ONE_WAY:
                return None
            return _error(INTERNAL_ERROR, f"{op.name} failed in the store process; its log says why")

    def _keys(self, r: Reader) -> list[bytes]:
        keys = r.keys()
        if len(keys) > self.limits.max_batch:
            self._refuse("batch", "a batch of %d entries (max_batch %d): refused", len(keys), self.limits.max_batch)
            raise _Refused(INVALID_ARGUMENT, f"a batch of {len(keys)} entries is above this store's "
                           f"max_batch {self.limits.max_batch}; split it")
        return keys

    def _dispatch(self, conn: _Conn, op: Op, r: Reader) -> bytes | None:
        index = self.index
        if op == Op.LOOKUP:
            keys = self._keys(r)
            r.done()
            return frame(op, pack_ints(index.lookup(keys)))
        if op == Op.PUT:
            overwrite = bool(r.u8())
            keys = self._keys(r)
            sizes = r.ints()
            r.done()
            if len(keys) != len(sizes):
                raise ProtocolError("PUT with keys and sizes of different lengths")
            lease, codes, offsets = index.begin_put(conn.id, keys, sizes, overwrite)
            self._count_entry_refusals()
            return frame(op, pack_ints([lease, self.arena.committed]), pack_ints(codes), pack_ints(offsets))
        if op == Op.COMMIT:
            lease = r.i64()
            r.done()
            done = index.commit_put(lease, owner=conn.id)
            return frame(op, pack_ints([code for _, code in done]))
        if op == Op.FENCE:
            epoch, owner = r.i64(), r.i64()
            r.done()
            if epoch == self.epoch:
                ended = index.fence(owner, conn.pid, own=owner == conn.id)
            else:
                ended = index.fence((epoch, owner), conn.pid)
            if ended:
                logger.info("client pid %d fenced connection %d of store process %d: %d leases ended",
                            conn.pid, owner, epoch, ended)
            return None
        if op in (Op.ABORT, Op.RELEASE):
            lease = r.i64()
            r.done()
            index.release(lease, owner=conn.id)
            return None
        if op == Op.GET:
            keys = self._keys(r)
            caps = r.ints()
            r.done()
            if len(keys) != len(caps):
                raise ProtocolError("GET with keys and capacities of different lengths")
            lease, results, offsets = index.begin_get(conn.id, keys, caps)
            return frame(op, pack_ints([lease, index.lease_slot(lease)]), pack_ints(results), pack_ints(offsets))
        if op == Op.DELETE:
            keys = self._keys(r)
            r.done()
            return frame(op, pack_ints([index.delete(k) for k in keys]))
        if op == Op.DELETE_PREFIX:
            prefixes = r.keys()
            r.done()
            if len(prefixes) != 1:
                raise _BadRequest(f"DELETE_PREFIX names one prefix, not {len(prefixes)}")
            prefix = prefixes[0]
            return frame(op, pack_ints([index.delete_prefix(prefix)]))
        if op == Op.HELLO:
            hello = _json(r)
            if not isinstance(hello, dict) or hello.get("version") != wire.PROTOCOL_VERSION:
                version = hello.get("version") if isinstance(hello, dict) else None
                return _error(INTERNAL_ERROR,
                              f"protocol version {version} is not this store's "
                              f"{wire.PROTOCOL_VERSION} (another sglang-simm release made it): "
                              f"stop it with 'sglang-simm store stop {self.paths.name}'")
            conn.started = True
            self.idle_since = None
            prefixes = hello.get("warmup_prefixes") or []
            for prefix in prefixes if isinstance(prefixes, list) else [prefixes]:
                refusal = self._add_warmup_prefix(prefix)
                if refusal:
                    self.log.warning("warmup_prefix", "client pid %d: %s", conn.pid, refusal)
            return frame(op, pack_json({**self.describe(), "conn": conn.id}))
        if op == Op.ADMIN:
            cmd = _json(r)
            if not isinstance(cmd, dict):
                raise ProtocolError("an ADMIN body that is not a JSON object")
            return frame(op, pack_json(self._admin(cmd, conn)))
        raise ProtocolError(f"op {op.name} is not a request")

    def _count_entry_refusals(self) -> None:
        stats = self.index.stats
        for reason in ("key", "size", "leases"):
            have = stats[f"refused_{reason}"]
            if have != self.refused[reason]:
                self.log.warning(reason, "refused %d entries (%s past this store's limits)",
                                 have - self.refused[reason], reason)
                self.refused[reason] = have

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.paths.name,
            "pid": os.getpid(),
            "generation": self.generation,
            "epoch": self.epoch,
            "arena": self.arena.path,
            "arena_bytes": self.arena.size,
            "data_start": self.data_start,
            "committed_bytes": self.arena.committed,
            "capacity_bytes": self.index.capacity,
            "policy": self.index.policy,
            "max_batch": self.limits.max_batch,
            "idle_exit_s": self.limits.idle_exit_s,
            "started_by": self.settings.started_by,
            "version": wire.PROTOCOL_VERSION,
        }

    def status(self, asking: _Conn | None = None) -> dict[str, Any]:
        """Everything ``sglang-simm store status`` shows; ``clients`` are the
        pids connected, the asker left out."""
        out = self.describe()
        out.update(self.index.snapshot())
        out["committed_bytes"] = self.arena.committed
        out["clients"] = sorted({c.pid for c in self.conns.values() if c.started and c is not asking})
        out["connections"] = len(self.conns)
        out["max_connections"] = self.max_connections
        out["connections_served"] = self.served
        out["buffered_request_bytes"] = self.buffered
        out["uptime_s"] = round(time.time() - self.started, 3)
        out["memory_error"] = self.arena.commit_error or ""
        out["recovered"] = self.recovered
        out["stale_released_bytes"] = self.stale_released
        out["recovery_dropped"] = self.dropped
        out["takeover_s"] = round(self.takeover_s, 4)
        out["held_at_takeover"] = self.held_at_takeover
        out["limits"] = self.limits.as_dict()
        for reason in REFUSALS:
            out[f"refused_{reason}"] = max(self.refused[reason], out.get(f"refused_{reason}", 0))
        return out

    def _add_warmup_prefix(self, prefix: object) -> str | None:
        """Count keys that start with a client's ``prefix`` apart (its
        warm-ups, ``StoreIndex.add_warmup_prefix``); why not, or None."""
        if not isinstance(prefix, str):
            return f"a warm-up key prefix must be a string, got {type(prefix).__name__}"
        try:
            self.index.add_warmup_prefix(prefix.encode("utf-8", "surrogatepass"))
        except ValueError as exc:
            return str(exc)
        return None

    def _admin(self, cmd: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        what = cmd.get("cmd")
        index = self.index
        if what == "status":
            return self.status(conn)
        if what == "clear":
            removed = index.clear()
            # Give the shared memory back: nothing lies past the high water
            # now, and below it only what is still held (puts being copied,
            # pinned reads, leases of closed connections) and the lease table.
            high = index.alloc.high_water()
            self.arena.release_after(high, upto=self.arena.size)  # and what clients faulted in past it
            index.memory_released(self.arena.release_holes(index.alloc.free_extents(below=high)))
            self._refault_until = time.monotonic() + REFAULT_WINDOW_S
            return {"removed": removed, "committed_bytes": self.arena.committed}
        if what == "keys":
            return {"keys": [k.decode("utf-8", "surrogatepass") for k in index.objects]}
        if what == "set_capacity":
            try:
                index.set_capacity(cmd.get("bytes"))
            except (TypeError, ValueError) as exc:
                return {"error": str(exc), "type": type(exc).__name__}
            self.settings.capacity = index.capacity
            self.settings.save(self.paths.settings)
            return {"capacity_bytes": index.capacity}
        if what == "set_policy":
            try:
                index.set_policy(cmd.get("policy"))
            except ValueError as exc:
                return {"error": str(exc), "type": "ValueError"}
            self.settings.policy = index.policy
            self.settings.save(self.paths.settings)
            return {"policy": index.policy}
        if what == "warmup_prefix":
            refusal = self._add_warmup_prefix(cmd.get("prefix"))
            if refusal:
                return {"error": refusal, "type": "ValueError"}
            return {"warmup_prefixes": len(index.warmup_prefixes)}
        if what == "stop":
            self.stop_reason = "stopped"
            self.running = False
            return {"stopping": os.getpid()}
        return {"error": f"unknown admin command {what!r}", "type": "ValueError"}

    def close(self, *, keep_objects: bool = False) -> None:
        """Stop serving; unless ``keep_objects``, free the shared memory and
        the index (a stop or idle exit: the objects are gone)."""
        for conn in list(self.conns.values()):
            self._drop(conn, "store stopping")
        self.sel.close()
        self.listener.close()
        for path in (self.paths.socket, self.paths.pid):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.table.close(unlink=not keep_objects)
        self.arena.close(unlink=not keep_objects)
        if not keep_objects:
            try:
                os.unlink(self.paths.settings)
            except FileNotFoundError:
                pass


class _BadRequest(ValueError):
    """A request whose body parses into something it cannot take: answered
    with InvalidArgument and a one-line reason, the connection kept."""


def _json(r: Reader) -> Any:
    """The rest of a body as JSON; _BadRequest when it is none (bad bytes,
    bad syntax, nested past the parser's depth)."""
    try:
        return r.json()
    except (ValueError, RecursionError, UnicodeError) as exc:
        raise _BadRequest(f"the body is no JSON ({_short(exc)})") from None


def _short(exc: BaseException) -> str:
    """A reason for a client: the exception's text, one line, bounded."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


class _Refused(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def _error(code: int, why: str) -> bytes:
    return frame(Op.ERROR, pack_json({"error": why, "code": code}))


def _lock_name(paths: StorePaths) -> int | None:
    """Hold ``NAME.lock`` for this process's life: one store per name. None
    when another live store process holds it."""
    fd = open_private(paths.lock, os.O_RDWR | os.O_CREAT)
    # A client probing the lock (``_host.lock_held``) holds it for a moment,
    # longer when its process is short of CPU: keep trying for two seconds
    # before concluding that a store process holds it.
    for attempt in range(100):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
        time.sleep(0.02)
    os.close(fd)
    return None


def remove_files(paths: StorePaths, *, objects: bool) -> None:
    """A store process that died left its socket (and, with ``objects``, its
    arena, index and settings) behind; clients still mapping an old arena
    keep its memory until they unmap it. Call with the name's lock held."""
    doomed = [paths.socket, paths.pid]
    if objects:
        doomed += [*paths.arenas(), paths.index, paths.settings]
    for path in doomed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _LogFile(logging.handlers.RotatingFileHandler):
    """The store's log, never opened through a symlink (it would append to
    the link's target)."""

    def _open(self):  # type: ignore[override]
        fd = open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def _setup_logging(paths: StorePaths, level: str) -> None:
    handler = _LogFile(paths.log, maxBytes=1 << 20, backupCount=1)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pid %(process)d: %(message)s"))
    root = logging.getLogger("sglang_simm")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    os.chmod(paths.log, 0o600)


@dataclass
class _Start:
    """What ``_settings_for`` decided: the settings to serve with, and the
    arena to take over (open and locked), if any."""

    settings: StoreSettings
    takeover: bool = False
    arena_fd: int | None = None
    #: another live store process holds an arena of this name: nothing to do
    in_use: str = ""


def _arena_to_take(paths: StorePaths, named: str) -> str:
    """The arena file a dead store left: the one its settings name, when
    that is an arena of this name in the store directory (never a path
    elsewhere), else the only arena of the name; "" when none."""
    arenas = paths.arenas()
    if named and os.path.dirname(os.path.abspath(named)) == os.path.abspath(paths.root) and \
            os.path.abspath(named) in {os.path.abspath(a) for a in arenas}:
        return named
    if named:
        logger.warning("store settings name the arena %r, which is not one of this store's files", named)
    return arenas[0] if len(arenas) == 1 else ""


def _settings_for(args: argparse.Namespace, paths: StorePaths) -> _Start:
    """The settings to serve with, and whether a dead store's objects are
    taken over: a dead store's own settings win over the launcher's, field
    by field (one that is out of range is the launcher's). Nothing is
    removed while another live store process holds an arena of the name
    (its lock file removed, it still serves): this one then does nothing."""
    limits = StoreLimits.from_dict({**json.loads(args.limits or "{}"), "idle_exit_s": args.idle_exit})
    asked = StoreSettings(capacity=args.capacity, policy=args.policy, limits=limits, started_by=args.started_by)
    for arena in paths.arenas():
        if arena_held(arena):
            return _Start(asked, in_use=arena)
    kept = StoreSettings.load(paths.settings, asked)
    arena = _arena_to_take(paths, kept.arena if kept is not None else "")
    why = ""
    if not arena:
        why = "no arena"
    else:
        why = IndexTable.unreadable(paths.index)
    fd = None
    if not why:
        try:
            fd = lock_arena(arena)
        except (OSError, StoreAccessError) as exc:
            why = str(exc)
        else:
            if fd is None:
                return _Start(asked, in_use=arena)
    if why:
        if why != "no arena":
            logger.warning("store %r: the objects a store process left cannot be taken over (%s): starting empty",
                           paths.name, why)
        remove_files(paths, objects=True)
        return _Start(asked)
    if kept is None:
        logger.warning("store %r: its settings are lost; taking over %s with the launcher's", paths.name, arena)
        kept = asked
    kept.arena = arena
    if (kept.capacity, kept.policy) != (asked.capacity, asked.policy):
        logger.warning(
            "store %r takes over with the settings it was started with (capacity %d, %s eviction), "
            "not the launcher's (capacity %d, %s); stop it to change them",
            paths.name, kept.capacity, kept.policy, asked.capacity, asked.policy,
        )
    remove_files(paths, objects=False)
    return _Start(kept, takeover=True, arena_fd=fd)


def _check_backing(paths: StorePaths, start: _Start, force: bool) -> str | None:
    """Before any memory is taken: a capacity beyond what the store
    directory's filesystem, or the host's memory for a tmpfs, can ever back
    is refused (the reason) for an operator's start without ``force``; a
    store a client starts, or one taken over, starts and logs it, with the
    figures (it lowers its capacity when the memory runs out, as any
    store does), as it does a capacity beyond what is free now."""
    settings = start.settings
    backing = Backing.of(paths.root)
    held = held_bytes(paths) if start.takeover else 0
    refusal, warning = backing.check(settings.capacity, held)
    if refusal and not force and not start.takeover and settings.started_by == "operator":
        return refusal
    if refusal:
        logger.warning("store %r: %s; starting anyway (%s): puts will fail with OutOfMemory, and the store "
                       "lower its capacity, when the memory runs out", paths.name, refusal,
                       "forced" if force else "taken over" if start.takeover else "started by a client")
    elif warning:
        logger.warning("store %r: %s", paths.name, warning)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm.embedded._daemon", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--policy", choices=EVICTION_POLICIES, default="fifo")
    parser.add_argument("--idle-exit", type=float, default=0.0, help="exit after S seconds with no client (0: never)")
    parser.add_argument("--started-by", choices=("client", "operator"), default="client")
    parser.add_argument("--limits", default="", help="StoreLimits fields as JSON")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--detach", action="store_true", help="fork and return at once (the launcher exits)")
    parser.add_argument("--force", action="store_true",
                        help="start even with a capacity beyond what this host can back (a warning instead)")
    args = parser.parse_args(argv)
    ensure_dir(args.dir)
    paths = StorePaths(args.dir, args.name)
    # The lock is taken before the fork, and the child inherits it (a flock
    # belongs to the open file, which the child shares): a client that sees
    # its launcher gone and the lock free knows no store is on its way. Taken
    # after, a loaded machine left a gap in which the client started another.
    lock = _lock_name(paths)
    if lock is None:
        return 0  # another store process of this name won the race: it serves
    if args.detach and os.fork():
        os._exit(0)  # the client that launched us reaps this launcher; the store lives on
    try:
        _setup_logging(paths, args.log_level)
    except (OSError, StoreAccessError) as exc:
        print(f"sglang-simm store {args.name!r}: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        start = _settings_for(args, paths)
        if start.in_use:
            logger.warning("store %r: another live store process holds its arena %s (its lock file %s was "
                           "removed?): it serves; this process stops", args.name, start.in_use, paths.lock)
            return 0
        refusal = _check_backing(paths, start, args.force)
        if refusal:
            logger.error("cannot start store %r: %s", args.name, refusal)
            print(f"sglang-simm store {args.name!r}: cannot start: {refusal}", file=sys.stderr)
            return 1
        daemon = StoreDaemon(paths, start.settings, takeover=start.takeover, arena_fd=start.arena_fd)
        settings, takeover = start.settings, start.takeover
    except Exception as exc:
        logger.exception("cannot start store %r", args.name)
        print(f"sglang-simm store {args.name!r}: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        os.unlink(paths.pid)  # whatever is there, a symlink included: never written through
    except FileNotFoundError:
        pass
    with os.fdopen(open_private(paths.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
        f.write(f"{os.getpid()}\n")

    def stop(signum: int, _frame: Any) -> None:
        daemon.stop_reason = signal.Signals(signum).name
        daemon.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the terminal that started a client
    if takeover:
        logger.info("store %r took over %d objects (%d dropped as unsound) of the store process that died, "
                    "in %.3f s; %d of its grants still held by live clients (epoch %d now)", args.name,
                    daemon.recovered, daemon.dropped, daemon.takeover_s, daemon.held_at_takeover, daemon.epoch)
    logger.info(
        "store %r serving on %s: capacity %d bytes, arena %s (%d bytes), eviction %s, max %d connections, "
        "idle exit %s",
        args.name, paths.socket, daemon.index.capacity, daemon.arena.path, daemon.arena.size, daemon.index.policy,
        daemon.max_connections, f"{settings.limits.idle_exit_s:g} s" if settings.limits.idle_exit_s else "never",
    )
    try:
        store_metrics_from_env(args.dir, args.name)  # opt-in HTTP /metrics (embedded/_http.py)
        daemon.serve_forever()
    finally:
        daemon.close()
        logger.info("store %r stopped (%s): shared memory freed", args.name, daemon.stop_reason or "exit")
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
