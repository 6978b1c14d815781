"""``PoolBinding``: one SGLang host pool bound to SiMM (memory, geometry, keys, views).

A binding is built at attach, in steps that each stand alone here:

1. ``host_regions``: the pool's host tensors, checked;
2. ``pool_geometry``: where every object of a page lies (``geometry``);
3. ``keys.key_layout`` and ``check_parts``: the key prefix and the suffix of
   every object, one per object the pool reports;
4. ``register_regions``: the tensors registered with the client, once;

plus a ``KeyCache``: a lookup's object keys, kept for the read that
follows. Per call, ``starts`` checks a batch's host indices and ``views``
makes the batch's ``BlockView``s from the geometry's pointer arithmetic,
and none is kept: a view per object kept for the pool's life (two million
for a million-page pool) was two million objects for every full garbage
collection of the scheduler to walk, and a bounded cache of them only
hits when SGLang hands out a host page again soon, which its first-in
first-out host allocator does only after the whole free list.

A binding also counts the data-path calls using it (``enter``/``leave``),
so a replaced or closed pool's memory is deregistered once *its* calls
are over (``retire``, ``drained``), whatever other pools are doing.
Every attach step may raise (``UnsupportedPoolError``); the per-call
methods never raise on bad input, they answer None.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sglang_simm import keys as keyspace
from sglang_simm.client import KVClient
from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import (
    PageGeometry,
    derive_geometry,
    derive_region_geometry,
    one_page_start,
    page_starts,
)

#: Up to this many pages a batch's pointers are worked out in plain Python:
#: below it numpy's fixed cost per call (about a microsecond per operation)
#: is more than the arithmetic (docs/backend-core.md).
SMALL_BATCH = 16

#: Object keys a pool keeps from its lookups for the reads that follow
#: (``KeyCache``; about 150 bytes each, so a few MiB at most; strings,
#: which the garbage collector does not track).
KEY_CACHE_LIMIT = 1 << 15

Meta = Callable[[Any], tuple[list[int], list[int]]]


# ------------------------------------------------------------------ steps


def host_regions(pool: Any, regions: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The host tensors that hold the pool's pages: ``regions`` when given
    (a Mamba pool's temporal and conv states), else its one ``kv_buffer``."""
    if regions is None:
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise UnsupportedPoolError(
                f"{type(pool).__name__}.kv_buffer is not one host tensor; "
                "this backend registers the host pool as one memory region"
            )
        regions = [buffer]
    regions = list(regions)
    if not regions or any(
        not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0 for t in regions
    ):
        raise UnsupportedPoolError(f"{type(pool).__name__}: every region must be a non-empty host tensor")
    return regions


def pool_geometry(pool: Any, meta: Meta, regions: Sequence[torch.Tensor]) -> tuple[PageGeometry, np.ndarray]:
    """The pool's page geometry, sampled from ``meta``, and the region index
    of every part."""
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in regions]
    common = dict(
        page_size=int(pool.page_size),
        pool_tokens=int(pool.size),
        make_indices=lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64),
    )
    try:
        if len(spans) == 1:
            geometry = derive_geometry(meta, buffer_start=spans[0][0], buffer_bytes=spans[0][1], **common)
            return geometry, np.zeros(geometry.parts, dtype=np.int64)
        return derive_region_geometry(meta, regions=spans, **common)
    except UnsupportedPoolError:
        raise
    except Exception as exc:
        raise UnsupportedPoolError(
            f"cannot read the page geometry of {type(pool).__name__} "
            f"(layout {getattr(pool, 'layout', '?')!r}): {type(exc).__name__}: {exc}"
        ) from exc


def check_parts(pool: Any, identity: keyspace.PageIdentity, geometry: PageGeometry, suffixes: Sequence[str]) -> None:
    """The key layout names exactly the objects the pool reports per page."""
    if len(suffixes) != geometry.parts:
        raise UnsupportedPoolError(
            f"{type(pool).__name__} reports {geometry.parts // geometry.chunks} "
            f"objects per page, expected {len(suffixes) // geometry.chunks} "
            f"for {'MLA' if identity.is_mla else 'MHA'}"
        )


def register_regions(client: KVClient, regions: Sequence[torch.Tensor]) -> list[Any]:
    """Register every region with the client; all or none."""
    mrs: list[Any] = []
    try:
        for t in regions:
            mrs.append(client.register(t))
    except BaseException:
        for mr in mrs:
            client.deregister(mr)
        raise
    return mrs


class KeyCache:
    """The object keys of one pool's pages: ``prefix + page key + suffix``.

    Serving's page keys are new on every lookup, so a cache of keys per page
    would never hit on first use and would cost more to fill than it saves.
    What repeats is a batch: SGLang's prefetch thread looks a batch up
    (``batch_exists``), then its I/O thread reads the same batch, or its
    first pages after the hit all-reduce, both cut at ``STORAGE_BATCH_SIZE``
    from the same first page. So a lookup keeps its batch's object keys
    (``remember``), under the batch's first page key, for the one call that
    reads it next; at most ``KEY_CACHE_LIMIT`` object keys are kept, the
    oldest batch dropped first.
    """

    def __init__(self, prefix: str, suffixes: tuple[str, ...]):
        self.prefix = prefix
        self.suffixes = suffixes
        #: the longest page key whose object keys fit SiMM's limit
        self.budget = keyspace.max_page_key_bytes(prefix, suffixes)
        #: first page key -> (the batch's page keys, their object keys)
        self._batches: OrderedDict[str, tuple[list[str], list[str]]] = OrderedDict()
        self._kept = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Object keys kept."""
        return self._kept

    def of_all(self, page_keys: Sequence[str], *, remember: bool = False) -> list[str] | None:
        """Object keys of every page, or None when any page key is unusable.
        ``remember``: keep them for the next call that names the same pages
        (or the first of them), which takes them."""
        out = self._take(page_keys) if self._batches else None
        if out is None:
            out = keyspace.batch_object_keys(self.prefix, page_keys, self.suffixes, self.budget)
            if out is None:
                return None
        if remember:
            # kept again when taken: another request's lookup of the same
            # batch (a shared prefix) leaves it for the reads to come
            self._keep(list(page_keys), out)
        return out

    def _take(self, page_keys: Sequence[str]) -> list[str] | None:
        try:
            with self._lock:
                kept = self._batches.pop(page_keys[0], None)
                if kept is not None:
                    self._kept -= len(kept[1])
        except (TypeError, IndexError):  # an unhashable page key, or no pages
            return None
        if kept is None:
            return None
        pages, objs = kept
        n = len(page_keys)
        # The same str objects (SGLang slices one list of hashes): identity
        # makes this compare cheap; equal strings of other objects match too.
        if n > len(pages) or pages[:n] != (page_keys if page_keys.__class__ is list else list(page_keys)):
            return None
        return objs if n == len(pages) else objs[: n * len(self.suffixes)]

    def _keep(self, pages: list[str], objs: list[str]) -> None:
        if len(objs) > KEY_CACHE_LIMIT:
            return
        batches = self._batches
        # The prefetch thread keeps, the I/O thread takes: one short lock.
        with self._lock:
            old = batches.pop(pages[0], None)
            if old is not None:
                self._kept -= len(old[1])
            batches[pages[0]] = (pages, objs)
            self._kept += len(objs)
            while self._kept > KEY_CACHE_LIMIT:
                _, (_, dropped) = batches.popitem(last=False)
                self._kept -= len(dropped)

    def of_usable(self, page_keys: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """The usable pages (indices into ``page_keys``) and their object keys."""
        fits = [keyspace.key_fits(k, self.budget) for k in page_keys]
        pages = np.flatnonzero(fits) if not all(fits) else np.arange(len(page_keys))
        usable = page_keys if len(pages) == len(page_keys) else [page_keys[i] for i in pages.tolist()]
        return pages, keyspace.object_keys(self.prefix, usable, self.suffixes)


# ---------------------------------------------------------------- binding


class PoolBinding:
    """One host pool bound to SiMM: its memory regions, geometry and keys,
    and the data-path calls using it.

    Everything per pool that does not change per call is computed here once.
    A pool is one region (its ``kv_buffer``) unless ``regions`` names several
    host tensors (a Mamba pool's temporal and conv states); each object is
    then viewed through the region that holds it. ``part_names`` names a
    side pool's objects when they are not K/V halves (``keys.named_part_suffixes``).
    """

    def __init__(
        self,
        *,
        client: KVClient,
        pool: Any,
        identity: keyspace.PageIdentity,
        scheme: str,
        meta: Meta,
        regions: Sequence[torch.Tensor] | None = None,
        part_names: Sequence[str] | None = None,
    ):
        self.pool = pool
        self.client = client
        tensors = host_regions(pool, regions)
        self.geometry, part_region = pool_geometry(pool, meta, tensors)
        g = self.geometry
        self.identity = replace(
            identity, object_bytes=g.object_bytes,
            dtype=keyspace.pool_dtype(identity.dtype, [str(t.dtype) for t in tensors]),
        )
        self.prefix, self.suffixes = keyspace.key_layout(self.identity, scheme, g.chunks, part_names)
        check_parts(pool, self.identity, g, self.suffixes)
        self.keys = KeyCache(self.prefix, self.suffixes)
        self.page_size = g.page_size
        self.parts = g.parts
        self.sizes = g.sizes
        self.sizes_list = g.sizes.tolist()
        self.page_bytes = g.page_bytes
        self.slots = g.num_pages * g.page_size
        #: where each part starts in SGLang's flat page (``get_data_page``
        #: flattens a slice of the pool's buffer: its parts in address
        #: order; K of every head group, then V, under ``page_head``)
        order = np.argsort(g.base, kind="stable")
        offsets = np.empty_like(g.sizes)
        offsets[order] = np.cumsum(g.sizes[order]) - g.sizes[order]
        self.flat_offsets = offsets
        #: where the registered region holding each part ends (an object
        #: read past its view can reach up to there, ``overrun_pages``)
        self.part_region_end = np.asarray(
            [tensors[r].data_ptr() + tensors[r].numel() * tensors[r].element_size() for r in part_region.tolist()],
            dtype=np.int64,
        )
        #: data-path calls using this binding now (list append/pop are
        #: atomic: cheaper than a lock on every call)
        self.calls: list[None] = []
        #: set once replaced or closed: no call may start on it any more
        self.retired = False
        #: set once retired and no call is using it: its memory may go
        self.drained = threading.Event()
        self.mrs = register_regions(client, tensors)
        #: the memory region of each part, in part order
        self.part_mrs = [self.mrs[r] for r in part_region.tolist()]
        self._view = client.view
        g = self.geometry
        #: the pointer formula's terms as Python ints, for small batches
        self._stride_list = (
            [int(x) for x in g.token_stride] if isinstance(g.token_stride, np.ndarray)
            else [int(g.token_stride)] * g.parts
        )
        self._base_list = g.base.tolist()

    # ------------------------------------------------------------ in flight

    def enter(self) -> bool:
        """Count a call in; False (and nothing counted) once retired. The
        flag is read after the count: a ``retire`` that saw no call sets it
        first, so the call sees it and backs off."""
        calls = self.calls
        calls.append(None)
        if self.retired:
            self.leave()
            return False
        return True

    def leave(self) -> None:
        calls = self.calls
        calls.pop()
        if self.retired and not calls:
            self.drained.set()

    def retire(self) -> bool:
        """No call starts on this binding from now on; True when none is
        using it (``drained`` is set), else ``drained`` is set by the last
        call to leave."""
        self.retired = True
        if not self.calls:
            self.drained.set()
        return self.drained.is_set()

    # ---------------------------------------------------------------- per call

    def starts(self, host_indices: Any, n: int) -> np.ndarray | list[int] | None:
        """First slot of every page of a batch of ``n``, or None when the
        indices are not ``n`` distinct whole pages inside this pool."""
        indices = _as_numpy(host_indices)
        if indices is None:
            return None
        if (n == 1 and indices.ndim == 1 and indices.shape[0] == self.page_size
                and indices.dtype in _INDEX_DTYPES):
            # one page: one integer comparison over its bytes, no numpy arithmetic
            first = one_page_start(indices.tobytes(), indices.itemsize, self.page_size, self.slots)
            return None if first is None else [first]
        return page_starts(indices, self.page_size, n, self.slots)

    def views(self, starts: Any) -> list[Any]:
        """The ``BlockView`` of every object of the pages at ``starts`` (their
        first slots, a list or an array), page-major, made now."""
        n = len(starts)
        return list(map(self._view, self.pointers(starts), self.sizes_list * n, self.part_mrs * n))

    def pointers(self, starts: Any) -> list[int]:
        """Object addresses of the pages at ``starts``, page-major, as Python
        ints: in Python for small batches, numpy above ``SMALL_BATCH``."""
        if len(starts) > SMALL_BATCH:
            return self.geometry.pointers(np.asarray(starts)).tolist()
        if starts.__class__ is not list:
            starts = starts.tolist()
        if self.parts == 2:
            (b0, b1), (t0, t1) = self._base_list, self._stride_list
            out: list[int] = []
            for s in starts:
                out += (b0 + s * t0, b1 + s * t1)
            return out
        bases = list(zip(self._base_list, self._stride_list))
        return [b + s * t for s in starts for b, t in bases]

    def overrun_pages(self, starts: np.ndarray | None, got: np.ndarray) -> np.ndarray:
        """Pages (rows of ``got``, one per page at ``starts``) whose bytes
        an object read back longer than its view may have overwritten.

        SiMM's client bounds a get by the view's whole registered region,
        not by the view (docs/upstream-simm-get-bound.md), so an object of
        ``got`` bytes into a view of ``size`` bytes writes
        ``[ptr + size, min(ptr + got, region end))`` too. In every layout the
        host pool's objects are plain byte ranges of its regions (page_first
        and page_first_direct: a K object runs into the next pages' K, the
        last into the first V; page_head: into the next head group's K, then
        the next page's; MLA and Mamba: into the next slots), so comparing
        byte ranges finds every page of the batch that range touches, in any
        layout, whatever order the client wrote the objects in. Pages
        outside this batch (other batches in flight, pages loaded earlier)
        may have been reached too; they are not ours to recall.
        ``starts`` None: client-owned blocks (the copying path), whose place
        is the client's business, so every page of the batch misses.
        """
        parts = self.parts
        rows = got.reshape(-1, parts)
        over = np.flatnonzero((rows > self.sizes[None, :]).ravel())
        hit = np.zeros(rows.shape[0], dtype=bool)
        if not over.size:
            return hit
        if starts is None:
            hit[:] = True
            return hit
        ptrs = self.geometry.pointers(np.asarray(starts, dtype=np.int64))
        sizes = np.tile(self.sizes, rows.shape[0])
        ends = np.tile(self.part_region_end, rows.shape[0])
        flat = got.reshape(-1)
        for i in over.tolist():
            lo = ptrs[i] + sizes[i]
            hi = min(ptrs[i] + int(flat[i]), ends[i])
            reached = (ptrs < hi) & (ptrs + sizes > lo)
            hit[np.flatnonzero(reached) // parts] = True
            hit[i // parts] = True
        return hit

    def page_object_keys(self, page_keys: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """The usable pages of a batch and their object keys (no indices)."""
        return self.keys.of_usable(page_keys)

    def close(self) -> None:
        """Deregister the pool's memory (once)."""
        mrs, self.mrs = self.mrs, []
        self.part_mrs = [None] * len(self.part_mrs)
        for mr in mrs:
            if mr is not None:
                self.client.deregister(mr)


#: index dtypes the one-page check reads as raw bytes (``one_page_start``)
_INDEX_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


def _as_numpy(host_indices: Any) -> np.ndarray | None:
    if isinstance(host_indices, torch.Tensor):
        try:
            return host_indices.numpy()  # a view, cheaper to inspect than the tensor
        except TypeError:  # not on the CPU (reading .device costs more than this)
            return host_indices.cpu().numpy()
    if isinstance(host_indices, np.ndarray):
        return host_indices
    try:
        return np.asarray(host_indices, dtype=np.int64)
    except (TypeError, ValueError):
        return None
