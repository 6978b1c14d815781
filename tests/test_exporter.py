"""The backend's series for SGLang's /metrics (sglang_simm/exporter.py), on a
registry of the test's own; the real server's /metrics is tests/e2e/test_observability.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from sglang_simm.exporter import LATENCY_BUCKETS, L3Exporter, exporter_for, labels_of  # noqa: E402
from sglang_simm.metrics import BackendCounters  # noqa: E402

LABELS = {"model_name": "llama-tiny", "tp_rank": "0", "pp_rank": "0", "dp_rank": ""}


def value(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_off_by_default_and_lazy():
    assert exporter_for(SimpleNamespace(enable_storage_metrics=False)) is None
    assert exporter_for(None) is None
    # importing the plugin never imports prometheus_client
    code = "import sys, sglang_simm, sglang_simm.metrics, sglang_simm.exporter; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_labels_like_sglang():
    sc = SimpleNamespace(model_name="m", tp_rank=1, pp_rank=0, dp_rank=None, enable_storage_metrics=True)
    assert labels_of(sc) == {"model_name": "m", "tp_rank": "1", "pp_rank": "0", "dp_rank": ""}


def test_counters_flush_deltas_only():
    registry = prometheus_client.CollectorRegistry()
    counters = BackendCounters(storage_metrics=True, exporter=L3Exporter(LABELS, registry=registry))
    counters.record_get(3, 1, 300, 0.0002)
    counters.record_set(5, 2, 1, 500, 0.003)
    counters.record_codes(__import__("collections").Counter({-2701: 2}))
    counters.record_error("size_mismatch")
    counters.flush_export()
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 3
    assert value(registry, "sglang_simm:l3_pages_missed_total") == 1
    assert value(registry, "sglang_simm:l3_pages_written_total") == 5
    assert value(registry, "sglang_simm:l3_pages_skipped_total") == 2
    assert value(registry, "sglang_simm:l3_pages_write_failed_total") == 1
    assert value(registry, "sglang_simm:l3_faults_total", code="size_mismatch") == 1
    faults = [s for s in registry.collect() if s.name == "sglang_simm:l3_faults"][0].samples
    assert sum(s.value for s in faults if s.name.endswith("_total")) == 3
    assert value(registry, "sglang_simm:l3_call_seconds_count", op="get") == 1
    assert value(registry, "sglang_simm:l3_call_seconds_count", op="set") == 1
    # a second flush with nothing new adds nothing; new counts add their delta
    counters.flush_export()
    counters.record_get(1, 0, 100, 0.0002)
    counters.flush_export()
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 4
    assert value(registry, "sglang_simm:l3_call_seconds_count", op="get") == 2


def test_histogram_matches_observe():
    """The bulk add gives exactly what observe() one by one gives."""
    seconds = [0.00001, 0.00005, 0.0003, 0.0003, 0.02, 0.9, 7.0]
    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    counters = BackendCounters(storage_metrics=False, exporter=L3Exporter(LABELS, registry=ours))
    for s in seconds:
        counters.record_get(1, 0, 1, s)
    counters.flush_export()
    hist = prometheus_client.Histogram("sglang_simm:l3_call_seconds", "x", labelnames=(*LABELS, "op"),
                                       buckets=LATENCY_BUCKETS, registry=theirs)
    for s in seconds:
        hist.labels(**LABELS, op="get").observe(s)
    for bound in [*LATENCY_BUCKETS, float("inf")]:
        le = prometheus_client.utils.floatToGoString(bound)
        assert value(ours, "sglang_simm:l3_call_seconds_bucket", op="get", le=le) == \
            value(theirs, "sglang_simm:l3_call_seconds_bucket", op="get", le=le), le
    assert value(ours, "sglang_simm:l3_call_seconds_sum", op="get") == pytest.approx(sum(seconds))


def test_breaker_one_call():
    registry = prometheus_client.CollectorRegistry()
    counters = BackendCounters(storage_metrics=False, exporter=L3Exporter(LABELS, registry=registry))
    counters.record_breaker("closed")
    counters.flush_export()
    assert value(registry, "sglang_simm:breaker_state") == 0
    counters.record_breaker("open")
    counters.record_breaker("open")
    counters.flush_export()
    assert value(registry, "sglang_simm:breaker_state") == 2
    assert value(registry, "sglang_simm:breaker_transitions_total", to="open") == 1
    counters.record_breaker("half_open")
    counters.record_breaker("closed")
    counters.flush_export()
    assert value(registry, "sglang_simm:breaker_state") == 0
    assert value(registry, "sglang_simm:breaker_transitions_total", to="closed") == 1


def test_every_l3_call_is_timed_by_operation(attach):
    """Gets, sets and the hit queries SGLang waits on before a prefill
    (v1 and v2) each land in the latency histogram under their operation."""
    import torch

    from sglang_simm_dev.pools import PRESETS

    registry = prometheus_client.CollectorRegistry()
    backend, host = attach(PRESETS["tiny"])
    counters = BackendCounters(storage_metrics=False, exporter=L3Exporter(LABELS, registry=registry))
    backend.counters = backend.answers.counters = counters
    ps = host.page_size
    keys = ["p0", "p1"]
    assert backend.batch_set_v1(keys, torch.arange(0, 2 * ps)) == [True, True]
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 2
    assert backend.batch_get_v1(keys, torch.arange(2 * ps, 4 * ps)) == [True, True]
    counters.flush_export()
    for op, n in (("set", 1), ("exists", 2), ("get", 1)):
        assert value(registry, "sglang_simm:l3_call_seconds_count", op=op) == n, op
        assert value(registry, "sglang_simm:l3_call_seconds_sum", op=op) > 0, op


def test_every_series_exists_from_attach():
    """A scrape before any L3 call tells the plugin's zeros from no plugin."""
    registry = prometheus_client.CollectorRegistry()
    L3Exporter(LABELS, registry=registry)
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 0
    assert value(registry, "sglang_simm:l3_call_seconds_count", op="set") == 0
    assert value(registry, "sglang_simm:l3_call_seconds_count", op="exists") == 0


def test_two_backends_share_families():
    """SGLang re-attaches a backend at runtime: the names register once."""
    registry = prometheus_client.CollectorRegistry()
    a, b = L3Exporter(LABELS, registry=registry), L3Exporter(LABELS, registry=registry)
    a.flush({"pages_read": 2})
    b.flush({"pages_read": 3})
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 5


def test_drain_flushes_at_most_every_interval(monkeypatch):
    import sglang_simm.metrics as metrics

    monkeypatch.setattr(metrics, "EXPORT_INTERVAL_S", 3600.0)
    registry = prometheus_client.CollectorRegistry()
    counters = BackendCounters(storage_metrics=False, exporter=L3Exporter(LABELS, registry=registry))
    counters.record_get(1, 0, 1, 0.001)
    counters.drain_storage_metrics()  # the first flushes at once
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 1
    counters.record_get(1, 0, 1, 0.001)
    counters.drain_storage_metrics()  # within the interval: not yet
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 1
    monkeypatch.setattr(metrics, "EXPORT_INTERVAL_S", 0.0)
    counters.drain_storage_metrics()
    assert value(registry, "sglang_simm:l3_pages_hit_total") == 2


def test_the_backend_reports_which_store_its_l3_is_in_its_log_and_metrics(attach, host_store_dir, caplog):
    """A local store's directory, and what chose it, in the server's log
    and as labels of ``sglang_simm:l3_store_info``: ``doctor --server``
    reads the server's, which its own shell may not share."""
    import logging

    from sglang_simm_dev.pools import PRESETS

    with caplog.at_level(logging.INFO, logger="sglang_simm.client"):
        backend, _host = attach(PRESETS["tiny"], enable_storage_metrics=True, model_name="store-info-test")
    address = backend.config.manager_address
    name = address.removeprefix("local://")
    said = [r.getMessage() for r in caplog.records if "lives in" in r.getMessage()]
    assert said == [f"SiMM local store {name!r} lives in {host_store_dir} (env SGLANG_SIMM_STORE_DIR)"]
    [family] = [f for f in prometheus_client.REGISTRY.collect() if f.name == "sglang_simm:l3_store_info"]
    [sample] = [s for s in family.samples if s.labels.get("address") == address]
    assert sample.value == 1 and sample.labels["model_name"] == "store-info-test"
    assert (sample.labels["store_dir"], sample.labels["store_dir_from"]) == (host_store_dir,
                                                                              "env SGLANG_SIMM_STORE_DIR")
