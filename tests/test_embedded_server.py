"""The local store's buffer reuse (an implementation detail the contract
suite cannot see): removed objects' buffers serve later puts of the same
size, count against the capacity, and are never reused while read."""

from __future__ import annotations

import threading

import torch

from sglang_simm.embedded import get_server, reset_servers
from sglang_simm.embedded._server import EmbeddedServer

MiB = 1 << 20


def _put(server: EmbeddedServer, key: str, data: torch.Tensor) -> int:
    return server.put_from([(key, data.data_ptr(), data.numel())], overwrite=True)[0]


def _get(server: EmbeddedServer, key: str, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    assert server.get_into([(key, out.data_ptr(), size)])[0] == size
    return out


def test_a_removed_buffer_serves_the_next_put_of_its_size():
    server = EmbeddedServer("recycle-a", 8 * MiB)
    a = torch.full((MiB,), 1, dtype=torch.uint8)
    b = torch.full((MiB,), 2, dtype=torch.uint8)
    assert _put(server, "a", a) == 0
    server.delete("a")
    assert server._free_bytes == MiB
    assert _put(server, "b", b) == 0
    assert server._free_bytes == 0  # taken, not allocated anew
    assert torch.equal(_get(server, "b", MiB), b)


def test_kept_buffers_count_against_capacity_and_give_way_first():
    server = EmbeddedServer("recycle-b", 4 * MiB)
    for i in range(4):
        assert _put(server, f"k{i}", torch.full((MiB,), i, dtype=torch.uint8)) == 0
    for i in range(4):
        server.delete(f"k{i}")
    assert server.used_bytes == 0 and server._free_bytes == 4 * MiB
    big = torch.full((3 * MiB,), 9, dtype=torch.uint8)
    assert _put(server, "big", big) == 0
    assert server.used_bytes + server._free_bytes <= 4 * MiB
    assert server.stats()["evictions"] == 0
    assert torch.equal(_get(server, "big", 3 * MiB), big)


def test_a_buffer_being_read_is_never_recycled():
    reset_servers("recycle-c")
    server = get_server("recycle-c")
    size = 8 * MiB
    values = [torch.full((size,), v, dtype=torch.uint8) for v in (3, 4)]
    assert _put(server, "k", values[0]) == 0
    torn = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            out = torch.empty(size, dtype=torch.uint8)
            if server.get_into([("k", out.data_ptr(), size)])[0] == size:
                first = int(out[0])
                if not bool((out == first).all()):
                    torn.append(first)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(200):  # overwrite and delete: old buffers get retired
        _put(server, "k", values[i % 2])
        if i % 7 == 0:
            server.delete("k")
            _put(server, "other", values[(i + 1) % 2])
            server.delete("other")
    stop.set()
    for t in threads:
        t.join()
    reset_servers("recycle-c")
    assert torn == []
