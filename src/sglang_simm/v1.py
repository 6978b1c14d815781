"""The zero-copy page path SGLang takes for ``simm``: ``batch_exists``, ``batch_get_v1``, ``batch_set_v1``.

Each call moves pages straight between SiMM and the host pool, one batch
call to the client, views made per batch (``PoolBinding.views``). Never
raises: a fault is counted, logged rate-limited, and answers misses.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

import numpy as np

from sglang_simm.inflight import Call

logger = logging.getLogger("sglang_simm.backend")


class V1Path:
    """``HiCacheSiMM``'s v1 data path."""

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every object exists."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return 0
        with Call(self._fault, "batch_exists") as call:
            b = self._use_kv(call, "batch_exists")
            if b is None:
                return 0
            self.counters.record_exists()
            # kept for the read of this batch that follows (KeyCache)
            obj_keys = b.keys.of_all(keys, remember=True)
            if obj_keys is None:
                pages, obj_keys = b.page_object_keys(keys)
                found = np.asarray(self.client.mexists_codes(obj_keys)) == 0
                if found.size != len(obj_keys):
                    raise RuntimeError(f"mexists answered {found.size} results for {len(obj_keys)} keys")
                page_ok = np.zeros(n, dtype=bool)
                page_ok[pages] = found.reshape(-1, b.parts).all(axis=1)
                return n if page_ok.all() else int(np.argmin(page_ok))
            codes = self.client.mexists_codes(obj_keys)
            if len(codes) != len(obj_keys):
                raise RuntimeError(f"mexists answered {len(codes)} results for {len(obj_keys)} keys")
            if not any(codes):  # 0: the object exists
                return n
            return list(map(bool, codes)).index(True) // b.parts
        return 0

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True only where every object of the
        page read back exactly its expected size."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        with Call(self._fault, "batch_get_v1") as call:
            b = self._use_kv(call, "batch_get_v1")
            if b is None:
                return [False] * n
            batch = self._resolve(b, keys, host_indices, "batch_get_v1")
            if batch is None:
                return [False] * n
            t0 = perf_counter()
            codes = self.client.mget_views(batch.keys, batch.views)
            dt = perf_counter() - t0
            if codes.__class__ is not list:
                codes = list(codes)
            if batch.rows is None and codes == b.sizes_list * n:  # every object, exactly its size
                self.counters.record_get(n, 0, n * b.page_bytes, dt, b.page_bytes)
                if self._profile:
                    self._profile_get(n, n, dt, b.page_bytes)
                return [True] * n
            got = np.asarray(codes, dtype=np.int64)
            if got.size != len(batch.keys):
                raise RuntimeError(f"mget answered {got.size} results for {len(batch.keys)} objects")
            result, hits = self._pages_read(batch, got)
            self.counters.record_get(hits, n - hits, hits * b.page_bytes, dt, b.page_bytes)
            if self._profile:
                self._profile_get(n, hits, dt, b.page_bytes)
            return result
        return [False] * n

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write pages: one mput, no lookup first (``Transfers._put``)."""
        n = len(keys) if keys is not None else 0
        if n == 0:
            return []
        with Call(self._fault, "batch_set_v1") as call:
            b = self._use_kv(call, "batch_set_v1")
            if b is None:
                return [False] * n
            batch = self._resolve(b, keys, host_indices, "batch_set_v1")
            if batch is None:
                return [False] * n
            t0 = perf_counter() if self._profile else 0.0
            (row,) = self._put([batch])
            if self._profile:
                logger.info("SiMM batch_set_v1: %d pages, %d stored, %.1f us",
                            n, sum(row), (perf_counter() - t0) * 1e6)
            return row
        return [False] * n

    def _profile_get(self, n: int, hits: int, dt: float, page_bytes: int) -> None:
        logger.info("SiMM batch_get_v1: %d pages, %d hits, %.1f us, %.2f GiB/s",
                    n, hits, dt * 1e6, hits * page_bytes / (1 << 30) / dt if dt else 0.0)
