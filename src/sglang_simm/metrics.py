"""Counters, SGLang's StorageMetrics, and rate-limited fault logging.

A fault on the data path is answered as a miss (the error contract on
``backend.HiCacheSiMM``), so it must be visible some other way: every one is
counted (by SiMM code or exception type) and logged at most once per
interval per kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.errors import code_name
from sglang_simm.exporter import LatencyTally


def storage_metrics_class() -> type | None:
    """SGLang's ``StorageMetrics``: moved from ``sglang.srt.metrics.collector``
    to ``sglang.srt.observability.metrics_collector`` in 0.5.x."""
    for module in (
        "sglang.srt.observability.metrics_collector",
        "sglang.srt.metrics.collector",
    ):
        try:
            mod = __import__(module, fromlist=["StorageMetrics"])
            return mod.StorageMetrics
        except (ImportError, AttributeError):
            continue
    return None


#: Operations kept for SGLang's StorageMetrics between two ``get_stats()``
#: calls; past this many the oldest are dropped, so memory stays bounded
#: even when nobody drains.
PENDING_LIMIT = 1024

#: The exporter is flushed at most this often (seconds): SGLang calls
#: ``get_stats()`` on every pass of its scheduler loop.
EXPORT_INTERVAL_S = 0.5


def _bounded() -> deque:
    return deque(maxlen=PENDING_LIMIT)


@dataclass
class _Pending:
    prefetch_pgs: deque = field(default_factory=_bounded)
    backup_pgs: deque = field(default_factory=_bounded)
    prefetch_bandwidth: deque = field(default_factory=_bounded)
    backup_bandwidth: deque = field(default_factory=_bounded)

    def __len__(self) -> int:
        return len(self.prefetch_pgs) + len(self.backup_pgs)


class BackendCounters:
    """What the backend did since it started; ``snapshot()`` reads it.

    ``storage_metrics``: keep per-operation entries for SGLang's
    ``StorageMetrics`` (``storage_config.enable_storage_metrics``). SGLang
    calls ``get_stats()`` only when its metrics are on (off by default), so
    with them off nothing is kept; with them on at most ``PENDING_LIMIT``
    entries per list wait for the next drain.
    """

    def __init__(self, *, storage_metrics: bool = True, exporter: Any = None) -> None:
        self._lock = threading.Lock()
        self.storage_metrics = bool(storage_metrics)
        #: ``exporter.L3Exporter`` (SGLang's /metrics), flushed by ``drain_storage_metrics``; None: off
        self.exporter = exporter
        self._latency = LatencyTally() if exporter is not None else None
        self._flushed_at = float("-inf")
        #: the backend's KV event stream (``events.L3Events``) when
        #: ``kv_events`` is on: its counters join the snapshot and /metrics
        self.events: Any = None
        self.breaker_state: str | None = None
        self.breaker_transitions: Counter[str] = Counter()
        self.pages_read = 0
        self.pages_missed = 0
        self.pages_written = 0
        self.pages_skipped = 0
        self.pages_write_failed = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.exists_queries = 0
        self.errors: Counter[str] = Counter()
        self._pending = _Pending()

    def record_get(self, hits: int, misses: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.pages_read += hits
            self.pages_missed += misses
            self.bytes_read += nbytes
            if self._latency is not None and seconds > 0:
                self._latency.observe("get", seconds)
            if hits and self.storage_metrics:
                self._pending.prefetch_pgs.append(hits)
                self._pending.prefetch_bandwidth.append(_gib_per_s(nbytes, seconds))

    def record_set(self, written: int, skipped: int, failed: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.pages_written += written
            self.pages_skipped += skipped
            self.pages_write_failed += failed
            self.bytes_written += nbytes
            if self._latency is not None and seconds > 0:
                self._latency.observe("set", seconds)
            if written and self.storage_metrics:
                self._pending.backup_pgs.append(written)
                self._pending.backup_bandwidth.append(_gib_per_s(nbytes, seconds))

    def record_exists(self, seconds: float = 0.0) -> None:
        """One hit query's lookup (its ``mexists``, ``seconds`` long: SGLang
        waits for it before a request's prefill)."""
        with self._lock:
            self.exists_queries += 1
            if self._latency is not None and seconds > 0:
                self._latency.observe("exists", seconds)

    def record_codes(self, codes: Counter[int]) -> None:
        with self._lock:
            for code, n in codes.items():
                self.errors[code_name(code)] += n

    def record_error(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.errors[kind] += n

    def record_breaker(self, state: str) -> None:
        """The circuit breaker's state (``closed``, ``half_open``, ``open``):
        a change counts one transition into ``state``."""
        with self._lock:
            if state != self.breaker_state:
                if self.breaker_state is not None:
                    self.breaker_transitions[state] += 1
                self.breaker_state = state

    def flush_export(self) -> None:
        """Push what changed since the last flush into SGLang's /metrics
        (nothing without an exporter)."""
        if self.exporter is None:
            return
        snap = self.snapshot()
        with self._lock:
            latency = self._latency.copy() if self._latency is not None else None
            breaker = (self.breaker_state, dict(self.breaker_transitions))
        self.exporter.flush(snap, latency, breaker)

    @property
    def pending(self) -> int:
        """Operations waiting for the next ``drain_storage_metrics``."""
        with self._lock:
            return len(self._pending)

    def drain_storage_metrics(self) -> Any:
        """SGLang's StorageMetrics of what happened since the last call;
        flushes the exporter (SGLang calls this on its scheduler thread)."""
        if self.exporter is not None:
            now = time.monotonic()
            if now - self._flushed_at >= EXPORT_INTERVAL_S:
                self._flushed_at = now
                self.flush_export()
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        cls = storage_metrics_class()
        if cls is None:
            return None
        metrics = cls()
        metrics.prefetch_pgs.extend(pending.prefetch_pgs)
        metrics.backup_pgs.extend(pending.backup_pgs)
        metrics.prefetch_bandwidth.extend(pending.prefetch_bandwidth)
        metrics.backup_bandwidth.extend(pending.backup_bandwidth)
        return metrics

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            total = self.pages_read + self.pages_missed
            return {
                "pages_read": self.pages_read,
                "pages_missed": self.pages_missed,
                "hit_rate": self.pages_read / total if total else 0.0,
                "pages_written": self.pages_written,
                "pages_skipped_existing": self.pages_skipped,
                "pages_write_failed": self.pages_write_failed,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "exists_queries": self.exists_queries,
                "errors": dict(self.errors),
                **({"kv_events": self.events.snapshot()} if self.events is not None else {}),
            }


def _gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / (1 << 30) / seconds if seconds > 0 else 0.0


class RateLimitedLog:
    """Log each kind of fault at most once per ``interval`` seconds, saying
    how many were suppressed in between."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(
        self, kind: str, msg: str, *args: Any, exc_info: bool = False, level: int = logging.WARNING
    ) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] += 1
                return False
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (%d more like this suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True
