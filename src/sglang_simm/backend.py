"""``HiCacheSiMM``: SGLang's L3 storage backend on SiMM.

One class is SGLang's surface (``HiCacheStorage``); the work is done by the
objects it holds, each with one job (docs/backend-core.md): ``client``,
``pools`` (``inflight``, each pool a ``binding.PoolBinding``), ``answers``
(``transfer``), ``counters`` and ``log`` (``metrics``), ``breaker``
(docs/resilience.md) and ``events`` (docs/kv-events.md).

Every data-path method reads the same way: ask the breaker, resolve one
``Batch`` per pool, one client call, record its answer with the breaker,
answer (``answers``). What raises and what never does is the contract on
``HiCacheSiMM`` (its docstring).
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any, Callable, Iterable, Sequence

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sglang_simm import copying, hybrid
from sglang_simm.binding import Batch, PoolBinding, bind_kv_pool, bind_side_pool, is_logical_anchor, kv_pool_of
from sglang_simm.breaker import Breaker
from sglang_simm.client import KVClient, connect
from sglang_simm.config import SiMMConfig, load_config, local_store_place, log_resolved
from sglang_simm.errors import PoolLeftOutError, is_fault
from sglang_simm.events import NO_EVENTS
from sglang_simm.events_publisher import events_for
from sglang_simm.removal_feed import RemovalFeed
from sglang_simm.exporter import exporter_for
from sglang_simm.inflight import Call, Pools, release
from sglang_simm.keys import PROBE_KEY
from sglang_simm.metrics import BackendCounters, RateLimitedLog
from sglang_simm.transfer import ALREADY_EXISTS, Answers, leading, object_keys, object_views

__all__ = ["CLOSE_WAIT_S", "HiCacheSiMM"]

logger = logging.getLogger("sglang_simm.backend")

#: How long ``close()`` waits for data-path calls in flight before it leaves
#: deregistration and the client's close to a background thread (a stuck
#: call is bounded by the client's request time limit).
CLOSE_WAIT_S = 10.0

KV = hybrid.KV

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


class HiCacheSiMM(HiCacheStorage):
    """SiMM as SGLang's HiCache L3 tier.

    Routes: ``simm`` (the plugin's registration: ``(storage_config,
    host_pool)``) and ``dynamic`` (``(storage_config, {})``; the pool comes
    through ``register_mem_pool_host``). ``client=`` injects a connected
    ``KVClient`` (it stays its owner's if the attach fails); by default one
    is built from the configuration. ``config=`` skips reading it.

    Errors, the one statement of this contract (the docs and the other
    modules refer here):

    * **Attach raises.** Construction and ``register_mem_pool_host`` raise,
      with the fix in the message, on a bad configuration, an unreachable
      cluster (the warm-up names the address and ``sglang-simm doctor``), an
      unsupported pool or a pool registered with a closed backend: a wrong
      setup must stop the server. A failed attach deregisters what it
      registered and closes the client it opened.
    * **The data path never raises into SGLang**: every data-path method
      (v1, v2, the copying path), ``get_stats`` and ``close``. SGLang's
      prefetch and backup threads die on an exception, while a False is
      only a miss. A client error code, a timeout, a wrong size, an
      exception, or a bad input from the controller (misaligned, reordered
      or out-of-range indices, bad keys, mismatched lengths; the host pool
      is not touched then) is answered as misses (or failed writes),
      counted by SiMM code or exception type (``stats()["errors"]``) and
      logged at most once per 10 s per kind.
    """

    def __init__(
        self,
        storage_config: Any = None,
        mem_pool_host: Any = None,
        *,
        client: KVClient | None = None,
        config: SiMMConfig | None = None,
    ):
        #: SGLang's ``HiCacheStorageConfig`` (ranks, model, layout flags)
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if config is None:
            resolved = load_config(extra)
            log_resolved(resolved, logger)
            config = resolved.config
        self.config: SiMMConfig = config
        #: SGLang drains get_stats() only with --enable-metrics (off by default)
        self.counters = BackendCounters(
            storage_metrics=bool(getattr(storage_config, "enable_storage_metrics", False)),
            exporter=exporter_for(storage_config),  # our series in SGLang's /metrics, same switch
        )
        self.log = RateLimitedLog(logger)
        #: fail fast while the store is down; one per backend (every pool, every thread)
        self.breaker = Breaker.from_config(config)
        self.pools = Pools()
        #: the KV host pool bound (SGLang's own attribute)
        self.mem_pool_host: Any = None
        if isinstance(mem_pool_host, dict) and not extra.get("interface_v1"):
            # The dynamic route without interface_v1: SGLang silently takes its
            # copying path (a Python copy per page). Say so, loudly, with the fix.
            logger.warning(
                "sglang-simm: 'interface_v1' is not set in --hicache-storage-backend-extra-config, "
                "so SGLang will use its slow copying path instead of zero-copy pages. "
                "Add \"interface_v1\": 1 to the extra config (or use --hicache-storage-backend simm)."
            )
        self.client: KVClient = client if client is not None else connect(config)
        if self.counters.exporter is not None:  # which store L3 is, for doctor --server
            try:
                self.counters.exporter.describe_store(config.manager_address, local_store_place(config))
            except Exception as exc:  # a metric never stops a start
                logger.warning("sglang-simm: cannot export which store L3 is (%s: %s)", type(exc).__name__, exc)
        self.answers = Answers(self.client, self.counters, self.log, profile=bool(config.enable_profile))
        # while open, the breaker probes by itself, so no request waits on a probe
        self.breaker.set_prober(self._probe)
        self.events, self.removals = NO_EVENTS, None
        try:
            self.events = events_for(storage_config, config)
            if self.events.on:
                self.answers.on_absent = self._absent
                self.counters.events = self.events
                removed_since = getattr(self.client, "removed_since", None)
                if removed_since is not None:
                    self.removals = RemovalFeed(removed_since, self.l3_removed, self.l3_cleared)
            if mem_pool_host is not None and not isinstance(mem_pool_host, dict):
                self.register_mem_pool_host(mem_pool_host)
        except BaseException:
            # A failed attach releases what it opened; an injected client
            # stays its owner's.
            if self.removals is not None:
                self.removals.close()
            self.events.close()
            self.pools.close()
            self.breaker.close()
            if client is None:
                self.client.close()
            raise

    # ------------------------------------------------------------------ attach

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the KV host pool: check it, register its memory once, derive
        its geometry and keys (``binding.bind_kv_pool``). A different pool
        replaces the bound one (whose memory is deregistered once the calls
        using it end). Raises (failing the attach) on a pool we refuse."""
        pool = kv_pool_of(mem_pool_host)
        if is_logical_anchor(pool):
            self._bind_logical_anchor(pool)
            return
        with self.pools.lock:
            self.pools.check_open("register_mem_pool_host")
            if self.pools.kv is not None and self.pools.kv.pool is pool:
                return
        binding = bind_kv_pool(self.client, pool, self.storage_config, self.config)
        old = self.pools.install(KV, binding, "register_mem_pool_host")
        self.mem_pool_host = pool
        if old is not None:
            release([old], what="the replaced KV host pool")
        if self.config.key_scheme == "legacy":
            logger.warning(_LEGACY_WARNING)
        self._find_fault_reporter()
        logger.info("sglang-simm: bound %s to %s", binding.describe(), self.client.description)

    def _bind_logical_anchor(self, pool: Any) -> None:
        """A KV anchor that holds no KV (DeepSeek V4): nothing to register or
        store; its pages' hits and bytes are its side pools'."""
        if self.pools.logical is pool:
            return
        old = self.pools.install_logical(pool, "register_mem_pool_host")
        self.mem_pool_host = pool
        if old is not None:
            release([old], what="the replaced KV host pool")
        self._find_fault_reporter()
        logger.info("sglang-simm: the KV anchor %s holds no KV (a logical anchor, as DeepSeek V4's): "
                    "nothing is stored for it; hits and bytes come from the side pools bound beside it",
                    type(pool).__name__)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a hybrid side pool (Mamba, SWA, draft, DSA indexer) as the
        KV pool is bound (``binding.bind_side_pool``). The KV anchor
        (``"kv"``) goes to ``register_mem_pool_host``. Raises
        UnsupportedPoolError (failing the attach) on a pool we refuse."""
        name = hybrid.pool_name(host_pool_name)
        if name == KV:
            self.register_mem_pool_host(host_pool)
            return
        with self.pools.lock:
            self.pools.check_open("register_mem_host_pool_v2")
            current = self.pools.side.get(name)
            if current is not None and current.pool is host_pool:
                return
        try:
            binding = bind_side_pool(self.client, host_pool, name, self.storage_config, self.config)
        except PoolLeftOutError as exc:
            old = self.pools.leave_out(name, str(exc), "register_mem_host_pool_v2")
            if old is not None:
                release([old], what=f"the replaced {name!r} host pool")
            logger.warning("sglang-simm: %s", exc)
            return
        old = self.pools.install(name, binding, "register_mem_host_pool_v2")
        if old is not None:
            release([old], what=f"the replaced {name!r} host pool")
        logger.info("sglang-simm: bound hybrid pool %r: %s", name, binding.describe())

    def on_host_pools_registered(self) -> None:
        """Once per attach (SGLang 0.5.23), after every pool: log the set."""
        self._find_fault_reporter()
        if self.pools.kv is None and self.pools.logical is None:
            logger.warning("sglang-simm: hybrid pools registered but no KV host pool is bound")
        logger.info(
            "sglang-simm: host pools bound to %s: %s", self.client.description,
            ", ".join(f"{n} ({type(b.pool).__name__}, {b.page_bytes} bytes per page)"
                      for n, b in self.pools.bound()) or "none",
        )

    # ------------------------------------------------------- v1: zero-copy pages

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every object exists."""
        n = len(keys) if keys is not None else 0
        if n == 0 or self._logical():
            return 0  # a logical anchor's hit is its side pools' (batch_exists_v2)
        with Call(self._fault, "batch_exists", self.breaker) as call:
            if not call.allow():
                return 0
            return self._kv_pages(call, keys)
        return 0

    def _kv_pages(self, call: Call, keys: Sequence[Any]) -> int:
        """The leading complete KV pages of ``keys`` (``batch_exists``'s
        body, inside ``call``, which the breaker let through)."""
        lookup = self._resolve(call, KV, keys, None, call.where)
        if lookup is None:
            return 0
        codes, dt = self._timed(call, self.client.mexists_codes, lookup.keys)
        (pages,) = self.answers.found([lookup], codes, dt)
        if self.events.on and not all(pages) and not any(map(is_fault, codes)):
            # the store answered every object: a page it lacks left L3 (a
            # call with a fault in it tells nothing, so it announces nothing)
            self.events.missed([k for k, here in zip(keys, pages) if not here])
        return leading(pages)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True only where every object of
        the page read back exactly its expected size."""
        return self._move_v1(keys, host_indices, extra_info, "batch_get_v1")

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write pages: one ``mput``, no lookup first (serving's backups are
        new pages; an object stored before answering ALREADY_EXISTS counts
        as stored: docs/backend-core.md, "Writes without a lookup first")."""
        return self._move_v1(keys, host_indices, extra_info, "batch_set_v1")

    def _move_v1(self, keys: list[str], host_indices: Any, extra_info: Any, where: str) -> list[bool]:
        """``batch_get_v1`` or ``batch_set_v1`` (``where``): one client call."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        if self._logical():
            # Nothing to move: the side pools hold the page, and SGLang loads
            # it from their batch_get_v2 and uses the fewer of the two answers.
            return [True] * n
        read = where == "batch_get_v1"
        with Call(self._fault, where, self.breaker) as call:
            if not call.allow():
                return [False] * n
            batch = self._resolve(call, KV, keys, host_indices, where)
            if batch is None:
                return [False] * n
            codes, dt = self._timed(call, self.client.mget_views if read else self.client.mput_views,
                                    batch.keys, batch.views)
            if read:
                return self.answers.read([batch], codes, dt, where, call)[0]
            (pages,) = self.answers.written([batch], codes, dt, where)
            self.events.stored(keys, pages, getattr(extra_info, "prefix_keys", None), batch.binding.page_size)
            return pages
        return [False] * n

    # -------------------------------------------------- v2: hybrid side pools

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Restorable prefixes of a hybrid model's pages.

        KV: the leading run of complete pages (``batch_exists``). Every extra
        pool is looked up under the KV page keys (a transfer's own keys are
        placeholders; their count is the TRAILING_PAGES window), all in one
        ``mexists``, and narrows the set of restorable prefix lengths by its
        hit policy; the KV hit is the longest length left.
        """
        n = len(keys) if keys is not None else 0
        with Call(self._fault, "batch_exists_v2", self.breaker) as call:
            if not call.allow():
                return hybrid.to_pool_transfer_result(hybrid.miss())
            transfers = self._stored(pool_transfers)
            for t in transfers:
                reason = hybrid.unsupported_policy_reason(t.hit_policy)
                if reason:
                    self.counters.record_error("unsupported_hit_policy")
                    self.log("hit_policy", "SiMM batch_exists_v2: pool %r: %s", hybrid.pool_name(t.name), reason)
                    return hybrid.to_pool_transfer_result(hybrid.miss())
            if self._logical():
                # No KV object exists; a prefix is restorable where the side
                # pools restore it, and at least one of them must hold every
                # page (ALL_PAGES), or nothing vouches for the KV itself.
                if not any(hybrid.policy_name(t.hit_policy) == hybrid.ALL_PAGES
                           and self.pools.get(hybrid.pool_name(t.name)) is not None for t in transfers):
                    self.log("logical_alone", "SiMM batch_exists_v2: a logical KV anchor queried without a "
                             "bound ALL_PAGES side pool; answering a miss")
                    return hybrid.to_pool_transfer_result(hybrid.miss())
                kv_pages = n
            else:
                kv_pages = self._kv_pages(call, keys) if n else 0
            if kv_pages <= 0 or not transfers:
                return hybrid.to_pool_transfer_result(hybrid.fold_hits(kv_pages, []))
            if not call.allow():  # the KV lookup faulted, or the breaker opened since
                return hybrid.to_pool_transfer_result(hybrid.miss())
            page_keys = list(keys[:kv_pages])
            lookups = [self._resolve(call, hybrid.pool_name(t.name), page_keys, None, "batch_exists_v2")
                       for t in transfers]
            found = [lk for lk in lookups if lk is not None]
            codes, dt = [], 0.0
            if found:
                codes, dt = self._timed(call, self.client.mexists_codes, object_keys(found))
            pages = iter(self.answers.found(found, codes, dt) if found else [])
            absent = [False] * kv_pages
            queries = [
                hybrid.PoolQuery(name=t.name, policy=hybrid.policy_name(t.hit_policy),
                                 window=hybrid.trailing_window(t.keys),
                                 page_exists=absent if lk is None else next(pages))
                for t, lk in zip(transfers, lookups)
            ]
            return hybrid.to_pool_transfer_result(hybrid.fold_hits(kv_pages, queries))
        try:
            return hybrid.to_pool_transfer_result(hybrid.miss())
        except Exception:
            return None

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read hybrid pools' pages into their host pools, every pool in one
        ``mget``: ``{pool name: one bool per key}``, True only where every
        object of the page read back exactly its expected size."""
        return self._move_v2(transfers, "batch_get_v2")

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write hybrid pools' pages, every pool in one ``mput``, no lookup
        first (as ``batch_set_v1``): ``{pool name: one bool per key}``."""
        return self._move_v2(transfers, "batch_set_v2")

    def _move_v2(self, transfers: Any, where: str) -> dict[Any, list[bool]]:
        """``batch_get_v2`` or ``batch_set_v2`` (``where``): one client call."""
        transfers = self._stored(transfers)
        read = where == "batch_get_v2"
        with Call(self._fault, where, self.breaker) as call:
            results = _all_false(transfers)
            if not call.allow():
                return results
            names, batches = self._resolve_v2(call, transfers, where)
            if not batches:
                return results
            codes, dt = self._timed(call, self.client.mget_views if read else self.client.mput_views,
                                    object_keys(batches), object_views(batches))
            if read:
                results.update(zip(names, self.answers.read(batches, codes, dt, where, call)))
            else:
                results.update(zip(names, self.answers.written(batches, codes, dt, where)))
            return results
        return _all_false(transfers)

    # ------------------------------------------------- SGLang's copying path

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Fill each flat page tensor (``copying``), or None on a miss."""
        n = len(keys) if keys is not None else 0
        targets = list(target_locations) if target_locations is not None else []
        if n == 0:
            return []
        with Call(self._fault, "batch_get", self.breaker) as call:
            if not call.allow():
                return [None] * n
            b = self._bound(call, KV, "batch_get")
            if b is None or len(targets) != n:
                if b is not None:
                    self.log("legacy_args", "SiMM: batch_get needs one target tensor per key")
                return [None] * n
            batch, blocks = copying.read_batch(self.client, b, keys, targets)
            codes, dt = self._timed(call, self.client.mget, batch.keys, batch.views)
            (pages,) = self.answers.read([batch], codes, dt, "batch_get", call)
            return copying.copy_out(batch, blocks, pages, targets)
        return [None] * n

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store flat page tensors (``copying``); True if all are stored.
        Unlike the zero-copy paths this asks ``mexists`` first: a stored
        object then costs no copy into a client block as well as no
        transfer."""
        n = len(keys) if keys is not None else 0
        vals = list(values) if values is not None else []
        if n == 0:
            return False
        with Call(self._fault, "batch_set", self.breaker) as call:
            if not call.allow():
                return False
            b = self._bound(call, KV, "batch_set")
            if b is None or len(vals) != n:
                if b is not None:
                    self.log("legacy_args", "SiMM: batch_set needs one value per key")
                return False
            batch = copying.write_batch(self.client, b, keys, vals)
            if batch is None:
                return False
            t0 = perf_counter()
            present = self.client.mexists(batch.keys)
            call.record((), perf_counter() - t0)  # bools: a hung store shows only as time
            if len(present) != len(batch.keys):
                raise RuntimeError(f"mexists answered {len(present)} results for {len(batch.keys)} keys")
            missing = [i for i, here in enumerate(present) if not here]
            codes = [ALREADY_EXISTS if here else 0 for here in present]
            if missing:
                if not call.allow():  # the lookup was a fault, or the breaker opened since
                    return False
                t1 = perf_counter()
                put = self.client.mput([batch.keys[i] for i in missing], [batch.views[i] for i in missing])
                call.record(put, perf_counter() - t1)
                if len(put) != len(missing):
                    raise RuntimeError(f"mput answered {len(put)} results for {len(missing)} objects")
                for i, code in zip(missing, put):
                    codes[i] = code
            (pages,) = self.answers.written([batch], codes, perf_counter() - t0, "batch_set")
            self.events.stored(keys, pages, None, b.page_size)
            return all(pages)
        return False

    # ------------------------------------------------------ resolve, faults

    def _find_fault_reporter(self) -> None:
        """At attach: a fault reporter SGLang's controller left on this
        backend (``breaker.find_fault_reporter``) is reported to from now
        on, as if handed to ``set_fault_reporter``."""
        if not self.breaker.reports.active and self.breaker.reports.attach(self):
            logger.info("sglang-simm: reporting L3 outcomes to SGLang's fault reporter %s",
                        type(self.breaker.reports._reporter).__name__)

    def _logical(self) -> bool:
        """The KV anchor bound is a logical one (no KV to store)."""
        return self.pools.kv is None and self.pools.logical is not None

    def _stored(self, transfers: Any) -> list[Any]:
        """``transfers`` without those of pools left out of L3: SGLang's
        controller reads a pool absent from an answer as "no verdict"
        (it neither narrows the hit nor fails the load)."""
        out = list(transfers or [])
        left_out = self.pools.left_out
        if left_out:
            out = [t for t in out if hybrid.pool_name(getattr(t, "name", None)) not in left_out]
        return out

    def _bound(self, call: Call, name: str, where: str) -> PoolBinding | None:
        """The pool bound as ``name``, counted in on ``call``; None (logged
        unless the backend is closed) when there is none."""
        b = self.pools.use(call, name)
        if b is None and not self.pools.closed:
            if name == KV:
                self.log("unbound", "SiMM: %s before a host pool was registered", where)
            else:
                self.counters.record_error("unregistered_pool")
                self.log("unregistered", "SiMM %s: pool %r was never registered; its pages miss", where, name)
        return b

    def _resolve(self, call: Call, name: str, keys: Sequence[Any], host_indices: Any, where: str) -> Batch | None:
        """The batch of pool ``name`` for ``keys``: a lookup where
        ``host_indices`` is None, else the pages to move to or from those
        host slots (``PoolBinding.batch``). None, counted and logged, when
        the pool is not bound or the indices are refused; pages whose key is
        unusable are left out (and miss), logged."""
        b = self._bound(call, name, where)
        if b is None:
            return None
        batch = b.lookup(keys) if host_indices is None else b.batch(keys, host_indices)
        if batch is None:
            self.counters.record_error("bad_indices")
            self.log("bad_indices",
                     "SiMM %s: host_indices do not hold %d distinct, whole, page-aligned pages of %d slots "
                     "inside the host pool; treating the batch as misses", where, len(keys), b.page_size)
        elif len(batch.rows) != batch.n:
            self.log("bad_key", "SiMM %s: %d page keys are not strings within %d bytes; those pages miss",
                     where, batch.n - len(batch.rows), b.budget)
        return batch

    def _resolve_v2(self, call: Call, transfers: list[Any], where: str) -> tuple[list[Any], list[Batch]]:
        """Every transfer with keys resolved (``_resolve``): their pool
        names, as SGLang gave them, and their batches."""
        names, batches = [], []
        for t in transfers:
            keys = list(t.keys or [])
            batch = self._resolve(call, hybrid.pool_name(t.name), keys, t.host_indices, where) if keys else None
            if batch is not None:
                names.append(t.name)
                batches.append(batch)
        return names, batches

    def _absent(self, binding: PoolBinding, object_keys: list[str]) -> None:
        """A read found these objects absent (``Answers.on_absent``): their
        KV pages left L3."""
        if binding is self.pools.kv:
            self.events.missed(dict.fromkeys(filter(None, map(binding.page_key, object_keys))))

    # ------------------------------------------- what the store says it lost

    def l3_removed(self, object_keys: Iterable[str]) -> None:
        """The store removed these objects (keys as the store holds them, of
        any namespace): the KV pages of this backend among them are
        announced removed (``kv_events``). Any thread; never blocks, never
        raises (docs/kv-events.md, "The store's removal channel")."""
        try:
            kv = self.pools.kv
            if not self.events.on or kv is None:
                return
            self.events.removed(dict.fromkeys(filter(None, map(kv.page_key, object_keys))))
        except Exception as exc:
            self._fault("l3_removed", exc)

    def l3_cleared(self, prefix: str = "") -> None:
        """The store removed every object whose key starts with ``prefix``
        (``""``: every object): when that covers this backend's pages, every
        page it announced is announced removed. Any thread; never blocks,
        never raises."""
        try:
            kv = self.pools.kv
            if self.events.on and kv is not None and kv.prefix.startswith(prefix):
                self.events.cleared()
        except Exception as exc:
            self._fault("l3_cleared", exc)

    def _timed(self, call: Call, op: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``op(*args)``'s codes and seconds, recorded on ``call`` (the breaker)."""
        t0 = perf_counter()
        codes = op(*args)
        dt = perf_counter() - t0
        call.record(codes, dt)
        return codes, dt

    def _fault(self, where: str, exc: BaseException) -> None:
        """An exception in a data-path call: counted by type, logged
        rate-limited; the call answers misses."""
        self.counters.record_error(f"exception:{type(exc).__name__}")
        self.log(f"exc:{where}", "SiMM %s failed (%s: %s); answering misses",
                 where, type(exc).__name__, exc, exc_info=True)

    # ---------------------------------------------------- stats, clear, close

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the previous call (drained); the
        breaker's state goes to the exporter with it (SGLang calls this on
        its scheduler thread, every pass with ``--enable-metrics``)."""
        try:
            self.counters.record_breaker(self.breaker.state)
            return self.counters.drain_storage_metrics()
        except Exception as exc:
            self._fault("get_stats", exc)
            return None

    def stats(self) -> dict[str, Any]:
        """Our own counters: hits, misses, bytes, errors by code;
        ``breaker``, the circuit breaker's state and counters
        (``Breaker.snapshot()``); and ``kv_events`` where this backend
        publishes (``L3Events.snapshot()``)."""
        out = self.counters.snapshot()
        out["breaker"] = self.breaker.snapshot()
        return out

    def set_fault_reporter(self, reporter: Any) -> None:
        """SGLang's fault reporter (``report_op(op=, fatal=, detail=)``,
        docs/resilience.md): every outcome the breaker records is reported
        to it; None detaches."""
        self.breaker.reports.set_fault_reporter(reporter)

    def clear(self) -> None:
        """Remove this backend's namespace where the client can list keys.

        SiMM's client has no key listing, so on a cluster nothing can be
        removed; the local store deletes by prefix.
        """
        bound = self.pools.bound()
        if not bound:
            return
        if not all(b.prefix for _, b in bound):
            logger.warning("SiMM clear(): key_scheme 'legacy' without extra_backend_tag has no "
                           "namespace of its own; nothing removed")
            return
        prefixes = [b.prefix for _, b in bound]
        if not self.client.supports_delete_prefix:
            logger.warning("SiMM clear(): the SiMM client cannot list keys, so pages under %s stay "
                           "until the cluster evicts them", ", ".join(map(repr, prefixes)))
            return
        for prefix in prefixes:
            removed = self.client.delete_prefix(prefix)
            logger.info("SiMM clear(): removed %d objects under %r", removed, prefix)
        self.events.cleared()

    def _probe(self) -> list[int]:
        """The breaker's probe: one lookup of a key no page has (a healthy
        store answers "not found"). On the local store a call that finds no
        store process starts one, so a probe also heals a killed store."""
        return self.client.mexists_codes([PROBE_KEY])

    def close(self, wait_s: float | None = None) -> None:
        """No new call starts; calls in flight finish (for up to ``wait_s``,
        default ``CLOSE_WAIT_S``, here; after that in the background); then
        every pool's memory is deregistered; then the client closes.
        Idempotent (errors: the class's contract). The event stream, if
        any, announces every page it announced as removed, then closes."""
        if self.removals is not None:
            self.removals.close()
        self.events.close()
        self.breaker.close()
        bindings = self.pools.close()
        if bindings is None:  # closed already
            return
        try:
            release(bindings, wait_s=CLOSE_WAIT_S if wait_s is None else wait_s,
                    then=self.client.close, what="a closed backend")
        except Exception as exc:
            logger.warning("SiMM close(): %s: %s", type(exc).__name__, exc)


def _all_false(transfers: list[Any]) -> dict[Any, list[bool]]:
    """``{pool name: all False}``: v2's answer before (or instead of) a read
    or write; a malformed transfer gets no entry."""
    out: dict[Any, list[bool]] = {}
    for t in transfers:
        try:
            out[t.name] = [False] * len(t.keys or [])
        except Exception:
            continue
    return out
