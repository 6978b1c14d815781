"""The host store's process: one per store name per user, serving every
client process on the host over a Unix socket.

It owns the index (``_index``) and the arena file (``_arena``), and never
touches object bytes: clients copy them. Single-threaded (a ``selectors``
loop), so the index needs no lock and a batch is one step. A client's
connection is its lease holder: when it closes, for whatever reason, the
client's unfinished puts are dropped and its pins released.

Started by the first client that finds no store (``_host.spawn``), it
outlives its clients, so a restarted SGLang server finds its pages; it ends
on ``sglang-simm store stop`` (an ADMIN ``stop``), SIGTERM or SIGINT.
Imports nothing heavy (no torch): it starts in well under a second.

    python -m sglang_simm.embedded._daemon --dir DIR --name NAME --capacity BYTES [--policy fifo|lru] [--detach]
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import itertools
import logging
import logging.handlers
import os
import secrets
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

from sglang_simm.embedded import _protocol as wire
from sglang_simm.embedded._arena import ArenaFile, arena_bytes_for
from sglang_simm.embedded._index import EVICTION_POLICIES, StoreIndex
from sglang_simm.embedded._paths import StorePaths, ensure_dir
from sglang_simm.embedded._protocol import Op, ProtocolError, Reader, frame, pack_ints, pack_json
from sglang_simm.errors import INTERNAL_ERROR

logger = logging.getLogger("sglang_simm.embedded.daemon")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _Conn:
    __slots__ = ("id", "inbuf", "outbuf", "pid", "sock", "started", "writing")

    def __init__(self, sock: socket.socket, conn_id: int, pid: int) -> None:
        self.sock = sock
        self.id = conn_id
        self.pid = pid
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.started = False  # HELLO done
        self.writing = False  # registered for EVENT_WRITE


class StoreDaemon:
    def __init__(self, paths: StorePaths, capacity: int, policy: str) -> None:
        self.paths = paths
        self.generation = secrets.token_hex(6)
        self.arena = ArenaFile(paths.arena(self.generation), arena_bytes_for(capacity))
        self.index = StoreIndex(
            capacity=capacity, arena_bytes=self.arena.size, policy=policy, commit=self.arena.commit
        )
        self.started = time.time()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self.running = True
        self.served = 0  # connections accepted since start
        self._scratch = bytearray(1 << 20)  # one receive buffer for every connection
        self._scratch_view = memoryview(self._scratch)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is born 0600
        try:
            self.listener.bind(paths.socket)
        finally:
            os.umask(old_umask)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)

    # -- the loop -----------------------------------------------------------

    def serve_forever(self) -> None:
        while self.running:
            for key, events in self.sel.select(timeout=0.5):
                if key.data is None:
                    self._accept()
                    continue
                conn: _Conn = key.data
                if events & selectors.EVENT_READ:
                    self._read(conn)
                if events & selectors.EVENT_WRITE and conn.id in self.conns:
                    self._flush(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if uid != os.geteuid():
                logger.warning("refused a connection from uid %d (pid %d): this store is uid %d's", uid, pid, os.geteuid())
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, next(self._ids), pid)
            self.conns[conn.id] = conn
            self.served += 1
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn, why: str) -> None:
        if self.conns.pop(conn.id, None) is None:
            return
        leases = self.index.drop_owner(conn.id)
        if leases:
            logger.info("client pid %d gone (%s) with %d open leases: released", conn.pid, why, leases)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        scratch = self._scratch
        try:
            got = conn.sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        if not got:
            self._drop(conn, "closed")
            return
        buf = conn.inbuf
        buf += self._scratch_view[:got]
        pos = 0
        try:
            while len(buf) - pos >= wire.HEADER.size:
                length, op = wire.HEADER.unpack_from(buf, pos)
                if length > wire.MAX_FRAME:
                    raise ProtocolError(f"a frame of {length} bytes")
                end = pos + wire.HEADER.size + length
                if len(buf) < end:
                    break
                reply = self._handle(conn, op, bytes(buf[pos + wire.HEADER.size : end]))
                pos = end
                if reply is not None:
                    conn.outbuf += reply
                if conn.id not in self.conns:
                    return
        except ProtocolError as exc:
            logger.warning("client pid %d sent a bad frame (%s): dropped", conn.pid, exc)
            self._drop(conn, "bad frame")
            return
        del buf[:pos]
        if conn.outbuf:
            self._flush(conn)

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
        if bool(conn.outbuf) != conn.writing:
            conn.writing = bool(conn.outbuf)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self.sel.modify(conn.sock, events, conn)

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
        except Exception as exc:  # a bug here must not take the store down
            logger.exception("op %s from pid %d failed", op.name, conn.pid)
            if op in wire.ONE_WAY:
                return None
            return frame(Op.ERROR, pack_json({"error": f"{type(exc).__name__}: {exc}", "code": INTERNAL_ERROR}))

    def _dispatch(self, conn: _Conn, op: Op, r: Reader) -> bytes | None:
        index = self.index
        if op == Op.LOOKUP:
            keys = r.keys()
            r.done()
            return frame(op, pack_ints(index.lookup(keys)))
        if op == Op.PUT:
            overwrite = bool(r.u8())
            keys = r.keys()
            sizes = r.ints()
            r.done()
            if len(keys) != len(sizes):
                raise ProtocolError("PUT with keys and sizes of different lengths")
            lease, codes, offsets = index.begin_put(conn.id, keys, sizes, overwrite)
            return frame(op, pack_ints([lease, self.arena.committed]), pack_ints(codes), pack_ints(offsets))
        if op == Op.COMMIT:
            lease = r.i64()
            r.done()
            done = index.commit_put(lease)
            return frame(op, pack_ints([code for _, code in done]))
        if op in (Op.ABORT, Op.RELEASE):
            lease = r.i64()
            r.done()
            index.release(lease)
            return None
        if op == Op.GET:
            keys = r.keys()
            caps = r.ints()
            r.done()
            if len(keys) != len(caps):
                raise ProtocolError("GET with keys and capacities of different lengths")
            lease, results, offsets = index.begin_get(conn.id, keys, caps)
            return frame(op, pack_ints([lease]), pack_ints(results), pack_ints(offsets))
        if op == Op.DELETE:
            keys = r.keys()
            r.done()
            return frame(op, pack_ints([index.delete(k) for k in keys]))
        if op == Op.DELETE_PREFIX:
            (prefix,) = r.keys()
            r.done()
            return frame(op, pack_ints([index.delete_prefix(prefix)]))
        if op == Op.HELLO:
            hello = r.json()
            if hello.get("version") != wire.PROTOCOL_VERSION:
                return frame(Op.ERROR, pack_json({
                    "error": f"protocol version {hello.get('version')} is not this store's "
                    f"{wire.PROTOCOL_VERSION} (another sglang-simm release made it): "
                    f"stop it with 'sglang-simm store stop {self.paths.name}'",
                }))
            conn.started = True
            return frame(op, pack_json(self.describe()))
        if op == Op.ADMIN:
            return frame(op, pack_json(self._admin(r.json(), conn)))
        raise ProtocolError(f"op {op.name} is not a request")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.paths.name,
            "pid": os.getpid(),
            "generation": self.generation,
            "arena": self.arena.path,
            "arena_bytes": self.arena.size,
            "committed_bytes": self.arena.committed,
            "capacity_bytes": self.index.capacity,
            "policy": self.index.policy,
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
        out["connections_served"] = self.served
        out["uptime_s"] = round(time.time() - self.started, 3)
        out["memory_error"] = self.arena.commit_error or ""
        return out

    def _admin(self, cmd: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        what = cmd.get("cmd")
        index = self.index
        if what == "status":
            return self.status(conn)
        if what == "clear":
            return {"removed": index.clear()}
        if what == "keys":
            return {"keys": [k.decode("utf-8", "surrogatepass") for k in index.objects]}
        if what == "set_capacity":
            try:
                index.set_capacity(cmd.get("bytes"))
            except (TypeError, ValueError) as exc:
                return {"error": str(exc), "type": type(exc).__name__}
            return {"capacity_bytes": index.capacity}
        if what == "set_policy":
            try:
                index.set_policy(cmd.get("policy"))
            except ValueError as exc:
                return {"error": str(exc), "type": "ValueError"}
            return {"policy": index.policy}
        if what == "stop":
            self.running = False
            return {"stopping": os.getpid()}
        return {"error": f"unknown admin command {what!r}", "type": "ValueError"}

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn, "store stopping")
        self.sel.close()
        self.listener.close()
        for path in (self.paths.socket, self.paths.pid):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.arena.close(unlink=True)


def _lock_name(paths: StorePaths) -> int | None:
    """Hold ``NAME.lock`` for this process's life: one store per name. None
    when another live store process holds it."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _remove_leftovers(paths: StorePaths) -> None:
    """A store process that died left its socket and arena behind; clients
    still mapping an old arena keep it alive until they unmap it."""
    for path in [paths.socket, *paths.arenas()]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _setup_logging(paths: StorePaths, level: str) -> None:
    handler = logging.handlers.RotatingFileHandler(paths.log, maxBytes=1 << 20, backupCount=1)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pid %(process)d: %(message)s"))
    root = logging.getLogger("sglang_simm")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    os.chmod(paths.log, 0o600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm.embedded._daemon", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--policy", choices=EVICTION_POLICIES, default="fifo")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--detach", action="store_true", help="fork and return at once (the launcher exits)")
    args = parser.parse_args(argv)
    if args.detach and os.fork():
        os._exit(0)  # the client that launched us reaps this launcher; the store lives on

    ensure_dir(args.dir)
    paths = StorePaths(args.dir, args.name)
    lock = _lock_name(paths)
    if lock is None:
        return 0  # another store process of this name won the race: it serves
    _setup_logging(paths, args.log_level)
    _remove_leftovers(paths)
    try:
        daemon = StoreDaemon(paths, args.capacity, args.policy)
    except Exception as exc:
        logger.exception("cannot start store %r", args.name)
        print(f"sglang-simm store {args.name!r}: cannot start: {exc}", file=sys.stderr)
        return 1
    with open(paths.pid, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.chmod(paths.pid, 0o600)

    def stop(signum: int, _frame: Any) -> None:
        daemon.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the terminal that started a client
    logger.info(
        "store %r serving on %s: capacity %d bytes, arena %s (%d bytes), eviction %s",
        args.name, paths.socket, daemon.index.capacity, daemon.arena.path, daemon.arena.size, daemon.index.policy,
    )
    try:
        daemon.serve_forever()
    finally:
        daemon.close()
        logger.info("store %r stopped", args.name)
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
