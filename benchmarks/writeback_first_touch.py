"""Where a write-back's time goes on a local store that has not used its memory yet.

    python benchmarks/writeback_first_touch.py [--pages 192] [--manager local|inprocess]

Writes ``--pages`` llama3-8b pages (8 MiB each) from a real SGLang host pool
through our backend in batches of 128, as SGLang's backup thread does, twice:
into a fresh store, then (after ``clear()``) into the memory it now uses. On
the local store it splits the time into the reservation request (the store
process commits the arena's memory: ``posix_fallocate``, the kernel
allocating and zeroing every page), this process mapping it in
(``MADV_POPULATE_WRITE``) and the copy itself. Last, the same bytes copied
with the store's copy routine into new shared memory, new process memory
and memory in use: the references. A diagnostic, not part of the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import time
import uuid
from typing import Any, Iterator


@contextlib.contextmanager
def timed_host_store(parts: dict[str, float]) -> Iterator[None]:
    """Add the time of the local store's reservation and publish requests,
    of mapping the arena in and of the copies to ``parts``."""
    from sglang_simm.local_store import _arena, _host

    request, populate, copy_many = _host.StoreHandle._request, _arena.ArenaMap.populate, _host.copy_many

    def timed_request(self: Any, op: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return request(self, op, *args, **kw)
        finally:
            part = {"PUT": "reserve (store process commits memory)", "COMMIT": "publish"}.get(op.name)
            if part:
                parts[part] = parts.get(part, 0.0) + time.perf_counter() - t

    def timed_populate(self: Any, end: int) -> None:
        t = time.perf_counter()
        populate(self, end)
        key = "map in (MADV_POPULATE_WRITE)"
        parts[key] = parts.get(key, 0.0) + time.perf_counter() - t

    def timed_copy(copies: Any) -> None:
        t = time.perf_counter()
        copy_many(copies)
        parts["copy"] = parts.get("copy", 0.0) + time.perf_counter() - t

    _host.StoreHandle._request, _arena.ArenaMap.populate, _host.copy_many = timed_request, timed_populate, timed_copy
    try:
        yield
    finally:
        _host.StoreHandle._request, _arena.ArenaMap.populate, _host.copy_many = request, populate, copy_many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=192)
    parser.add_argument("--manager", default="local", choices=["local", "inprocess"])
    args = parser.parse_args()

    from sglang_simm.backend import HiCacheSiMM
    from sglang_simm.local_store import reset_servers
    from sglang_simm_dev.bench.pages import fill_pool, host_indices, page_keys
    from sglang_simm_dev.demo.reference import memcpy_reference
    from sglang_simm_dev.pools import PRESETS, build_host_pool, storage_config

    geom, pages = PRESETS["llama3-8b"], args.pages
    pool = build_host_pool(geom, tokens=pages * geom.page_size)
    fill_pool(pool)
    name = f"first-touch-{uuid.uuid4().hex[:6]}"
    nbytes = pages * geom.page_bytes()
    extra = {"manager_address": f"{args.manager}://{name}", "local_store_capacity_bytes": nbytes + (64 << 20)}
    backend = HiCacheSiMM(storage_config(model_name=geom.name, extra_config=extra), pool)
    try:
        for label, salt in (("into a fresh store", "a"), ("into memory the store uses (after clear())", "b")):
            parts: dict[str, float] = {}
            keys = page_keys(pages, name + salt)
            with timed_host_store(parts) if args.manager == "local" else contextlib.nullcontext():
                t0 = time.perf_counter()
                for i in range(0, pages, 128):
                    batch = keys[i:i + 128]
                    idx = host_indices(range(i, i + len(batch)), geom.page_size)
                    assert all(backend.batch_set_v1(batch, idx)), "a write failed"
                seconds = time.perf_counter() - t0
            split = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts.items())
            print(f"write-back {label}: {nbytes / seconds / 1e9:.2f} GB/s ({seconds * 1e3:.0f} ms"
                  + (f": {split})" if split else ")"))
            backend.clear()
        buf = pool.kv_buffer
        objects = geom.page_bytes() // 2
        for shared in (True, False):
            ref = memcpy_reference(buf.data_ptr(), nbytes, objects, shared=shared, limit=nbytes)
            print(f"memcpy of the same {nbytes >> 20} MiB, the store's copy routine: into {ref['memory']} "
                  f"{ref['new_memory_gbps']:.2f} GB/s, into the same memory again {ref['memory_in_use_gbps']:.2f} GB/s")
    finally:
        backend.close()
        reset_servers(name)


if __name__ == "__main__":
    main()
