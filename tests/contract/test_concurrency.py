"""Several threads, batch calls, distinct and shared keys; every byte checked.

Readers of a shared key must only ever see one complete written value, never
a mix of two or a torn copy: each value's size says which write it came
from, and its bytes must equal that write's bytes exactly.
"""

from __future__ import annotations

import random
import threading

import torch

from sglang_simm.errors import GET_OBJECT_FAILED, OK

THREADS = 8
ROUNDS = 12
BATCH = 6
SHARED_KEYS = 3
MAX_OWN = 96 * 1024
SHARED_BASE = 5000  # shared value size = BASE + writer * ROUNDS + round: unique per write


def shared_value(rand, key_index: int, writer: int, rnd: int) -> torch.Tensor:
    size = SHARED_BASE + writer * ROUNDS + rnd
    return rand(size, seed=1_000_000 + key_index * 10_000 + writer * ROUNDS + rnd)


def decode_shared(rand, key_index: int, size: int) -> torch.Tensor | None:
    writer, rnd = divmod(size - SHARED_BASE, ROUNDS)
    if not (0 <= writer < THREADS and 0 <= rnd < ROUNDS):
        return None  # a size no write had
    return shared_value(rand, key_index, writer, rnd)


def test_threads_with_distinct_and_shared_keys(kv, store, key, rand, make_memory):
    shared = [key(f"shared-{i}") for i in range(SHARED_KEYS)]
    max_shared = SHARED_BASE + THREADS * ROUNDS
    memories = [make_memory(64 << 20) for _ in range(THREADS)]
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mem = memories[tid]
        # the local store: half share one client, half have their own (the real client wants one per process)
        client = kv.Store() if tid % 2 and getattr(kv, "__simm_local_store__", False) else store
        try:
            start.wait()
            for rnd in range(ROUNDS):
                # distinct keys: a batch written, checked, read back byte for byte
                keys = [key(f"t{tid}-r{rnd}-{j}") for j in range(BATCH)]
                datas = [rand(rng.randint(1, MAX_OWN), seed=tid * 1000 + rnd * 10 + j) for j in range(BATCH)]
                views = [mem.holding(d)[0] for d in datas]
                codes = client.mput(keys, views)
                if codes != [OK] * BATCH:
                    errors.append(f"t{tid} mput {codes}")
                    continue
                outs = [mem.view(MAX_OWN, fill=0) for _ in keys]
                got = client.mget(keys, [v for v, _ in outs])
                for data, n, (_, out) in zip(datas, got, outs):
                    if n != data.numel() or not torch.equal(out[:n], data):
                        errors.append(f"t{tid} own key read {n} bytes, wrong")

                # shared keys: overwrite with this thread's value, read whatever is there
                ki = rng.randrange(SHARED_KEYS)
                value = shared_value(rand, ki, tid, rnd)
                code = client.put(shared[ki], mem.holding(value)[0])
                if code != OK:
                    errors.append(f"t{tid} put shared {code}")
                view, out = mem.view(max_shared, fill=0)
                ki = rng.randrange(SHARED_KEYS)
                n = client.get(shared[ki], view)
                if n == GET_OBJECT_FAILED:
                    continue  # not written yet
                expected = decode_shared(rand, ki, n) if n > 0 else None
                if expected is None or not torch.equal(out[:n], expected):
                    errors.append(f"t{tid} shared key {ki}: torn or foreign value ({n} bytes)")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"t{tid} raised {exc!r}")

    threads = [threading.Thread(target=worker, args=(tid,)) for tid in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not errors, errors[:10]


def test_concurrent_batches_on_one_key_set_never_tear(kv, store, key, rand, make_memory):
    """Writers overwrite the same keys with whole values while readers mget them."""
    keys = [key(f"k{i}") for i in range(4)]
    values = {w: rand(64 * 1024 + w, seed=w) for w in range(4)}  # size names the writer
    mem0 = make_memory()
    for k in keys:
        assert store.put(k, mem0.holding(values[0])[0]) == OK
    mems = [make_memory(1 << 20) for _ in range(7)]  # made here: registering is not per thread
    stop = threading.Event()
    errors: list[str] = []

    def writer(w: int) -> None:
        mem = mems[w]
        src = mem.holding(values[w])[0]
        while not stop.is_set():
            for k in keys:
                if store.put(k, src) != OK:
                    errors.append(f"writer {w} failed")

    def reader(r: int) -> None:
        mem = mems[4 + r]
        outs = [mem.view(64 * 1024 + 8, fill=0) for _ in keys]
        for _ in range(60):
            got = store.mget(keys, [v for v, _ in outs])
            for n, (_, out) in zip(got, outs):
                w = n - 64 * 1024
                if w not in values or not torch.equal(out[:n], values[w]):
                    errors.append(f"reader {r} saw {n} bytes, torn or foreign")

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(1, 4)]
    readers = [threading.Thread(target=reader, args=(r,)) for r in range(3)]
    for thread in writers + readers:
        thread.start()
    for thread in readers:
        thread.join(timeout=120)
    stop.set()
    for thread in writers:
        thread.join(timeout=120)
    assert not errors, errors[:10]
