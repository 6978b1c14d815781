"""The store process: one per store name per user, serving every client
process on the host over a Unix socket.

It owns the index and its own segment and never touches an object's bytes:
clients copy them, inside grants. Single-threaded (a ``selectors`` loop), so
the index needs no lock and a batch is one step. Its memory rule, and when
it keeps or gives up its objects: docs/local-store-design.md. Every input is
checked (``_limits``): a limit passed is a SiMM code, a rate-limited log line
and a ``refused_<reason>`` counter, never a crash.

    python -m sglang_simm.local_store._server --dir DIR --name NAME --capacity BYTES [--policy fifo|lru]
        [--idle-exit S] [--started-by client|operator] [--limits JSON] [--detach] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
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
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.local_store._index import GrantError, StoreIndex, check_capacity
from sglang_simm.local_store._limits import EVICTION_POLICIES, REFUSALS, RateLimitedLog, StoreLimits, check_policy
from sglang_simm.local_store._paths import (
    StoreAccessError,
    StorePaths,
    ensure_dir,
    open_private,
    proc_alive,
    proc_start,
    unlink_quietly,
)
from sglang_simm.local_store._protocol import (
    HEADER,
    ONE_WAY,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    Reader,
    frame,
    pack_ints,
    pack_json,
    pack_keys,
)
from sglang_simm.local_store._segments import Backing, OwnSegment, Segment, capacity_problem, medium_of, segment_bytes
from sglang_simm.local_store._table import IndexTable
from sglang_simm.simm_rules import INTERNAL_ERROR, INVALID_ARGUMENT, TARGET_UNAVAILABLE

logger = logging.getLogger("sglang_simm.local_store.server")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_FD_RESERVE = 32  # descriptors kept for the store's own files and its log
_ACCEPT_BACKOFF_S = 0.1
HELLO_DEADLINE_S = 5.0  # a connection silent this long after accept is dropped
TICK_S = 0.25
#: Earlier segments kept at most; older ones' objects are dropped at start.
MAX_EARLIER = 16
#: On a disk, the store keeps this share of the filesystem free.
DISK_WATERMARK = 0.05


@dataclass
class StoreSettings:
    """What a store was started with (``NAME.json``): a store started by a
    client after a stop or a crash keeps them; an operator's start sets them."""

    capacity: int
    policy: str = "fifo"
    limits: StoreLimits = field(default_factory=StoreLimits)
    started_by: str = "client"

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        unlink_quietly(tmp)  # whatever is there, a symlink included: never written through
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
            json.dump({"capacity": self.capacity, "policy": self.policy, "limits": self.limits.as_dict(),
                       "started_by": self.started_by}, f)
        os.replace(tmp, path)  # atomic: a crash leaves the old or the new

    @classmethod
    def load(cls, path: str) -> StoreSettings | None:
        """The settings in ``path``; None when there are none, or they do not
        hold (logged: the launcher's apply then)."""
        try:
            with os.fdopen(open_private(path, os.O_RDONLY)) as f:
                data = json.loads(f.read(1 << 20))
            kept = cls(check_capacity(data["capacity"]), check_policy(data["policy"]),
                       StoreLimits.from_dict(data["limits"]), data["started_by"])
            if kept.started_by not in ("client", "operator"):
                raise ValueError(f"started_by {kept.started_by!r}")
            return kept
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, UnicodeError, RecursionError) as exc:
            logger.warning("store settings %s are unusable (%s): the launcher's apply instead", path, exc)
            return None


class _Conn:
    __slots__ = ("accepted", "counted", "data", "id", "inbuf", "outbuf", "paused", "pid", "sock", "start",
                 "started", "writing")

    def __init__(self, sock: socket.socket, conn_id: int, pid: int, start: int) -> None:
        self.sock, self.id, self.pid, self.start = sock, conn_id, pid, start
        self.accepted = time.monotonic()
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.started = False  # HELLO done
        self.data = False  # a data connection: its process has a client-table row
        self.writing = self.paused = False
        self.counted = 0  # bytes of inbuf counted in the store's ``buffered``

    @property
    def proc(self) -> tuple[int, int]:
        return self.pid, self.start


@dataclass
class _Proc:
    """A client process with data connections: its row of the client table."""

    row: int
    conns: set = field(default_factory=set)


class _BadRequest(ValueError):
    """A body that parses into fields this request cannot take."""


class _Refused(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def _error(code: int, why: str) -> bytes:
    return frame(Op.ERROR, pack_json({"error": why, "code": code}))


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class StoreProcess:
    """A store serving ``paths`` with ``settings``; ``earlier``: the segments
    earlier store processes left (open), whose objects ``table`` may hold."""

    def __init__(self, paths: StorePaths, settings: StoreSettings, table: IndexTable, earlier: list[Segment]) -> None:
        self.paths, self.settings, self.limits = paths, settings, settings.limits
        self.medium = medium_of(paths.root)
        rows = self.limits.max_clients
        while True:  # a generation nobody ever had: 64 random bits
            self.gen = secrets.token_hex(8)
            if not os.path.exists(paths.segment(self.gen)):
                break
        self.own = OwnSegment.create(paths.segment(self.gen), self.gen, segment_bytes(settings.capacity, rows), rows)
        self.table = table
        found, self.dropped = table.recover({int(s.gen, 16): (s.data_start, s.size) for s in earlier})
        self.index = StoreIndex(capacity=settings.capacity, table=table, own=self.own, earlier=earlier,
                                policy=settings.policy, limits=self.limits)
        self.recovered = self.index.recover(found)
        if not self.recovered:  # for the clients that follow removals: the earlier objects are gone
            self.index.note([(True, b"")])
        self.index.release_earlier()
        self.started = time.time()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.procs: dict[tuple[int, int], _Proc] = {}
        self._next_conn = 1
        self.running, self.stop_reason, self.discard = True, "", False
        self.served, self.buffered = 0, 0
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.log = RateLimitedLog(logger)
        self.max_connections = max(1, min(self.limits.max_connections, _fd_limit() - _FD_RESERVE))
        self._scratch = bytearray(1 << 20)
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._accept_paused_until = 0.0
        self._listening = False
        self._next_tick = 0.0
        self.idle_since: float | None = time.monotonic()
        self._bind()

    def _bind(self) -> None:
        unlink_quietly(self.paths.socket)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is born 0600
        try:
            self.listener.bind(self.paths.socket)
        finally:
            os.umask(old_umask)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self._socket_id = _file_id(self.paths.socket)
        self._listening = False
        self._listen(True)

    # -- the loop ------------------------------------------------------------------

    def _listen(self, on: bool) -> None:
        if on != self._listening:
            (self.sel.register(self.listener, selectors.EVENT_READ, None) if on
             else self.sel.unregister(self.listener))
            self._listening = on

    def serve_forever(self) -> None:
        while self.running:
            wait = TICK_S if self._listening else min(TICK_S, max(self._accept_paused_until - time.monotonic(), 0))
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
        if now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        self._end_orphans()
        if self.index.earlier_held() and self.index.release_earlier():
            logger.info("the earlier store processes' clients are done: their segments' memory is given back")
        if self.medium == "disk":
            st = os.statvfs(self.paths.root)
            free, keep = st.f_bavail * st.f_frsize, int(st.f_blocks * st.f_frsize * DISK_WATERMARK)
            if free < keep:
                self.index.limit_to_free(0)
                self.log.warning("disk", "store %r: the disk has %d bytes free, under its %d-byte watermark: "
                                 "capacity lowered to %d bytes", self.paths.name, free, keep, self.index.capacity)
        for conn in [c for c in self.conns.values() if not c.started and now - c.accepted >= HELLO_DEADLINE_S]:
            self._refuse("hello", "client pid %d said no HELLO within %g s: dropped", conn.pid, HELLO_DEADLINE_S)
            self._drop(conn, "no hello")
        if _file_id(self.paths.socket) != self._socket_id:  # removed or replaced under us: be reachable again
            logger.warning("store %r: its socket %s was removed or replaced: listening again", self.paths.name,
                           self.paths.socket)
            self._listen(False)
            self.listener.close()
            try:
                self._bind()
            except OSError as exc:  # its directory went too: nobody can reach it any more
                logger.warning("store %r: cannot listen again (%s): stopping", self.paths.name, exc)
                self.stop_reason, self.running = "socket gone", False
                return
        idle = self.limits.idle_exit_s
        if idle and self.idle_since is not None and now - self.idle_since >= idle:
            logger.info("no client for %g s (idle exit): stopping", idle)
            self.stop_reason, self.running, self.discard = "idle", False, self.medium == "memory"

    def _end_orphans(self) -> None:
        """End the grants of closed connections whose process has no copy in
        flight any more, or is gone; forget processes that are gone."""
        gone = {key for key, proc in self.procs.items() if not proc.conns and not proc_alive(*key)}
        if self.index.orphaned():
            ended = self.index.end_orphans(lambda key: self.own.busy_of(self.procs[key].row),
                                           lambda key: key not in gone and proc_alive(*key))
            if ended:
                self.log.info("orphans", "%d grants of closed connections ended: their processes have no copy in "
                              "flight, or are gone", ended)
        for key in gone - set(self.index.orphaned()):
            self.own.set_row(self.procs.pop(key).row, 0, 0)

    def _refuse(self, reason: str, msg: str, *args: object) -> None:
        self.refused[reason] += 1
        self.log.warning(reason, msg, *args)

    # -- connections ---------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._refuse("fds", "accept failed (%s, %d connections open): refusing and pausing accepts for "
                             "%g s; raise the fd limit or lower max_connections", exc, len(self.conns),
                             _ACCEPT_BACKOFF_S)
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._spare_fd is not None:
                    os.close(self._spare_fd)  # the spare one accepts and refuses the waiting client
                    with contextlib.suppress(OSError):
                        self._send_refusal(self.listener.accept()[0], "the local store is out of file descriptors")
                    self._spare_fd = _spare()
                self._listen(False)
                self._accept_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S
                return
            self._admit(sock)

    @staticmethod
    def _send_refusal(sock: socket.socket, why: str) -> None:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(_error(TARGET_UNAVAILABLE, why))
        sock.close()

    def _admit(self, sock: socket.socket) -> None:
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            start = proc_start(pid)  # opens /proc/PID/stat: the descriptor accept() left may have been the last
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._refuse("fds", "no descriptor left to admit a client (%d connections open): refused; raise "
                             "the fd limit or lower max_connections", len(self.conns))
                self._send_refusal(sock, "the local store is out of file descriptors")
            else:
                sock.close()
            return
        if uid != os.geteuid():
            logger.warning("refused a connection from uid %d (pid %d): this store is uid %d's", uid, pid, os.geteuid())
            sock.close()
            return
        if len(self.conns) >= self.max_connections:
            self._refuse("connections", "refused client pid %d: %d connections open (max_connections)",
                         pid, len(self.conns))
            self._send_refusal(sock, f"the local store has {len(self.conns)} connections open, its limit "
                                     f"(max_connections {self.max_connections})")
            return
        if start is None:  # gone already
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, self._next_conn, pid, start)
        self._next_conn += 1
        self.conns[conn.id] = conn
        self.served += 1
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn, why: str) -> None:
        """Close ``conn``; its grants stay until its process has no copy in
        flight or is gone (a thread of it may still be copying under them)."""
        if self.conns.pop(conn.id, None) is None:
            return
        self.buffered -= conn.counted
        proc = self.procs.get(conn.proc) if conn.data else None
        if proc is not None:
            proc.conns.discard(conn.id)
            held = self.index.close_owner(conn.id, conn.proc)
            if held:
                logger.info("client pid %d: connection %d closed (%s) with %d grants open: they end once the "
                            "process has no copy in flight", conn.pid, conn.id, why, held)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
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
        conn.inbuf += memoryview(self._scratch)[:got]
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Serve the whole frames buffered for ``conn`` while its replies do not back up."""
        buf, pos, limits = conn.inbuf, 0, self.limits
        try:
            while len(buf) - pos >= HEADER.size:
                if len(conn.outbuf) > limits.reply_backlog_bytes:
                    if not conn.paused:
                        conn.paused = True
                        self._watch(conn)
                    break
                length, op = HEADER.unpack_from(buf, pos)
                if length > limits.max_frame_bytes:
                    self._refuse("frame", "client pid %d sent a frame of %d bytes (max_frame_bytes %d): dropped",
                                 conn.pid, length, limits.max_frame_bytes)
                    self._drop(conn, "frame too large")
                    return
                end = pos + HEADER.size + length
                if len(buf) < end:
                    break
                reply = self._handle(conn, op, bytes(buf[pos + HEADER.size:end]))
                pos = end
                if conn.id not in self.conns:
                    return
                if reply is not None:
                    conn.outbuf += reply
        except ProtocolError as exc:
            self._refuse("bad_frame", "client pid %d sent a bad frame (%s): dropped", conn.pid, exc)
            self._drop(conn, "bad frame")
            return
        del buf[:pos]
        self.buffered += len(buf) - conn.counted
        conn.counted = len(buf)
        if self.buffered > limits.input_budget_bytes:
            self._refuse("input_budget", "client pid %d: %d unfinished request bytes over all connections "
                         "(input_budget_bytes %d): dropped", conn.pid, self.buffered, limits.input_budget_bytes)
            self._drop(conn, "input budget")
            return
        if conn.outbuf:
            self._flush(conn)

    def _watch(self, conn: _Conn) -> None:
        events = (0 if conn.paused else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.writing else 0)
        self.sel.modify(conn.sock, events or selectors.EVENT_WRITE, conn)

    def _flush(self, conn: _Conn, fds: list[int] | None = None) -> None:
        try:
            if fds:  # the segments go with the first byte of the HELLO reply
                sent = conn.sock.sendmsg([conn.outbuf], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))])
            else:
                sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        del conn.outbuf[:sent]
        writing = bool(conn.outbuf)
        resume = conn.paused and len(conn.outbuf) <= self.limits.reply_backlog_bytes
        if writing != conn.writing or resume:
            conn.writing = writing
            conn.paused = conn.paused and not resume
            self._watch(conn)
            if resume:
                self._process(conn)

    # -- requests ------------------------------------------------------------------

    def _handle(self, conn: _Conn, op: int, body: bytes) -> bytes | None:
        try:
            op = Op(op)
        except ValueError:
            raise ProtocolError(f"unknown op {op}") from None
        if not conn.started and op != Op.HELLO:
            raise ProtocolError("the first request must be HELLO")
        try:
            return self._dispatch(conn, op, Reader(body))
        except ProtocolError:
            raise
        except _Refused as exc:
            return None if op in ONE_WAY else _error(exc.code, str(exc))
        except GrantError as exc:
            self._refuse("grant_owner", "client pid %d: %s %s: %s", conn.pid, op.name, exc,
                         "ignored" if op in ONE_WAY else "refused")
            return None if op in ONE_WAY else _error(INVALID_ARGUMENT, f"{op.name}: {exc}")
        except (_BadRequest, ValueError, TypeError, RecursionError, UnicodeError) as exc:
            self._refuse("request", "client pid %d: a malformed %s request (%s): refused", conn.pid, op.name,
                         _short(exc))
            return None if op in ONE_WAY else _error(INVALID_ARGUMENT, f"{op.name}: a malformed request "
                                                                       f"({_short(exc)})")
        except Exception:  # a bug here must not take the store down
            logger.exception("op %s from pid %d failed", op.name, conn.pid)
            return None if op in ONE_WAY else _error(INTERNAL_ERROR, f"{op.name} failed in the store process; "
                                                                     "its log says why")

    def _keys(self, r: Reader) -> list[bytes]:
        keys = r.keys()
        if len(keys) > self.limits.max_batch:
            self._refuse("batch", "a batch of %d entries (max_batch %d): refused", len(keys), self.limits.max_batch)
            raise _Refused(INVALID_ARGUMENT, f"a batch of {len(keys)} entries is above this store's max_batch "
                                             f"{self.limits.max_batch}; split it")
        return keys

    def _data(self, conn: _Conn) -> tuple[int, int]:
        if not conn.data:
            raise _Refused(INVALID_ARGUMENT, "this connection said it moves no data (HELLO data: false)")
        return conn.proc

    def _dispatch(self, conn: _Conn, op: Op, r: Reader) -> bytes | None:
        index = self.index
        if op == Op.LOOKUP:
            keys = self._keys(r)
            r.done()
            return frame(op, pack_ints(index.lookup(keys)))
        if op == Op.PUT:
            overwrite, keys, sizes = bool(r.u8()), self._keys(r), r.ints()
            r.done()
            if len(keys) != len(sizes):
                raise ProtocolError("PUT with keys and sizes of different lengths")
            grant, codes, offsets = index.begin_put(conn.id, self._data(conn), keys, sizes, overwrite)
            self._count_refusals()
            return frame(op, pack_ints([grant, index.committed, self.own.epoch]), pack_ints(codes),
                         pack_ints(offsets))
        if op == Op.COMMIT:
            grant, crcs = r.i64(), r.ints()
            r.done()
            return frame(op, pack_ints(index.commit_put(conn.id, grant, crcs)))
        if op == Op.ABORT:
            grant = r.i64()
            r.done()
            index.release(conn.id, grant)
            return None
        if op == Op.GET:
            keys, caps = self._keys(r), r.ints()
            r.done()
            if len(keys) != len(caps):
                raise ProtocolError("GET with keys and capacities of different lengths")
            grant, results, segs, offsets, verify = index.begin_get(conn.id, self._data(conn), keys, caps)
            return frame(op, pack_ints([grant]), pack_ints(results), pack_ints(segs), pack_ints(offsets),
                         pack_ints(verify))
        if op == Op.RELEASE:
            grant, failed = r.i64(), r.ints()
            r.done()
            if failed:
                self.log.warning("checksum", "client pid %d: %d recovered objects failed their checksum: dropped, "
                                 "read as misses", conn.pid, len(failed))
            index.release(conn.id, grant, failed)
            return None
        if op == Op.DELETE:
            keys = self._keys(r)
            r.done()
            return frame(op, pack_ints([index.delete(k) for k in keys]))
        if op == Op.DELETE_PREFIX:
            prefixes = r.keys()
            r.done()
            if len(prefixes) != 1:
                raise _BadRequest(f"DELETE_PREFIX names one prefix, not {len(prefixes)}")
            return frame(op, pack_ints([index.delete_prefix(prefixes[0])]))
        if op == Op.REMOVED:
            cursor = r.i64()
            r.done()
            end, lost, keys, prefixes = index.removed_since(cursor, self.limits.max_batch)
            return frame(op, pack_ints([end, int(lost)]), pack_keys(len(keys), b"\0".join(keys)),
                         pack_keys(len(prefixes), b"\0".join(prefixes)))
        if op == Op.HELLO:
            if conn.started:
                raise ProtocolError("a second HELLO")
            return self._hello(conn, r.json())
        if op == Op.ADMIN:
            cmd = r.json()
            if not isinstance(cmd, dict):
                raise _BadRequest("an ADMIN body that is not a JSON object")
            return frame(op, pack_json(self._admin(cmd, conn)))
        raise ProtocolError(f"op {op.name} is not a request")

    def _hello(self, conn: _Conn, hello: Any) -> bytes | None:
        if not isinstance(hello, dict) or hello.get("version") != PROTOCOL_VERSION:
            version = hello.get("version") if isinstance(hello, dict) else None
            return _error(INTERNAL_ERROR, f"protocol version {version} is not this store's {PROTOCOL_VERSION} "
                                          f"(another sglang-simm release made it): stop it with 'sglang-simm "
                                          f"store stop {self.paths.name}'")
        info = {**self.describe(), "conn": conn.id}
        fds: list[int] = []
        if hello.get("data", True):
            proc = self.procs.get(conn.proc)
            if proc is None:
                taken = {p.row for p in self.procs.values()}
                row = next((i for i in range(len(self.own.rows)) if i not in taken), None)
                if row is None:
                    self._refuse("clients", "refused client pid %d: %d client processes (max_clients)", conn.pid,
                                 len(self.procs))
                    return _error(TARGET_UNAVAILABLE, f"the local store serves {len(self.procs)} client processes, "
                                                      f"its limit (max_clients)")
                self.own.set_row(row, conn.pid, conn.start)  # before the client holds the segment
                proc = self.procs[conn.proc] = _Proc(row)
            proc.conns.add(conn.id)
            conn.data = True
            live = [s for s in self.index.segs if not s.gone]
            info.update(row=proc.row, segments=[{"gen": s.seg.gen, "size": s.seg.size, "data_start":
                                                 s.seg.data_start} for s in live])
            fds = [s.seg.fd for s in live]
        conn.started = True
        self.idle_since = None
        conn.outbuf += frame(Op.HELLO, pack_json(info))
        self._flush(conn, fds)
        return None

    def _count_refusals(self) -> None:
        stats = self.index.stats
        for reason in ("key", "size", "grants"):
            have = stats[f"refused_{reason}"]
            if have != self.refused[reason]:
                self.log.warning(reason, "refused %d entries (%s past this store's limits)",
                                 have - self.refused[reason], reason)
                self.refused[reason] = have

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.paths.name, "pid": os.getpid(), "gen": self.gen, "medium": self.medium,
            "dir": self.paths.root, "capacity_bytes": self.index.capacity, "policy": self.index.policy,
            "max_batch": self.limits.max_batch, "client_share_bytes": self.index.share,
            "committed_bytes": self.index.committed, "epoch": self.own.epoch,
            "idle_exit_s": self.limits.idle_exit_s, "started_by": self.settings.started_by,
            "version": PROTOCOL_VERSION,
        }

    def status(self, asking: _Conn | None = None) -> dict[str, Any]:
        out = {**self.describe(), **self.index.snapshot()}
        backing = Backing.of(self.paths.root)
        out.update(
            clients=sorted({c.pid for c in self.conns.values() if c.started and c is not asking}),
            connections=len(self.conns), max_connections=self.max_connections, connections_served=self.served,
            buffered_request_bytes=self.buffered, uptime_s=round(time.time() - self.started, 3),
            memory_error=self.own.commit_error, recovered=self.recovered, recovery_dropped=self.dropped,
            orphaned_grants=sum(self.index.orphaned().values()),
            orphan_pids=sorted(k[0] for k in self.index.orphaned()),
            fs_total_bytes=backing.fs_total, fs_free_bytes=backing.fs_free, limits=self.limits.as_dict(),
        )
        for reason in REFUSALS:
            out[f"refused_{reason}"] = max(self.refused[reason], out.get(f"refused_{reason}", 0))
        return out

    def _admin(self, cmd: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        what, index = cmd.get("cmd"), self.index
        if what == "status":
            return self.status(conn)
        if what == "clear":
            removed = index.clear()
            index.give_back()
            return {"removed": removed, "committed_bytes": index.committed}
        if what == "keys":
            return {"keys": [k.decode("utf-8", "surrogatepass") for k in index.keys()]}
        if what in ("set_capacity", "set_policy"):
            try:
                index.set_capacity(cmd.get("bytes")) if what == "set_capacity" else index.set_policy(cmd.get("policy"))
            except (TypeError, ValueError) as exc:
                return {"error": str(exc), "type": type(exc).__name__}
            self.settings.capacity, self.settings.policy = index.capacity, index.policy
            self.settings.save(self.paths.settings)
            return {"capacity_bytes": index.capacity, "policy": index.policy}
        if what == "stop":
            self.stop_reason, self.running, self.discard = "stopped", False, bool(cmd.get("discard"))
            return {"stopping": os.getpid(), "discard": self.discard}
        return {"error": f"unknown admin command {what!r}", "type": "ValueError"}

    def close(self) -> None:
        """Stop serving. The objects stay for the next store process of the
        name, unless ``discard``: then every file that holds them goes."""
        for conn in list(self.conns.values()):
            self._drop(conn, "store stopping")
        self.sel.close()
        self.listener.close()
        for path in (self.paths.socket, self.paths.pid):
            unlink_quietly(path)
        for seg in self.index.segs:
            if not seg.gone and seg.seg is not None:
                seg.seg.close(unlink=self.discard)
        self.table.close(unlink=self.discard)
        if self.discard:
            unlink_quietly(self.paths.settings)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


# -- starting -----------------------------------------------------------------------------


def lock_name(paths: StorePaths, wait_s: float = 2.0) -> int | None:
    """Hold ``NAME.lock`` for this process's life (one store per name); None
    when another store process holds it. A client probing the lock holds it
    for a moment: keep trying for ``wait_s``."""
    fd = open_private(paths.lock, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return None
                raise
        time.sleep(0.02)


def remove_files(paths: StorePaths) -> None:
    """Every file that holds a stopped store's objects (its lock held by the caller)."""
    for path in (paths.socket, paths.pid, *paths.data_files(), paths.settings):
        unlink_quietly(path)


def open_store(paths: StorePaths, asked: StoreSettings, *, force: bool = False) -> StoreProcess:
    """The store process's state, from what the directory holds: the
    settings (a client's start keeps the store's own), the index and the
    earlier segments. Raises ``StoreRefused`` for a capacity this host can
    never hold. The caller holds the name's lock."""
    kept = StoreSettings.load(paths.settings)
    settings = asked if kept is None or asked.started_by == "operator" else kept
    other = kept if settings is asked else asked
    if other is not None and (other.capacity, other.policy) != (settings.capacity, settings.policy):
        logger.warning("store %r starts with %s capacity %d and %s eviction, not %s %d and %s", paths.name,
                       "the operator's" if settings is asked else "the", settings.capacity, settings.policy,
                       "its earlier" if settings is asked else "the launcher's", other.capacity, other.policy)
    refusal, warning = capacity_problem(paths.root, settings.capacity, rows=settings.limits.max_clients,
                                        force=force or settings.started_by != "operator")
    if refusal:
        raise StoreRefused(refusal)
    if warning:
        logger.warning("store %r: %s", paths.name, warning)
    if os.path.islink(paths.index):  # planted: it proves nothing, and is never written through
        logger.warning("store %r: its index %s is a symlink: removed, starting empty", paths.name, paths.index)
        os.unlink(paths.index)
    try:
        table = IndexTable(paths.index, settings.limits.objects_for(settings.capacity), adopt=True)
    except BlockingIOError:
        raise StoreRefused(f"another live store process holds {paths.index} (its lock file {paths.lock} was "
                           "removed?): it serves") from None
    earlier = []
    for gen, path in sorted(paths.segments().items(), key=lambda kv: os.stat(kv[1]).st_mtime):
        try:
            earlier.append(Segment.open(path, gen))
        except (OSError, ValueError) as exc:
            logger.warning("store %r: %s is no segment it can read (%s): removed", paths.name, path, exc)
            unlink_quietly(path)
    for seg in earlier[:-MAX_EARLIER]:  # the oldest past the bound: their objects go
        seg.close(unlink=True)
    earlier = earlier[-MAX_EARLIER:]
    if earlier and not table.adopted:
        logger.warning("store %r: its index %s proves nothing: starting empty", paths.name, paths.index)
    store = StoreProcess(paths, settings, table, earlier)
    settings.save(paths.settings)
    return store


class StoreRefused(Exception):
    """A store that must not start, and why."""


def serve_in_thread(root: str, name: str, capacity: int, policy: str = "fifo") -> StoreProcess:
    """The store on a daemon thread of this process (``inprocess``): the same
    store, in a directory the caller made private; it ends with the process."""
    paths = StorePaths(root, name)
    lock = lock_name(paths)
    if lock is None:
        raise StoreRefused(f"a store {name!r} already runs in {root}")
    try:
        store = open_store(paths, StoreSettings(capacity, policy))
    except BaseException:
        os.close(lock)
        raise

    def serve() -> None:
        try:
            store.serve_forever()
        finally:
            store.close()
            os.close(lock)

    threading.Thread(target=serve, name=f"sglang-simm-store-{name}", daemon=True).start()
    return store


class _LogFile(logging.handlers.RotatingFileHandler):
    """The store's log, never opened through a symlink."""

    def _open(self):  # type: ignore[override]
        return os.fdopen(open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a",
                         encoding=self.encoding, errors=self.errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm.local_store._server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--policy", choices=EVICTION_POLICIES, default="fifo")
    parser.add_argument("--idle-exit", type=float, default=0.0)
    parser.add_argument("--started-by", choices=("client", "operator"), default="client")
    parser.add_argument("--limits", default="", help="StoreLimits fields as JSON")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--detach", action="store_true", help="fork and return at once")
    parser.add_argument("--force", action="store_true", help="start beyond what is free now")
    args = parser.parse_args(argv)
    ensure_dir(args.dir)
    paths = StorePaths(args.dir, args.name)
    # Locked before the fork, held by the child: a client that sees its
    # launcher gone and the lock free knows no store is on its way.
    lock = lock_name(paths)
    if lock is None:
        return 0  # another store process of this name won the race: it serves
    if args.detach and os.fork():
        os._exit(0)
    try:
        handler = _LogFile(paths.log, maxBytes=1 << 20, backupCount=1)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pid %(process)d: %(message)s"))
        root = logging.getLogger("sglang_simm")
        root.handlers[:], root.propagate = [handler], False
        root.setLevel(args.log_level)
    except (OSError, StoreAccessError) as exc:
        print(f"sglang-simm store {args.name!r}: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        limits = StoreLimits.from_dict({**json.loads(args.limits or "{}"), "idle_exit_s": args.idle_exit})
        store = open_store(paths, StoreSettings(args.capacity, args.policy, limits, args.started_by),
                           force=args.force)
    except Exception as exc:
        logger.error("cannot start store %r: %s", args.name, exc, exc_info=not isinstance(exc, StoreRefused))
        print(f"sglang-simm store {args.name!r}: cannot start: {exc}", file=sys.stderr)
        return 1
    unlink_quietly(paths.pid)
    with os.fdopen(open_private(paths.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
        f.write(f"{os.getpid()}\n")

    def stop(signum: int, _frame: Any) -> None:
        store.stop_reason, store.running = signal.Signals(signum).name, False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the terminal that started a client
    if store.recovered or store.dropped:
        logger.info("store %r serves %d objects of earlier store processes (%d dropped as unsound)%s", args.name,
                    store.recovered, store.dropped, "; their segments are held until their clients are done"
                    if store.index.earlier_held() else "")
    logger.info("store %r serving on %s: %s, capacity %d bytes, segment %s, eviction %s, idle exit %s",
                args.name, paths.socket, store.medium, store.index.capacity, store.own.path, store.index.policy,
                f"{limits.idle_exit_s:g} s" if limits.idle_exit_s else "never")
    try:
        from sglang_simm.local_store._metrics import serve_from_env

        serve_from_env(args.dir, args.name)
        store.serve_forever()
    finally:
        store.close()
        logger.info("store %r stopped (%s): %s", args.name, store.stop_reason or "exit",
                    "its objects discarded" if store.discard else "its objects kept for the next start")
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
