"""``HiCacheSiMM``: SGLang's L3 storage backend on SiMM.

Attach-time work (config, connection, warm-up, memory registration, page
geometry, per-pool object tables) may raise: a wrong setup must stop the
server with a message. Data-path methods never raise: SGLang's prefetch and
backup threads die on an exception, while a False is only a miss. Faults
there are counted by code and logged rate-limited.
"""

from __future__ import annotations

import logging
import operator
from itertools import chain
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sglang_simm import errors, hybrid, keys as keyspace
from sglang_simm.client import KVClient, connect
from sglang_simm.config import SiMMConfig, load_config, log_resolved
from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import (
    SUPPORTED_LAYOUTS,
    PageGeometry,
    derive_geometry,
    derive_region_geometry,
    page_starts,
)
from sglang_simm.metrics import BackendCounters, RateLimitedLog

logger = logging.getLogger(__name__)

#: Above this many objects per pool, views are built per call instead of
#: once for the pool's lifetime (memory over speed).
VIEW_TABLE_LIMIT = 1 << 21

#: Page keys whose object keys are kept (about 200 bytes each per object).
KEY_CACHE_LIMIT = 1 << 16

#: Codes that mean "not there": the synchronous client folds every server
#: answer of a get, a plain miss included, into GetObjectFailed.
_MISS_CODES = (errors.DS_KEY_NOT_FOUND, errors.GET_OBJECT_FAILED)
#: A concurrent writer stored the object first (same key, same bytes).
_ALREADY_EXISTS = errors.DS_DATA_ALREADY_EXISTS


@dataclass
class _Plan:
    """One batch resolved to SiMM objects."""

    #: indices (into the caller's keys) of the pages the objects belong to;
    #: None: every page, in order
    pages: np.ndarray | None
    keys: list[str]
    views: list[Any]

    @property
    def rows(self) -> Any:
        """Index of the planned pages among the caller's keys."""
        return slice(None) if self.pages is None else self.pages


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
        meta: Callable[[Any], tuple[list[int], list[int]]],
        regions: Sequence[torch.Tensor] | None = None,
        part_names: Sequence[str] | None = None,
    ):
        self.pool = pool
        self.page_size = int(pool.page_size)
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
        self.buffers = regions
        self.buffer = regions[0]
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in regions]
        make_indices = lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64)  # noqa: E731
        try:
            if len(regions) == 1:
                self.geometry: PageGeometry = derive_geometry(
                    meta,
                    page_size=self.page_size,
                    pool_tokens=int(pool.size),
                    buffer_start=spans[0][0],
                    buffer_bytes=spans[0][1],
                    make_indices=make_indices,
                )
                part_region = np.zeros(self.geometry.parts, dtype=np.int64)
            else:
                self.geometry, part_region = derive_region_geometry(
                    meta,
                    page_size=self.page_size,
                    pool_tokens=int(pool.size),
                    regions=spans,
                    make_indices=make_indices,
                )
        except UnsupportedPoolError:
            raise
        except Exception as exc:
            raise UnsupportedPoolError(
                f"cannot read the page geometry of {type(pool).__name__} "
                f"(layout {getattr(pool, 'layout', '?')!r}): {type(exc).__name__}: {exc}"
            ) from exc
        self.identity = identity = _with_object_bytes(identity, self.geometry.object_bytes)
        if scheme == "legacy":
            refusal = keyspace.legacy_refusal(identity)
            if refusal:
                raise UnsupportedPoolError(
                    f"key_scheme 'legacy' cannot be used here: {refusal}; use key_scheme 'namespaced'"
                )
            self.prefix = keyspace.legacy_prefix(identity)
            self.suffixes = keyspace.legacy_suffixes(identity, self.geometry.chunks)
        else:
            self.prefix = keyspace.namespaced_prefix(identity)
            if part_names is not None:
                self.suffixes = keyspace.named_part_suffixes(identity, part_names, self.geometry.chunks)
            else:
                self.suffixes = keyspace.namespaced_suffixes(identity, self.geometry.chunks)
        if len(self.suffixes) != self.geometry.parts:
            raise UnsupportedPoolError(
                f"{type(pool).__name__} reports {self.geometry.parts // self.geometry.chunks} "
                f"objects per page, expected {len(self.suffixes) // self.geometry.chunks} "
                f"for {'MLA' if identity.is_mla else 'MHA'}"
            )
        self.key_budget = keyspace.max_page_key_bytes(self.prefix, self.suffixes)
        self.parts = self.geometry.parts
        self.sizes = self.geometry.sizes
        self.sizes_list = self.sizes.tolist()
        self.page_bytes = self.geometry.page_bytes
        self.client = client
        self.mrs: list[Any] = []
        try:
            for t in regions:
                self.mrs.append(client.register(t))
        except BaseException:
            for mr in self.mrs:
                client.deregister(mr)
            raise
        self.mr = self.mrs[0]
        #: the memory region of each part, in part order
        self.part_mrs = [self.mrs[r] for r in part_region.tolist()]
        self._view = client.view
        self._table: list[Any] | None = None
        self._page_views: dict[int, tuple[Any, ...]] | None = None
        total = self.geometry.num_pages * self.parts
        if total <= VIEW_TABLE_LIMIT:
            ptrs = self.geometry.pointers(
                np.arange(self.geometry.num_pages, dtype=np.int64) * self.page_size
            ).tolist()
            sizes = self.sizes_list * self.geometry.num_pages
            mrs = self.part_mrs * self.geometry.num_pages
            self._table = [self._view(p, s, m) for p, s, m in zip(ptrs, sizes, mrs)]
            parts = self.parts
            self._page_views = {
                page * self.page_size: tuple(self._table[page * parts:(page + 1) * parts])
                for page in range(self.geometry.num_pages)
            }
        self._key_cache: dict[str, tuple[str, ...]] = {}

    def fast_keys(self, page_keys: Sequence[str], *, remember: bool = True) -> list[str] | None:
        """Object keys of every page, or None when any page key is unusable.

        Lookups repeat page keys (exists, then get, then other requests
        sharing the prefix), so their object keys are cached, validated once
        on insert. Writes pass ``remember=False``: a page this server backs
        up stays in its own host tiers, so it rarely looks it up again soon.
        """
        cache = self._key_cache
        try:
            return list(chain.from_iterable([cache[k] for k in page_keys]))
        except (KeyError, TypeError):  # a new (or unhashable) page key
            return self._new_keys(page_keys, remember)

    def _new_keys(self, page_keys: Sequence[str], remember: bool = True) -> list[str] | None:
        """Validate a batch of page keys with C-level checks, build their
        object keys, and cache them (``remember``)."""
        try:
            joined = "".join(page_keys)  # TypeError: a key that is not a str
        except TypeError:
            return None
        if not page_keys or min(map(len, page_keys)) == 0:
            return None
        budget = self.key_budget
        if max(map(len, page_keys)) > budget or (
            not joined.isascii() and not all(keyspace.key_fits(k, budget) for k in page_keys)
        ):
            return None
        parts = self.parts
        out = keyspace.object_keys(self.prefix, page_keys, self.suffixes)
        if not remember:
            return out
        cache = self._key_cache
        if len(cache) + len(page_keys) > KEY_CACHE_LIMIT:
            cache.clear()
        cache.update(zip(page_keys, zip(*[out[i::parts] for i in range(parts)])))
        return out

    def fast_views(self, host_indices: Any, n: int) -> list[Any] | None:
        """Views of ``n`` pages from their first slots, or None when the
        indices are not whole pages of this pool (then ``plan`` decides).

        A page is named by its first slot, as SGLang's own
        ``get_page_buffer_meta`` does; the last slot is checked too, so a
        short or reordered page is refused.
        """
        views = self._page_views
        ps = self.page_size
        if views is None or not isinstance(host_indices, torch.Tensor):
            return None
        try:
            slots = host_indices.numpy()  # a view, cheaper to inspect and slice than the tensor
        except (TypeError, RuntimeError):  # not on the CPU, or not plain memory
            return None
        if slots.ndim != 1 or len(slots) != n * ps:
            return None
        firsts_arr = slots[::ps]
        firsts = firsts_arr.tolist()
        if ps > 1:
            step = ps - 1
            if n > 32:
                if (slots[step::ps] - firsts_arr != step).any():
                    return None
            elif any(last - first != step for first, last in zip(firsts, slots[step::ps].tolist())):
                return None
        try:
            return list(chain.from_iterable(map(views.__getitem__, firsts)))
        except (KeyError, TypeError):
            return None

    def plan(
        self, page_keys: Sequence[str], host_indices: Any, log: RateLimitedLog, *, remember: bool = True
    ) -> _Plan | None:
        """Resolve a batch; None (all misses) when the indices are unusable.

        ``pages`` is None when every page is usable (the common case, served
        without numpy); otherwise it lists the usable pages.
        """
        n = len(page_keys)
        obj_keys = self.fast_keys(page_keys, remember=remember)
        if obj_keys is not None:
            views = self.fast_views(host_indices, n)
            if views is not None:
                return _Plan(pages=None, keys=obj_keys, views=views)
        indices = _as_numpy(host_indices)
        starts = page_starts(indices, self.page_size, n) if indices is not None else None
        if starts is None:
            log(
                "bad_indices",
                "SiMM: host_indices do not hold %d whole, page-aligned pages of %d slots "
                "(got %s); treating the batch as misses",
                n, self.page_size, None if indices is None else indices.shape,
            )
            return None
        if np.any(starts + self.page_size > self.geometry.num_pages * self.page_size) or np.any(starts < 0):
            log("bad_indices", "SiMM: host_indices outside the host pool; treating the batch as misses")
            return None
        pages, obj_keys = self.page_object_keys(page_keys)
        if len(pages) != n:
            log("bad_key", "SiMM: %d page keys are not strings within %d bytes; those pages miss",
                n - len(pages), self.key_budget)
            starts = starts[pages]
        valid = len(pages)
        if self._table is not None:
            ids = self.geometry.object_ids(starts // self.page_size).tolist()
            views = list(operator.itemgetter(*ids)(self._table)) if len(ids) > 1 else [self._table[i] for i in ids]
        else:
            ptrs = self.geometry.pointers(starts).tolist()
            sizes = self.sizes_list * valid
            mrs = self.part_mrs * valid
            view = self._view
            views = [view(p, s, m) for p, s, m in zip(ptrs, sizes, mrs)]
        return _Plan(pages=pages, keys=obj_keys, views=views)

    def page_object_keys(self, page_keys: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        fits = [keyspace.key_fits(k, self.key_budget) for k in page_keys]
        pages = np.flatnonzero(fits) if not all(fits) else np.arange(len(page_keys))
        valid = page_keys if len(pages) == len(page_keys) else [page_keys[i] for i in pages.tolist()]
        return pages, keyspace.object_keys(self.prefix, valid, self.suffixes)

    def close(self) -> None:
        self._table = None
        self._page_views = None
        mrs, self.mrs, self.mr = self.mrs, [], None
        self.part_mrs = [None] * len(self.part_mrs)
        for mr in mrs:
            if mr is not None:
                self.client.deregister(mr)


def _with_object_bytes(identity: keyspace.PageIdentity, object_bytes: tuple[int, ...]) -> keyspace.PageIdentity:
    from dataclasses import replace

    return replace(identity, object_bytes=object_bytes)


def _as_numpy(host_indices: Any) -> np.ndarray | None:
    if isinstance(host_indices, torch.Tensor):
        if host_indices.device.type != "cpu":
            host_indices = host_indices.cpu()
        return host_indices.numpy()
    if isinstance(host_indices, np.ndarray):
        return host_indices
    try:
        return np.asarray(host_indices, dtype=np.int64)
    except (TypeError, ValueError):
        return None


class HiCacheSiMM(HiCacheStorage):
    """SiMM as SGLang's HiCache L3 tier (v1 zero-copy page interface).

    Routes: ``simm`` (the plugin's registration: ``(storage_config,
    host_pool)``) and ``dynamic`` (``(storage_config, {})``; the pool comes
    through ``register_mem_pool_host``). ``client=`` injects a connected
    ``KVClient``; by default one is built from the configuration.
    """

    def __init__(
        self,
        storage_config: Any = None,
        mem_pool_host: Any = None,
        *,
        client: KVClient | None = None,
        config: SiMMConfig | None = None,
    ):
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if config is None:
            resolved = load_config(extra)
            log_resolved(resolved, logger)
            config = resolved.config
        self.config = config
        self.counters = BackendCounters()
        self._log = RateLimitedLog(logger)
        self._profile = bool(config.enable_profile)
        self._lock = threading.Lock()
        self._closed = False
        self.mem_pool_host = None
        self._kv: PoolBinding | None = None
        #: hybrid side pools by name (v2): Mamba, SWA, draft, DSA indexer
        self._side: dict[str, PoolBinding] = {}

        if isinstance(mem_pool_host, dict) and not extra.get("interface_v1"):
            # The dynamic route without interface_v1: SGLang silently takes its
            # copying path (a Python copy per page). Say so, loudly, with the fix.
            logger.warning(
                "sglang-simm: 'interface_v1' is not set in --hicache-storage-backend-extra-config, "
                "so SGLang will use its slow copying path instead of zero-copy pages. "
                "Add \"interface_v1\": 1 to the extra config (or use --hicache-storage-backend simm)."
            )
        self.client = client if client is not None else connect(config)
        if mem_pool_host is not None and not isinstance(mem_pool_host, dict):
            self.register_mem_pool_host(mem_pool_host)

    # ------------------------------------------------------------------ attach

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the KV host pool: check it, register its memory once, build
        its object table. Raises (failing the attach) on a pool we refuse."""
        # SGLang 0.5.10-0.5.18 hand hybrid models' pools over as a HostPoolGroup
        # proxy without head or layer attributes; the KV pool is its anchor.
        anchor = getattr(mem_pool_host, "anchor_entry", None)
        if anchor is not None and getattr(anchor, "host_pool", None) is not None:
            mem_pool_host = anchor.host_pool
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise UnsupportedPoolError(
                f"{type(mem_pool_host).__name__} has no kv_buffer (a logical KV pool, as DeepSeek V4 "
                "uses); sglang-simm stores MHA and MLA KV pools only"
            )
        with self._lock:
            if self._kv is not None and self._kv.pool is mem_pool_host:
                return
            layout = getattr(mem_pool_host, "layout", None)
            if layout not in SUPPORTED_LAYOUTS:
                raise UnsupportedPoolError(
                    f"sglang-simm supports the host pool layouts {', '.join(SUPPORTED_LAYOUTS)}, "
                    f"not {layout!r}: start SGLang with --hicache-mem-layout page_first "
                    "(page_head for heterogeneous TP with tp_lcm_size)"
                )
            identity = self.page_identity(mem_pool_host, "kv")
            meta = mem_pool_host.get_page_buffer_meta
            if identity.split_factor > 1:
                split = identity.split_factor
                meta = lambda idx: mem_pool_host.get_split_heads_page_buffer_meta(idx, split)  # noqa: E731
            binding = PoolBinding(
                client=self.client, pool=mem_pool_host, identity=identity,
                scheme=self.config.key_scheme, meta=meta,
            )
            old, self._kv = self._kv, binding
            self.mem_pool_host = mem_pool_host
        if old is not None:
            old.close()
        g = binding.geometry
        logger.info(
            "sglang-simm: bound %s (%s, %d pages of %d tokens, %d objects of %s bytes per page%s) "
            "to %s, key prefix %r",
            type(mem_pool_host).__name__, layout, g.num_pages, g.page_size, g.parts,
            "/".join(str(s) for s in sorted(set(binding.sizes_list))),
            f", split in {g.chunks} chunks" if g.chunks > 1 else "",
            self.client.description, binding.prefix,
        )

    def page_identity(self, pool: Any, pool_name: str = "kv") -> keyspace.PageIdentity:
        sc = self.storage_config
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
            extra_backend_tag=self.config.extra_backend_tag,
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

    # ----------------------------------------------------------- v1 data path

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every object exists."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return 0
        try:
            b = self._kv
            if b is None:
                self._log("unbound", "SiMM: batch_exists before a host pool was registered")
                return 0
            self.counters.record_exists()
            obj_keys = b.fast_keys(keys)
            if obj_keys is not None:
                found_list = self.client.mexists(obj_keys)
                if len(found_list) != len(obj_keys):
                    raise RuntimeError(f"mexists answered {len(found_list)} results for {len(obj_keys)} keys")
                if all(found_list):
                    return n
                return list(found_list).index(False) // b.parts
            pages, obj_keys = b.page_object_keys(keys)
            found = np.asarray(self.client.mexists(obj_keys), dtype=bool)
            if found.size != len(obj_keys):
                raise RuntimeError(f"mexists answered {found.size} results for {len(obj_keys)} keys")
            page_ok = np.zeros(n, dtype=bool)
            page_ok[pages] = found.reshape(-1, b.parts).all(axis=1)
            return n if page_ok.all() else int(np.argmin(page_ok))
        except Exception as exc:
            self._fault("batch_exists", exc)
            return 0

    def _planned(
        self, where: str, keys: Sequence[str], host_indices: Any, *, remember: bool = True
    ) -> tuple[PoolBinding, _Plan] | None:
        """The KV binding and the batch's objects, or None when it can only miss."""
        b = self._kv
        if b is None:
            self._log("unbound", "SiMM: %s before a host pool was registered", where)
            return None
        plan = b.plan(keys, host_indices, self._log, remember=remember)
        if plan is None:
            self.counters.record_error("bad_indices")
            return None
        return b, plan

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True only where every object of the
        page read back exactly its expected size."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        try:
            planned = self._planned("batch_get_v1", keys, host_indices)
            if planned is None:
                return [False] * n
            b, plan = planned
            t0 = time.perf_counter()
            codes = self.client.mget(plan.keys, plan.views)
            dt = time.perf_counter() - t0
            if codes.__class__ is not list:
                codes = list(codes)
            if plan.pages is None and codes == b.sizes_list * n:  # every object, exactly its size
                self.counters.record_get(n, 0, n * b.page_bytes, dt, b.page_bytes)
                if self._profile:
                    self._profile_get(n, n, dt, b)
                return [True] * n
            got = np.asarray(codes, dtype=np.int64)
            if got.size != len(plan.keys):
                raise RuntimeError(f"mget answered {got.size} results for {len(plan.keys)} objects")
            result, hits = self._pages_read(b, plan, n, got)
            self.counters.record_get(hits, n - hits, hits * b.page_bytes, dt, b.page_bytes)
            if self._profile:
                self._profile_get(n, hits, dt, b)
            return result
        except Exception as exc:
            self._fault("batch_get_v1", exc)
            return [False] * n

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write pages not yet stored (one mexists, one mput of the rest)."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        try:
            planned = self._planned("batch_set_v1", keys, host_indices, remember=False)
            if planned is None:
                return [False] * n
            b, plan = planned
            t0 = time.perf_counter()
            present_list = self.client.mexists(plan.keys)
            if len(present_list) != len(plan.keys):
                raise RuntimeError(f"mexists answered {len(present_list)} results for {len(plan.keys)} keys")
            if plan.pages is None and not any(present_list):
                # the common backup: nothing stored yet, so one mput of it all
                put_codes = self.client.mput(plan.keys, plan.views)
                if len(put_codes) == len(plan.keys) and not any(put_codes):
                    dt = time.perf_counter() - t0
                    self.counters.record_set(n, 0, 0, n * b.page_bytes, dt)
                    if self._profile:
                        self._profile_set(n, 0, n, dt)
                    return [True] * n
            else:
                put_codes = None
            present = np.asarray(present_list, dtype=bool)
            skipped = int(present.reshape(-1, b.parts).all(axis=1).sum())
            sizes = np.tile(b.sizes, len(plan.keys) // b.parts)
            # put_codes: the mput above already covered every object
            written_bytes = self._put_missing(plan.keys, plan.views, present, sizes, put_codes)
            dt = time.perf_counter() - t0
            ok = present.reshape(-1, b.parts).all(axis=1)
            result = np.zeros(n, dtype=bool)
            result[plan.rows] = ok
            good = int(ok.sum())
            self.counters.record_set(good - skipped, skipped, n - good, written_bytes, dt)
            if self._profile:
                self._profile_set(n, skipped, good - skipped, dt)
            return result.tolist()
        except Exception as exc:
            self._fault("batch_set_v1", exc)
            return [False] * n

    def _pages_read(self, b: PoolBinding, plan: _Plan, n: int, codes: np.ndarray) -> tuple[list[bool], int]:
        """One bool per caller page from mget's codes for ``plan``: True where
        every object read back exactly its size; and how many were. Faults
        among the rest are counted."""
        got = codes.reshape(-1, b.parts)
        ok = (got == b.sizes[None, :]).all(axis=1)
        result = np.zeros(n, dtype=bool)
        result[plan.rows] = ok
        hits = int(ok.sum())
        if hits != ok.size:
            self._count_codes(got[~ok], b.sizes)
        return result.tolist(), hits

    def _put_missing(
        self, keys: Sequence[str], views: Sequence[Any], present: np.ndarray, sizes: np.ndarray,
        codes: Sequence[int] | None = None,
    ) -> int:
        """Put the objects not ``present`` and mark those now stored (in place);
        bytes written. ``codes``: the answer of an mput already made for every
        object, when nothing was present."""
        missing = np.flatnonzero(~present)
        if not missing.size:
            return 0
        if codes is None:
            idx = missing.tolist()
            codes = self.client.mput([keys[i] for i in idx], [views[i] for i in idx])
        got = np.asarray(codes, dtype=np.int64)
        if got.size != missing.size:
            raise RuntimeError(f"mput answered {got.size} results for {missing.size} objects")
        stored = (got == 0) | (got == _ALREADY_EXISTS)
        present[missing] = stored
        if not stored.all():
            self._count_failed_puts(got[~stored])
        return int(sizes[missing][stored].sum())

    def _profile_get(self, n: int, hits: int, dt: float, b: PoolBinding) -> None:
        logger.info("SiMM batch_get_v1: %d pages, %d hits, %.1f us, %.2f GiB/s",
                    n, hits, dt * 1e6, hits * b.page_bytes / (1 << 30) / dt if dt else 0.0)

    def _profile_set(self, n: int, skipped: int, written: int, dt: float) -> None:
        logger.info("SiMM batch_set_v1: %d pages, %d already stored, %d written, %.1f us",
                    n, skipped, written, dt * 1e6)

    # ------------------------------------------------- legacy (copying) path

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """SGLang's copying path: fill each flat page tensor, or None on a miss.

        The flat page SGLang hands over is the page's objects back to back,
        so the same objects serve both paths.
        """
        n = len(keys) if keys is not None else 0
        targets = list(target_locations) if target_locations is not None else []
        try:
            b = self._kv
            if b is None or len(targets) != n:
                self._log("legacy_args", "SiMM: batch_get needs a registered pool and one target tensor per key")
                return [None] * n
            out: list[Any] = [None] * n
            pages, obj_keys = b.page_object_keys(keys)
            blocks = [self.client.allocate(s) for s in b.sizes_list * len(pages)]
            codes = np.asarray(self.client.mget(obj_keys, [blk.view() for blk in blocks]), dtype=np.int64)
            ok = (codes.reshape(-1, b.parts) == b.sizes[None, :]).all(axis=1)
            for row, page in enumerate(pages.tolist()):
                target = targets[page]
                if not ok[row] or not _fits_flat(target, b.page_bytes):
                    continue
                flat = target.view(torch.uint8) if target.dtype != torch.uint8 else target
                parts = [blk.as_ref() for blk in blocks[row * b.parts:(row + 1) * b.parts]]
                flat.copy_(torch.cat(parts))
                out[page] = target
            hits = sum(x is not None for x in out)
            self.counters.record_get(hits, n - hits, hits * b.page_bytes, 0.0, b.page_bytes)
            return out
        except Exception as exc:
            self._fault("batch_get", exc)
            return [None] * n

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """SGLang's copying path: store flat page tensors; True if all stored."""
        n = len(keys) if keys is not None else 0
        vals = list(values) if values is not None else []
        if n == 0:
            return False
        try:
            b = self._kv
            if b is None or len(vals) != n:
                self._log("legacy_args", "SiMM: batch_set needs a registered pool and one value per key")
                return False
            pages, obj_keys = b.page_object_keys(keys)
            if len(pages) != n or not all(_fits_flat(v, b.page_bytes) for v in vals):
                return False
            present = np.asarray(self.client.mexists(obj_keys), dtype=bool)
            missing = np.flatnonzero(~present).tolist()
            if missing:
                offsets = np.concatenate([[0], np.cumsum(b.sizes)[:-1]]).tolist()
                put_keys, put_views = [], []
                for i in missing:
                    page, part = divmod(i, b.parts)
                    src = vals[page].contiguous().view(torch.uint8).reshape(-1)
                    size = b.sizes_list[part]
                    blk = self.client.allocate(size)
                    blk.as_ref().copy_(src[offsets[part]:offsets[part] + size])
                    put_keys.append(obj_keys[i])
                    put_views.append(blk.view())
                codes = np.asarray(self.client.mput(put_keys, put_views), dtype=np.int64)
                stored = (codes == 0) | (codes == _ALREADY_EXISTS)
                if not stored.all():
                    self._count_failed_puts(codes[~stored])
                present[missing] = stored
            ok = present.reshape(-1, b.parts).all(axis=1)
            self.counters.record_set(int(ok.sum()), 0, int((~ok).sum()), 0, 0.0)
            return bool(ok.all())
        except Exception as exc:
            self._fault("batch_set", exc)
            return False

    # ------------------------------------------------- v2 (hybrid models)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a hybrid side pool (Mamba, SWA, draft, DSA indexer): check
        it, register its memory once, derive its geometry and keys. The KV
        anchor (``"kv"``) is already bound by ``register_mem_pool_host``.
        Raises UnsupportedPoolError (failing the attach) on a pool we refuse."""
        name = hybrid.pool_name(host_pool_name)
        self.__dict__.setdefault("registered_pools", {})[host_pool_name] = host_pool
        if name == hybrid.KV:
            if self._kv is None:
                self.register_mem_pool_host(host_pool)
            return
        with self._lock:
            current = self._side.get(name)
            if current is not None and current.pool is host_pool:
                return
        model_is_mla = bool(getattr(self.storage_config, "is_mla_model", False))
        layout = hybrid.describe_side_pool(host_pool, name, model_is_mla=model_is_mla)
        identity = replace(
            self.page_identity(host_pool, name), is_mla=layout.replicated, tp_lcm_size=None
        )
        binding = PoolBinding(
            client=self.client, pool=host_pool, identity=identity, scheme=self.config.key_scheme,
            meta=host_pool.get_page_buffer_meta, regions=layout.regions, part_names=layout.part_names,
        )
        with self._lock:
            if self._closed:
                old, binding = binding, None
            else:
                old, self._side[name] = self._side.get(name), binding
        if old is not None:
            old.close()
        if binding is None:
            return
        g = binding.geometry
        logger.info(
            "sglang-simm: bound hybrid pool %r (%s, %s, %d pages of %d slots, %d objects of %s bytes "
            "per page in %d region(s)%s), key prefix %r",
            name, type(host_pool).__name__, layout.kind, g.num_pages, g.page_size, g.parts,
            "/".join(str(x) for x in sorted(set(binding.sizes_list))), len(binding.mrs),
            f", split in {g.chunks} chunks" if g.chunks > 1 else "", binding.prefix,
        )

    def on_host_pools_registered(self) -> None:
        """Once per attach (SGLang 0.5.23), after every pool: log the set."""
        bound = [("kv", self._kv)] if self._kv is not None else []
        bound += sorted(self._side.items())
        if self._kv is None:
            logger.warning("sglang-simm: hybrid pools registered but no KV host pool is bound")
        logger.info(
            "sglang-simm: host pools bound to %s: %s", self.client.description,
            ", ".join(f"{n} ({type(b.pool).__name__}, {b.page_bytes} bytes per page)" for n, b in bound)
            or "none",
        )

    def _binding(self, name: Any) -> PoolBinding | None:
        key = hybrid.pool_name(name)
        return self._kv if key == hybrid.KV else self._side.get(key)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Restorable prefixes of a hybrid model's pages.

        KV: the leading run of complete pages (``batch_exists``). Every extra
        pool is looked up under the KV page keys (a transfer's own keys are
        placeholders; their count is the TRAILING_PAGES window) and narrows
        the set of restorable prefix lengths by its hit policy; the KV hit is
        the longest length left. Never raises; a fault is a miss.
        """
        try:
            transfers = list(pool_transfers or [])
            for t in transfers:
                reason = hybrid.unsupported_policy_reason(t.hit_policy)
                if reason:
                    self.counters.record_error("unsupported_hit_policy")
                    self._log("hit_policy", "SiMM batch_exists_v2: pool %r: %s",
                              hybrid.pool_name(t.name), reason)
                    return hybrid.to_pool_transfer_result(hybrid.miss())
            n = len(keys) if keys is not None else 0
            kv_pages = self.batch_exists(keys, extra_info) if n else 0
            if kv_pages <= 0 or not transfers:
                return hybrid.to_pool_transfer_result(hybrid.fold_hits(kv_pages, []))
            page_keys = list(keys[:kv_pages])
            # One existence query for every pool's objects.
            lookups: list[tuple[Any, PoolBinding | None, np.ndarray, int]] = []
            all_keys: list[str] = []
            for t in transfers:
                b = self._binding(t.name)
                if b is None:
                    self.counters.record_error("unregistered_pool")
                    self._log("unregistered", "SiMM batch_exists_v2: pool %r was never registered; "
                              "it restores nothing", hybrid.pool_name(t.name))
                    lookups.append((t, None, np.empty(0, dtype=np.int64), len(all_keys)))
                    continue
                pages, obj_keys = b.page_object_keys(page_keys)
                lookups.append((t, b, pages, len(all_keys)))
                all_keys.extend(obj_keys)
            found = np.zeros(0, dtype=bool)
            if all_keys:
                self.counters.record_exists()
                found = np.asarray(self.client.mexists(all_keys), dtype=bool)
                if found.size != len(all_keys):
                    raise RuntimeError(f"mexists answered {found.size} results for {len(all_keys)} keys")
            queries = []
            for t, b, pages, start in lookups:
                page_exists = np.zeros(kv_pages, dtype=bool)
                if b is not None and pages.size:
                    stop = start + pages.size * b.parts
                    page_exists[pages] = found[start:stop].reshape(-1, b.parts).all(axis=1)
                queries.append(hybrid.PoolQuery(
                    name=t.name, policy=hybrid.policy_name(t.hit_policy),
                    window=hybrid.trailing_window(t.keys), page_exists=page_exists,
                ))
            return hybrid.to_pool_transfer_result(hybrid.fold_hits(kv_pages, queries))
        except Exception as exc:
            self._fault("batch_exists_v2", exc)
            try:
                return hybrid.to_pool_transfer_result(hybrid.miss())
            except Exception:
                return None

    def _plan_v2(
        self, transfers: list[Any], results: dict[Any, list[bool]], op: str
    ) -> list[tuple[Any, PoolBinding, int, _Plan]]:
        """Resolve every transfer; results start as all-False, one per key."""
        plans = []
        for t in transfers:
            keys = list(t.keys or [])
            results[t.name] = [False] * len(keys)
            if not keys:
                continue
            b = self._binding(t.name)
            if b is None:
                self.counters.record_error("unregistered_pool")
                self._log("unregistered", "SiMM %s: pool %r was never registered; its pages miss",
                          op, hybrid.pool_name(t.name))
                continue
            plan = b.plan(keys, t.host_indices, self._log)
            if plan is None:
                self.counters.record_error("bad_indices")
                continue
            plans.append((t.name, b, len(keys), plan))
        return plans

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read hybrid pools' pages into their host pools (one mget for all):
        ``{pool name: one bool per key}``, True only where every object of
        the page read back exactly its expected size."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        try:
            plans = self._plan_v2(transfers, results, "batch_get_v2")
            if not plans:
                return results
            all_keys = [k for _, _, _, plan in plans for k in plan.keys]
            all_views = [v for _, _, _, plan in plans for v in plan.views]
            t0 = time.perf_counter()
            codes = np.asarray(self.client.mget(all_keys, all_views), dtype=np.int64)
            dt = time.perf_counter() - t0
            if codes.size != len(all_keys):
                raise RuntimeError(f"mget answered {codes.size} results for {len(all_keys)} objects")
            hits = total = nbytes = 0
            start = 0
            for name, b, n, plan in plans:
                results[name], good = self._pages_read(b, plan, n, codes[start:start + len(plan.keys)])
                start += len(plan.keys)
                hits += good
                total += n
                nbytes += good * b.page_bytes
            self.counters.record_get(hits, total - hits, nbytes, dt, nbytes / hits if hits else 0)
            if self._profile:
                logger.info("SiMM batch_get_v2: %d pages in %d pools, %d hits, %.1f us",
                            total, len(plans), hits, dt * 1e6)
            return results
        except Exception as exc:
            self._fault("batch_get_v2", exc)
            return _all_false(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write hybrid pools' pages not yet stored (one mexists, one mput of
        the rest, for all pools): ``{pool name: one bool per key}``."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        try:
            plans = self._plan_v2(transfers, results, "batch_set_v2")
            if not plans:
                return results
            all_keys = [k for _, _, _, plan in plans for k in plan.keys]
            all_views = [v for _, _, _, plan in plans for v in plan.views]
            all_sizes = np.concatenate([np.tile(b.sizes, len(plan.keys) // b.parts) for _, b, _, plan in plans])
            t0 = time.perf_counter()
            present = np.asarray(self.client.mexists(all_keys), dtype=bool)
            if present.size != len(all_keys):
                raise RuntimeError(f"mexists answered {present.size} results for {len(all_keys)} keys")
            already = present.copy()
            written_bytes = self._put_missing(all_keys, all_views, present, all_sizes)
            dt = time.perf_counter() - t0
            good = skipped = total = 0
            start = 0
            for name, b, n, plan in plans:
                stop = start + len(plan.keys)
                ok = present[start:stop].reshape(-1, b.parts).all(axis=1)
                skipped += int(already[start:stop].reshape(-1, b.parts).all(axis=1).sum())
                start = stop
                row = np.zeros(n, dtype=bool)
                row[plan.rows] = ok
                results[name] = row.tolist()
                good += int(ok.sum())
                total += n
            self.counters.record_set(good - skipped, skipped, total - good, written_bytes, dt)
            if self._profile:
                logger.info("SiMM batch_set_v2: %d pages in %d pools, %d already stored, %d written, %.1f us",
                            total, len(plans), skipped, good - skipped, dt * 1e6)
            return results
        except Exception as exc:
            self._fault("batch_set_v2", exc)
            return _all_false(transfers)

    # ---------------------------------------------------- lifecycle and stats

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the previous call (drained)."""
        try:
            return self.counters.drain_storage_metrics()
        except Exception as exc:
            self._fault("get_stats", exc)
            return None

    def stats(self) -> dict[str, Any]:
        """Our own counters: hits, misses, bytes, errors by code."""
        return self.counters.snapshot()

    def clear(self) -> None:
        """Remove this backend's namespace where the client can list keys.

        SiMM's client has no key listing, so on a cluster nothing can be
        removed; the embedded store deletes by prefix.
        """
        b = self._kv
        if b is None:
            return
        if not b.prefix:
            logger.warning("SiMM clear(): key_scheme 'legacy' without extra_backend_tag has no "
                           "namespace of its own; nothing removed")
            return
        prefixes = [b.prefix] + [side.prefix for side in list(self._side.values())]
        if not self.client.supports_delete_prefix:
            logger.warning("SiMM clear(): the SiMM client cannot list keys, so pages under %s stay "
                           "until the cluster evicts them", ", ".join(map(repr, prefixes)))
            return
        for prefix in prefixes:
            removed = self.client.delete_prefix(prefix)
            logger.info("SiMM clear(): removed %d objects under %r", removed, prefix)

    def close(self) -> None:
        """Deregister host memory and release the client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            binding, self._kv = self._kv, None
            side, self._side = list(self._side.values()), {}
        try:
            for b in [binding, *side]:
                if b is not None:
                    b.close()
            self.client.close()
        except Exception as exc:
            logger.warning("SiMM close(): %s: %s", type(exc).__name__, exc)

    # ---------------------------------------------------------------- faults

    def _fault(self, where: str, exc: BaseException) -> None:
        self.counters.record_error(f"exception:{type(exc).__name__}")
        self._log(f"exc:{where}", "SiMM %s failed (%s: %s); answering misses",
                  where, type(exc).__name__, exc, exc_info=True)

    def _count_codes(self, got: np.ndarray, sizes: np.ndarray) -> None:
        negative = got[(got < 0) & ~np.isin(got, _MISS_CODES)]
        if negative.size:
            codes = Counter(negative.tolist())
            self.counters.record_codes(codes)
            self._log("codes", "SiMM read errors: %s",
                      ", ".join(f"{errors.code_name(c)} x{k}" for c, k in codes.items()))
        wrong = int(((got > 0) & (got != np.broadcast_to(sizes, got.shape))).sum())
        if wrong:
            self.counters.record_error("size_mismatch", wrong)
            self._log("size", "SiMM: %d objects read back with an unexpected size; those pages miss", wrong)

    def _count_failed_puts(self, codes: np.ndarray) -> None:
        counts = Counter(codes.tolist())
        self.counters.record_codes(counts)
        self._log("put", "SiMM write errors: %s",
                  ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counts.items()))


def _all_false(transfers: list[Any]) -> dict[Any, list[bool]]:
    out: dict[Any, list[bool]] = {}
    for t in transfers:
        try:
            out[t.name] = [False] * len(t.keys or [])
        except Exception:  # a malformed transfer: nothing to answer for it
            continue
    return out


def _fits_flat(t: Any, nbytes: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() * t.element_size() == nbytes
    )
