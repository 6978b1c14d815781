"""What a local store costs to start, empty, and to take over after kill -9, by capacity.

    PYTHONPATH=src python benchmarks/store_start.py [--capacities 4GiB,1TiB] [--objects 2000] [--timeout 60]

For each capacity: starts a store process (``python -m
sglang_simm.local_store._server``) in a private directory, times it until it
answers a HELLO, reads its private memory (``RssAnon``) and the memory its
index file holds (``st_blocks``); puts ``--objects`` objects of 4 KiB
through a raw connection, kills it with SIGKILL, starts the next store
process of the name (a takeover) and reads the same again. Prints a table.
A diagnostic, not part of the suite; ``--force`` is passed to the store
where the capacity is beyond what the directory's filesystem can back.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from sglang_simm.local_store import _protocol as wire
from sglang_simm.local_store._protocol import Op, Reader, encode_keys, frame, pack_i64, pack_ints, pack_json
from sglang_simm.values import parse_byte_size


def _call(sock: socket.socket, op: Op, *parts: bytes) -> tuple[int, bytes]:
    sock.sendall(frame(op, *parts))
    head = b""
    while len(head) < wire.HEADER.size:
        head += sock.recv(wire.HEADER.size - len(head))
    length, op = wire.HEADER.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return op, body


def _hello(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(path)
        # a data connection: its segments come as descriptors, which recv() drops (closed)
        op, _ = _call(sock, Op.HELLO, pack_json({"version": wire.PROTOCOL_VERSION, "data": True}))
    except OSError:
        sock.close()
        return None
    if op != Op.HELLO:
        sock.close()
        return None
    return sock


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return -1


def _start(root: str, name: str, capacity: int, timeout: float, force: bool) -> tuple[subprocess.Popen, float, socket.socket | None]:
    cmd = [sys.executable, "-m", "sglang_simm.local_store._server", "--dir", root, "--name", name,
           "--capacity", str(capacity), "--started-by", "operator"]
    if force:
        cmd.append("--force")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sock_path = os.path.join(root, f"{name}.sock")
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return proc, time.monotonic() - t0, None
        if os.path.exists(sock_path):
            sock = _hello(sock_path)
            if sock is not None:
                return proc, time.monotonic() - t0, sock
        time.sleep(0.005)
    return proc, time.monotonic() - t0, None


def _held(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", default="4GiB,1TiB")
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--dir", default=None, help="parent of the private store directory (default /dev/shm)")
    parser.add_argument("--no-force", action="store_true", help="never pass --force (a tree from before it)")
    args = parser.parse_args()
    parent = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows = []
    for text in args.capacities.split(","):
        capacity = parse_byte_size(text)
        root = tempfile.mkdtemp(prefix="store-start-", dir=parent)
        os.chmod(root, 0o700)
        st = os.statvfs(root)
        force = capacity > st.f_blocks * st.f_frsize and not args.no_force
        name = "s"
        index = os.path.join(root, f"{name}.index")
        row = {"capacity": text}
        proc, took, sock = _start(root, name, capacity, args.timeout, force)
        try:
            if sock is None:
                row["start"] = f"no answer in {took:.1f} s" if proc.poll() is None else \
                    f"refused: {proc.stderr.read().decode().strip()[:120]}"
                rows.append(row)
                continue
            row.update(start_s=f"{took:.2f}", rss_mib=_mib(_rss_anon_kib(proc.pid) * 1024), index_mib=_mib(_held(index)))
            keys = [f"k{i}" for i in range(args.objects)]
            for i in range(0, len(keys), 500):
                batch = keys[i:i + 500]
                op, body = _call(sock, Op.PUT, b"\x01", encode_keys(batch), pack_ints([4096] * len(batch)))
                grant = Reader(body).ints()[0]
                _call(sock, Op.COMMIT, pack_i64(grant), pack_ints([0] * len(batch)))  # 0: no checksum to verify
            sock.close()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc, took, sock = _start(root, name, capacity, args.timeout, force)
            if sock is None:
                row["takeover"] = f"no answer in {took:.1f} s" if proc.poll() is None else \
                    f"refused: {proc.stderr.read().decode().strip()[:120]}"
            else:
                op, body = _call(sock, Op.ADMIN, pack_json({"cmd": "status"}))
                status = Reader(body).json()
                row.update(takeover_s=f"{took:.2f}", objects=status.get("objects"),
                           rss2_mib=_mib(_rss_anon_kib(proc.pid) * 1024), index2_mib=_mib(_held(index)))
                sock.close()
            rows.append(row)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            subprocess.run(["rm", "-rf", root], check=False)
    cols = [("capacity", "capacity"), ("start_s", "start s"), ("rss_mib", "RssAnon MiB"),
            ("index_mib", "index MiB"), ("takeover_s", "takeover s"), ("objects", "objects kept"),
            ("rss2_mib", "RssAnon MiB after"), ("index2_mib", "index MiB after"), ("start", "note"),
            ("takeover", "takeover note")]
    cols = [(k, h) for k, h in cols if any(k in r for r in rows)]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
