"""The client's answers read: one bool per page from a batch call's codes, counted.

A data-path call hands the client the objects of one or more ``Batch``es
and gets one code per object, in the batches' order. ``Answers`` reads
those codes back into one bool per page asked for, per batch (True only
where every object of the page is), and counts pages, bytes, seconds and
every fault by its SiMM code (``metrics.BackendCounters``), logged
rate-limited. An answer of the wrong length raises (the calling method's
``Call`` turns it into a fault and misses).
"""

from __future__ import annotations

import logging
from collections import Counter
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from sglang_simm import errors
from sglang_simm.binding import Batch, PoolBinding
from sglang_simm.client import KVClient
from sglang_simm.metrics import BackendCounters, RateLimitedLog

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.inflight import Call

logger = logging.getLogger("sglang_simm.backend")

#: The one code that means "not there" for certain (SiMM's async get). The
#: synchronous client folds every server-side failure of a get, a plain miss
#: included, into GetObjectFailed, which ``Answers._get_failed`` tells apart.
_MISS_CODES = (errors.DS_KEY_NOT_FOUND,)
_GET_FAILED = errors.GET_OBJECT_FAILED
#: The object was there already: the v0.1.0.post1 tag's mput keeps it and
#: answers this; a concurrent writer of the same page got there first.
ALREADY_EXISTS = errors.DS_DATA_ALREADY_EXISTS


def leading(pages: list[bool]) -> int:
    """How many leading pages are True."""
    return pages.index(False) if False in pages else len(pages)


class Answers:
    """Reads a batch call's codes into pages, and counts them.

    ``client`` is used only to tell a miss from a fault when a get answers
    GetObjectFailed (``_get_failed``); ``profile`` logs every call's pages
    and time (the ``enable_profile`` setting)."""

    def __init__(self, client: KVClient, counters: BackendCounters, log: RateLimitedLog, *,
                 profile: bool = False) -> None:
        self.client = client
        self.counters = counters
        self.log = log
        self.profile = profile
        #: told ``(binding, object keys)`` when a read finds objects absent
        #: (``DataServerKeyNotFound``, or a GetObjectFailed whose object a
        #: lookup does not find): evicted since SGLang's lookup. None: nobody asks
        self.on_absent: Callable[[PoolBinding, list[str]], None] | None = None

    # ------------------------------------------------------------ lookups

    def found(self, batches: Sequence[Batch], codes: Sequence[int], seconds: float = 0.0) -> list[list[bool]]:
        """``mexists`` codes (0: the object exists) to one bool per page
        asked for, per batch: every object of the page exists. ``seconds``:
        the ``mexists`` call's time, for the latency histogram."""
        self.counters.record_exists(seconds)
        out = []
        for bt, seg in _split(batches, codes, "mexists"):
            parts = bt.binding.parts
            none = [0] * parts
            out.append(_pages(bt, [seg[i:i + parts] == none for i in range(0, len(seg), parts)]))
        return out

    # ------------------------------------------------------------- reads

    def read(self, batches: Sequence[Batch], codes: Sequence[int], seconds: float, where: str,
             call: Call | None = None) -> list[list[bool]]:
        """``mget`` codes (bytes read, or a negative SiMM code) to one bool
        per page asked for, per batch: True where every object read back
        exactly its size and no other object of the batch ran over it.
        Faults among the rest are counted and logged. ``call`` (the data
        path's ``inflight.Call``) gates and records the lookup that tells a
        GetObjectFailed miss from a fault (``_get_failed``)."""
        rows: list[list[bool]] = []
        hits = total = nbytes = 0
        for bt, seg in _split(batches, codes, "mget"):
            b = bt.binding
            parts, sizes = b.parts, b.sizes_list
            ok = [seg[i:i + parts] == sizes for i in range(0, len(seg), parts)]
            if not all(ok):
                reached = self._read_faults(bt, np.asarray(seg, dtype=np.int64), call).tolist()
                ok = [good and not hit for good, hit in zip(ok, reached)]
            good = sum(ok)
            rows.append(_pages(bt, ok))
            hits, total, nbytes = hits + good, total + bt.n, nbytes + good * b.page_bytes
        self.counters.record_get(hits, total - hits, nbytes, seconds)
        if self.profile:
            logger.info("SiMM %s: %d pages in %d pool(s), %d hits, %.1f us, %.2f GiB/s", where, total,
                        len(batches), hits, seconds * 1e6, nbytes / (1 << 30) / seconds if seconds else 0.0)
        return rows

    def _read_faults(self, batch: Batch, codes: np.ndarray, call: Call | None = None) -> np.ndarray:
        """Count and log what went wrong in one pool's mget answer (one code
        per object); return the pages an object read back longer than its
        view may have overwritten (``PoolBinding.overrun_pages``), which
        must miss too. Only batches with a miss get here."""
        b = batch.binding
        sizes = np.tile(b.sizes, codes.size // b.parts)
        failed = codes < 0
        get_failed = np.flatnonzero(codes == _GET_FAILED)
        if get_failed.size:
            self._get_failed([batch.keys[i] for i in get_failed.tolist()], call, b)
        if self.on_absent is not None:
            absent = np.flatnonzero(np.isin(codes, _MISS_CODES)).tolist()
            if absent:
                self.on_absent(b, [batch.keys[i] for i in absent])
        other = codes[failed & (codes != _GET_FAILED) & ~np.isin(codes, _MISS_CODES)]
        if other.size:
            counted = Counter(other.tolist())
            self.counters.record_codes(counted)
            self.log("codes", "SiMM read errors: %s",
                     ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counted.items()))
        short = int(((codes >= 0) & (codes < sizes)).sum())
        if short:
            self.counters.record_error("size_mismatch", short)
            self.log("size", "SiMM: %d objects read back shorter than expected; those pages miss", short)
        over = np.flatnonzero(codes > sizes)
        if not over.size:
            return np.zeros(codes.size // b.parts, dtype=bool)
        reached = b.overrun_pages(batch.starts, codes)
        self.counters.record_error("get_overrun", int(over.size))
        first = int(over[0])
        self.log(
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

    def _get_failed(self, keys: list[str], call: Call | None = None, binding: PoolBinding | None = None) -> None:
        """Sort GetObjectFailed answers (SiMM's synchronous get answers it
        for an absent key too) into misses and faults by looking the objects
        up: one that exists failed (a fault, counted under its code), one
        that does not was evicted (a miss, not logged; docs/keys-and-faults.md).

        The lookup is a client call of ``call``'s: made only where its
        breaker allows (else the answers stay uncounted misses), and
        recorded by its time (its answer is bools, so a hung store shows
        only as time)."""
        if call is not None and not call.allow():
            return
        try:
            t0 = perf_counter()
            present = self.client.mexists(keys)
            if call is not None:
                call.record((), perf_counter() - t0)
            faults = sum(bool(p) for p in present) if len(present) == len(keys) else len(keys)
        except Exception as exc:
            if call is not None:
                call.record(exc=exc)
            faults = len(keys)
        else:
            if self.on_absent is not None and binding is not None and faults < len(keys):
                self.on_absent(binding, [k for k, here in zip(keys, present) if not here])
        if not faults:
            return
        self.counters.record_codes(Counter({_GET_FAILED: faults}))
        self.log("get_failed", "SiMM: %d objects exist but their get failed (%s); those pages miss",
                 faults, errors.code_name(_GET_FAILED))

    # ------------------------------------------------------------ writes

    def written(self, batches: Sequence[Batch], codes: Sequence[int], seconds: float, where: str) -> list[list[bool]]:
        """``mput`` codes (0: put now; ALREADY_EXISTS: stored before, which
        counts as stored) to one bool per page asked for, per batch: True
        where every object of the page is stored. Failures are counted by
        code and logged."""
        rows: list[list[bool]] = []
        written = skipped = failed = nbytes = 0
        for bt, seg in _split(batches, codes, "mput"):
            b = bt.binding
            parts = b.parts
            ok = []
            for i in range(0, len(seg), parts):
                page = seg[i:i + parts]
                new, before = page.count(0), page.count(ALREADY_EXISTS)
                ok.append(new + before == parts)
                skipped += before == parts
            nbytes += sum(size for code, size in zip(seg, b.sizes_list * len(ok)) if code == 0)
            stored = sum(ok)
            written, failed = written + stored, failed + bt.n - stored
            if stored != len(ok):
                counts = Counter(c for c in seg if c != 0 and c != ALREADY_EXISTS)
                self.counters.record_codes(counts)
                self.log("put", "SiMM write errors: %s",
                         ", ".join(f"{errors.code_name(c)} x{k}" for c, k in counts.items()))
            rows.append(_pages(bt, ok))
        written -= skipped
        self.counters.record_set(written, skipped, failed, nbytes, seconds)
        if self.profile:
            logger.info("SiMM %s: %d pages in %d pool(s), %d stored, %.1f us", where,
                        sum(bt.n for bt in batches), len(batches), written + skipped, seconds * 1e6)
        return rows


def _pages(batch: Batch, resolved: list[bool]) -> list[bool]:
    """One bool per page asked for, from one per resolved page (``rows``);
    False for the pages left out."""
    out = [False] * batch.n
    for page, good in zip(batch.rows, resolved):
        out[page] = good
    return out


def _split(batches: Sequence[Batch], codes: Sequence[int], what: str) -> Iterator[tuple[Batch, list[int]]]:
    """Each batch with its own codes, cut from one answer for every batch's
    objects, checked to hold one code per object."""
    got = codes.tolist() if hasattr(codes, "tolist") else list(codes)
    want = sum(len(bt.keys) for bt in batches)
    if len(got) != want:
        raise RuntimeError(f"{what} answered {len(got)} results for {want} objects")
    start = 0
    for bt in batches:
        stop = start + len(bt.keys)
        yield bt, got[start:stop]
        start = stop


def object_keys(batches: Sequence[Batch]) -> list[str]:
    """Every batch's object keys, in order: one client call's keys."""
    return [k for bt in batches for k in bt.keys]


def object_views(batches: Sequence[Batch]) -> list[Any]:
    """Every batch's views, in order: one client call's views."""
    return [v for bt in batches for v in bt.views]
