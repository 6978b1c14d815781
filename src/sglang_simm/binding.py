"""``PoolBinding``: one SGLang host pool bound to SiMM (memory, geometry, keys), and its batches.

A binding is built at attach (``bind_kv_pool``, ``bind_side_pool``), in
steps that each stand alone here:

1. ``host_regions``: the pool's host tensors, checked;
2. ``pool_geometry``: where every object of a page lies (``geometry``);
3. ``keys.key_layout`` and ``check_parts``: the key prefix and the suffix of
   every object, one per object the pool reports;
4. ``register_regions``: the tensors registered with the client, once.

Every attach step may raise (``UnsupportedPoolError``): a pool we refuse
stops the server with the fix.

Per call, the binding turns a batch into one ``Batch``: ``lookup`` (page
keys to object keys) or ``batch`` (page keys and host indices to object
keys and views). Views are made per batch and none is kept from one call
to the next (why: docs/backend-core.md, "No Python object per page").

A binding also counts the data-path calls using it (``enter``/``leave``),
so a replaced or closed pool's memory is deregistered once *its* calls
are over (``retire``, ``drained``), whatever other pools are doing.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from sglang_simm import hybrid, keys as keyspace
from sglang_simm.client import KVClient
from sglang_simm.errors import PoolLeftOutError, UnsupportedPoolError
from sglang_simm.geometry import (
    SUPPORTED_LAYOUTS,
    PageGeometry,
    derive_geometry,
    derive_region_geometry,
    page_starts,
)

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.config import SiMMConfig

Meta = Callable[[Any], tuple[list[int], list[int]]]


# ------------------------------------------------------------------ steps


def host_regions(pool: Any, regions: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The host tensors that hold the pool's pages: ``regions`` when given
    (a Mamba pool's temporal and conv states), else its ``kv_buffer``: one
    tensor, or a K and a V tensor."""
    if regions is None:
        buffer = pool.kv_buffer
        if isinstance(buffer, (tuple, list)) and len(buffer) == 2 and hasattr(pool, "v_head_dim"):
            # K and V in buffers of their own, each with its stride
            # (AsymmetricMHATokenToKVPoolHost: MiMo-V2's head sizes differ)
            regions = list(buffer)
        elif not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise UnsupportedPoolError(
                f"{type(pool).__name__}.kv_buffer is neither one host tensor nor a K/V pair of them; "
                "sglang-simm registers a KV host pool as one region, or two for K and V"
            )
        else:
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
    except NotImplementedError as exc:
        # SGLang's own refusal to describe the pool's pages for storage
        # (MXFP8 KV: its scales live outside kv_buffer): no L3 backend can
        # store it, so say what to change.
        fix = (
            "serve this model with --kv-cache-dtype auto (or fp8_e4m3) to keep L3, or leave "
            "--hicache-storage-backend off"
            if "mxfp8" in type(pool).__name__.lower()
            else "leave --hicache-storage-backend off for this model"
        )
        raise UnsupportedPoolError(
            f"SGLang does not describe the pages of {type(pool).__name__} for L3 storage ({exc}); "
            f"sglang-simm cannot store this pool: {fix}"
        ) from exc
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


# ----------------------------------------------------------------- attach


def kv_pool_of(pool: Any) -> Any:
    """The KV host pool SGLang handed over (the anchor, where SGLang hands a
    hybrid model's pools over as a ``HostPoolGroup``). Raises on a pool with
    no ``kv_buffer`` that is not a logical anchor (``is_logical_anchor``)."""
    anchor = getattr(pool, "anchor_entry", None)
    if anchor is not None and getattr(anchor, "host_pool", None) is not None:
        pool = anchor.host_pool
    if getattr(pool, "kv_buffer", None) is None and not is_logical_anchor(pool):
        raise UnsupportedPoolError(
            f"{type(pool).__name__} has no kv_buffer and is not a logical KV anchor; "
            "sglang-simm stores KV host pools that hold their pages in host memory"
        )
    return pool


def is_logical_anchor(pool: Any) -> bool:
    """A KV anchor that holds no KV at all (DeepSeek V4's ``LogicalHostPool``:
    page-aligned token slots, no tensor, ``get_page_buffer_meta`` answers
    None): its pages' bytes live in the side pools SGLang registers beside
    it, which this backend stores."""
    if getattr(pool, "kv_buffer", None) is not None or not callable(getattr(pool, "get_page_buffer_meta", None)):
        return False
    try:
        return pool.get_page_buffer_meta(torch.arange(0, int(pool.page_size), dtype=torch.int64)) is None
    except Exception:
        return False


def page_identity(storage_config: Any, pool: Any, pool_name: str, tag: str | None) -> keyspace.PageIdentity:
    """What gives ``pool``'s pages their meaning, from SGLang's storage
    config (``HiCacheStorageConfig``; None: one rank, no model name)."""
    sc = storage_config
    g = lambda name, default: getattr(sc, name, default) if sc is not None else default  # noqa: E731
    return keyspace.PageIdentity(
        model_name=str(g("model_name", "") or ""),
        is_mla=bool(g("is_mla_model", False)),
        tp_size=int(g("tp_size", 1) or 1),
        tp_rank=int(g("tp_rank", 0) or 0),
        pp_size=int(g("pp_size", 1) or 1),
        pp_rank=int(g("pp_rank", 0) or 0),
        page_size=int(pool.page_size),
        dtype=str(getattr(pool, "dtype", "")),
        layout=str(getattr(pool, "layout", "")),
        object_bytes=(),
        extra_backend_tag=tag,
        attn_cp_size=int(g("attn_cp_size", 1) or 1),
        attn_cp_rank=int(g("attn_cp_rank", 0) or 0),
        dcp_size=int(g("dcp_size", 1) or 1),
        dcp_rank=int(g("dcp_rank", 0) or 0),
        # SGLang sets should_split_heads only where tp_lcm_size > tp_size;
        # ranks at tp_lcm_size must name their heads the same way to share.
        tp_lcm_size=(
            int(g("tp_lcm_size", 0) or 0) or None
            if getattr(pool, "layout", None) == "page_head" and not g("is_mla_model", False)
            else None
        ),
        pool=pool_name,
    )


def bind_kv_pool(client: KVClient, pool: Any, storage_config: Any, config: SiMMConfig) -> PoolBinding:
    """Bind the KV host pool (``kv_pool_of``'s): its layout checked, its
    identity, geometry and keys derived, its memory registered."""
    layout = getattr(pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise UnsupportedPoolError(
            f"sglang-simm supports the host pool layouts {', '.join(SUPPORTED_LAYOUTS)}, "
            f"not {layout!r}: start SGLang with --hicache-mem-layout page_first "
            "(page_head for heterogeneous TP with tp_lcm_size)"
        )
    identity = page_identity(storage_config, pool, hybrid.KV, config.extra_backend_tag)
    meta = pool.get_page_buffer_meta
    if identity.split_factor > 1:
        split = identity.split_factor
        meta = lambda idx: pool.get_split_heads_page_buffer_meta(idx, split)  # noqa: E731
    return PoolBinding(client=client, pool=pool, identity=identity, scheme=config.key_scheme, meta=meta)


def bind_side_pool(client: KVClient, pool: Any, name: str, storage_config: Any, config: SiMMConfig) -> PoolBinding:
    """Bind a hybrid side pool (Mamba, SWA, draft, indexers, DeepSeek V4's
    pools) called ``name``: left out (PoolLeftOutError) where only some
    ranks would write it (``hybrid.writer_only_reason``), else bound as
    the KV pool is."""
    sc = storage_config
    model_is_mla = bool(getattr(sc, "is_mla_model", False))
    layout = hybrid.describe_side_pool(pool, name, model_is_mla=model_is_mla)
    left_out = hybrid.writer_only_reason(
        layout, name, type(pool).__name__, model_is_mla=model_is_mla,
        tp_size=int(getattr(sc, "tp_size", 1) or 1), dcp_size=int(getattr(sc, "dcp_size", 1) or 1),
    )
    if left_out:
        raise PoolLeftOutError(left_out)
    identity = replace(
        page_identity(sc, pool, name, config.extra_backend_tag), is_mla=layout.replicated, tp_lcm_size=None
    )
    return PoolBinding(
        client=client, pool=pool, identity=identity, scheme=config.key_scheme,
        meta=layout.meta or pool.get_page_buffer_meta, regions=layout.regions, part_names=layout.part_names,
    )


# ------------------------------------------------------------------ batch


class Batch(NamedTuple):
    """One pool's batch resolved to SiMM objects: what a data-path call
    hands the client, and what its answer is read against."""

    binding: PoolBinding
    #: pages asked for
    n: int
    #: the pages resolved (ascending indices into the ``n``): those whose
    #: page key is usable (``keys.key_fits``); the rest miss
    rows: list[int]
    #: object keys of the resolved pages, page-major
    keys: list[str]
    #: one view per key (empty for a lookup, which moves no bytes)
    views: Sequence[Any]
    #: first host slot of every resolved page; None where the bytes are not
    #: in the host pool (a lookup; the copying path's client-owned blocks)
    starts: np.ndarray | None


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
        #: the longest page key whose object keys fit SiMM's limit
        self.budget = keyspace.max_page_key_bytes(self.prefix, self.suffixes)
        self.page_size = g.page_size
        self.parts = g.parts
        self.sizes = g.sizes
        self.sizes_list = g.sizes.tolist()
        self.page_bytes = g.page_bytes
        #: token slots the pool holds (a page's first slot lies below)
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

    def describe(self) -> str:
        """One line for the attach log: pages, objects, sizes, regions, chunks."""
        g = self.geometry
        return (
            f"{type(self.pool).__name__} ({getattr(self.pool, 'layout', '?')}, {g.num_pages} pages of "
            f"{g.page_size} slots, {g.parts} objects of "
            f"{'/'.join(str(s) for s in sorted(set(self.sizes_list)))} bytes per page in "
            f"{len(self.mrs)} region(s){f', split in {g.chunks} chunks' if g.chunks > 1 else ''}), "
            f"key prefix {self.prefix!r}"
        )

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

    def lookup(self, page_keys: Sequence[Any], wanted: Sequence[bool] | None = None) -> Batch:
        """The object keys of a batch's pages, no bytes to move: every page
        whose key is usable (a string within ``budget`` bytes) and, where
        ``wanted`` is given, wanted; the others are left out of ``rows``."""
        rows, usable = self._usable(page_keys, wanted)
        return Batch(self, len(page_keys), rows, keyspace.object_keys(self.prefix, usable, self.suffixes), [], None)

    def batch(self, page_keys: Sequence[Any], host_indices: Any) -> Batch | None:
        """A batch of pages to move between SiMM and these host slots: its
        object keys and one view per object (``lookup``, ``views``); None
        when ``host_indices`` are not ``len(page_keys)`` distinct whole pages
        inside this pool (``geometry.page_starts``), a batch we refuse to
        act on rather than read or write the wrong slots."""
        indices = _as_numpy(host_indices)
        starts = None if indices is None else page_starts(indices, self.page_size, len(page_keys), self.slots)
        if starts is None:
            return None
        rows, usable = self._usable(page_keys)
        starts = starts[rows]
        return Batch(self, len(page_keys), rows, keyspace.object_keys(self.prefix, usable, self.suffixes),
                     self.views(starts), starts)

    def _usable(self, page_keys: Sequence[Any], wanted: Sequence[bool] | None = None) -> tuple[list[int], list[str]]:
        """The pages to resolve (indices) and their page keys."""
        budget = self.budget
        rows = [i for i, k in enumerate(page_keys) if keyspace.key_fits(k, budget)]
        if wanted is not None:
            rows = [i for i in rows if wanted[i]]
        return rows, [page_keys[i] for i in rows]

    def page_key(self, object_key: str) -> str | None:
        """The page key one of this pool's object keys names (``prefix +
        page key + suffix``), or None when ``object_key`` is not one of its."""
        if not isinstance(object_key, str) or not object_key.startswith(self.prefix):
            return None
        start = len(self.prefix)
        for suffix in self.suffixes:
            if object_key.endswith(suffix) and len(object_key) > start + len(suffix):
                return object_key[start:len(object_key) - len(suffix)]
        return None

    def views(self, starts: np.ndarray) -> list[Any]:
        """The view of every object of the pages at ``starts`` (their first
        slots), page-major, made now."""
        n = len(starts)
        ptrs = self.geometry.pointers(starts).tolist()
        return list(map(self.client.view, ptrs, self.sizes_list * n, self.part_mrs * n))

    def overrun_pages(self, starts: np.ndarray | None, got: np.ndarray) -> np.ndarray:
        """Pages (rows of ``got``, one per page at ``starts``) whose bytes
        an object read back longer than its view may have overwritten.

        SiMM's client bounds a get by the view's registered region, not by
        the view (docs/upstream-simm-get-bound.md), so an object of ``got``
        bytes into a view of ``size`` bytes writes ``[ptr + size, min(ptr +
        got, region end))`` too; in every layout objects are plain byte
        ranges of their regions, so comparing byte ranges finds every page
        of the batch it touches (docs/keys-and-faults.md). ``starts`` None:
        client-owned blocks (the copying path), so every page misses.
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

    def close(self) -> None:
        """Deregister the pool's memory (once)."""
        mrs, self.mrs = self.mrs, []
        self.part_mrs = [None] * len(self.part_mrs)
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
