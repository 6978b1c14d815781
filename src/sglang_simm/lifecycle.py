"""The backend's life: attach (config, client, pools), re-registration, close, stats.

Attach-time work may raise: a wrong setup must stop the server with a
message. ``close()`` keeps one order always: no new call starts; calls in
flight finish; then memory is deregistered; then the client closes
(``inflight.release``). A pool replaced by a re-registration (v1 or v2)
is deregistered once its own calls end, never by a data-path thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from sglang_simm import hybrid, keys as keyspace
from sglang_simm.binding import PoolBinding
from sglang_simm.client import KVClient, connect
from sglang_simm.config import SiMMConfig, load_config, log_resolved
from sglang_simm.errors import BackendClosedError, UnsupportedPoolError
from sglang_simm.exporter import exporter_for
from sglang_simm.geometry import SUPPORTED_LAYOUTS
from sglang_simm.inflight import Call, release
from sglang_simm.metrics import BackendCounters, RateLimitedLog

logger = logging.getLogger("sglang_simm.backend")

#: How long ``close()`` waits for data-path calls still in flight before it
#: leaves the rest (deregistration, then the client's close) to a
#: background thread. SGLang stops its storage threads before it closes a
#: backend, so calls are rarely in flight then; a stuck one is bounded by
#: the client's request time limit.
CLOSE_WAIT_S = 10.0

_LEGACY_WARNING = (
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


class Lifecycle:
    """Attach, re-registration, close and stats of ``HiCacheSiMM``."""

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
            storage_metrics=bool(getattr(storage_config, "enable_storage_metrics", False)),
            exporter=exporter_for(storage_config),  # our series in SGLang's /metrics, same switch
        )
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
        """Bind the KV host pool: check it, register its memory once, derive
        its geometry and keys. A different pool replaces the bound one (whose
        memory is deregistered once the calls using it end). Raises (failing
        the attach) on a pool we refuse."""
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
        old = self._install("register_mem_pool_host", None, binding)
        self.mem_pool_host = mem_pool_host
        if old is not None:
            release([old], what="the replaced KV host pool")
        if self.config.key_scheme == "legacy":
            logger.warning(_LEGACY_WARNING)
        g = binding.geometry
        logger.info(
            "sglang-simm: bound %s (%s, %d pages of %d tokens, %d objects of %s bytes per page%s) "
            "to %s, key prefix %r",
            type(mem_pool_host).__name__, layout, g.num_pages, g.page_size, g.parts,
            "/".join(str(s) for s in sorted(set(binding.sizes_list))),
            f", split in {g.chunks} chunks" if g.chunks > 1 else "",
            self.client.description, binding.prefix,
        )

    def _install(self, where: str, name: str | None, binding: PoolBinding) -> PoolBinding | None:
        """Make ``binding`` the pool of ``name`` (None: KV); the one it
        replaces, if any. A backend closed meanwhile refuses it (released)."""
        with self._lock:
            closed = self._closed
            if not closed:
                if name is None:
                    old, self._kv = self._kv, binding
                else:
                    old, self._side[name] = self._side.get(name), binding
        if closed:
            binding.close()
            self._check_open(where)
        return old

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a hybrid side pool (Mamba, SWA, draft, DSA indexer): check
        it, register its memory once, derive its geometry and keys. The KV
        anchor (``"kv"``) goes to ``register_mem_pool_host``, which binds it
        or, for a different pool than the one bound, replaces it as v1 does.
        Raises UnsupportedPoolError (failing the attach) on a pool we refuse."""
        name = hybrid.pool_name(host_pool_name)
        if name == hybrid.KV:
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
        old = self._install("register_mem_host_pool_v2", name, binding)
        if old is not None:
            release([old], what=f"the replaced {name!r} host pool")
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

    # ---------------------------------------------------------- per call

    def _call(self, where: str) -> Call:
        return Call(self._fault, where)

    def _use_kv(self, call: Call, where: str) -> PoolBinding | None:
        """The KV pool, counted in on ``call``; None (logged unless closed)
        when there is none."""
        b = call.use(self._kv) or call.use(self._kv)  # again if replaced since read
        if b is None and not self._closed:
            self._log("unbound", "SiMM: %s before a host pool was registered", where)
        return b

    def _use(self, call: Call, name: Any, where: str) -> PoolBinding | None:
        """The pool called ``name`` (the KV pool for ``hybrid.KV``), counted
        in on ``call``; None (logged unless closed) when there is none."""
        key = hybrid.pool_name(name)
        if key == hybrid.KV:
            return self._use_kv(call, where)
        b = call.use(self._side.get(key)) or call.use(self._side.get(key))
        if b is None and not self._closed:
            self.counters.record_error("unregistered_pool")
            self._log("unregistered", "SiMM %s: pool %r was never registered; its pages miss",
                      where, key)
        return b

    def _fault(self, where: str, exc: BaseException) -> None:
        self.counters.record_error(f"exception:{type(exc).__name__}")
        self._log(f"exc:{where}", "SiMM %s failed (%s: %s); answering misses",
                  where, type(exc).__name__, exc, exc_info=True)

    # ---------------------------------------------------- close and stats

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

    def close(self, wait_s: float | None = None) -> None:
        """No new call starts; calls in flight finish (for up to ``wait_s``,
        default ``CLOSE_WAIT_S``, here; after that in the background); then
        every pool's memory is deregistered; then the client closes.
        Idempotent, and never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bindings = [b for b in (self._kv, *self._side.values()) if b is not None]
            self._kv, self._side = None, {}
        try:
            release(bindings, wait_s=CLOSE_WAIT_S if wait_s is None else wait_s,
                    then=self.client.close, what="a closed backend")
        except Exception as exc:
            logger.warning("SiMM close(): %s: %s", type(exc).__name__, exc)
