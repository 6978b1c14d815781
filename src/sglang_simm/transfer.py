"""What every data path shares: a batch resolved to objects, and the client's answers read.

``_resolve`` turns one pool's batch (page keys, host indices) into object
keys and views, or None (counted) when its indices are unusable.
``_pages_read`` and ``_put_rows`` turn ``mget``/``mput`` codes into one
bool per page, counting and logging every fault by its SiMM code.
"""

from __future__ import annotations

import logging
from collections import Counter
from time import perf_counter as _now
from typing import Any, NamedTuple, Sequence

import numpy as np

from sglang_simm import errors
from sglang_simm.binding import PoolBinding

logger = logging.getLogger("sglang_simm.backend")

#: The one code that means "not there" for certain (SiMM's async get). The
#: synchronous client folds every server-side failure of a get, a plain miss
#: included, into GetObjectFailed, which ``_read_faults`` tells apart.
_MISS_CODES = (errors.DS_KEY_NOT_FOUND,)
_GET_FAILED = errors.GET_OBJECT_FAILED
#: The object was there already: the v0.1.0.post1 tag's mput keeps it and
#: answers this; a concurrent writer of the same page got there first.
ALREADY_EXISTS = errors.DS_DATA_ALREADY_EXISTS


class Batch(NamedTuple):
    """One pool's batch resolved to SiMM objects."""

    binding: PoolBinding
    #: pages asked for
    n: int
    #: indices of the pages the objects belong to; None: every page, in order
    rows: np.ndarray | None
    keys: list[str]
    #: one view per key (a list, or a sequence that makes them on demand)
    views: Sequence[Any]
    #: first host slot of every resolved page; None for client-owned blocks
    starts: np.ndarray | None


class Transfers:
    """The shared steps of ``HiCacheSiMM``'s data paths."""

    def _resolve(self, b: PoolBinding, keys: Sequence[str], host_indices: Any, where: str) -> Batch | None:
        n = len(keys)
        starts = b.starts(host_indices, n)
        if starts is None:
            self.counters.record_error("bad_indices")
            self._log(
                "bad_indices",
                "SiMM %s: host_indices do not hold %d distinct, whole, page-aligned pages of %d slots "
                "inside the host pool; treating the batch as misses",
                where, n, b.page_size,
            )
            return None
        obj_keys = b.keys.of_all(keys)
        if obj_keys is not None:
            return Batch(b, n, None, obj_keys, b.views(starts), starts)
        rows, obj_keys = b.keys.of_usable(keys)
        if len(rows) != n:
            self._log("bad_key", "SiMM: %d page keys are not strings within %d bytes; those pages miss",
                      n - len(rows), b.keys.budget)
        starts = np.asarray(starts)[rows]
        return Batch(b, n, rows, obj_keys, b.views(starts), starts)

    # ------------------------------------------------------------- reads

    def _pages_read(self, batch: Batch, codes: np.ndarray) -> tuple[list[bool], int]:
        """One bool per page asked for from mget's codes for ``batch``: True
        where every object read back exactly its size and no other object of
        the batch ran over it; and how many were. Faults among the rest are
        counted."""
        b = batch.binding
        got = codes.reshape(-1, b.parts)
        ok = (got == b.sizes[None, :]).all(axis=1)
        if not ok.all():
            ok &= ~self._read_faults(batch, codes)
        result = np.zeros(batch.n, dtype=bool)
        result[slice(None) if batch.rows is None else batch.rows] = ok
        return result.tolist(), int(ok.sum())

    def _read_faults(self, batch: Batch, codes: np.ndarray) -> np.ndarray:
        """Count and log what went wrong in one pool's mget answer (one code
        per object); return the pages an object read back longer than its
        view may have overwritten (``overrun_pages``), which must miss too.
        Off the fast path: only batches with a miss get here."""
        b = batch.binding
        sizes = np.tile(b.sizes, codes.size // b.parts)
        failed = codes < 0
        get_failed = np.flatnonzero(codes == _GET_FAILED)
        if get_failed.size:
            self._get_failed([batch.keys[i] for i in get_failed.tolist()])
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
        reached = b.overrun_pages(batch.starts, codes)
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
            batch.keys[first], int(codes[first]), int(sizes[first]), int(over.size),
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

    # ------------------------------------------------------------ writes

    def _put(self, batches: Sequence[Batch]) -> list[list[bool]]:
        """The write step of the zero-copy paths (v1, v2): one ``mput`` of
        every object, no lookup first. Serving's backups are new pages; an
        object already stored is put again (SiMM HEAD deletes and re-puts
        it, the same bytes; the v0.1.0.post1 tag keeps it and answers
        DataServerDataAlreadyExists, which counts as stored), which costs
        less than asking ``mexists`` before every write (docs/per-call-cost.md)."""
        if len(batches) == 1:
            keys, views = batches[0].keys, batches[0].views
        else:
            keys = [k for bt in batches for k in bt.keys]
            views = [v for bt in batches for v in bt.views]
        t0 = _now()
        codes = self.client.mput_views(keys, views if views.__class__ is list else list(views))
        seconds = _now() - t0
        if codes.__class__ is not list:
            codes = list(codes)
        if len(codes) != len(keys):
            raise RuntimeError(f"mput answered {len(codes)} results for {len(keys)} objects")
        if len(batches) == 1 and batches[0].rows is None and not any(codes):
            bt = batches[0]  # the common backup: every page new and now stored
            self.counters.record_set(bt.n, 0, 0, bt.n * bt.binding.page_bytes, seconds)
            return [[True] * bt.n]
        return self._put_rows(batches, np.asarray(codes, dtype=np.int64), seconds)

    def _put_rows(self, batches: Sequence[Batch], codes: np.ndarray, seconds: float) -> list[list[bool]]:
        """One bool per page asked for, per batch, from one code per object
        (0: put now; ALREADY_EXISTS: stored before); counted."""
        stored = (codes == 0) | (codes == ALREADY_EXISTS)
        if not stored.all():
            counts = Counter(codes[~stored].tolist())
            self.counters.record_codes(counts)
            self._log("put", "SiMM write errors: %s",
                      ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counts.items()))
        rows: list[list[bool]] = []
        written = skipped = failed = nbytes = 0
        start = 0
        for bt in batches:
            b = bt.binding
            stop = start + len(bt.keys)
            seg = codes[start:stop].reshape(-1, b.parts)
            ok = stored[start:stop].reshape(-1, b.parts).all(axis=1)
            before = ok & (seg == ALREADY_EXISTS).all(axis=1)
            nbytes += int(((seg == 0) * b.sizes[None, :]).sum())
            written += int(ok.sum()) - int(before.sum())
            skipped += int(before.sum())
            failed += bt.n - int(ok.sum())
            row = np.zeros(bt.n, dtype=bool)
            row[slice(None) if bt.rows is None else bt.rows] = ok
            rows.append(row.tolist())
            start = stop
        self.counters.record_set(written, skipped, failed, nbytes, seconds)
        return rows
