"""The hybrid models' path (SGLang 0.5.23): ``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2``.

KV pages still move through v1; v2 moves the side pools' pages (Mamba,
SWA, draft, DSA indexer), every pool of a call in one client call. Never
raises: a fault answers misses.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

import numpy as np

from sglang_simm import hybrid
from sglang_simm.binding import PoolBinding
from sglang_simm.inflight import Call
from sglang_simm.transfer import Batch

logger = logging.getLogger("sglang_simm.backend")


class V2Path:
    """``HiCacheSiMM``'s v2 data path."""

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Restorable prefixes of a hybrid model's pages.

        KV: the leading run of complete pages (``batch_exists``). Every extra
        pool is looked up under the KV page keys (a transfer's own keys are
        placeholders; their count is the TRAILING_PAGES window) and narrows
        the set of restorable prefix lengths by its hit policy; the KV hit is
        the longest length left. Never raises; a fault is a miss.
        """
        with Call(self._fault, "batch_exists_v2") as call:
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
                b = self._use(call, t.name, "batch_exists_v2")
                if b is None:
                    lookups.append((t, None, np.empty(0, dtype=np.int64), len(all_keys)))
                    continue
                pages, obj_keys = b.page_object_keys(page_keys)
                lookups.append((t, b, pages, len(all_keys)))
                all_keys.extend(obj_keys)
            found = np.zeros(0, dtype=bool)
            if all_keys:
                self.counters.record_exists()
                found = np.asarray(self.client.mexists_codes(all_keys)) == 0
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
        try:
            return hybrid.to_pool_transfer_result(hybrid.miss())
        except Exception:
            return None

    def _resolve_v2(self, call: Call, transfers: list[Any], results: dict[Any, list[bool]],
                    where: str) -> list[tuple[Any, Batch]]:
        """Resolve every transfer; results start as all-False, one per key."""
        batches = []
        for t in transfers:
            keys = list(t.keys or [])
            results[t.name] = [False] * len(keys)
            if not keys:
                continue
            b = self._use(call, t.name, where)
            if b is None:
                continue
            batch = self._resolve(b, keys, t.host_indices, where)
            if batch is not None:
                batches.append((t.name, batch))
        return batches

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read hybrid pools' pages into their host pools (one mget for all):
        ``{pool name: one bool per key}``, True only where every object of
        the page read back exactly its expected size."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        with Call(self._fault, "batch_get_v2") as call:
            batches = self._resolve_v2(call, transfers, results, "batch_get_v2")
            if not batches:
                return results
            all_keys = [k for _, bt in batches for k in bt.keys]
            all_views = [v for _, bt in batches for v in bt.views]
            t0 = perf_counter()
            codes = np.asarray(self.client.mget_views(all_keys, all_views), dtype=np.int64)
            dt = perf_counter() - t0
            if codes.size != len(all_keys):
                raise RuntimeError(f"mget answered {codes.size} results for {len(all_keys)} objects")
            hits = total = nbytes = 0
            start = 0
            for name, bt in batches:
                results[name], good = self._pages_read(bt, codes[start:start + len(bt.keys)])
                start += len(bt.keys)
                hits += good
                total += bt.n
                nbytes += good * bt.binding.page_bytes
            self.counters.record_get(hits, total - hits, nbytes, dt, nbytes / hits if hits else 0)
            if self._profile:
                logger.info("SiMM batch_get_v2: %d pages in %d pools, %d hits, %.1f us",
                            total, len(batches), hits, dt * 1e6)
            return results
        return _all_false(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write hybrid pools' pages (one mput for all pools, no lookup
        first): ``{pool name: one bool per key}``."""
        transfers = list(transfers or [])
        results: dict[Any, list[bool]] = {}
        with Call(self._fault, "batch_set_v2") as call:
            batches = self._resolve_v2(call, transfers, results, "batch_set_v2")
            if not batches:
                return results
            t0 = perf_counter()
            rows = self._put([bt for _, bt in batches])
            for (name, _), row in zip(batches, rows):
                results[name] = row
            if self._profile:
                logger.info("SiMM batch_set_v2: %d pages in %d pools, %d stored, %.1f us",
                            sum(bt.n for _, bt in batches), len(batches), sum(map(sum, rows)),
                            (perf_counter() - t0) * 1e6)
            return results
        return _all_false(transfers)


def _all_false(transfers: list[Any]) -> dict[Any, list[bool]]:
    out: dict[Any, list[bool]] = {}
    for t in transfers:
        try:
            out[t.name] = [False] * len(t.keys or [])
        except Exception:  # a malformed transfer: nothing to answer for it
            continue
    return out
