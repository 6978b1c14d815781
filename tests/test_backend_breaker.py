"""The breaker in the data path: real SGLang host pools (built as
test_backend.py builds them) on the in-process local store, whose fault flags
(``down``, ``latency_us``) stand for a store that is gone or hung.

Faults open the breaker, misses never do; while it is open every
data-path method answers misses at once without touching the client (no
pool counted in, no client block allocated, no backup written); after each
backoff the breaker's own thread probes (no request waits on it), and a
store that answers closes it; no host-pool slot is left counted in. Without
its prober (``data_path_probes``: the fallback when a probe never reports)
the first data-path call after the backoff is the probe. The state machine itself is tested on
its own with a fake clock (test_breaker.py); a store process killed or
stopped, in tests/store/test_store_breaker.py.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import pytest
import torch

from pages import fill_random, hashes, page, raw, slots, tiny
from sglang_simm.breaker import CLOSED, HALF_OPEN, OPEN
from sglang_simm.local_store import get_server
from sglang_simm_dev.faults import configure_faults
from polling import until

#: a breaker that opens after two faults and probes 50 ms later, no jitter
FAST = {"breaker_threshold": 2, "breaker_backoff_ms": 50, "breaker_backoff_max_ms": 200, "breaker_jitter": 0}


@pytest.fixture
def local(attach, store_name):
    """``local(**extra)`` -> (backend, host pool, faults): a backend on an
    in-process local store of the test's own with ``FAST``'s breaker;
    ``faults(**changes)`` sets the simulated network to it."""

    def _local(geom=None, **extra):
        extra = {"manager_address": f"inprocess://{store_name}", **FAST, **extra}
        backend, host = attach(geom or tiny(), extra=extra)
        return backend, host, partial(configure_faults, store_name)

    yield _local
    configure_faults(store_name, down=False, latency_us=0)


class Touches:
    """Every client method a data-path call may use, wrapped to count calls
    (``allocate`` included: a client block is host memory)."""

    NAMES = ("mexists", "mexists_codes", "mget", "mget_views", "mput", "mput_views", "allocate")

    def __init__(self, client):
        self.calls: list[str] = []
        #: the thread of each call, in order
        self.threads: list[str] = []
        for name in self.NAMES:
            real = getattr(client, name)
            setattr(client, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            self.calls.append(name)
            self.threads.append(threading.current_thread().name)
            return real(*args, **kwargs)

        return counted


def open_it(backend, faults, keys):
    """Take the store down and fault until the breaker opens."""
    faults(down=True)
    for _ in range(backend.breaker.threshold):
        assert backend.batch_exists(keys) == 0
    assert backend.breaker.state == OPEN, backend.stats()["breaker"]


def wait_probe_due(backend):
    """Sleep until the breaker's next probe is due."""
    due = backend.stats()["breaker"]["next_probe_in_s"]
    time.sleep((due or 0.0) + 0.01)


def data_path_probes(backend):
    """No prober: the first data-path call after the backoff probes (the
    breaker's fallback when its own probe never reports)."""
    backend.breaker.set_prober(None)


PROBER = "SiMM L3 breaker probe"


def in_flight(backend) -> int:
    """Data-path calls counted in on any bound pool."""
    return sum(len(b.calls) for _, b in backend.pools.bound())


def test_faults_open_it_calls_while_open_touch_nothing_and_a_probe_closes_it(local):
    backend, host, faults = local()
    fill_random(host, 1)
    keys = hashes(4)
    want = [page(host, p) for p in range(4)]
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    assert backend.stats()["breaker"]["state"] == CLOSED

    open_it(backend, faults, keys)
    snap = backend.stats()["breaker"]
    assert snap["opened_total"] == 1 and snap["last_cause"] == "SendRPCFailed(-2300) x8"
    assert not any(k.startswith("exception:") for k in backend.stats()["errors"])  # codes, not exceptions

    touches = Touches(backend.client)
    fill_random(host, 2)
    before = raw(host)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots(host, 8, 4)) == [False] * 4
    assert backend.batch_set_v1(hashes(4, "new"), slots(host, 0, 4)) == [False] * 4
    assert backend.exists(keys[0]) is False
    target = torch.zeros(backend.pools.kv.page_bytes, dtype=torch.uint8)
    assert backend.batch_get([keys[0]], [target]) == [None]
    assert backend.batch_set([keys[0]], [target]) is False
    assert touches.calls == [], touches.calls  # not the store, not a client block
    assert torch.equal(raw(host), before)  # nothing read into the host pool
    assert in_flight(backend) == 0
    assert backend.stats()["breaker"]["refused"] == 6

    faults(down=False)
    until(lambda: backend.breaker.state == CLOSED, "the breaker's probe to close it")
    assert set(touches.threads) == {PROBER}  # the probe was the breaker's own call, no request's
    snap = backend.stats()["breaker"]
    assert snap["closed_total"] == 1 and snap["probes"] >= 1
    assert backend.batch_exists(keys) == 4
    assert backend.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    assert all(torch.equal(page(host, 8 + i), want[i]) for i in range(4))
    assert in_flight(backend) == 0


def test_misses_never_open_it(local):
    backend, host, _faults = local()
    keys = hashes(6, "absent")
    for _ in range(10):
        assert backend.batch_exists(keys) == 0
        # the sync get's only answer for an absent key is GetObjectFailed,
        # which the backend looks up (a second client call, recorded too)
        assert backend.batch_get_v1(keys, slots(host, 0, 6)) == [False] * 6
        assert backend.batch_get([keys[0]], [torch.zeros(backend.pools.kv.page_bytes, dtype=torch.uint8)]) == [None]
    snap = backend.stats()["breaker"]
    assert snap["state"] == CLOSED and snap["faults"] == 0 and snap["consecutive_faults"] == 0


def test_a_healthy_answer_between_faults_keeps_it_closed(local):
    backend, host, faults = local()
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    for _ in range(5):
        faults(down=True)
        assert backend.batch_exists(keys) == 0
        faults(down=False)
        assert backend.batch_exists(keys) == 2
    snap = backend.stats()["breaker"]
    assert snap["state"] == CLOSED and snap["faults"] == 5 and snap["opened_total"] == 0


def test_a_hung_store_opens_it_by_time(local):
    """Answers that come too late (90% of request_timeout_ms) are faults,
    whatever they say: a real client's mexists reads a timeout as absent."""
    backend, host, faults = local(request_timeout_ms=100)
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    faults(latency_us=150_000)
    assert backend.batch_exists(keys) == 2  # a right answer, but too late
    assert backend.batch_exists(keys) == 2
    snap = backend.stats()["breaker"]
    assert snap["state"] == OPEN and snap["last_cause"].startswith("a call took")
    touches = Touches(backend.client)
    assert backend.batch_exists(keys) == 0 and touches.calls == []  # at once, as a miss
    faults(latency_us=0)
    wait_probe_due(backend)
    assert backend.batch_exists(keys) == 2
    assert backend.breaker.state == CLOSED


def test_a_probe_that_faults_opens_it_again_with_a_longer_wait(local):
    backend, host, faults = local()
    keys = hashes(2)
    touches = Touches(backend.client)
    open_it(backend, faults, keys)
    until(lambda: backend.stats()["breaker"]["probe_faults"] >= 1, "a probe to fault")
    snap = backend.stats()["breaker"]
    assert snap["state"] == OPEN and snap["closed_total"] == 0
    # the second wait is twice the first (no jitter), unless a later probe is under way
    assert snap["next_probe_in_s"] > 0.05 or snap["probe_faults"] > 1
    probes = touches.threads[backend.breaker.threshold:]
    assert probes and set(probes) == {PROBER}  # after the opening, only the prober asked the store
    # requests while open never wait for a probe: they are refused at once
    assert backend.batch_get_v1(keys, slots(host, 0, 2)) == [False, False]
    assert set(touches.threads[backend.breaker.threshold:]) == {PROBER}
    assert in_flight(backend) == 0


def test_no_request_ever_probes_a_hung_store(local):
    """The store hangs (each call waits 0.3 s): after the opening, requests
    answer misses without touching the client for as long as the hang
    lasts, while the prober's calls wait on the store."""
    backend, host, faults = local(request_timeout_ms=300)
    keys = hashes(2)
    touches = Touches(backend.client)
    faults(latency_us=300_000)
    for _ in range(backend.breaker.threshold):
        assert backend.batch_exists(keys) == 0  # slow calls: timeouts
    assert backend.breaker.state != CLOSED
    opened_at = len(touches.threads)
    until(lambda: backend.stats()["breaker"]["probe_faults"] >= 2, "two probes to time out")
    for _ in range(20):
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, slots(host, 0, 2)) == [False, False]
    assert set(touches.threads[opened_at:]) == {PROBER}, touches.threads
    faults(latency_us=0)
    until(lambda: backend.breaker.state == CLOSED, "a probe to close it once the store answers")
    assert in_flight(backend) == 0


def test_closing_the_backend_ends_its_prober(local):
    backend, host, faults = local()
    keys = hashes(2)
    open_it(backend, faults, keys)
    until(lambda: any(t.name == PROBER for t in threading.enumerate()), "the prober to start")
    backend.close()
    until(lambda: not any(t.name == PROBER for t in threading.enumerate()), "the prober to end")


def test_a_probe_that_ends_without_an_answer_frees_the_slot(local):
    """A probe refused before its client call (indices that do not fit the
    pool) says nothing about the store: the next call probes."""
    backend, host, faults = local()
    data_path_probes(backend)
    keys = hashes(2)
    open_it(backend, faults, keys)
    faults(down=False)
    wait_probe_due(backend)
    bad = torch.arange(3, 3 + 2 * host.page_size, dtype=torch.int64)  # not page-aligned
    assert backend.batch_get_v1(keys, bad) == [False, False]
    assert backend.breaker.state == OPEN  # the slot given back, not a verdict
    assert backend.batch_exists(keys) == 0  # the next call is the probe; the store answers (a miss)
    assert backend.breaker.state == CLOSED


def test_an_exception_of_the_store_is_a_fault_and_ours_is_not(local):
    backend, host, _faults = local()
    keys = hashes(2)

    def reset(*_args):
        raise ConnectionResetError("peer reset")

    def ours(*_args):
        raise TypeError("not the store's")

    backend.client.mget_views = ours
    for _ in range(3):
        assert backend.batch_get_v1(keys, slots(host, 0, 2)) == [False, False]
    assert backend.breaker.state == CLOSED and backend.stats()["breaker"]["faults"] == 0
    backend.client.mget_views = reset
    for _ in range(2):
        assert backend.batch_get_v1(keys, slots(host, 0, 2)) == [False, False]
    snap = backend.stats()["breaker"]
    assert snap["state"] == OPEN and snap["last_cause"] == "ConnectionResetError: peer reset"
    assert backend.stats()["errors"]["exception:ConnectionResetError"] == 2  # still counted as before
    assert in_flight(backend) == 0


def test_a_disabled_breaker_never_opens(local):
    backend, host, faults = local(breaker_enabled=False)
    keys = hashes(2)
    faults(down=True)
    touches = Touches(backend.client)
    for _ in range(6):
        assert backend.batch_exists(keys) == 0
    assert len(touches.calls) == 6 and backend.stats()["breaker"]["state"] == CLOSED


def test_hybrid_v2_calls_are_gated_once_for_every_pool(local):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from sglang_simm_dev.hybrid_pools import transfer
    from test_hybrid import kv_side_pool

    backend, kv, faults = local()
    data_path_probes(backend)
    swa = kv_side_pool(tiny(layer_num=1, name="swa-layers"))
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    backend.on_host_pools_registered()
    keys = hashes(2, "v2")
    assert all(backend.batch_set_v1(keys, slots(kv, 0, 2)))
    assert backend.batch_set_v2([transfer(PoolName.SWA, keys=keys, host_indices=slots(swa, 0, 2))]) == {
        PoolName.SWA: [True, True]}
    query = [transfer(PoolName.SWA, keys=keys)]
    assert backend.batch_exists_v2(keys, query).kv_hit_pages == 2

    open_it(backend, faults, keys)
    touches = Touches(backend.client)
    assert backend.batch_exists_v2(keys, query).kv_hit_pages == 0
    got = backend.batch_get_v2([transfer(PoolName.SWA, keys=keys, host_indices=slots(swa, 4, 2))])
    assert got == {PoolName.SWA: [False, False]}
    put = backend.batch_set_v2([transfer(PoolName.SWA, keys=hashes(2, "new"), host_indices=slots(swa, 0, 2))])
    assert put == {PoolName.SWA: [False, False]}
    assert touches.calls == [] and in_flight(backend) == 0

    faults(down=False)
    wait_probe_due(backend)
    # one gate for the whole call: the KV lookup is the probe and closes
    # it, the side pools' lookup follows on the closed breaker
    assert backend.batch_exists_v2(keys, query).kv_hit_pages == 2
    assert touches.calls == ["mexists_codes", "mexists_codes"]
    assert backend.breaker.state == CLOSED and backend.stats()["breaker"]["late"] == 0
    got = backend.batch_get_v2([transfer(PoolName.SWA, keys=keys, host_indices=slots(swa, 4, 2))])
    assert got == {PoolName.SWA: [True, True]}


def test_each_outcome_goes_to_sglangs_fault_reporter(local):
    """sgl-project/sglang#17521's shape, by duck typing: handed over with
    set_fault_reporter, or found on the backend at attach."""

    class FaultManager:
        def __init__(self):
            self.ops = []

        def report_op(self, *, op, fatal, detail):
            self.ops.append((op, fatal))

    backend, host, faults = local()
    other, _host, _ = local()
    found = FaultManager()
    other._fault_reporter = found  # where the PR's HiCacheStorage keeps it
    other.on_host_pools_registered()
    manager = FaultManager()
    backend.set_fault_reporter(manager)
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    open_it(backend, faults, keys)
    assert backend.batch_exists(keys) == 0  # refused: not reported
    # the breaker's own probes (under way by now, the store still down) are reported as "probe"
    assert [o for o in manager.ops if o[0] != "probe"] == [
        ("batch_set_v1", False), ("batch_exists", True), ("batch_exists", True)]
    assert {fatal for op, fatal in manager.ops if op == "probe"} <= {True}

    assert other.batch_exists(keys) == 0  # found at attach: reported there
    assert found.ops == [("batch_exists", True)]


def test_transitions_are_logged_once_each(local, caplog):
    backend, _host, faults = local()
    keys = hashes(2)
    with caplog.at_level(logging.INFO, logger="sglang_simm.breaker"):
        open_it(backend, faults, keys)
        for _ in range(20):
            backend.batch_exists(keys)  # refused: counted, never logged
        faults(down=False)
        until(lambda: backend.breaker.state == CLOSED, "a probe to close it")
    text = caplog.text
    snap = backend.stats()["breaker"]
    assert text.count("breaker open after") == 1 and text.count("breaker closed") == 1
    assert text.count("half-open") == snap["probes"] and text.count("open again") == snap["probe_faults"]


def test_clear_and_close_are_not_gated(local, store_name):
    backend, host, faults = local()
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    open_it(backend, faults, keys)
    faults(down=False)
    backend.clear()  # an operator's action: goes to the store while the breaker is open
    assert len(get_server(store_name)) == 0
    # not a probe, nor a success that closes it (its probe may fall due meanwhile)
    assert backend.breaker.state in (OPEN, HALF_OPEN)
    backend.close()
    assert backend.client.closed


def test_concurrent_threads_while_open_get_misses_and_exactly_one_probe(local):
    import threading

    backend, host, faults = local()
    data_path_probes(backend)
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    open_it(backend, faults, keys)
    faults(down=False, latency_us=50_000)  # the probe takes a while
    wait_probe_due(backend)
    touches = Touches(backend.client)
    results = []
    start = threading.Barrier(6)

    def worker():
        start.wait()
        results.append(backend.batch_exists(keys))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert touches.calls == ["mexists_codes"]  # exactly one probe reached the store
    assert sorted(results) == [0] * 5 + [2]
    assert backend.breaker.state == CLOSED and in_flight(backend) == 0


def test_its_state_reaches_the_servers_metrics(attach, store_name):
    """With --enable-metrics (``enable_storage_metrics``), SGLang's get_stats()
    carries the breaker's state to ``sglang_simm:breaker_state``."""
    pytest.importorskip("prometheus_client")
    from sglang_simm import metrics

    backend, host = attach(tiny(), extra={"manager_address": f"inprocess://{store_name}", **FAST},
                           enable_storage_metrics=True)
    assert backend.counters.exporter is not None
    faults = partial(configure_faults, store_name)
    fill_random(host, 1)
    keys = hashes(4)
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    backend.get_stats()
    try:
        open_it(backend, faults, keys)
        saved, metrics.EXPORT_INTERVAL_S = metrics.EXPORT_INTERVAL_S, 0.0
        try:
            backend.get_stats()
        finally:
            metrics.EXPORT_INTERVAL_S = saved
    finally:
        faults(down=False)
    assert backend.counters.breaker_state == OPEN
    assert backend.counters.breaker_transitions["open"] == 1
