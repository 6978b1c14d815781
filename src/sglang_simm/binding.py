"""``PoolBinding``: one SGLang host pool bound to SiMM (memory, geometry, keys, views).

A binding is built at attach, in steps that each stand alone here:

1. ``host_regions``: the pool's host tensors, checked;
2. ``pool_geometry``: where every object of a page lies (``geometry``);
3. ``keys.key_layout`` and ``check_parts``: the key prefix and the suffix of
   every object, one per object the pool reports;
4. ``register_regions``: the tensors registered with the client, once;
5. ``ViewTable``: a ``BlockView`` per object, made on first use and kept
   for the pool's life (up to ``VIEW_TABLE_LIMIT``);

plus a ``KeyCache``: a lookup's object keys, kept for the read that
follows. Per call, ``plan`` resolves a batch (page keys and host indices)
to the objects to move, or None. Every step may raise at attach
(``UnsupportedPoolError``); ``plan`` never raises on bad input, it answers
None or leaves the bad pages out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sglang_simm import keys as keyspace
from sglang_simm.client import KVClient
from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import PageGeometry, derive_geometry, derive_region_geometry, page_starts
from sglang_simm.metrics import RateLimitedLog

#: Views kept per pool, at most (``ViewTable``). Past it, views of further
#: pages are made per call (a few us of CPU per view instead of a lookup):
#: memory over speed. Two million views take about 330 MiB with the embedded
#: client (measured) and an estimated 650 MiB with SiMM's, under 1% of any
#: host pool with objects of 64 KiB or more (README, "Views").
VIEW_TABLE_LIMIT = 1 << 21

#: Object keys a pool keeps from its lookups for the reads that follow
#: (``KeyCache``; about 150 bytes each, so a few MiB at most).
KEY_CACHE_LIMIT = 1 << 15

Meta = Callable[[Any], tuple[list[int], list[int]]]


@dataclass
class Plan:
    """One batch resolved to SiMM objects."""

    #: indices (into the caller's keys) of the pages the objects belong to;
    #: None: every page, in order
    pages: np.ndarray | None
    keys: list[str]
    #: one view per key (a list, or a sequence that makes them on demand)
    views: Sequence[Any]
    #: first host slot of every caller page; None where the batch names no
    #: host slots (the copying path's client-owned blocks)
    starts: np.ndarray | None = None

    @property
    def rows(self) -> Any:
        """Index of the planned pages among the caller's keys."""
        return slice(None) if self.pages is None else self.pages


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


class ViewTable:
    """``BlockView``s of the pool's objects, each page's under its first slot.

    Made on first use, for the pages a batch names and the table does not
    hold yet, and kept for the pool's lifetime, up to ``VIEW_TABLE_LIMIT``
    objects; past that, views of pages not kept are made per call. Attach
    therefore costs nothing per page (a million-page pool made two million
    views at attach before: seconds and hundreds of MiB, README), and a
    batch of pages already seen costs one dictionary lookup per page.
    """

    def __init__(self, geometry: PageGeometry, view: Callable[[int, int, Any], Any], part_mrs: list[Any]):
        self._geometry = geometry
        self._view = view
        #: the memory region of each part, in part order
        self._part_mrs = part_mrs
        self._sizes = geometry.sizes.tolist()
        self._by_start: dict[int, tuple[Any, ...]] | None = {}
        self._max_pages = max(0, VIEW_TABLE_LIMIT // geometry.parts)
        self._slots = geometry.num_pages * geometry.page_size

    def __len__(self) -> int:
        """Pages whose views are kept."""
        return len(self._by_start or ())

    def _make(self, starts: np.ndarray) -> list[Any]:
        n = len(starts)
        ptrs = self._geometry.pointers(starts).tolist()
        view = self._view
        return [view(p, s, m) for p, s, m in zip(ptrs, self._sizes * n, self._part_mrs * n)]

    def of_pages(self, starts: np.ndarray) -> list[Any] | None:
        """Every view of the pages whose page-aligned first slots are
        ``starts``, page-major; None when one of them is outside the pool
        (or the table is closed)."""
        by_start = self._by_start
        if by_start is None:
            return None
        try:
            return list(chain.from_iterable(map(by_start.__getitem__, starts.tolist())))
        except KeyError:  # a page not seen yet, or outside the pool
            return self._add(by_start, starts)

    def _add(self, by_start: dict[int, tuple[Any, ...]], starts: np.ndarray) -> list[Any] | None:
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) >= self._slots):
            return None
        wanted = starts.tolist()
        new = [s for s in dict.fromkeys(wanted) if s not in by_start]
        parts = self._geometry.parts
        made = self._make(np.asarray(new, dtype=np.int64))
        fresh = {s: tuple(made[i * parts:(i + 1) * parts]) for i, s in enumerate(new)}
        if len(by_start) + len(fresh) <= self._max_pages:
            # Threads may add the same page at once: either's views are right.
            by_start.update(fresh)
        get = by_start.get
        return list(chain.from_iterable(fresh[s] if s in fresh else get(s) for s in wanted))

    def close(self) -> None:
        self._by_start = None
        self._part_mrs = [None] * len(self._part_mrs)


class KeyCache:
    """The object keys of one pool's pages: ``prefix + page key + suffix``.

    Serving's page keys are new on every lookup, so a cache of keys per page
    never hits on its first use and costs more to fill than it saves (an
    earlier version: 113 against 40 us for an exists of 128 new pages, and
    milliseconds of GIL to empty it when full). What does repeat is a batch:
    SGLang's prefetch thread looks a batch up (``batch_exists``), then its
    I/O thread reads the same batch, or its first pages after the hit
    all-reduce, both cut at ``STORAGE_BATCH_SIZE`` from the same first page.
    So a lookup keeps its batch's object keys (``remember``), under the
    batch's first page key, for the one call that reads it next; at most
    ``KEY_CACHE_LIMIT`` object keys are kept, the oldest batch dropped first.
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
            if not keyspace.keys_fit(page_keys, self.budget):
                return None
            out = keyspace.object_keys(self.prefix, page_keys, self.suffixes)
        if remember and page_keys:
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
    """One host pool bound to SiMM: its memory regions, geometry and keys.

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
        self.mrs = register_regions(client, tensors)
        try:
            self.views = ViewTable(g, client.view, [self.mrs[r] for r in part_region.tolist()])
        except BaseException:
            self._deregister()
            raise

    def plan(
        self, page_keys: Sequence[str], host_indices: Any, log: RateLimitedLog
    ) -> Plan | None:
        """Resolve a batch; None (all misses) when the indices are unusable.

        ``pages`` is None when every page key is usable (the common case,
        its keys from the cache); otherwise it lists the usable pages.
        """
        n = len(page_keys)
        ps = self.page_size
        indices = _as_numpy(host_indices)
        starts = page_starts(indices, ps, n) if indices is not None else None
        if starts is None:
            log(
                "bad_indices",
                "SiMM: host_indices do not hold %d whole, page-aligned pages of %d slots "
                "(got %s); treating the batch as misses",
                n, ps, None if indices is None else indices.shape,
            )
            return None
        views = self.views.of_pages(starts)
        if views is None:
            log("bad_indices", "SiMM: host_indices outside the host pool; treating the batch as misses")
            return None
        obj_keys = self.keys.of_all(page_keys)
        if obj_keys is not None:
            return Plan(pages=None, keys=obj_keys, views=views, starts=starts)
        pages, obj_keys = self.keys.of_usable(page_keys)
        if len(pages) != n:
            log("bad_key", "SiMM: %d page keys are not strings within %d bytes; those pages miss",
                n - len(pages), self.keys.budget)
        ids = self.geometry.object_ids(pages).tolist()
        return Plan(pages=pages, keys=obj_keys, views=[views[i] for i in ids], starts=starts)

    def overrun_pages(self, plan: Plan, got: np.ndarray) -> np.ndarray:
        """Planned pages (rows of ``got``, one per planned page) whose bytes
        an object read back longer than its view may have overwritten.

        SiMM's client bounds a get by the view's whole registered region,
        not by the view (docs/upstream-simm-get-bound.md), so an object of
        ``got`` bytes into a view of ``size`` bytes writes
        ``[ptr + size, min(ptr + got, region end))`` too. In every layout the
        host pool's objects are plain byte ranges of its regions (page_first
        and page_first_direct: a K object runs into the next pages' K, the
        last into the first V; page_head: into the next head group's K, then
        the next page's; MLA and Mamba: into the next slots), so comparing
        byte ranges finds every planned page that range touches, in any
        layout, whatever order the client wrote the objects in. Pages
        outside this batch (other batches in flight, pages loaded earlier)
        may have been reached too; they are not ours to recall.
        """
        parts = self.parts
        rows = got.reshape(-1, parts)
        over = np.flatnonzero((rows > self.sizes[None, :]).ravel())
        hit = np.zeros(rows.shape[0], dtype=bool)
        if not over.size:
            return hit
        if plan.starts is None:
            # client-owned blocks (the copying path): where they lie, and
            # so which of them an overrun reached, is the client's business
            hit[:] = True
            return hit
        starts = plan.starts[plan.rows]
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
        self.views.close()
        self._deregister()

    def _deregister(self) -> None:
        mrs, self.mrs = self.mrs, []
        for mr in mrs:
            if mr is not None:
                self.client.deregister(mr)


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
