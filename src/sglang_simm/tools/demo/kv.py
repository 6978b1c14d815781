"""``sglang-simm demo``: HiCache's L3 write-back and restore, on a CPU.

What SGLang does with an L3 storage backend while it serves, replayed with
SGLang's own pieces and a real model's page geometry:

* a real SGLang host KV pool (``pin_memory=False``) holding whole pages;
* the backend attached through SGLang's storage factory, as ``simm``;
* page keys from SGLang's own page hash (``get_storage_hash_str``), chained
  over the token ids of the prefix;
* by default SGLang's own ``HybridCacheController`` (0.5.23) drives the
  backend: its backup thread writes pages back, its prefetch threads look
  pages up and load them, in batches of ``STORAGE_BATCH_SIZE``, exactly as
  in serving. This module plays the radix cache's part: it computes page
  keys, enqueues ``write_storage`` / ``prefetch`` operations, allocates host
  slots for a hit and waits on the acknowledgements. ``--direct`` calls the
  backend's ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` itself,
  batch by batch, the way the controller does.

Phases:

1. write-back: request A's pages (a deterministic byte pattern per page,
   derived from the page's key) go from the host pool to the store;
2. cold restore: the host pool is wiped, A is looked up and loaded into
   other host slots, and every byte is compared with the pattern;
3. request B shares a prefix with A (3/4 of its pages) and then goes on:
   the lookup must find exactly the shared prefix, which is loaded and
   checked; B's new pages are written; finally they are fetched back by
   their chained keys (as a radix cache does after matching a prefix in
   host memory) and checked.

Any missing page, short lookup or differing byte fails the run (exit 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import resource
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Callable, Iterator, Sequence

logger = logging.getLogger(__name__)

#: Pages in request A when ``--pages`` is not given. With llama3-8b (8 MiB a
#: page) the run moves about 4.5 GB and holds under 4 GiB of KV data.
DEFAULT_PAGES = 192
#: The share of request B's pages that it has in common with request A.
SHARED_FRACTION = 0.75
#: The controller's batch size (SGLang's ``STORAGE_BATCH_SIZE``), when the
#: installed SGLang does not export it.
FALLBACK_BATCH_SIZE = 128
#: Poison written over the host pool before every restore: a page that is
#: not really loaded cannot pass the byte comparison.
POISON_BYTE = 0xA5
#: A vocabulary size for the synthetic prompts (Llama 3's).
VOCAB_SIZE = 128_256

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SETUP = 2


class DemoFailure(Exception):
    """A check failed: a page is missing, a lookup is wrong or a byte differs."""


class DemoSetupError(Exception):
    """The demo cannot run with these options on this machine."""


# ---------------------------------------------------------------- utilities


def _quiet_imports() -> contextlib.AbstractContextManager[Any]:
    """SGLang warns at import about GPU-only quantization methods; on a CPU
    that is expected noise."""
    cm = warnings.catch_warnings()

    class _Quiet:
        def __enter__(self) -> None:
            cm.__enter__()
            warnings.simplefilter("ignore")

        def __exit__(self, *exc: Any) -> None:
            cm.__exit__(*exc)

    return _Quiet()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_rss_bytes() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def storage_batch_size() -> int:
    try:
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        return int(STORAGE_BATCH_SIZE)
    except Exception:
        return FALLBACK_BATCH_SIZE


# ------------------------------------------------------------- page hashes


def python_page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's page hash chain in pure Python: per whole page, SHA-256 over
    the previous page's digest (if any) and the page's token ids as
    little-endian uint32 (``hash_binding.cpp``, token ids below 2**32)."""
    import hashlib
    from array import array

    prior = bytes.fromhex(prior_hash) if prior_hash else None
    out: list[str] = []
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        page = array("I", token_ids[start:start + page_size])
        if sys.byteorder != "little":
            page.byteswap()
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(page.tobytes())
        prior = h.digest()
        out.append(h.hexdigest())
    return out


def sglang_hash_function() -> tuple[Callable[..., Any] | None, str]:
    """SGLang's own ``get_storage_hash_str`` if it imports and its native
    extension loads; else None and why."""
    try:
        with _quiet_imports():
            from sglang.srt.mem_cache.utils import get_storage_hash_str
        get_storage_hash_str([1, 2], None, page_size=2)
        return get_storage_hash_str, "sglang.srt.mem_cache.utils.get_storage_hash_str"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


class PageHasher:
    """Page keys the way SGLang computes them (its function when it works)."""

    def __init__(self) -> None:
        self.fn, detail = sglang_hash_function()
        if self.fn is not None:
            self.source = detail
            self.fallback_reason = None
        else:
            self.source = "python re-implementation of SGLang's page hash"
            self.fallback_reason = detail

    def __call__(self, token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
        if self.fn is not None:
            return list(self.fn(list(token_ids), prior_hash, page_size=page_size))
        return python_page_hashes(token_ids, page_size, prior_hash)


# ---------------------------------------------------------------- patterns


class PagePattern:
    """A deterministic byte pattern per page, tied to the page's key.

    One random block the size of a page (fixed seed), XORed word by word
    with 64 bits of the page's key: every page differs from every other,
    and every word of a page from its neighbours, so a lost, swapped,
    shifted or partly written page cannot compare equal.
    """

    def __init__(self, page_bytes: int, seed: int = 0x51AA):
        import torch

        self.page_bytes = page_bytes
        words = (page_bytes + 7) // 8
        gen = torch.Generator().manual_seed(seed)
        self._base = torch.randint(0, 256, (words * 8,), dtype=torch.uint8, generator=gen).view(torch.int64)

    @staticmethod
    def key_seed(key: str) -> int:
        value = int(key[:16], 16) if len(key) >= 16 else hash(key) & (2**64 - 1)
        return value - 2**64 if value >= 2**63 else value

    def _words(self, key: str) -> Any:
        return self._base ^ self.key_seed(key)

    def expected(self, key: str) -> Any:
        """The page's bytes (uint8)."""
        import torch

        return self._words(key).view(torch.uint8)[: self.page_bytes]

    def fill(self, host: Any, slot: int, key: str) -> None:
        import torch

        words = self._words(key)
        data = words if self.page_bytes % 8 == 0 else words.view(torch.uint8)[: self.page_bytes]
        host.set_from_flat_data_page(slot, data.view(host.dtype))

    def check(self, host: Any, slot: int, key: str) -> int | None:
        """None when the page at ``slot`` holds exactly ``key``'s pattern;
        else the offset of the first differing byte."""
        import torch

        got = host.get_data_page(slot, flat=True).reshape(-1).view(torch.uint8)
        if got.numel() != self.page_bytes:
            return min(got.numel(), self.page_bytes)
        if self.page_bytes % 8 == 0:
            # word by word: the same bytes, an eighth of the comparisons
            if torch.equal(got.view(torch.int64) ^ self.key_seed(key), self._base):
                return None
        want = self.expected(key)
        if torch.equal(got, want):
            return None
        return int((got != want).nonzero()[0].item())


def _wipe(host: Any) -> None:
    import torch

    buffers = [getattr(host, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    for buf in buffers:
        if isinstance(buf, torch.Tensor):
            buf.view(-1).view(torch.uint8).fill_(POISON_BYTE)


# ---------------------------------------------------------------- progress


class _Progress:
    """rich progress bars on a terminal; nothing otherwise."""

    def __init__(self, console: Any):
        self._progress = None
        if console is not None and getattr(console, "is_terminal", False):
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._progress = Progress(
                    SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
                )
            except ImportError:
                self._progress = None

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """Yields ``update(completed)``."""
        if self._progress is None:
            yield lambda _completed: None
            return
        progress = self._progress
        progress.start()
        tid = progress.add_task(description, total=max(total, 1))
        try:
            yield lambda completed: progress.update(tid, completed=completed)
        finally:
            progress.remove_task(tid)
            progress.stop()


# ------------------------------------------------------------------ results


@dataclass
class Phase:
    name: str
    request: str
    kind: str  # "write" or "read"
    pages: int  # pages offered (write) or looked up (read)
    hits: int | None = None  # pages the lookup found (read)
    pages_moved: int = 0  # pages stored (write) or loaded (read)
    page_bytes: int = 0
    seconds: float = 0.0  # the storage work: enqueue to last acknowledgement
    lookup_seconds: float | None = None
    verified_pages: int = 0
    relocated_pages: int | None = None

    @property
    def bytes(self) -> int:
        return self.pages_moved * self.page_bytes

    @property
    def hit_rate(self) -> float | None:
        if self.kind != "read" or self.hits is None or not self.pages:
            return None
        return self.hits / self.pages

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(bytes=self.bytes, hit_rate=self.hit_rate, gbps=self.gbps)
        return d


@dataclass
class DemoResult:
    info: dict[str, Any] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    verified_pages: int = 0
    verified_bytes: int = 0
    expected_verified_bytes: int = 0
    ok: bool = False
    error: str | None = None
    total_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.info,
            "phases": [p.as_dict() for p in self.phases],
            "verified_pages": self.verified_pages,
            "verified_bytes": self.verified_bytes,
            "expected_verified_bytes": self.expected_verified_bytes,
            "ok": self.ok,
            "error": self.error,
            "total_seconds": self.total_seconds,
            "peak_rss_bytes": _peak_rss_bytes(),
        }


# ------------------------------------------------------------------ drivers


def _build_pools(geom: Any, layout: str, host_pages: int) -> tuple[Any, Any]:
    """A small CPU device pool (two pages: the controller needs one, the
    L2 copies never run) and a host pool of at least ``host_pages`` pages."""
    from sglang_simm.tools import pools

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


class _Driver:
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


class DirectDriver(_Driver):
    """Calls the backend itself, batch by batch, as the controller would."""

    mode = "direct"

    def __init__(self, geom: Any, layout: str, host_pages: int, extra: dict[str, Any]):
        from sglang_simm import plugin
        from sglang_simm.tools import pools

        with _quiet_imports():
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


class ControllerDriver(_Driver):
    """SGLang's own ``HybridCacheController`` (0.5.23) drives the backend.

    Built on a CPU: a CPU ``MHATokenToKVPool`` / ``MLATokenToKVPool`` and
    ``PagedTokenToKVPoolAllocator``, a host pool with ``pin_memory=False`` in
    an anchor-only ``HostPoolGroup`` (what SGLang's ``build_kv_only_stack``
    builds), a world-size-1 gloo process group (the controller's rank
    agreement all-reduces are then no-ops) and the parallel layout published
    through ``get_parallel().override(...)`` for the controller's lifetime.
    """

    mode = "controller"

    def __init__(self, geom: Any, layout: str, host_pages: int, extra: dict[str, Any], hasher: PageHasher,
                 timeout_s: float):
        import torch.distributed as dist

        from sglang_simm import plugin
        from sglang_simm.tools import pools

        with _quiet_imports():
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
            if not dist.is_initialized():
                fd, path = tempfile.mkstemp(prefix="sglang-simm-demo-pg-")
                os.close(fd)
                os.unlink(path)  # gloo's file store creates it
                dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
                self._stack.callback(_remove_quietly, path)
                self._stack.callback(dist.destroy_process_group)
            elif dist.get_world_size() != 1:
                raise DemoSetupError("a torch.distributed process group with more than one rank is already set up")
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
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0,
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
                enable_storage_metrics=True,
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
            f"SGLang {_sglang_version()}'s {type(self.cc).__name__} (backup, prefetch and "
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
        while True:
            try:
                op = self.cc.ack_backup_queue.get(timeout=0.05)
            except Empty:
                progress(self._written_so_far(before))
                if time.monotonic() > deadline:
                    raise DemoFailure(
                        f"SGLang's backup thread did not acknowledge the write of {len(keys)} pages "
                        f"within {self.timeout_s:.0f} s")
                continue
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
        while True:  # the prefetch thread's verdict (batch_exists, rank-agreed)
            try:
                hit_op = self.cc.prefetch_hit_queue.get(timeout=0.05)
            except Empty:
                if time.monotonic() > deadline:
                    raise DemoFailure(f"SGLang's prefetch thread did not answer the lookup of {rid}")
                continue
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
        while True:
            try:
                ack = self.cc.ack_prefetch_queue.get(timeout=0.05)
            except Empty:
                if time.monotonic() > deadline:
                    raise DemoFailure(f"SGLang's prefetch-IO thread did not finish loading {rid}")
                continue
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


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# --------------------------------------------------------------------- demo


@dataclass
class DemoOptions:
    model: str = "llama3-8b"
    pages: int | None = None
    page_size: int | None = None
    layout: str = "page_first"
    direct: bool = False
    json_path: str | None = None
    seed: int | None = None
    timeout_s: float | None = None

    @classmethod
    def from_args(cls, args: Any) -> DemoOptions:
        return cls(
            model=getattr(args, "model", None) or "llama3-8b",
            pages=getattr(args, "pages", None),
            page_size=getattr(args, "page_size", None),
            layout=getattr(args, "layout", None) or "page_first",
            direct=bool(getattr(args, "direct", False)),
            json_path=getattr(args, "json", None),
            seed=getattr(args, "seed", None),
            timeout_s=getattr(args, "timeout", None),
        )


def resolve_geometry(model: str, page_size: int | None) -> Any:
    from sglang_simm.tools.pools import PRESETS

    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; choose one of: {', '.join(PRESETS)} (--list-models)")
    geom = PRESETS[model]
    if page_size is not None:
        if page_size < 1:
            raise ValueError(f"--page-size must be at least 1, got {page_size}")
        geom = dataclasses.replace(geom, page_size=page_size)
    return geom


def split_request(pages: int) -> tuple[int, int]:
    """(shared, new) pages of request B."""
    shared = min(max(1, int(pages * SHARED_FRACTION)), pages - 1)
    return shared, pages - shared


def _resolve_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The extra config with ``manager_address`` defaulting to ``local``
    (when no source sets it), and the resolved SiMM config."""
    from sglang_simm import config as cfg

    extra = dict(extra)
    if "manager_address" not in extra:
        named = False
        for _name, source in cfg.SOURCES:
            try:
                named = named or "manager_address" in source(extra, os.environ)
            except Exception:
                named = True  # a broken source: let load_config report it
        if not named:
            extra["manager_address"] = "local"
    return extra, cfg.load_config(extra)


def list_models(console: Any) -> int:
    from rich.table import Table

    from sglang_simm.tools.pools import PRESETS

    table = Table(title="geometry presets (one TP rank)")
    for col in ("preset", "model", "layers", "KV heads", "head dim", "page", "dtype", "page bytes"):
        table.add_column(col, justify="left" if col in ("preset", "model", "dtype") else "right")
    for key, g in PRESETS.items():
        heads = "MLA" if g.is_mla else str(g.head_num)
        dim = f"{g.kv_lora_rank}+{g.qk_rope_head_dim}" if g.is_mla else str(g.head_dim)
        table.add_row(key, g.name, str(g.layer_num), heads, dim, str(g.page_size),
                      str(g.dtype).replace("torch.", ""), _human(g.page_bytes()))
    from sglang_simm.tools.demo.hybrid import list_rows

    for row in list_rows():
        table.add_row(*row)
    console.print(table)
    return EXIT_OK


class Demo:
    def __init__(self, console: Any, opts: DemoOptions, extra: dict[str, Any]):
        self.console = console
        self.opts = opts
        self.geom = resolve_geometry(opts.model, opts.page_size)
        self.pages = opts.pages if opts.pages is not None else DEFAULT_PAGES
        if self.pages < 2:
            raise ValueError(f"--pages must be at least 2 (request B shares some and adds some), got {self.pages}")
        if self.geom.is_mla and opts.layout == "page_head":
            raise ValueError("the page_head layout is for MHA models; MLA presets use page_first or page_first_direct")
        self.shared, self.new = split_request(self.pages)
        self.page_bytes = self.geom.page_bytes()
        # Headroom so that every restore lands in other host slots than the
        # pages were written from (SGLang's host allocator reuses freed slots
        # last).
        self.host_pages = self.pages + max(1, self.pages // 4)
        if self.geom.is_mla and opts.layout == "page_first_direct":
            # SGLang 0.5.23's MLATokenToKVPoolHost indexes a page_first_direct
            # buffer (pages first) by layer when it builds its transfer views,
            # so it needs at least as many pages as layers.
            self.host_pages = max(self.host_pages, self.geom.layer_num)
        self.store_pages = self.pages + self.new
        self.extra, self.resolved = _resolve_extra(extra)
        self.config = self.resolved.config
        self.result = DemoResult()
        self.progress = _Progress(console)
        self.seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**32)
        self.timeout_s = opts.timeout_s or max(120.0, self.pages * 1.0)
        self._created_store: str | None = None

    # -- setup ---------------------------------------------------------------

    def _plan_memory(self) -> None:
        host_bytes = self.host_pages * self.page_bytes
        store_bytes = self.store_pages * self.page_bytes if self.config.is_embedded else 0
        if self.config.is_embedded and self.resolved.sources.get("embedded_capacity_bytes") == "default":
            # Room for every page the demo writes (plus the warm-up object),
            # not the embedded store's general default.
            self.extra["embedded_capacity_bytes"] = store_bytes + (16 << 20)
        need = host_bytes + store_bytes + 2 * self.page_bytes
        available = _available_memory()
        if available is not None and need > 0.9 * available:
            raise DemoSetupError(
                f"{self.pages} pages of {_human(self.page_bytes)} need about {_human(need)} "
                f"(host pool {_human(host_bytes)}"
                + (f", embedded store {_human(store_bytes)}" if store_bytes else "")
                + f"), more than the {_human(available)} available: use fewer --pages"
            )

    def _build_driver(self, hasher: PageHasher) -> _Driver:
        from sglang_simm.errors import SiMMError

        if not self.opts.direct:
            try:
                return ControllerDriver(self.geom, self.opts.layout, self.host_pages, self.extra, hasher,
                                        self.timeout_s)
            except SiMMError as exc:  # the backend refused to attach: the direct path would too
                raise DemoSetupError(f"the backend could not attach: {exc}") from exc
            except Exception as exc:  # SGLang's controller does not build here
                reason = f"{type(exc).__name__}: {exc}"
                logger.debug("SGLang's controller could not be built", exc_info=True)
                self.result.info["controller_error"] = reason
                self.console.print(
                    f"[yellow]note:[/yellow] SGLang's controller cannot be built here ({reason}); "
                    "calling the backend directly instead")
        try:
            return DirectDriver(self.geom, self.opts.layout, self.host_pages, self.extra)
        except SiMMError as exc:
            raise DemoSetupError(f"the backend could not attach: {exc}") from exc
        except DemoSetupError:
            raise
        except Exception as exc:
            raise DemoSetupError(
                f"could not build SGLang's host pool or attach the backend: {type(exc).__name__}: {exc}"
            ) from exc

    # -- checks --------------------------------------------------------------

    def _check(self, condition: bool, message: str) -> None:
        if not condition:
            raise DemoFailure(message)

    def _ok(self, message: str) -> None:
        self.console.print(f"  [green]ok[/green]  {message}")

    def _fill(self, driver: _Driver, pattern: PagePattern, slots: list[int], keys: list[str], what: str) -> None:
        with self.progress.task(f"filling {what}", len(keys)) as update:
            for n, (slot, key) in enumerate(zip(slots, keys), 1):
                pattern.fill(driver.host, slot, key)
                if n % 8 == 0:
                    update(n)

    def _verify(self, driver: _Driver, pattern: PagePattern, slots: list[int], keys: list[str],
                page_numbers: Sequence[int], what: str) -> int:
        bad: list[tuple[int, int, int]] = []
        with self.progress.task(f"verifying {what}", len(keys)) as update:
            for n, (slot, key, page) in enumerate(zip(slots, keys, page_numbers), 1):
                offset = pattern.check(driver.host, slot, key)
                if offset is None:
                    self.result.verified_pages += 1
                    self.result.verified_bytes += self.page_bytes
                else:
                    bad.append((page, slot, offset))
                if n % 8 == 0:
                    update(n)
        if bad:
            first = ", ".join(
                f"page {p} (host slot {s}, first differing byte at offset {o} of {self.page_bytes})"
                for p, s, o in bad[:3])
            raise DemoFailure(
                f"{what}: {len(bad)} of {len(keys)} restored pages differ from what was written: {first}"
                + (" ..." if len(bad) > 3 else ""))
        return len(keys)

    def _page_starts(self, indices: Any) -> list[int]:
        return indices[:: self.geom.page_size].tolist()

    def _fetch(self, driver: _Driver, rid: str, tokens: list[int], keys: list[str], last_hash: str | None,
               what: str) -> tuple[int, int, Any, float, float]:
        with self.progress.task(what, len(keys)) as update:
            return driver.fetch(rid, tokens, keys, last_hash, update)

    # -- the run -------------------------------------------------------------

    def run(self) -> DemoResult:
        t_run = time.perf_counter()
        geom, ps, N, S, M = self.geom, self.geom.page_size, self.pages, self.shared, self.new
        res = self.result
        res.expected_verified_bytes = (N + S + M) * self.page_bytes
        self._plan_memory()
        res.info.update(
            model=self.opts.model, model_name=geom.name, layout=self.opts.layout,
            geometry=dict(layers=geom.layer_num, kv_heads=geom.head_num, head_dim=geom.head_dim,
                          page_size=ps, dtype=str(geom.dtype).replace("torch.", ""), is_mla=geom.is_mla,
                          kv_lora_rank=geom.kv_lora_rank, qk_rope_head_dim=geom.qk_rope_head_dim),
            page_bytes=self.page_bytes, pages=N, shared_pages=S, new_pages=M, host_pool_pages=self.host_pages,
            batch_size=storage_batch_size(), seed=self.seed, sglang_version=_sglang_version(),
            manager_address=self.config.manager_address,
        )

        from sglang_simm.embedded import server_names

        stores_before = set(server_names())
        if self.config.is_embedded and self.config.embedded_name not in stores_before:
            # the demo's own store: dropped at the end, its memory with it
            self._created_store = self.config.embedded_name
        driver = None
        try:
            with _quiet_imports():
                hasher = PageHasher()
                driver = self._build_driver(hasher)
            self._announce(driver, hasher)
            res.info.update(mode=driver.mode, driver=driver.description, hash_function=hasher.source,
                            hash_fallback_reason=hasher.fallback_reason,
                            store=getattr(getattr(driver.backend, "client", None), "description", None))
            self._phases(driver, hasher)
            res.ok = True
        finally:
            if driver is not None:
                res.info["backend_stats"] = driver.backend_stats()
                driver.close()
            if self._created_store is not None:
                from sglang_simm.embedded import reset_servers

                reset_servers(self._created_store)
            res.total_seconds = time.perf_counter() - t_run
        return res

    def _announce(self, driver: _Driver, hasher: PageHasher) -> None:
        g, c = self.geom, self.console
        objects = 1 if g.is_mla else 2
        shape = (f"{g.layer_num} layers, MLA {g.kv_lora_rank}+{g.qk_rope_head_dim}" if g.is_mla
                 else f"{g.layer_num} layers x {g.head_num} KV heads x {g.head_dim}")
        store = getattr(getattr(driver.backend, "client", None), "description", self.config.manager_address)
        c.print(f"[bold]sglang-simm demo[/bold]: HiCache L3 write-back and restore on {store}")
        c.print(f"  model     {g.name} ({shape}, {str(g.dtype).replace('torch.', '')}, "
                f"{g.page_size} tokens a page)")
        c.print(f"  page      {_human(self.page_bytes)} = {objects} object(s) of "
                f"{_human(self.page_bytes // objects)}, layout {self.opts.layout}")
        c.print(f"  requests  A: {self.pages} pages; B: {self.shared} shared with A + {self.new} new")
        c.print(f"  driver    {driver.description}")
        c.print(f"  keys      {hasher.source}"
                + (f" (SGLang's: {hasher.fallback_reason})" if hasher.fallback_reason else ""))

    def _phases(self, driver: _Driver, hasher: PageHasher) -> None:
        res, ps, pb = self.result, self.geom.page_size, self.page_bytes
        N, S, M = self.pages, self.shared, self.new
        rng = random.Random(self.seed)
        tokens_a = [rng.randrange(VOCAB_SIZE) for _ in range(N * ps)]
        tokens_b = tokens_a[: S * ps] + [rng.randrange(VOCAB_SIZE) for _ in range(M * ps)]
        keys_a = hasher(tokens_a, ps)
        keys_b = hasher(tokens_b, ps)
        self._check(len(keys_a) == N and len(keys_b) == N, "the page hash did not give one key per page")
        self._check(keys_b[:S] == keys_a[:S] and keys_b[S] != keys_a[S],
                    "the page keys of the shared prefix differ between the two requests")
        self._check(len(set(keys_a + keys_b[S:])) == N + M, "two pages got the same key")
        pattern = PagePattern(pb)

        # 1. write-back of request A
        slots_a = driver.alloc(N * ps)
        self._check(slots_a is not None, f"the host pool has no room for {N} pages")
        starts_a = self._page_starts(slots_a)
        self._fill(driver, pattern, starts_a, keys_a, "request A's pages in the host pool")
        with self.progress.task("write-back: host pool -> store", N) as update:
            stored, seconds = driver.write(keys_a, tokens_a, slots_a, update)
        phase = Phase("write-back", "A", "write", N, pages_moved=stored, page_bytes=pb, seconds=seconds)
        res.phases.append(phase)
        self._check(stored == N, f"write-back stored {stored} of {N} pages")
        self._ok(f"write-back: {N} pages ({_human(N * pb)}) stored")

        # 2. cold restore of request A into other host slots
        driver.free(slots_a)
        _wipe(driver.host)
        hits, loaded, slots, lookup, load = self._fetch(driver, "request-A", tokens_a, keys_a, None,
                                                        "cold restore: store -> host pool")
        phase = Phase("cold restore", "A", "read", N, hits=hits, pages_moved=loaded, page_bytes=pb,
                      seconds=lookup + load, lookup_seconds=lookup)
        res.phases.append(phase)
        self._check(hits == N, f"cold restore: the lookup found {hits} of {N} pages (hit rate {hits / N:.2f})")
        self._check(loaded == N, f"cold restore: {loaded} of {N} pages loaded")
        starts = self._page_starts(slots)
        phase.relocated_pages = sum(a != b for a, b in zip(starts, starts_a))
        phase.verified_pages = self._verify(driver, pattern, starts, keys_a, range(N), "cold restore")
        self._ok(f"cold restore: {N}/{N} pages found and loaded into other host slots "
                 f"({phase.relocated_pages} moved), every byte checked")
        driver.free(slots)
        _wipe(driver.host)

        # 3. request B: the shared prefix hits, the rest is new
        hits, loaded, slots, lookup, load = self._fetch(driver, "request-B", tokens_b, keys_b, None,
                                                        "request B: lookup and load of the prefix")
        phase = Phase("prefix hit", "B", "read", N, hits=hits, pages_moved=loaded, page_bytes=pb,
                      seconds=lookup + load, lookup_seconds=lookup)
        res.phases.append(phase)
        self._check(hits == S, f"request B: the lookup found {hits} pages, expected exactly the {S} shared ones")
        self._check(loaded == S, f"request B: {loaded} of {S} shared pages loaded")
        phase.verified_pages = self._verify(driver, pattern, self._page_starts(slots), keys_b[:S], range(S),
                                            "request B's shared prefix")
        self._ok(f"request B: lookup found exactly the {S} shared pages of {N}; loaded, every byte checked")

        slots_new = driver.alloc(M * ps)
        self._check(slots_new is not None, f"the host pool has no room for {M} more pages")
        starts_new = self._page_starts(slots_new)
        self._fill(driver, pattern, starts_new, keys_b[S:], "request B's new pages")
        with self.progress.task("request B: write-back of the new pages", M) as update:
            stored, seconds = driver.write(keys_b[S:], tokens_b[S * ps:], slots_new, update)
        phase = Phase("write new", "B", "write", M, pages_moved=stored, page_bytes=pb, seconds=seconds)
        res.phases.append(phase)
        self._check(stored == M, f"request B: write-back stored {stored} of {M} new pages")
        self._ok(f"request B: {M} new pages stored")
        driver.free(slots_new)
        _wipe(driver.host)

        # ... and fetched back by their chained keys, after the prefix.
        hits, loaded, slots_back, lookup, load = self._fetch(
            driver, "request-B-rest", tokens_b[S * ps:], keys_b[S:], keys_b[S - 1],
            "request B: fetch of the new pages")
        phase = Phase("read new", "B", "read", M, hits=hits, pages_moved=loaded, page_bytes=pb,
                      seconds=lookup + load, lookup_seconds=lookup)
        res.phases.append(phase)
        self._check(hits == M, f"request B: the lookup after the prefix found {hits} of {M} new pages")
        self._check(loaded == M, f"request B: {loaded} of {M} new pages loaded")
        starts = self._page_starts(slots_back)
        phase.relocated_pages = sum(a != b for a, b in zip(starts, starts_new))
        phase.verified_pages = self._verify(driver, pattern, starts, keys_b[S:], range(S, N),
                                            "request B's new pages")
        self._ok(f"request B: the {M} new pages read back after the prefix, every byte checked")
        driver.free(slots_back)
        driver.free(slots)


def _rate(gbps: float | None) -> str:
    if gbps is None:
        return "-"
    return f"{gbps:.2f} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.1f} MB/s"


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def render_table(console: Any, result: DemoResult) -> None:
    from rich.table import Table

    table = Table(title=f"HiCache L3 phases ({result.info.get('mode', '?')} path)")
    for col in ("phase", "pages", "hit rate", "bytes", "time", "speed"):
        table.add_column(col, justify="left" if col == "phase" else "right", no_wrap=True)
    for p in result.phases:
        rate = "-" if p.hit_rate is None else f"{p.hit_rate:.2f} ({p.hits}/{p.pages})"
        pages = f"{p.pages_moved}/{p.pages}" if p.kind == "write" else f"{p.pages_moved}"
        table.add_row(f"{p.request}: {p.name}", pages, rate, _human(p.bytes), _duration(p.seconds),
                      _rate(p.gbps))
    console.print(table)


def _write_json(path: str, result: DemoResult) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result.as_dict(), fh, indent=2, default=str)
        fh.write("\n")


def run_demo(console: Any, args: Any, extra: dict[str, Any]) -> int:
    """The ``demo`` command. 0: every check passed; 1: a check failed;
    2: the demo could not run with these options here."""
    if getattr(args, "list_models", False):
        return list_models(console)
    opts = DemoOptions.from_args(args)
    from sglang_simm.tools.demo.hybrid import is_hybrid_preset, run_hybrid_demo

    if is_hybrid_preset(opts.model):  # a KV pool plus a Mamba state pool (v2)
        return run_hybrid_demo(console, opts, extra)
    try:
        demo = Demo(console, opts, extra)
    except (ValueError, DemoSetupError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return EXIT_SETUP
    code = EXIT_OK
    try:
        demo.run()
    except DemoFailure as exc:
        demo.result.error = str(exc)
        console.print(f"[red]FAILED:[/red] {exc}")
        code = EXIT_FAILED
    except DemoSetupError as exc:
        demo.result.error = str(exc)
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_SETUP
    except Exception as exc:  # a bug or an SGLang this demo does not know: show it, keep the JSON
        demo.result.error = f"{type(exc).__name__}: {exc}"
        console.print_exception()
        code = EXIT_FAILED
    result = demo.result
    if result.phases:
        render_table(console, result)
    if code == EXIT_OK:
        console.print(
            f"[green]all checks passed[/green]: {result.verified_pages} restored pages "
            f"({_human(result.verified_bytes)}) match what was written, byte for byte; "
            f"{result.total_seconds:.1f} s, peak memory {_human(_peak_rss_bytes())}")
    if opts.json_path:
        _write_json(opts.json_path, result)
        console.print(f"results written to {opts.json_path}")
    return code
