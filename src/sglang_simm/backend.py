"""``HiCacheSiMM``: SGLang's L3 storage backend on SiMM (attach, v1, v2, the copying path, faults).

Attach-time work (config, connection, warm-up, memory registration, page
geometry, per-pool object tables) may raise: a wrong setup must stop the
server with a message. Data-path methods never raise: SGLang's prefetch and
backup threads die on an exception, while a False is only a miss. Faults
there are counted by code and logged rate-limited.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sglang_simm import errors, hybrid, keys as keyspace
from sglang_simm.binding import Plan, PoolBinding
from sglang_simm.client import KVClient, connect
from sglang_simm.config import SiMMConfig, load_config, log_resolved
from sglang_simm.errors import BackendClosedError, UnsupportedPoolError
from sglang_simm.geometry import SUPPORTED_LAYOUTS
from sglang_simm.metrics import BackendCounters, RateLimitedLog

logger = logging.getLogger(__name__)

#: The one code that means "not there" for certain (SiMM's async get). The
#: synchronous client folds every server-side failure of a get, a plain miss
#: included, into GetObjectFailed, which ``_read_faults`` tells apart.
_MISS_CODES = (errors.DS_KEY_NOT_FOUND,)
_GET_FAILED = errors.GET_OBJECT_FAILED
#: A concurrent writer stored the object first (same key, same bytes).
_ALREADY_EXISTS = errors.DS_DATA_ALREADY_EXISTS


class _InFlight:
    """Data-path calls in progress, and the bindings a re-registration (or
    ``close()``) replaced, closed (memory deregistered) once no call is in
    progress.

    Every data-path method appends to ``calls`` before it reads a binding
    and calls ``leave()`` when done: ``append``/``pop`` of a list are atomic
    and cheaper than a lock or a wrapper on every call. A replaced binding
    is closed at once when no call is in flight, otherwise by the last call
    to leave. A call that enters after the swap never sees the old binding.
    """

    def __init__(self) -> None:
        self.calls: list[None] = []
        self.retired: list[PoolBinding] = []
        self._lock = threading.Lock()

    def retire(self, binding: PoolBinding) -> None:
        with self._lock:
            self.retired.append(binding)
        if not self.calls:
            self.release()

    def leave(self) -> None:
        calls = self.calls
        calls.pop()
        if self.retired and not calls:
            self.release()

    def release(self) -> None:
        with self._lock:
            if self.calls:
                return
            retired, self.retired = self.retired, []
        for b in retired:
            try:
                b.close()
            except Exception as exc:  # deregistration failed: log, keep going
                logger.warning("SiMM: closing a replaced host pool binding failed: %s: %s",
                               type(exc).__name__, exc)


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
        # SGLang drains get_stats() only with --enable-metrics (off by default).
        self.counters = BackendCounters(
            storage_metrics=bool(getattr(storage_config, "enable_storage_metrics", False))
        )
        self._log = RateLimitedLog(logger)
        self._profile = bool(config.enable_profile)
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight = _InFlight()
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
        try:
            if mem_pool_host is not None and not isinstance(mem_pool_host, dict):
                self.register_mem_pool_host(mem_pool_host)
        except BaseException:
            # A failed attach releases what it opened; an injected client
            # stays its owner's.
            self._closed = True
            if client is None:
                self.client.close()
            raise

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
            self._check_open("register_mem_pool_host")
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
            self._in_flight.retire(old)
        if self.config.key_scheme == "legacy":
            logger.warning(
                "sglang-simm: key_scheme 'legacy' is in use. Its keys name no model, layout or object "
                "size, and SiMM's client bounds a get by the whole registered host pool, not by the "
                "page's object (docs/upstream-simm-get-bound.md): an object stored under a legacy key "
                "by another model or layout, a foreign tenant or a corrupt store that is longer than "
                "the page's object is written past it, over neighbouring host pages, before this "
                "backend can check its size. Such reads are counted (get_overrun) and miss, with "
                "the pages they may have reached in the same batch, but pages outside the batch "
                "cannot be recalled. Use key_scheme 'namespaced' (the default) once the migration "
                "is over."
            )
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

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise BackendClosedError(
                f"{where}: this HiCacheSiMM backend is closed; SGLang attaches a new backend "
                "(create_backend) instead of reusing a closed one"
            )

    # ----------------------------------------------------------- v1 data path

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every object exists."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return 0
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            b = self._kv
            if b is None:
                self._log("unbound", "SiMM: batch_exists before a host pool was registered")
                return 0
            self.counters.record_exists()
            # kept for the read of this batch that follows (KeyCache)
            obj_keys = b.keys.of_all(keys, remember=True)
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
        finally:
            self._in_flight.leave()

    def _planned(self, where: str, keys: Sequence[str], host_indices: Any, *, write: bool) -> tuple[PoolBinding, Plan] | None:
        """The KV binding and the batch's objects, or None when it can only miss."""
        b = self._kv
        if b is None:
            self._log("unbound", "SiMM: %s before a host pool was registered", where)
            return None
        plan = self._plan(b, keys, host_indices, write=write)
        return None if plan is None else (b, plan)

    def _plan(self, b: PoolBinding, keys: Sequence[str], host_indices: Any, *, write: bool) -> Plan | None:
        """One batch of one pool resolved to objects (v1 and v2 alike), or
        None (counted) when its indices are unusable. A read of a batch just
        looked up takes the lookup's object keys (``binding.KeyCache``)."""
        plan = b.plan(keys, host_indices, self._log)
        if plan is None:
            self.counters.record_error("bad_indices")
        return plan

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True only where every object of the
        page read back exactly its expected size."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            planned = self._planned("batch_get_v1", keys, host_indices, write=False)
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
        finally:
            self._in_flight.leave()

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write pages not yet stored (one mexists, one mput of the rest)."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            planned = self._planned("batch_set_v1", keys, host_indices, write=True)
            if planned is None:
                return [False] * n
            b, plan = planned
            w = self._write([(b, plan, n)])
            if self._profile:
                logger.info("SiMM batch_set_v1: %d pages, %d already stored, %d written, %.1f us",
                            n, w.skipped, w.written, w.seconds * 1e6)
            return w.rows[0]
        except Exception as exc:
            self._fault("batch_set_v1", exc)
            return [False] * n
        finally:
            self._in_flight.leave()

    def _pages_read(self, b: PoolBinding, plan: Plan, n: int, codes: np.ndarray) -> tuple[list[bool], int]:
        """One bool per caller page from mget's codes for ``plan``: True where
        every object read back exactly its size and no other object of the
        batch ran over it; and how many were. Faults among the rest are
        counted."""
        got = codes.reshape(-1, b.parts)
        ok = (got == b.sizes[None, :]).all(axis=1)
        if not ok.all():
            ok &= ~self._read_faults(b, plan, codes)
        result = np.zeros(n, dtype=bool)
        result[plan.rows] = ok
        return result.tolist(), int(ok.sum())

    def _write(self, segments: Sequence[tuple[PoolBinding, Plan, int]]) -> _Written:
        """The one write step of every path (v1, v2 and copying): one
        ``mexists`` for the objects of every ``(binding, plan, pages asked)``
        segment, one ``mput`` of those not stored yet, counted. A page is
        stored when every object of it is, from before or now."""
        if len(segments) == 1:
            keys, views = segments[0][1].keys, segments[0][1].views
        else:
            keys = [k for _, plan, _ in segments for k in plan.keys]
            views = [v for _, plan, _ in segments for v in plan.views]
        t0 = time.perf_counter()
        present_list = self.client.mexists(keys)
        if len(present_list) != len(keys):
            raise RuntimeError(f"mexists answered {len(present_list)} results for {len(keys)} keys")
        put_codes = None
        if keys and not any(present_list):
            # the common backup: nothing stored yet, so one mput of it all
            put_codes = self.client.mput(keys, views if views.__class__ is list else list(views))
            if len(put_codes) == len(keys) and not any(put_codes):
                return self._written_all(segments, time.perf_counter() - t0)
        present = np.asarray(present_list, dtype=bool)
        already = present.copy()
        sizes = np.concatenate([np.tile(b.sizes, len(plan.keys) // b.parts) for b, plan, _ in segments])
        nbytes = self._put_missing(keys, views, present, sizes, put_codes)
        seconds = time.perf_counter() - t0
        rows, good, skipped, total, start = [], 0, 0, 0, 0
        for b, plan, n in segments:
            stop = start + len(plan.keys)
            ok = present[start:stop].reshape(-1, b.parts).all(axis=1)
            skipped += int(already[start:stop].reshape(-1, b.parts).all(axis=1).sum())
            start = stop
            row = np.zeros(n, dtype=bool)
            row[plan.rows] = ok
            rows.append(row.tolist())
            good += int(ok.sum())
            total += n
        self.counters.record_set(good - skipped, skipped, total - good, nbytes, seconds)
        return _Written(rows, good - skipped, skipped, nbytes, seconds)

    def _written_all(self, segments: Sequence[tuple[PoolBinding, Plan, int]], seconds: float) -> _Written:
        """``_write``'s answer when every planned object was new and is now stored."""
        rows, written, total, nbytes = [], 0, 0, 0
        for b, plan, n in segments:
            pages = len(plan.keys) // b.parts
            if plan.pages is None:
                rows.append([True] * n)
            else:
                row = np.zeros(n, dtype=bool)
                row[plan.pages] = True
                rows.append(row.tolist())
            written += pages
            total += n
            nbytes += pages * b.page_bytes
        self.counters.record_set(written, 0, total - written, nbytes, seconds)
        return _Written(rows, written, 0, nbytes, seconds)

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

    # ------------------------------------------------- legacy (copying) path

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """SGLang's copying path: fill each flat page tensor, or None on a miss.

        The flat page SGLang hands over is the page's objects back to back in
        address order (``PoolBinding.flat_offsets``), so the same objects
        serve both paths.
        """
        n = len(keys) if keys is not None else 0
        targets = list(target_locations) if target_locations is not None else []
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            b = self._kv
            if b is None or len(targets) != n:
                self._log("legacy_args", "SiMM: batch_get needs a registered pool and one target tensor per key")
                return [None] * n
            out: list[Any] = [None] * n
            pages, obj_keys = b.page_object_keys(keys)
            blocks = [self.client.allocate(s) for s in b.sizes_list * len(pages)]
            views = [blk.view() for blk in blocks]
            codes = np.asarray(self.client.mget(obj_keys, views), dtype=np.int64)
            if codes.size != len(obj_keys):
                raise RuntimeError(f"mget answered {codes.size} results for {len(obj_keys)} objects")
            ok = (codes.reshape(-1, b.parts) == b.sizes[None, :]).all(axis=1)
            if not ok.all():
                ok &= ~self._read_faults(b, Plan(pages=pages, keys=obj_keys, views=views), codes)
            offsets, sizes = b.flat_offsets.tolist(), b.sizes_list
            for row, page in enumerate(pages.tolist()):
                target = targets[page]
                if not ok[row] or not _fits_flat(target, b.page_bytes):
                    continue
                flat = target.view(torch.uint8) if target.dtype != torch.uint8 else target
                flat = flat.reshape(-1)
                for part, blk in enumerate(blocks[row * b.parts:(row + 1) * b.parts]):
                    flat[offsets[part]:offsets[part] + sizes[part]].copy_(blk.as_ref())
                out[page] = target
            hits = sum(x is not None for x in out)
            self.counters.record_get(hits, n - hits, hits * b.page_bytes, 0.0, b.page_bytes)
            return out
        except Exception as exc:
            self._fault("batch_get", exc)
            return [None] * n
        finally:
            self._in_flight.leave()

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """SGLang's copying path: store flat page tensors; True if all stored."""
        n = len(keys) if keys is not None else 0
        vals = list(values) if values is not None else []
        if n == 0:
            return False
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            b = self._kv
            if b is None or len(vals) != n:
                self._log("legacy_args", "SiMM: batch_set needs a registered pool and one value per key")
                return False
            pages, obj_keys = b.page_object_keys(keys)
            if len(pages) != n or not all(_fits_flat(v, b.page_bytes) for v in vals):
                return False
            plan = Plan(pages=None, keys=obj_keys, views=_Staged(self.client, b, vals))
            return all(self._write([(b, plan, n)]).rows[0])
        except Exception as exc:
            self._fault("batch_set", exc)
            return False
        finally:
            self._in_flight.leave()

    # ------------------------------------------------- v2 (hybrid models)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a hybrid side pool (Mamba, SWA, draft, DSA indexer): check
        it, register its memory once, derive its geometry and keys. The KV
        anchor (``"kv"``) is already bound by ``register_mem_pool_host``.
        Raises UnsupportedPoolError (failing the attach) on a pool we refuse."""
        name = hybrid.pool_name(host_pool_name)
        if name == hybrid.KV:
            if self._kv is None:
                self.register_mem_pool_host(host_pool)
            return
        with self._lock:
            self._check_open("register_mem_host_pool_v2")
            current = self._side.get(name)
            if current is not None and current.pool is host_pool:
                return
        sc = self.storage_config
        model_is_mla = bool(getattr(sc, "is_mla_model", False))
        layout = hybrid.describe_side_pool(host_pool, name, model_is_mla=model_is_mla)
        refusal = hybrid.writer_only_refusal(
            layout, name, type(host_pool).__name__, model_is_mla=model_is_mla,
            tp_size=int(getattr(sc, "tp_size", 1) or 1), dcp_size=int(getattr(sc, "dcp_size", 1) or 1),
        )
        if refusal:
            raise UnsupportedPoolError(refusal)
        identity = replace(
            self.page_identity(host_pool, name), is_mla=layout.replicated, tp_lcm_size=None
        )
        binding = PoolBinding(
            client=self.client, pool=host_pool, identity=identity, scheme=self.config.key_scheme,
            meta=host_pool.get_page_buffer_meta, regions=layout.regions, part_names=layout.part_names,
        )
        with self._lock:
            closed = self._closed
            if not closed:
                old, self._side[name] = self._side.get(name), binding
        if closed:  # closed while this pool was being bound
            binding.close()
            self._check_open("register_mem_host_pool_v2")
        if old is not None:
            self._in_flight.retire(old)
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
        self._in_flight.calls.append(None)  # in flight until leave()
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
        finally:
            self._in_flight.leave()

    def _plan_v2(
        self, transfers: list[Any], results: dict[Any, list[bool]], op: str, *, write: bool
    ) -> list[tuple[Any, PoolBinding, int, Plan]]:
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
            plan = self._plan(b, keys, t.host_indices, write=write)
            if plan is not None:
                plans.append((t.name, b, len(keys), plan))
        return plans

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read hybrid pools' pages into their host pools (one mget for all):
        ``{pool name: one bool per key}``, True only where every object of
        the page read back exactly its expected size."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            plans = self._plan_v2(transfers, results, "batch_get_v2", write=False)
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
        finally:
            self._in_flight.leave()

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write hybrid pools' pages not yet stored (one mexists, one mput of
        the rest, for all pools): ``{pool name: one bool per key}``."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        self._in_flight.calls.append(None)  # in flight until leave()
        try:
            plans = self._plan_v2(transfers, results, "batch_set_v2", write=True)
            if not plans:
                return results
            w = self._write([(b, plan, n) for _, b, n, plan in plans])
            for (name, _, _, _), row in zip(plans, w.rows):
                results[name] = row
            if self._profile:
                logger.info("SiMM batch_set_v2: %d pages in %d pools, %d already stored, %d written, %.1f us",
                            sum(n for _, _, n, _ in plans), len(plans), w.skipped, w.written, w.seconds * 1e6)
            return results
        except Exception as exc:
            self._fault("batch_set_v2", exc)
            return _all_false(transfers)
        finally:
            self._in_flight.leave()

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
            # Calls still in flight (SGLang joins its storage threads with a
            # timeout) keep their memory registered until they end.
            for b in [binding, *side]:
                if b is not None:
                    self._in_flight.retire(b)
            self.client.close()
        except Exception as exc:
            logger.warning("SiMM close(): %s: %s", type(exc).__name__, exc)

    # ---------------------------------------------------------------- faults

    def _fault(self, where: str, exc: BaseException) -> None:
        self.counters.record_error(f"exception:{type(exc).__name__}")
        self._log(f"exc:{where}", "SiMM %s failed (%s: %s); answering misses",
                  where, type(exc).__name__, exc, exc_info=True)

    def _read_faults(self, b: PoolBinding, plan: Plan, codes: np.ndarray) -> np.ndarray:
        """Count and log what went wrong in one pool's mget answer (one code
        per planned object); return the planned pages an object read back
        longer than its view may have overwritten (``overrun_pages``), which
        must miss too. Off the fast path: only batches with a miss get here."""
        sizes = np.tile(b.sizes, codes.size // b.parts)
        failed = codes < 0
        get_failed = np.flatnonzero(codes == _GET_FAILED)
        if get_failed.size:
            self._get_failed([plan.keys[i] for i in get_failed.tolist()])
        other = codes[failed & (codes != _GET_FAILED) & ~np.isin(codes, _MISS_CODES)]
        if other.size:
            counted = Counter(other.tolist())
            self.counters.record_codes(counted)
            self._log("codes", "SiMM read errors: %s",
                      ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counted.items()))
        short = int(((codes >= 0) & (codes < sizes)).sum())
        if short:
            self.counters.record_error("size_mismatch", short)
            self._log("size", "SiMM: %d objects read back shorter than expected; those pages miss", short)
        over = np.flatnonzero(codes > sizes)
        if not over.size:
            return np.zeros(codes.size // b.parts, dtype=bool)
        reached = b.overrun_pages(plan, codes)
        self.counters.record_error("get_overrun", int(over.size))
        first = int(over[0])
        self._log(
            "overrun",
            "SiMM: object %r read back %d bytes into a view of %d (%d such objects in this batch): "
            "SiMM's client writes a get up to the end of the registered host pool, so the bytes "
            "past the view overwrote host memory next to it. This page and the %d other pages of "
            "the batch that memory may hold miss; pages outside this batch that it reached cannot "
            "be recalled. A longer object under this key means another writer's bytes (key_scheme "
            "'legacy', a foreign tenant or a corrupt store)",
            plan.keys[first], int(codes[first]), int(sizes[first]), int(over.size),
            int(reached.sum()) - len(set((over // b.parts).tolist())),
            level=logging.ERROR,
        )
        return reached

    def _get_failed(self, keys: list[str]) -> None:
        """Sort GetObjectFailed answers into misses and faults. The
        synchronous client answers it for any server-side failure, an absent
        key included (SiMM's only answer for a miss there, and the embedded
        store's), so the objects are looked up: one that exists failed for
        another reason (a fault, counted under its code); one that does not
        was evicted since SGLang's exists query (a miss, not logged)."""
        try:
            present = self.client.mexists(keys)
            faults = sum(bool(p) for p in present) if len(present) == len(keys) else len(keys)
        except Exception:
            faults = len(keys)
        if not faults:
            return
        self.counters.record_codes(Counter({_GET_FAILED: faults}))
        self._log("get_failed", "SiMM: %d objects exist but their get failed (%s); those pages miss",
                  faults, errors.code_name(_GET_FAILED))

    def _count_failed_puts(self, codes: np.ndarray) -> None:
        counts = Counter(codes.tolist())
        self.counters.record_codes(counts)
        self._log("put", "SiMM write errors: %s",
                  ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counts.items()))


@dataclass(frozen=True)
class _Written:
    """What one write did."""

    #: per segment, one bool per page asked for: stored (before or now)
    rows: list[list[bool]]
    #: pages put now, pages found already stored
    written: int
    skipped: int
    #: bytes put, and the seconds from mexists to the last mput
    nbytes: int
    seconds: float


class _Staged:
    """The copying path's objects as views: object ``i`` is copied out of
    its flat page into a client-owned block when first asked for, so only
    the objects not stored yet are copied."""

    def __init__(self, client: KVClient, b: PoolBinding, pages: list[torch.Tensor]):
        self._client = client
        self._parts = b.parts
        self._sizes = b.sizes_list
        self._offsets = b.flat_offsets.tolist()
        self._pages = pages
        self._blocks: list[Any] = []  # held until the put is done

    def __len__(self) -> int:
        return len(self._pages) * self._parts

    def __getitem__(self, i: int) -> Any:
        page, part = divmod(i, self._parts)
        src = self._pages[page].contiguous().view(torch.uint8).reshape(-1)
        size, offset = self._sizes[part], self._offsets[part]
        block = self._client.allocate(size)
        block.as_ref().copy_(src[offset:offset + size])
        self._blocks.append(block)
        return block.view()

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))


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
