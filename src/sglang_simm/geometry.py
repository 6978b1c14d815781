"""Page geometry: where each object of a KV page lies in the host pool.

SGLang's ``get_page_buffer_meta`` walks pages in a Python loop on every
call. Its pointer formula is affine in the page's index::

    ptr(page, part) = base[part] + page * page_stride      (page = first slot // page_size)

for every layout we accept (a stride per page, not per token slot), so it is
sampled once at registration (first, second and last page), checked, and then
evaluated with numpy for a whole batch. Sampling the pool's own method keeps
us right across SGLang releases whose formulas differ. Objects larger than
SiMM's value limit are cut into equal chunks: more parts, with their own bases.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sglang_simm.errors import MAX_VALUE_BYTES, UnsupportedPoolError

#: Layouts whose page objects are contiguous and affine in the slot index.
SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")

_LAYOUT_FIX = (
    "start SGLang with --hicache-mem-layout page_first (or page_first_direct; "
    "page_head for heterogeneous TP)"
)


@dataclass(frozen=True)
class PageGeometry:
    """How one page of the pool maps onto SiMM objects."""

    page_size: int
    #: pages the pool holds
    num_pages: int
    #: bytes between the starts of two consecutive pages; one per part
    #: (an array) when the parts live in separate buffers of their own
    #: stride (``derive_region_geometry``)
    page_stride: int | np.ndarray
    #: byte address of each object of slot 0, in part order
    base: np.ndarray
    #: byte size of each object, in part order
    sizes: np.ndarray
    #: chunks each pool object was cut into (1: none)
    chunks: int
    #: bytes of one unchunked object, as the pool reports it
    object_bytes: tuple[int, ...]

    @property
    def parts(self) -> int:
        return int(self.base.shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self.sizes.sum())

    def pointers(self, first_slots: np.ndarray) -> np.ndarray:
        """Object addresses for pages starting at ``first_slots`` (page-aligned),
        page-major; in int64, as ``page * stride`` passes 2^31 in a big pool."""
        pages = np.asarray(first_slots).astype(np.int64, copy=False) // self.page_size
        return (pages[:, None] * self.page_stride + self.base[None, :]).ravel()


def chunk_count(object_bytes: int, limit: int = MAX_VALUE_BYTES) -> int:
    return -(-object_bytes // limit)


def derive_geometry(
    meta: Callable[[Any], tuple[list[int], list[int]]],
    *,
    page_size: int,
    pool_tokens: int,
    buffer_start: int,
    buffer_bytes: int,
    make_indices: Callable[[int, int], Any],
    value_limit: int = MAX_VALUE_BYTES,
) -> PageGeometry:
    """Sample ``meta`` (the pool's ``get_page_buffer_meta``) and fit the
    affine model; raise UnsupportedPoolError when the pool does not follow it.
    ``make_indices(start, stop)`` builds ``meta``'s index tensor (no torch here)."""
    num_pages = pool_tokens // page_size
    if num_pages < 1:
        raise UnsupportedPoolError(
            f"host pool holds {pool_tokens} token slots, fewer than one page of {page_size}"
        )
    probes = sorted({0, min(1, num_pages - 1), num_pages - 1})
    sampled: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for page in probes:
        start = page * page_size
        ptrs, sizes = meta(make_indices(start, start + page_size))
        sampled[page] = (np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    base, sizes = sampled[0]
    if base.size == 0 or np.any(sizes <= 0):
        raise UnsupportedPoolError("the host pool reported no objects for a page")

    if num_pages > 1:
        delta = sampled[1][0] - base
        page_stride = int(delta[0])
        if np.any(delta != page_stride):
            raise UnsupportedPoolError(
                "the host pool's page objects do not move together from page to page; "
                + _LAYOUT_FIX
            )
    else:
        page_stride = 0
    for page, (ptrs, psizes) in sampled.items():
        expected = base + page * page_stride
        if ptrs.shape != base.shape or np.any(ptrs != expected) or np.any(psizes != sizes):
            raise UnsupportedPoolError(
                f"page {page} of the host pool does not follow the layout of page 0; "
                + _LAYOUT_FIX
            )

    # Every object of the last page inside the buffer: then every page is.
    last = base + (num_pages - 1) * page_stride
    if np.any(base < buffer_start) or np.any(last + sizes > buffer_start + buffer_bytes):
        raise UnsupportedPoolError(
            "the host pool's page objects lie outside its kv_buffer "
            f"(buffer {buffer_bytes} bytes at {buffer_start:#x})"
        )
    if num_pages > 1 and page_stride < int(sizes.max()):
        raise UnsupportedPoolError(
            "the host pool's page objects overlap the next page; " + _LAYOUT_FIX
        )

    whole = PageGeometry(page_size=page_size, num_pages=num_pages, page_stride=page_stride, base=base, sizes=sizes,
                         chunks=1, object_bytes=tuple(int(s) for s in sizes))
    return _chunked(whole, value_limit)


def derive_region_geometry(
    meta: Callable[[Any], tuple[list[int], list[int]]],
    *,
    page_size: int,
    pool_tokens: int,
    regions: Sequence[tuple[int, int]],
    make_indices: Callable[[int, int], Any],
    value_limit: int = MAX_VALUE_BYTES,
) -> tuple[PageGeometry, np.ndarray]:
    """``derive_geometry`` for a pool whose objects of one page lie in
    several buffers (``regions``, as ``(start, bytes)``), each with its own
    stride: each part is fitted inside the region that holds it. The
    geometry (one ``page_stride`` per part) and each part's region index."""
    if not regions:
        raise UnsupportedPoolError("the host pool has no buffers to register")
    first, first_sizes = meta(make_indices(0, page_size))
    first = [int(p) for p in first]
    first_sizes = [int(s) for s in first_sizes]
    if not first or len(first) != len(first_sizes):
        raise UnsupportedPoolError("the host pool reported no objects for a page")
    parts = len(first)

    def part_meta(j: int) -> Callable[[Any], tuple[list[int], list[int]]]:
        def one(indices: Any) -> tuple[list[int], list[int]]:
            ptrs, sizes = meta(indices)
            if len(ptrs) != parts or len(sizes) != parts:
                raise UnsupportedPoolError(
                    f"the host pool reports {len(ptrs)} objects for one page here and "
                    f"{parts} for page 0"
                )
            return [int(ptrs[j])], [int(sizes[j])]

        return one

    fitted: list[PageGeometry] = []
    region_of: list[int] = []
    for j, (ptr, size) in enumerate(zip(first, first_sizes)):
        owner = next(
            (r for r, (start, nbytes) in enumerate(regions) if start <= ptr and ptr + size <= start + nbytes),
            None,
        )
        if owner is None:
            raise UnsupportedPoolError(
                f"object {j} of page 0 ({size} bytes at {ptr:#x}) lies in none of the host pool's buffers"
            )
        start, nbytes = regions[owner]
        fitted.append(
            derive_geometry(
                part_meta(j), page_size=page_size, pool_tokens=pool_tokens,
                buffer_start=start, buffer_bytes=nbytes, make_indices=make_indices,
                value_limit=1 << 62,  # chunked below, all parts alike
            )
        )
        region_of.append(owner)

    sizes = np.concatenate([g.sizes for g in fitted])
    whole = PageGeometry(page_size=page_size, num_pages=fitted[0].num_pages,
                         page_stride=np.asarray([g.page_stride for g in fitted], dtype=np.int64),
                         base=np.concatenate([g.base for g in fitted]), sizes=sizes, chunks=1,
                         object_bytes=tuple(int(s) for s in sizes))
    geometry = _chunked(whole, value_limit)
    return geometry, np.repeat(np.asarray(region_of, dtype=np.int64), geometry.chunks)


def _chunked(g: PageGeometry, limit: int) -> PageGeometry:
    """``g`` with every object cut into ``chunks`` pieces when one exceeds ``limit``."""
    chunks = max(chunk_count(s, limit) for s in g.object_bytes)
    if chunks == 1:
        return g
    base, sizes = _split(g.base, g.sizes, chunks)
    stride = np.repeat(g.page_stride, chunks) if isinstance(g.page_stride, np.ndarray) else g.page_stride
    return dataclasses.replace(g, page_stride=stride, base=base, sizes=sizes, chunks=chunks)


def _split(base: np.ndarray, sizes: np.ndarray, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut every object into ``chunks`` adjacent pieces of near-equal size."""
    new_base, new_sizes = [], []
    for b, s in zip(base.tolist(), sizes.tolist()):
        step = -(-s // chunks)
        for i in range(chunks):
            lo = i * step
            hi = min(s, lo + step)
            new_base.append(b + lo)
            new_sizes.append(hi - lo)
    return np.asarray(new_base, dtype=np.int64), np.asarray(new_sizes, dtype=np.int64)


def page_starts(
    host_indices: np.ndarray, page_size: int, num_keys: int, slots: int | None = None
) -> np.ndarray | None:
    """First slot of each page, or None when ``host_indices`` is not
    ``num_keys`` distinct whole pages: ``page_size`` consecutive integer
    slots each, from a page-aligned first slot (below ``slots``, the pool's
    size, when given).

    The one check of a batch's indices, for every path: a malformed batch is
    a controller bug we refuse to act on rather than read or write the wrong
    slots. Every slot is checked: a page reordered inside would put its
    tokens in the wrong slots; two pages on the same slots would leave one
    page holding the other's bytes while both answer True. Every slot minus
    its page's start must be its place in the page, compared in one
    ``memcmp`` with rows of ``0 .. page_size - 1``.
    """
    if host_indices.ndim != 1 or host_indices.dtype.kind not in "iu":
        return None
    if host_indices.shape[0] != num_keys * page_size:
        return None
    starts = host_indices[::page_size]
    first = starts.tolist()
    if any(slot % page_size for slot in first) or len(set(first)) != num_keys:
        return None
    if slots is not None and first and (min(first) < 0 or max(first) >= slots):
        return None
    if page_size > 1:
        offsets = host_indices.reshape(num_keys, page_size) - starts[:, None]  # new and contiguous
        if not _ramps(offsets.dtype, page_size, num_keys).startswith(offsets.data):
            return None
    return starts


#: (dtype, page_size) -> ``0 .. page_size - 1`` repeated, as bytes (grown as needed)
_RAMPS: dict[tuple[np.dtype, int], bytes] = {}


def _ramps(dtype: np.dtype, page_size: int, count: int) -> bytes:
    """At least ``count`` rows of ``0 .. page_size - 1`` in ``dtype``, as bytes."""
    key = (dtype, page_size)
    ramps = _RAMPS.get(key)
    if ramps is None or len(ramps) < count * page_size * dtype.itemsize:
        rows = max(count, max(1, (1 << 13) // page_size))
        ramps = np.tile(np.arange(page_size, dtype=dtype), rows).tobytes()
        _RAMPS[key] = ramps
    return ramps
