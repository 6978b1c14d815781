"""A client process of a local store, driven by the multi-process tests.

    python store_child.py MODE '{"root": ..., "name": ..., ...}'

Talks to the store through ``StoreHandle`` (or, in ``kv-put``, through the
``simm.kv`` surface a server uses) with plain ctypes buffers (no torch, so a
child starts fast, and no torch thread pool to deadlock a fork). Objects
are self-checking: the first 8 bytes hold a version, every other byte is
``pattern(key, version)``, so a reader tells a whole object from a torn or
foreign one.

Modes (each prints ``ready`` once it holds what the test wants, then a JSON
line with what it saw):
* ``stall-put`` / ``kv-put``: a put whose copy writes half its objects, then
  waits for the file ``go``, then writes the rest;
* ``stall-get``: a get whose copy reads half, waits for ``go``, reads the
  rest and checks every byte it reports as a hit;
* ``idle``: connects, then waits (until killed);
* ``churn``: puts batches of new versions until killed;
* ``worker``: rounds of puts and gets over own and shared keys, every byte
  checked; exits 1 if anything was wrong.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import sys
import time
import zlib

from sglang_simm.local_store import _maps
from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.simm_rules import OK


def pattern(key: str, version: int) -> int:
    return (zlib.crc32(key.encode()) + version * 7919) % 251 + 1


def fill(buf, key: str, version: int) -> None:
    ctypes.memset(buf, pattern(key, version), len(buf))
    struct.pack_into("<q", buf, 0, version)


def check(buf, key: str, size: int) -> str | None:
    """None if ``buf`` holds a whole object of ``key``; else what is wrong."""
    data = bytes(buf[:size])
    version = struct.unpack_from("<q", data, 0)[0]
    if data.count(pattern(key, version), 8) != size - 8:
        return f"{key}: torn or foreign bytes (version {version})"
    return None


def handle(args) -> StoreHandle:
    server = StoreHandle(args["name"], root=args["root"], capacity=args.get("capacity", 256 << 20),
                         timeout_s=args.get("timeout_s", 5.0), spawn=args.get("spawn", True))
    server.open()
    return server


def buffers(n: int, size: int):
    return [ctypes.create_string_buffer(size) for _ in range(n)]


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)


def stall(method: str, go: str, before_ready=None) -> None:
    """Make ``SegmentMap.<method>`` copy half its objects, announce, wait
    for ``go``, then copy the rest: a copy in flight, counted as the real
    client counts it. ``before_ready`` runs while it is half done."""
    real = getattr(_maps.SegmentMap, method)
    stalled = []

    def slow(self, copies):
        if stalled:
            return real(self, copies)
        stalled.append(True)
        half = max(len(copies) // 2, 1)
        real(self, copies[:half])
        if before_ready is not None:
            before_ready()
        print("ready", flush=True)
        wait_for(go)
        if copies[half:]:
            real(self, copies[half:])

    setattr(_maps.SegmentMap, method, slow)


def stall_put(args) -> None:
    server = handle(args)
    keys, size = args["keys"], args["size"]
    bufs = buffers(len(keys), size)
    for key, buf in zip(keys, bufs):
        fill(buf, key, args.get("version", 1))
    # ``hang_up``: a bad frame on its own connection, and the store hangs up on it mid-copy
    stall("write", args["go"], (lambda: server._current().sock.send(b"\0\0\0\0\xfe")) if args.get("hang_up")
          else None)
    codes = server.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)
    print(json.dumps({"codes": codes}), flush=True)
    if args.get("then_idle"):
        time.sleep(3600)


def kv_put(args) -> None:
    """Through ``simm.kv`` as a server's backend uses it: a stalled mput, then
    (after ``go2``) another on whatever store answers then."""
    from sglang_simm import local_store as kv

    for flag, value in (("local_store_scope", "host"), ("local_store_dir", args["root"]),
                        ("cm_primary_node_ip", args["name"]), ("clnt_sync_req_timeout_ms", "2000")):
        assert kv.set_flag(flag, value)
    store = kv.Store()
    keys, size = args["keys"], args["size"]
    bufs = buffers(len(keys), size)
    region = ctypes.create_string_buffer(size * len(keys))
    import torch  # register_mr takes a tensor, as SiMM's does

    mr = kv.register_mr(torch.frombuffer(region, dtype=torch.uint8))
    views = [kv.BlockView.from_buffer(ctypes.addressof(region) + i * size, size, mr) for i in range(len(keys))]
    for i, key in enumerate(keys):
        fill(bufs[i], key, 1)
        ctypes.memmove(ctypes.addressof(region) + i * size, bufs[i], size)
    stall("write", args["go"])
    first = store.mput(keys, views)
    print(json.dumps({"codes": first}), flush=True)
    wait_for(args["go2"])
    second = store.mput(keys, views)
    print(json.dumps({"codes": second}), flush=True)


def stall_get(args) -> None:
    server = handle(args)
    keys, size = args["keys"], args["size"]
    out = buffers(len(keys), size)
    stall("read", args["go"])
    got = server.get_into([(k, ctypes.addressof(b), size) for k, b in zip(keys, out)])
    problems = [why for key, buf, n in zip(keys, out, got) if n == size and (why := check(buf, key, size))]
    print(json.dumps({"results": got, "problems": problems}), flush=True)
    if args.get("then_idle"):
        time.sleep(3600)


def idle(args) -> None:
    server = handle(args)
    server.lookup(["idle-probe"])
    print("ready", flush=True)
    time.sleep(3600)


def churn(args) -> None:
    server = handle(args)
    size, batch = args["size"], args["batch"]
    rng = random.Random(args.get("seed", 0))
    bufs = buffers(batch, size)
    version = 0
    while True:
        version += 1
        keys = [f"churn-{rng.randrange(args['keyspace'])}" for _ in range(batch)]
        for key, buf in zip(keys, bufs):
            fill(buf, key, version)
        server.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)
        if version == 1:
            print("ready", flush=True)


def worker(args) -> None:
    server = handle(args)
    size, rounds = args["size"], args["rounds"]
    own = [f"w{args['id']}-{i}" for i in range(args["own"])]
    shared = [f"shared-{i}" for i in range(args["shared"])]
    rng = random.Random(args["id"])
    bufs, out = buffers(len(own) + len(shared), size), buffers(len(own) + len(shared), size)
    problems: list[str] = []
    stats = {"put": 0, "got": 0, "missed": 0}
    for r in range(rounds):
        keys = own + rng.sample(shared, len(shared) // 2)
        for key, buf in zip(keys, bufs):
            fill(buf, key, r * 100 + args["id"])  # shared keys: versions of every writer race
        codes = server.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)
        stats["put"] += sum(c == OK for c in codes)
        bad = [c for c in codes if c != OK]
        if bad:
            problems.append(f"round {r}: put codes {sorted(set(bad))}")
        reads = own + shared
        got = server.get_into([(k, ctypes.addressof(b), size) for k, b in zip(reads, out)])
        for i, (key, n) in enumerate(zip(reads, got)):
            if n == size:
                stats["got"] += 1
                why = check(out[i], key, size)
                if why:
                    problems.append(f"round {r}: {why}")
            elif key in own:
                problems.append(f"round {r}: own key {key} read back {n}")
            else:
                stats["missed"] += 1
    server.close()
    print(json.dumps({"problems": problems[:20], **stats}), flush=True)
    sys.exit(1 if problems else 0)


def torture(args) -> None:
    """Until the file ``stop`` exists: puts and gets of a shared key space,
    every byte of every hit checked, a forked child now and then doing the
    same on the inherited handle. Survives its store's deaths and restarts
    (a call that fails is counted, the next reconnects). Prints its counts."""
    import os

    from sglang_simm.local_store.contract import StoreUnreachable

    server = handle({**args, "timeout_s": 2.0})
    size, space = args["size"], args["keyspace"]
    rng = random.Random(args["seed"])
    counts = {"puts": 0, "hits": 0, "misses": 0, "wrong": 0, "failed_calls": 0, "forks": 0, "fork_wrong": 0}
    problems: list[str] = []

    def rounds(n: int) -> None:
        for _ in range(n):
            keys = [f"t{rng.randrange(space)}" for _ in range(rng.randint(1, 12))]
            bufs = buffers(len(keys), size)
            for key, buf in zip(keys, bufs):
                fill(buf, key, rng.randrange(1 << 40))
            try:
                codes = server.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)
                counts["puts"] += codes.count(OK)
                reads = [f"t{rng.randrange(space)}" for _ in range(rng.randint(1, 16))]
                out = buffers(len(reads), size)
                got = server.get_into([(k, ctypes.addressof(b), size) for k, b in zip(reads, out)])
            except StoreUnreachable:
                counts["failed_calls"] += 1
                time.sleep(0.05)
                continue
            for key, buf, n in zip(reads, out, got):
                if n == size:
                    counts["hits"] += 1
                    why = check(buf, key, size)
                    if why:
                        counts["wrong"] += 1
                        problems.append(why)
                else:
                    counts["misses"] += 1

    print("ready", flush=True)
    while not os.path.exists(args["stop"]):
        rounds(20)
        pid = os.fork()
        if pid == 0:  # a child on its parent's handle: its own connection, locks and row
            counts["wrong"] = 0
            rounds(5)
            os._exit(min(counts["wrong"], 100))
        counts["forks"] += 1
        counts["fork_wrong"] += os.waitpid(pid, 0)[1] >> 8
    print(json.dumps({**counts, "problems": problems[:10]}), flush=True)


if __name__ == "__main__":
    {"stall-put": stall_put, "kv-put": kv_put, "stall-get": stall_get, "idle": idle, "churn": churn,
     "worker": worker, "torture": torture}[sys.argv[1]](json.loads(sys.argv[2]))
