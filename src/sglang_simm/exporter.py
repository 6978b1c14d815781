"""The backend's counters in SGLang's own ``/metrics`` (``--enable-metrics``).

A data-path call pays nothing for it: ``BackendCounters`` (``metrics.py``)
counts as always and, only where an exporter is attached, adds the call's
latency to a ``LatencyTally``; ``L3Exporter.flush``, run from ``get_stats()``
on SGLang's scheduler thread, turns what grew since its last flush into
Prometheus increments. Off (SGLang's default), ``exporter_for`` answers
None and ``prometheus_client`` is never imported. The series, and why they
reach the server's endpoint: docs/observability.md.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left
from typing import Any, Mapping

#: every series' name starts with this (the local store's are ``sglang_simm:store_*``)
PREFIX = "sglang_simm:"

#: labels of every series, as SGLang's scheduler metrics name them
LABELS = ("model_name", "tp_rank", "pp_rank", "dp_rank")

#: call latency buckets, seconds: from a local store's batch to a client timeout
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)

#: the breaker's states as the gauge's values
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

#: labels of ``l3_store_info``: which store L3 is (``describe_store``)
STORE_LABELS = ("address", "store_dir", "store_dir_from")

#: (snapshot field, metric name, help) of the plain counters
COUNTERS = (
    ("pages_read", "l3_pages_hit", "L3 pages read back whole (every object of the page, its exact size)"),
    ("pages_missed", "l3_pages_missed", "L3 pages asked for and not read (absent, short, or a fault)"),
    ("pages_written", "l3_pages_written", "L3 pages stored"),
    ("pages_skipped_existing", "l3_pages_skipped",
     "L3 pages not written again because the store already held them"),
    ("pages_write_failed", "l3_pages_write_failed", "L3 pages whose write failed (see l3_faults_total)"),
    ("bytes_read", "l3_read_bytes", "Bytes read from L3 into the host pool"),
    ("bytes_written", "l3_written_bytes", "Bytes written from the host pool to L3"),
    ("exists_queries", "l3_exists_calls", "Existence lookups (batch_exists) answered"),
)

#: operations whose latency is kept: the client's batch call of each
OPERATIONS = ("get", "set", "exists")

#: the KV event stream's counters (``kv_events`` on): series made at the
#: first flush that has them, so a server without the stream has none
EVENT_KINDS = ("stored", "removed")


class LatencyTally:
    """Counts of call latencies per bucket and their sum, per operation;
    not locked (its owner's lock covers it)."""

    __slots__ = ("counts", "sums")

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {op: [0] * (len(LATENCY_BUCKETS) + 1) for op in OPERATIONS}
        self.sums: dict[str, float] = dict.fromkeys(OPERATIONS, 0.0)

    def observe(self, op: str, seconds: float) -> None:
        self.counts[op][bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sums[op] += seconds

    def copy(self) -> tuple[dict[str, list[int]], dict[str, float]]:
        return {op: list(c) for op, c in self.counts.items()}, dict(self.sums)


def labels_of(storage_config: Any) -> dict[str, str]:
    """The labels SGLang's scheduler puts on its own series, from the
    storage config it hands the backend."""
    def get(name: str, default: Any = "") -> str:
        value = getattr(storage_config, name, default)
        return "" if value is None else str(value)

    return {"model_name": get("model_name"), "tp_rank": get("tp_rank", 0), "pp_rank": get("pp_rank", 0),
            "dp_rank": get("dp_rank")}


def exporter_for(storage_config: Any) -> L3Exporter | None:
    """An exporter where SGLang's metrics are on (its storage config's
    ``enable_storage_metrics``, set by ``--enable-metrics``), else None;
    None too where ``prometheus_client`` cannot be imported."""
    if not getattr(storage_config, "enable_storage_metrics", False):
        return None
    try:
        return L3Exporter(labels_of(storage_config))
    except ImportError:
        return None


class _Families:
    """The metric families, made once per process and registry: a second
    backend in the process (SGLang re-attaches one at runtime) takes its
    children from the same families, as registering a name twice fails."""

    _lock = threading.Lock()
    _by_registry: weakref.WeakKeyDictionary[Any, _Families] = weakref.WeakKeyDictionary()

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw = {"labelnames": LABELS, "registry": registry}
        self.counters = {field: Counter(f"{PREFIX}{name}", text, **kw) for field, name, text in COUNTERS}
        self.faults = Counter(f"{PREFIX}l3_faults", "Faults of L3 calls by SiMM code (or exception type); "
                              "each is answered as a miss", labelnames=(*LABELS, "code"), registry=registry)
        self.latency = Histogram(f"{PREFIX}l3_call_seconds", "Latency of the SiMM client's batch call per "
                                 "operation (get: mget of a batch_get; set: mput of a batch_set; "
                                 "exists: mexists of a hit query, on the request's path)",
                                 labelnames=(*LABELS, "op"), buckets=LATENCY_BUCKETS, registry=registry)
        self.breaker_state = Gauge(f"{PREFIX}breaker_state", "The circuit breaker's state: 0 closed, "
                                   "1 half open, 2 open (L3 calls skipped)", labelnames=LABELS,
                                   registry=registry, multiprocess_mode="mostrecent")
        self.breaker_transitions = Counter(f"{PREFIX}breaker_transitions", "Circuit breaker transitions, "
                                           "by the state entered", labelnames=(*LABELS, "to"), registry=registry)
        self.store = Gauge(f"{PREFIX}l3_store_info", "The store this backend's L3 is, always 1: its address "
                           "and, for a local store, the directory it lives in and what chose it",
                           labelnames=(*LABELS, *STORE_LABELS), registry=registry, multiprocess_mode="mostrecent")
        self.event_pages = Counter(f"{PREFIX}kv_events_pages", "L3 pages announced as SGLang KV events "
                                   "(kv_events), by event: stored (BlockStored) or removed (BlockRemoved)",
                                   labelnames=(*LABELS, "event"), registry=registry)
        self.event_drops = Counter(f"{PREFIX}kv_events_dropped_pages", "L3 pages whose event was dropped, "
                                   "by event: the plugin's queue was full (max_queue_size), or SGLang's "
                                   "publisher refused the batch", labelnames=(*LABELS, "event"), registry=registry)
        self.event_batches = Counter(f"{PREFIX}kv_events_batches", "KVEventBatch messages handed to SGLang's "
                                     "publisher (kv_events)", labelnames=LABELS, registry=registry)

    @classmethod
    def of(cls, registry: Any) -> _Families:
        with cls._lock:
            families = cls._by_registry.get(registry)
            if families is None:
                families = cls._by_registry[registry] = cls(registry)
            return families


class L3Exporter:
    """Pushes what a ``BackendCounters`` counted into Prometheus metrics.

    ``flush(snapshot, latency, breaker)`` takes absolute totals and adds
    what grew since the previous flush; nothing else touches Prometheus.
    ``registry``: the default registry (what SGLang's ``/metrics`` reads in
    multiprocess mode), or a test's own.
    """

    def __init__(self, labels: Mapping[str, str], *, registry: Any = None) -> None:
        if registry is None:
            from prometheus_client import REGISTRY as registry  # noqa: N811
        self.labels = {name: str(labels.get(name, "")) for name in LABELS}
        self._families = _Families.of(registry)
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._last_faults: dict[str, int] = {}
        self._last_counts = {op: [0] * (len(LATENCY_BUCKETS) + 1) for op in OPERATIONS}
        self._last_sums = dict.fromkeys(OPERATIONS, 0.0)
        self._breaker: str | None = None
        self._last_transitions: dict[str, int] = {}
        self._last_events: dict[str, int] = {}
        # every series of this backend exists, at 0, from its attach: a scrape
        # tells "the plugin counts, nothing happened" from "no plugin here"
        f = self._families
        for field, _name, _text in COUNTERS:
            f.counters[field].labels(**self.labels)
        for op in OPERATIONS:
            f.latency.labels(**self.labels, op=op)

    def describe_store(self, address: str, place: tuple[str, str] | None) -> None:
        """Which store L3 is, once at attach: ``l3_store_info`` at 1 with the
        manager address and, for a local store, its directory and what chose
        it (``config.local_store_place``; "" for a cluster). ``doctor
        --server`` reads the server's own, which its shell may not share."""
        directory, chosen_by = place or ("", "")
        self._families.store.labels(**self.labels, address=address, store_dir=directory,
                                    store_dir_from=chosen_by).set(1)

    def flush(self, snapshot: Mapping[str, Any], latency: tuple[dict[str, list[int]], dict[str, float]] | None = None,
              breaker: tuple[str | None, Mapping[str, int]] | None = None) -> None:
        f, labels = self._families, self.labels
        with self._lock:  # one flush at a time: the deltas are read and stored together
            for field, _name, _text in COUNTERS:
                value = snapshot.get(field, 0)
                delta = value - self._last.get(field, 0)
                if delta > 0:
                    f.counters[field].labels(**labels).inc(delta)
                    self._last[field] = value
            for code, n in (snapshot.get("errors") or {}).items():
                delta = n - self._last_faults.get(code, 0)
                if delta > 0:
                    f.faults.labels(**labels, code=str(code)).inc(delta)
                    self._last_faults[code] = n
            if latency is not None:
                counts, sums = latency
                for op in OPERATIONS:
                    grew = [now - before for now, before in zip(counts[op], self._last_counts[op])]
                    if any(grew):
                        _add_to_histogram(f.latency.labels(**labels, op=op), grew, sums[op] - self._last_sums[op])
                        self._last_counts[op], self._last_sums[op] = counts[op], sums[op]
            events = snapshot.get("kv_events")
            if events:
                self._flush_events(events)
            if breaker is not None:
                state, transitions = breaker
                if state is not None and state != self._breaker:
                    f.breaker_state.labels(**labels).set(BREAKER_STATES.get(state, -1))
                    self._breaker = state
                for to, n in transitions.items():
                    delta = n - self._last_transitions.get(to, 0)
                    if delta > 0:
                        f.breaker_transitions.labels(**labels, to=to).inc(delta)
                        self._last_transitions[to] = n

    def _flush_events(self, events: Mapping[str, Any]) -> None:
        """The event stream's totals into its series (under ``_lock``)."""
        f, labels = self._families, self.labels
        totals = {("pages", kind): events.get(f"{kind}_pages", 0) for kind in EVENT_KINDS}
        totals.update({("drops", kind): (events.get("dropped_pages") or {}).get(kind, 0) for kind in EVENT_KINDS})
        totals[("batches", "")] = events.get("batches", 0)
        first = not self._last_events
        for (what, kind), value in totals.items():
            key = f"{what}:{kind}"
            delta = value - self._last_events.get(key, 0)
            if what == "batches":
                child = f.event_batches.labels(**labels)
            else:
                child = (f.event_pages if what == "pages" else f.event_drops).labels(**labels, event=kind)
            if delta > 0 or first:  # every series exists from the first flush
                child.inc(max(delta, 0))
                self._last_events[key] = value


def _add_to_histogram(child: Any, per_bucket: list[int], total: float) -> None:
    """Add ``per_bucket[i]`` observations to bucket i (and ``total`` to the
    sum) of a labelled Histogram in one step each, the way ``observe``
    adds one (prometheus_client keeps a value per bucket, not cumulative,
    and the sum; tests/test_exporter.py holds this against ``observe``)."""
    buckets = child._buckets
    for i, n in enumerate(per_bucket):
        if n:
            buckets[i].inc(n)
    child._sum.inc(total)
