"""The in-process local store's invariant, where the contract suite cannot
reach it: a get running beside overwrites, evictions and deletes that
reuse the arena copies a whole published value or nothing, never a torn or
foreign one; and its memory is the index's (committed as objects need it,
given back on a clear)."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from sglang_simm.local_store._server import EmbeddedServer
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK

KiB, MiB = 1 << 10, 1 << 20
KEYS = 4
#: Value ``v``: ``VALUE_BASE + v`` bytes, every byte ``v``: its size and
#: its bytes both name the write it came from.
VALUE_BASE = 64 * KiB
VALUES = 40


def _value(v: int) -> torch.Tensor:
    return torch.full((VALUE_BASE + v,), v, dtype=torch.uint8)


def test_gets_beside_overwrite_evict_and_delete_see_whole_published_values():
    # Room for about six values: every round of puts evicts, so freed
    # extents are handed to new puts while readers may still be copying.
    server = EmbeddedServer("oneindex-torn", 6 * (VALUE_BASE + VALUES))
    values = [_value(v) for v in range(VALUES)]
    keys = [f"k{i}" for i in range(KEYS)]
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        outs = [torch.empty(VALUE_BASE + VALUES, dtype=torch.uint8) for _ in range(2)]
        while not stop.is_set():
            for out in outs:
                out.fill_(255)
            batch = rng.sample(keys, 2)
            got = server.get_into([(k, out.data_ptr(), out.numel()) for k, out in zip(batch, outs)])
            for n, out in zip(got, outs):
                if n == DS_KEY_NOT_FOUND:
                    continue
                v = n - VALUE_BASE
                if not 0 <= v < VALUES or not bool((out[:n] == v).all()):
                    errors.append(f"read {n} bytes: torn or foreign (first byte {int(out[0])})")
                reads[0] += 1

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            action = rng.random()
            k = rng.choice(keys)
            if action < 0.7:
                data = values[rng.randrange(VALUES)]
                code = server.put_from([(k, data.data_ptr(), data.numel())], overwrite=True)[0]
                if code != OK:
                    errors.append(f"put {k}: {code}")
            elif action < 0.85:
                server.delete(k)
            else:  # other keys' puts evict the shared ones
                data = values[rng.randrange(VALUES)]
                server.put_from([(f"filler-{rng.randrange(20)}", data.data_ptr(), data.numel())], overwrite=True)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    writers = [threading.Thread(target=writer, args=(100 + i,)) for i in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in readers + writers), "a thread hung"
    assert not errors, errors[:10]
    stats = server.stats()
    assert stats["evictions"] > 0 and stats["deletes"] > 0 and reads[0] > 0
    assert server.used_bytes <= server.capacity_bytes


def _arena_rss(server: EmbeddedServer) -> int:
    """Bytes of the server's arena backed by memory (its mapping may be
    split where its committed prefix ends)."""
    lo, hi = server._arena.base, server._arena.base + server._arena.size
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_memory_is_committed_as_objects_need_it_and_given_back_on_clear():
    server = EmbeddedServer("oneindex-memory", 4 << 30)  # the default capacity
    assert _arena_rss(server) == 0  # address space only
    data = torch.full((MiB,), 7, dtype=torch.uint8)
    for i in range(16):
        assert server.put_from([(f"k{i}", data.data_ptr(), MiB)], overwrite=True) == [OK]
    assert 16 * MiB <= _arena_rss(server) <= 17 * MiB
    for i in range(16):  # deleted objects' room is kept for the next puts, within the arena
        server.delete(f"k{i}")
    assert server.put_from([("again", data.data_ptr(), MiB)], overwrite=True) == [OK]
    assert _arena_rss(server) <= 17 * MiB
    server.clear()
    assert _arena_rss(server) == 0
    assert server.stats()["puts"] == 17  # a clear keeps the counters


def test_memory_the_host_refuses_fails_the_put_with_out_of_memory_and_nothing_else(monkeypatch):
    """As the store process on a full tmpfs: the put that needed more memory
    fails with OUT_OF_MEMORY, the capacity drops to the memory committed,
    and later puts evict within it."""
    import ctypes
    import errno

    from sglang_simm.local_store import _private_arena
    from sglang_simm.simm_rules import OUT_OF_MEMORY

    server = EmbeddedServer("oneindex-oom", 64 * MiB)
    limit = server._arena.base + 6 * MiB  # the host backs 6 MiB of it, no more
    mprotect = _private_arena._mprotect

    def refusing(address: int, length: int, prot: int) -> int:
        if address + length > limit:
            ctypes.set_errno(errno.ENOMEM)
            return -1
        return mprotect(address, length, prot)

    monkeypatch.setattr(_private_arena, "_mprotect", refusing)
    data = torch.full((MiB,), 4, dtype=torch.uint8)
    codes = [server.put_from([(f"k{i}", data.data_ptr(), MiB)], overwrite=True)[0] for i in range(12)]
    first = codes.index(OUT_OF_MEMORY)
    assert codes[:first] == [OK] * first and codes[first + 1:] == [OK] * (len(codes) - first - 1)
    stats = server.stats()
    assert stats["out_of_memory"] == 1 and stats["capacity_bytes"] <= 6 * MiB and stats["evictions"] > 0
    out = torch.zeros(MiB, dtype=torch.uint8)
    assert server.get_into([("k11", out.data_ptr(), MiB)]) == [MiB] and bool((out == 4).all())
