"""A client process of a local store, driven by the multi-process tests.

    python store_child.py MODE '{"root": ..., "name": ..., ...}'

Talks to the store through ``StoreHandle`` with plain ctypes buffers (no
torch, so a child starts fast). Object contents are self-checking: the first
8 bytes hold a version, every other byte is ``pattern(key, version)``, so a
reader can tell a whole object from a torn or foreign one.

Modes (each prints ``ready`` once it holds what the test wants to kill it with):
* ``hold-put``: reserve a batch, copy half of it, then wait (never commits);
* ``hold-get``: pin a batch of objects, then wait (never releases);
* ``churn``: put batches of objects with new versions until killed;
* ``worker``: rounds of put and get over its own and shared keys, checking
  every byte; prints a JSON summary and exits 1 if anything was wrong.
"""

from __future__ import annotations

import ctypes
import json
import random
import struct
import sys
import time
import zlib

from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.local_store._protocol import Op, encode_keys, pack_ints
from sglang_simm.errors import OK


def pattern(key: str, version: int) -> int:
    return (zlib.crc32(key.encode()) + version * 7919) % 251 + 1


def fill(buf, key: str, version: int) -> None:
    ctypes.memset(buf, pattern(key, version), len(buf))
    struct.pack_into("<q", buf, 0, version)


def check(buf, key: str, size: int) -> str | None:
    """None if ``buf`` holds a whole object of ``key``; else what is wrong."""
    data = bytes(buf[:size])
    version = struct.unpack_from("<q", data, 0)[0]
    want = pattern(key, version)
    if data.count(want, 8) != size - 8:
        return f"{key}: torn or foreign bytes (version {version})"
    return None


def handle(args) -> StoreHandle:
    server = StoreHandle(args["name"], root=args["root"], capacity=args.get("capacity", 256 << 20),
                        timeout_s=args.get("timeout_s", 5.0))
    server.open()
    return server


def buffers(n: int, size: int):
    return [ctypes.create_string_buffer(size) for _ in range(n)]


def hold_put(args) -> None:
    server = handle(args)
    keys, size = args["keys"], args["size"]
    bufs = buffers(len(keys), size)
    for key, buf in zip(keys, bufs):
        fill(buf, key, 1)
    conn, r = server._request(Op.PUT, b"\x01", encode_keys(keys), pack_ints([size] * len(keys)))
    lease, committed = r.ints()
    codes, offsets = r.ints(), r.ints()
    assert lease and codes == [OK] * len(keys), codes
    conn.arena.populate(committed)
    for key, buf, off in list(zip(keys, bufs, offsets))[: len(keys) // 2]:
        ctypes.memmove(conn.arena.base + off, buf, size)
    print("ready", flush=True)
    time.sleep(3600)


def hold_get(args) -> None:
    server = handle(args)
    keys, size = args["keys"], args["size"]
    conn, r = server._request(Op.GET, encode_keys(keys), pack_ints([size] * len(keys)))
    lease, _slot = r.ints()
    assert lease, "nothing to pin"
    print("ready", flush=True)
    time.sleep(3600)


def churn(args) -> None:
    server = handle(args)
    size, batch = args["size"], args["batch"]
    rng = random.Random(args.get("seed", 0))
    bufs = buffers(batch, size)
    version = 0
    announced = False
    while True:
        version += 1
        keys = [f"churn-{rng.randrange(args['keyspace'])}" for _ in range(batch)]
        for key, buf in zip(keys, bufs):
            fill(buf, key, version)
        server.put_from([(k, ctypes.addressof(b), size) for k, b in zip(keys, bufs)], True)
        if not announced:
            print("ready", flush=True)
            announced = True


def worker(args) -> None:
    server = handle(args)
    size, rounds = args["size"], args["rounds"]
    own = [f"w{args['id']}-{i}" for i in range(args["own"])]
    shared = [f"shared-{i}" for i in range(args["shared"])]
    rng = random.Random(args["id"])
    bufs = buffers(len(own) + len(shared), size)
    out = buffers(len(own) + len(shared), size)
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


if __name__ == "__main__":
    {"hold-put": hold_put, "hold-get": hold_get, "churn": churn, "worker": worker}[sys.argv[1]](json.loads(sys.argv[2]))
