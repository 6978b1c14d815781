"""How the KV demo drives the backend: SGLang's own cache controller (``ControllerDriver``) or direct calls (``DirectDriver``).

Both do what the radix cache asks of HiCache's L3 path: allocate host
slots, write pages back, look pages up and load the hit.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from queue import Empty
from typing import Any, Callable, Iterator

from sglang_simm_dev.demo.common import (
    DemoFailure,
    DemoSetupError,
    PageHasher,
    python_page_hashes,
    quiet_imports,
    sglang_version,
    storage_batch_size,
)


def _build_pools(geom: Any, layout: str, host_pages: int) -> tuple[Any, Any]:
    """A small CPU device pool (two pages: the controller needs one, the
    L2 copies never run) and a host pool of at least ``host_pages`` pages."""
    from sglang_simm_dev import pools

    device_tokens = 2 * geom.page_size
    device_pool = pools.build_device_pool(geom, device_tokens)
    ratio = host_pages * geom.page_size / device_tokens
    host = pools.build_host_pool(geom, tokens=device_tokens, layout=layout, ratio=ratio, device_pool=device_pool)
    return device_pool, host


def _model_name(geom: Any, host: Any) -> str:
    try:
        from sglang.srt.managers.cache_controller import storage_model_name

        return storage_model_name(geom.name, host) or geom.name
    except Exception:
        return geom.name


class Driver:
    """What the radix cache asks of HiCache's L3 path."""

    mode = "?"
    description = "?"
    host: Any
    backend: Any
    page_size: int

    def alloc(self, tokens: int) -> Any:
        raise NotImplementedError

    def free(self, indices: Any) -> None:
        raise NotImplementedError

    def write(self, keys: list[str], token_ids: list[int], host_indices: Any,
              progress: Callable[[int], None]) -> tuple[int, float]:
        """(pages stored, seconds)."""
        raise NotImplementedError

    def fetch(self, rid: str, token_ids: list[int], keys: list[str], last_hash: str | None,
              progress: Callable[[int], None]) -> tuple[int, int, Any, float, float]:
        """Look the pages of ``token_ids`` (keys ``keys``, chained after
        ``last_hash``) up and load the hit into fresh host slots: (hit pages,
        loaded pages, host indices or None, lookup seconds, load seconds)."""
        raise NotImplementedError

    def backend_stats(self) -> dict[str, Any]:
        stats = getattr(self.backend, "stats", None)
        try:
            return dict(stats()) if callable(stats) else {}
        except Exception:
            return {}

    def close(self) -> None:
        pass


class DirectDriver(Driver):
    """Calls the backend itself, batch by batch, as the controller would."""

    mode = "direct"

    def __init__(self, geom: Any, layout: str, host_pages: int, extra: dict[str, Any]):
        from sglang_simm import plugin
        from sglang_simm_dev import pools

        with quiet_imports():
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        if not plugin.register():
            raise DemoSetupError("could not register the 'simm' backend with SGLang's storage factory")
        self.page_size = geom.page_size
        self.batch = storage_batch_size()
        _device_pool, self.host = _build_pools(geom, layout, host_pages)
        config = pools.storage_config(
            tp_rank=0, tp_size=1, is_mla_model=geom.is_mla, enable_storage_metrics=True,
            is_page_first_layout=layout == "page_first", model_name=_model_name(geom, self.host),
            extra_config=dict(extra),
        )
        self.backend = StorageBackendFactory.create_backend("simm", config, self.host)
        # What the controller does right after creating a backend.
        self.backend.register_mem_pool_host(self.host)
        on_registered = getattr(self.backend, "on_host_pools_registered", None)
        if callable(on_registered):
            on_registered()
        self.description = (
            "the backend called directly (batch_exists / batch_get_v1 / batch_set_v1, "
            f"{self.batch} pages a batch)"
        )

    def alloc(self, tokens: int) -> Any:
        return self.host.alloc(tokens)

    def free(self, indices: Any) -> None:
        self.host.free(indices)

    def write(self, keys, token_ids, host_indices, progress):
        ps, done = self.page_size, 0
        start = time.perf_counter()
        for i in range(0, len(keys), self.batch):
            batch = keys[i:i + self.batch]
            ok = self.backend.batch_set_v1(batch, host_indices[i * ps:(i + len(batch)) * ps])
            if not all(ok):  # the controller stops a backup at the first failed batch
                break
            done += len(batch)
            progress(done)
        return done, time.perf_counter() - start

    def fetch(self, rid, token_ids, keys, last_hash, progress):
        ps = self.page_size
        start = time.perf_counter()
        hits = 0
        for i in range(0, len(keys), self.batch):
            batch = keys[i:i + self.batch]
            found = int(self.backend.batch_exists(batch))
            hits += found
            if found < len(batch):
                break
        lookup = time.perf_counter() - start
        if hits == 0:
            return 0, 0, None, lookup, 0.0
        indices = self.alloc(hits * ps)
        if indices is None:
            raise DemoFailure(f"the host pool has no room for {hits} pages")
        start = time.perf_counter()
        loaded = 0
        for i in range(0, hits, self.batch):
            batch = keys[i:min(i + self.batch, hits)]
            ok = list(self.backend.batch_get_v1(batch, indices[i * ps:(i + len(batch)) * ps]))
            lead = len(batch) if all(ok) else ok.index(False)
            loaded += lead
            progress(loaded)
            if lead < len(batch):
                break
        return hits, loaded, indices, lookup, time.perf_counter() - start

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


class ControllerDriver(Driver):
    """SGLang's own ``HybridCacheController`` (0.5.23) drives the backend.

    Built on a CPU: a CPU ``MHATokenToKVPool`` / ``MLATokenToKVPool`` and
    ``PagedTokenToKVPoolAllocator``, a host pool with ``pin_memory=False`` in
    an anchor-only ``HostPoolGroup`` (what SGLang's ``build_kv_only_stack``
    builds), a gloo process group and the parallel layout published through
    ``get_parallel().override(...)`` for the controller's lifetime.

    ``tp=(rank, size)`` with ``size > 1`` makes this one TP rank of a group
    whose other ranks are other processes (``init_method`` names the gloo
    rendezvous, e.g. ``file:///tmp/pg``): the controller then agrees on hits
    with them (a MIN all-reduce) and, for MLA, backs up from rank 0 only,
    as in serving. With the default world of one, those all-reduces are no-ops.
    """

    mode = "controller"

    def __init__(self, geom: Any, layout: str, host_pages: int, extra: dict[str, Any], hasher: PageHasher,
                 timeout_s: float, *, tp: tuple[int, int] = (0, 1), init_method: str | None = None,
                 enable_metrics: bool = True):
        import torch.distributed as dist

        from sglang_simm import plugin
        from sglang_simm_dev import pools

        with quiet_imports():
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
            from sglang.srt.mem_cache.hicache_storage import PoolName
            from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hcc
            from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
            from sglang.srt.mem_cache.pool_host import HostPoolGroup
            from sglang.srt.runtime_context import get_parallel

        if not plugin.register():
            raise DemoSetupError("could not register the 'simm' backend with SGLang's storage factory")
        self._handle_cls = CacheRequestHandle
        self.page_size = ps = geom.page_size
        self.timeout_s = timeout_s
        self._stack = contextlib.ExitStack()
        try:
            tp_rank, tp_size = tp
            if not dist.is_initialized():
                if init_method is None:
                    if tp_size != 1:
                        raise DemoSetupError("a TP group of more than one rank needs an init_method")
                    fd, path = tempfile.mkstemp(prefix="sglang-simm-demo-pg-")
                    os.close(fd)
                    os.unlink(path)  # gloo's file store creates it
                    init_method = f"file://{path}"
                    self._stack.callback(_remove_quietly, path)
                dist.init_process_group("gloo", init_method=init_method, rank=tp_rank, world_size=tp_size)
                self._stack.callback(dist.destroy_process_group)
            elif dist.get_world_size() != tp_size:
                raise DemoSetupError(
                    f"a torch.distributed process group of {dist.get_world_size()} ranks is already set up, "
                    f"not {tp_size}")
            group = dist.group.WORLD

            device_pool, self.host = _build_pools(geom, layout, host_pages)
            allocator = pools._call(
                PagedTokenToKVPoolAllocator, size=device_pool.size, page_size=ps, dtype=geom.dtype,
                device="cpu", kvcache=device_pool, need_sort=False,
            )
            self.pool_group = HostPoolGroup([
                build_pool_entry(
                    name=PoolName.KV, host_pool=self.host, device_pool=device_pool,
                    layer_mapping={i: i for i in range(geom.layer_num)},
                    transfer_layer_id_max=geom.layer_num, is_anchor=True,
                )
            ])
            if hasher.fn is None:
                # SGLang's native page hash did not build here: the controller
                # keys its lookups with the same function, so give it ours.
                saved = hcc.get_storage_hash_str
                hcc.get_storage_hash_str = lambda key, prior=None, page_size=None: python_page_hashes(
                    list(key), page_size, prior)
                self._stack.callback(setattr, hcc, "get_storage_hash_str", saved)
            self._stack.enter_context(get_parallel().override(
                tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0,
            ))
            self.cc = hcc.HybridCacheController(
                allocator, self.pool_group, ps, group,
                load_cache_event=threading.Event(),
                write_policy="write_through",
                io_backend="direct",
                storage_backend="simm",
                prefetch_threshold=ps,
                model_name=geom.name,
                storage_backend_extra_config=dict(extra),
                transfer_layer_id_max=geom.layer_num,
                enable_storage_metrics=enable_metrics,
            )
            self._stack.callback(self.cc.detach_storage_backend)
        except BaseException:
            self._stack.close()
            raise
        self.backend = self.cc.storage_backend
        if self.cc.page_set_func != self.cc._page_set_zero_copy:
            self.close()
            raise DemoSetupError("SGLang's controller did not choose the zero-copy page path for 'simm'")
        self.description = (
            f"SGLang {sglang_version()}'s {type(self.cc).__name__} (backup, prefetch and "
            f"prefetch-IO threads, {storage_batch_size()} pages a batch)"
        )

    def alloc(self, tokens: int) -> Any:
        return self.pool_group.alloc(tokens)

    def free(self, indices: Any) -> None:
        self.pool_group.free(indices)

    def _written_so_far(self, before: dict[str, Any]) -> int:
        now = self.backend_stats()
        return sum(int(now.get(k, 0)) - int(before.get(k, 0))
                   for k in ("pages_written", "pages_skipped_existing"))

    def write(self, keys, token_ids, host_indices, progress):
        before = self.backend_stats()
        deadline = time.monotonic() + self.timeout_s
        start = time.perf_counter()
        op_id = self.cc.write_storage(host_indices, list(token_ids), list(keys), None)
        failure = (f"SGLang's backup thread did not acknowledge the write of {len(keys)} pages "
                   f"within {self.timeout_s:.0f} s")
        for op in _items(self.cc.ack_backup_queue, deadline, failure,
                         idle=lambda: progress(self._written_so_far(before))):
            if op.id == op_id:
                break
        seconds = time.perf_counter() - start
        stored = int(op.completed_tokens) // self.page_size
        progress(stored)
        return stored, seconds

    def fetch(self, rid, token_ids, keys, last_hash, progress):
        ps = self.page_size
        deadline = time.monotonic() + self.timeout_s
        handle = self._handle_cls(rid=rid, attempt_id=0)
        start = time.perf_counter()
        op = self.cc.prefetch(handle, list(token_ids), last_hash)
        # the prefetch thread's verdict (batch_exists, rank-agreed)
        for hit_op in _items(self.cc.prefetch_hit_queue, deadline,
                             f"SGLang's prefetch thread did not answer the lookup of {rid}"):
            if hit_op is op:
                break
        lookup = time.perf_counter() - start
        computed = getattr(op, "all_hash_values", None)
        if computed is not None and list(computed) != list(keys):
            raise DemoFailure(f"SGLang's controller keyed {rid}'s pages differently from the demo")
        hit_tokens = int(op.storage_hit_count)
        hits = hit_tokens // ps
        if hits == 0:
            return 0, 0, None, lookup, 0.0
        # The radix cache's part: host slots for the hit, then hand the
        # operation to the prefetch-IO thread.
        indices = self.cc.alloc_prefetch_host_buffers(op, hit_tokens)
        if indices is None:
            raise DemoFailure(f"the host pool has no room for {hits} pages")
        op.host_indices = indices
        op.hash_value = op.hash_value[:hits]
        start = time.perf_counter()
        self.cc.prefetch_buffer.put(op)
        completed = 0
        for ack in _items(self.cc.ack_prefetch_queue, deadline,
                          f"SGLang's prefetch-IO thread did not finish loading {rid}"):
            if ack.operation is not op:
                continue
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
                progress(completed // ps)
            if ack.completed_req:
                break
        return hits, completed // ps, indices, lookup, time.perf_counter() - start

    def close(self) -> None:
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()


def _items(queue: Any, deadline: float, failure: str, idle: Callable[[], Any] | None = None) -> Iterator[Any]:
    """What one of the controller's queues hands out, as it comes; ``idle``
    runs between polls; past ``deadline``, DemoFailure(``failure``)."""
    while True:
        try:
            item = queue.get(timeout=0.05)
        except Empty:
            if idle is not None:
                idle()
            if time.monotonic() > deadline:
                raise DemoFailure(failure) from None
            continue
        yield item


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
