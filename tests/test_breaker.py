"""The breaker: faults told from misses, its state machine on a fake clock,
one probe among many threads, its log lines and counters, SGLang's fault
reporter by duck typing."""

from __future__ import annotations

import functools
import logging
import random
import threading
import time

import pytest

import sglang_simm_dev.faults as faults_instrument

from sglang_simm import errors
from sglang_simm.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    REFUSED,
    SLOW_FRACTION,
    Breaker,
    FaultReports,
    fault_of,
    find_fault_reporter,
    is_fault_exception,
)
from sglang_simm.config import SiMMConfig
from polling import until

# --------------------------------------------------------------------------
# Faults and misses: every code errors.py knows, one verdict each
# --------------------------------------------------------------------------

#: code -> is it a fault (the store unreachable or too slow)?
FAULT_TABLE = {
    errors.OK: False,
    errors.INVALID_ARGUMENT: False,  # our argument, refused before it left
    errors.TIMEOUT: True,
    errors.OUT_OF_MEMORY: False,  # a full store answered
    errors.TARGET_NOT_FOUND: True,  # the manager does not know the node
    errors.TARGET_UNAVAILABLE: True,
    errors.INTERNAL_ERROR: True,
    errors.UNKNOWN_ERROR: True,  # also GetRoutingTableTimeout
    errors.ROUTING_TABLE_FAILED: True,
    errors.SHARD_LOOKUP_FAILED: True,
    errors.PUT_OBJECT_FAILED: False,  # the server answered (no room)
    errors.GET_OBJECT_FAILED: False,  # the sync get's answer for an absent key
    errors.DELETE_OBJECT_FAILED: False,
    errors.LOOKUP_OBJECT_FAILED: False,
    errors.MEMPOOL_INIT_FAILED: False,  # local resources: no backoff cures them
    errors.MEMPOOL_ALLOCATE_FAILED: False,
    errors.MEMPOOL_RELEASE_FAILED: False,
    errors.REGISTER_MR_FAILED: False,
    errors.DEREGISTER_MR_FAILED: False,
    errors.SEND_RPC_FAILED: True,
    errors.BUILD_CONNECTION_FAILED: True,
    errors.ADD_CHANNELS_FAILED: True,
    errors.DS_KEY_NOT_FOUND: False,  # a miss is healthy
    errors.DS_DATA_ALREADY_EXISTS: False,
    errors.DS_CACHE_POOL_ALLOC_FAILED: False,
}


def test_the_table_covers_every_code_errors_knows():
    assert set(FAULT_TABLE) == set(errors.CODE_NAMES)


@pytest.mark.parametrize(("code", "fault"), FAULT_TABLE.items(), ids=[errors.code_name(c) for c in FAULT_TABLE])
def test_is_fault(code, fault):
    assert errors.is_fault(code) is fault
    assert (code in errors.FAULT_CODES) is fault


@pytest.mark.parametrize(
    "code", [1, 4096, 1 << 40, -1004, -9999], ids=["one", "bytes", "big", "InvalidState", "unknown"]
)
def test_byte_counts_and_unknown_codes_are_not_faults(code):
    assert errors.is_fault(code) is False


def test_numpy_codes():
    np = pytest.importorskip("numpy")
    assert errors.is_fault(np.int64(errors.TIMEOUT)) and not errors.is_fault(np.int64(errors.DS_KEY_NOT_FOUND))


class CodedError(ConnectionError):
    """The local store's StoreUnreachable: a ConnectionError with a code."""

    def __init__(self, code):
        super().__init__(f"code {code}")
        self.code = code


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (CodedError(errors.SEND_RPC_FAILED), True),
        (CodedError(errors.INVALID_ARGUMENT), False),
        (ConnectionResetError("reset"), True),
        (TimeoutError("slow"), True),
        (OSError("socket"), True),
        (TypeError("key is not a str"), False),
        (ValueError("bad view"), False),
        (RuntimeError("the SiMM client is closed"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_exceptions(exc, fault):
    assert is_fault_exception(exc) is fault
    assert (fault_of(exc=exc) is not None) is fault


def test_a_call_is_a_fault_only_when_every_answer_is_one():
    assert fault_of([errors.SEND_RPC_FAILED] * 4) == "SendRPCFailed(-2300) x4"
    assert fault_of([errors.TIMEOUT]) == "Timeout(-1002)"
    assert fault_of([errors.SEND_RPC_FAILED, errors.TIMEOUT]) == "SendRPCFailed(-2300) x2"
    # one healthy answer (a hit, a miss) means the store answered
    assert fault_of([errors.SEND_RPC_FAILED, 4096]) is None
    assert fault_of([errors.SEND_RPC_FAILED, errors.DS_KEY_NOT_FOUND]) is None
    assert fault_of([errors.GET_OBJECT_FAILED] * 8) is None
    assert fault_of([]) is None and fault_of() is None


def test_a_slow_call_is_a_timeout_whatever_it_answered():
    assert fault_of([0, 0], seconds=0.95, slow_s=0.9).startswith("a call took 0.95 s")
    assert fault_of([0, 0], seconds=0.5, slow_s=0.9) is None
    assert fault_of([0], seconds=100.0) is None  # no limit given: time not looked at


# --------------------------------------------------------------------------
# The state machine, on a fake clock
# --------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


FAULT = [errors.SEND_RPC_FAILED, errors.SEND_RPC_FAILED]
MISS = [errors.DS_KEY_NOT_FOUND, errors.DS_KEY_NOT_FOUND]
HIT = [4096, 4096]


def make(clock=None, *, u=0.0, **kw) -> Breaker:
    kw.setdefault("threshold", 3)
    kw.setdefault("backoff_s", 1.0)
    kw.setdefault("backoff_max_s", 8.0)
    kw.setdefault("jitter", 0.5)
    return Breaker(clock=clock or Clock(), random=lambda: u, **kw)


def fail(b: Breaker, n: int = 1, codes=FAULT) -> None:
    for _ in range(n):
        permit = b.allow()
        assert permit
        permit.record(codes)


def open_breaker(b: Breaker) -> None:
    fail(b, b.threshold)
    assert b.state == OPEN


def test_closed_to_open_after_threshold_consecutive_faults():
    b = make()
    fail(b, 2)
    assert b.state == CLOSED and b.snapshot()["consecutive_faults"] == 2
    fail(b)
    assert b.state == OPEN
    snap = b.snapshot()
    assert (snap["opened_total"], snap["last_cause"]) == (1, "SendRPCFailed(-2300) x2")


def test_a_healthy_answer_resets_the_count():
    b = make()
    for _ in range(10):
        fail(b, 2)
        b.allow().record(HIT)
    assert b.state == CLOSED and b.snapshot()["faults"] == 20


def test_misses_never_open_it():
    b = make(threshold=1)
    for codes in (MISS, [errors.GET_OBJECT_FAILED] * 3, [errors.DS_CACHE_POOL_ALLOC_FAILED], [0, 1], []):
        for _ in range(50):
            b.allow().record(codes)
    assert b.state == CLOSED and b.snapshot()["faults"] == 0


def test_open_answers_refused_without_a_call():
    b = make()
    open_breaker(b)
    for _ in range(5):
        assert b.allow() is REFUSED and not REFUSED
    assert b.snapshot()["refused"] == 5


def test_one_probe_after_the_backoff():
    clock = Clock()
    b = make(clock)
    open_breaker(b)
    assert b.snapshot()["next_probe_in_s"] == pytest.approx(1.0)
    clock.advance(0.999)
    assert not b.allow()
    clock.advance(0.001)
    probe = b.allow()
    assert probe and probe.probe and b.state == HALF_OPEN
    assert not any(b.allow() for _ in range(10))  # the others still answer misses
    assert b.snapshot()["probes"] == 1


def test_a_probe_that_answers_closes_it():
    clock = Clock()
    b = make(clock)
    open_breaker(b)
    clock.advance(1.0)
    probe = b.allow()
    assert probe.record(MISS) is None  # a miss is an answer: the store is back
    assert b.state == CLOSED
    snap = b.snapshot()
    assert (snap["closed_total"], snap["consecutive_faults"], snap["next_probe_in_s"]) == (1, 0, None)
    assert b.allow() and not b.allow().probe


def test_a_faulting_probe_reopens_with_the_next_backoff():
    clock = Clock()
    b = make(clock)  # u = 0: no jitter taken
    open_breaker(b)
    waits = []
    for _ in range(6):
        waits.append(b.snapshot()["next_probe_in_s"])
        clock.advance(waits[-1])
        probe = b.allow()
        assert probe.probe
        probe.record(FAULT)
        assert b.state == OPEN
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # doubling, capped
    assert b.snapshot()["probe_faults"] == 6 and b.snapshot()["opened_total"] == 1
    # a success closes it, and the next opening starts from the base again
    clock.advance(8.0)
    b.allow().record(HIT)
    open_breaker(b)
    assert b.snapshot()["next_probe_in_s"] == 1.0


@pytest.mark.parametrize("u", [0.0, 0.25, 0.999999])
def test_jitter_only_shortens_and_the_cap_is_a_hard_bound(u):
    b = make(u=u, backoff_s=0.5, backoff_max_s=30.0, jitter=0.2)
    for attempt in range(40):
        raw = min(30.0, 0.5 * 2**attempt)
        wait = b.backoff(attempt)
        assert raw * 0.8 <= wait <= raw <= 30.0
        assert wait == pytest.approx(raw * (1 - 0.2 * u))


def test_jitter_spreads_real_random_waits():
    rng = random.Random(7)
    b = Breaker(backoff_s=1.0, backoff_max_s=30.0, jitter=0.2, random=rng.random)
    waits = [b.backoff(10) for _ in range(500)]
    assert 24.0 <= min(waits) and max(waits) <= 30.0
    assert max(waits) - min(waits) > 5.0  # spread over most of the window


def test_a_slow_call_counts_as_a_timeout():
    b = make(slow_call_s=0.9)
    for _ in range(3):
        b.allow().record([0, 0], seconds=1.0)  # a hung store's mexists: "absent", after the limit
    assert b.state == OPEN and b.snapshot()["last_cause"].startswith("a call took 1.00 s")


def test_an_answer_from_before_the_opening_is_ignored():
    clock = Clock()
    b = make(clock)
    early = b.allow()  # admitted while closed, answers after the breaker opened
    open_breaker(b)
    early.record(HIT)
    assert b.state == OPEN and b.snapshot()["late"] == 1
    clock.advance(1.0)
    probe = b.allow()
    early.record(FAULT)  # nor can a late fault reopen a half-open breaker
    assert b.state == HALF_OPEN
    probe.record(HIT)
    assert b.state == CLOSED


def test_a_probe_without_an_answer_frees_the_slot():
    clock = Clock()
    b = make(clock)
    open_breaker(b)
    clock.advance(1.0)
    probe = b.allow()
    with probe:
        pass  # an early return: bad input, the store never asked
    assert b.state == OPEN
    second = b.allow()  # the next call probes at once, no new backoff
    assert second.probe and second is not probe
    second.record(HIT)
    assert b.state == CLOSED


def test_a_probe_that_never_reports_is_replaced():
    clock = Clock()
    b = make(clock, probe_timeout_s=10.0)
    open_breaker(b)
    clock.advance(1.0)
    lost = b.allow()
    clock.advance(9.9)
    assert not b.allow()
    clock.advance(0.1)
    fresh = b.allow()
    assert fresh.probe
    lost.record(FAULT)  # the lost one's answer, at last: too late
    assert b.state == HALF_OPEN
    fresh.record(HIT)
    assert b.state == CLOSED and b.snapshot()["probes"] == 2


def test_with_block_records_the_stores_exceptions_and_lets_them_through():
    clock = Clock()
    b = make(clock, threshold=2)
    for _ in range(2):
        with pytest.raises(ConnectionResetError):
            with b.allow():
                raise ConnectionResetError("peer reset")
    assert b.state == OPEN and "ConnectionResetError" in b.snapshot()["last_cause"]
    clock.advance(1.0)
    with pytest.raises(TypeError):  # not the store's: no verdict, the slot is freed
        with b.allow():
            raise TypeError("a key is not a str")
    assert b.state == OPEN and b.allow().probe


def test_other_exceptions_neither_open_nor_reset():
    b = make(threshold=2)
    fail(b)
    for _ in range(5):
        with pytest.raises(RuntimeError):
            with b.allow():
                raise RuntimeError("mget answered 3 results for 4 objects")
    assert b.state == CLOSED and b.snapshot()["consecutive_faults"] == 1


def test_the_wiring_pattern_inside_the_backends_call_context():
    """The gate and record of docs/resilience.md inside ``inflight.Call``,
    which swallows the exception after the permit has seen it."""
    from sglang_simm.inflight import Call

    clock = Clock()
    b = make(clock, threshold=2)
    seen = []
    answers = iter([ConnectionResetError("peer reset"), TimeoutError("timed out"), [errors.DS_KEY_NOT_FOUND]])
    touched = []

    def batch_get(n=2):
        with Call(lambda where, exc: seen.append((where, type(exc).__name__)), "batch_get_v1"):
            permit = b.allow()
            if not permit:
                return [False] * n
            with permit:
                touched.append(1)
                answer = next(answers)
                if isinstance(answer, BaseException):
                    raise answer
                permit.record(answer * n, seconds=0.001, op="batch_get_v1")
                return [False] * n
        return [False] * n

    assert batch_get() == [False, False] and batch_get() == [False, False]
    assert b.state == OPEN and seen == [("batch_get_v1", "ConnectionResetError"), ("batch_get_v1", "TimeoutError")]
    assert batch_get() == [False, False] and len(touched) == 2  # open: the client is not called
    clock.advance(1.0)
    assert batch_get() == [False, False] and len(touched) == 3  # the probe: a miss, the store answered
    assert b.state == CLOSED


def test_disabled_never_opens():
    b = make(enabled=False, threshold=1)
    for _ in range(20):
        permit = b.allow()
        assert permit
        permit.record(FAULT)
    assert b.state == CLOSED and b.snapshot()["enabled"] is False


# -- the prober: probes off the request path (real clock, short waits) ------


def quick(**kw) -> Breaker:
    return Breaker(threshold=2, backoff_s=0.02, backoff_max_s=0.05, jitter=0.0, **kw)


def test_with_a_prober_no_call_probes_and_the_probers_answer_closes_it():
    b = quick()
    answers = iter([FAULT, FAULT, MISS])  # a miss is healthy: the store answered
    calls = []

    def probe():
        calls.append(threading.current_thread().name)
        return next(answers)

    b.set_prober(probe)
    open_breaker(b)
    refused_calls = 0
    while b.state != CLOSED:  # the backoffs pass, yet no call is let through
        assert not b.allow()
        refused_calls += 1
        time.sleep(0.001)
        assert refused_calls < 30_000, b.snapshot()
    assert len(calls) == 3 and set(calls) == {"SiMM L3 breaker probe"}
    snap = b.snapshot()
    assert snap["probes"] == 3 and snap["probe_faults"] == 2 and snap["closed_total"] == 1
    assert b.allow()  # closed: calls go through again
    until(lambda: b._prober is None, "the prober to end once closed")


def test_a_prober_that_answers_nothing_waits_a_backoff_before_the_next():
    b = quick()
    calls = []

    def probe():
        calls.append(1)
        raise TypeError("not the store's")  # no verdict

    b.set_prober(probe)
    open_breaker(b)
    until(lambda: len(calls) >= 3, "three probes")
    time.sleep(0.2)
    b.close()
    # at most one probe per 20-50 ms wait: a handful in 0.2 s, never a spin
    assert len(calls) < 40, len(calls)
    assert b.state == OPEN and b.snapshot()["probe_faults"] == 0


def test_a_prober_set_while_open_starts_and_close_ends_it():
    b = quick()
    open_breaker(b)
    b.set_prober(lambda: FAULT)
    until(lambda: b.snapshot()["probe_faults"] >= 1, "the prober to probe")
    thread = b._prober
    b.close()
    thread.join(5)
    assert not thread.is_alive() and b._prober is None
    assert b.snapshot()["prober"] is False


def test_a_stuck_prober_lets_a_call_probe_after_the_probe_timeout():
    clock = Clock()
    b = make(clock, probe_timeout_s=5.0)
    release = threading.Event()
    b.set_prober(lambda: release.wait(30) and MISS)
    open_breaker(b)
    clock.advance(10.0)  # the backoff is over: the prober takes the probe and hangs in it
    with b._lock:
        b._wake.notify_all()
    until(lambda: b.state == HALF_OPEN, "the prober's probe")
    assert not b.allow()  # a probe is in flight
    clock.advance(5.0)
    permit = b.allow()  # it never reported: a call probes instead
    assert permit and permit.probe
    permit.record(MISS)
    assert b.state == CLOSED
    release.set()
    until(lambda: b._prober is None, "the prober to end")
    assert b.snapshot()["late"] == 1  # its answer came from an earlier epoch


def test_argument_checks():
    for kw in ({"threshold": 0}, {"backoff_s": 0}, {"backoff_s": 2.0, "backoff_max_s": 1.0},
               {"jitter": 1.0}, {"jitter": -0.1}, {"probe_timeout_s": 0}):
        with pytest.raises(ValueError):
            Breaker(**kw)


def test_from_config():
    cfg = SiMMConfig(manager_address="local", request_timeout_ms=2000, breaker_threshold=7,
                     breaker_backoff_ms=250, breaker_backoff_max_ms=4000, breaker_jitter=0.1)
    b = Breaker.from_config(cfg)
    assert (b.threshold, b.backoff_s, b.backoff_max_s, b.jitter) == (7, 0.25, 4.0, 0.1)
    assert b.slow_call_s == pytest.approx(2.0 * SLOW_FRACTION) and b.probe_timeout_s == 60.0
    assert Breaker.from_config(SiMMConfig(manager_address="local", breaker_enabled=False)).allow()


# --------------------------------------------------------------------------
# The closed path takes no lock
# --------------------------------------------------------------------------


def test_closed_path_takes_no_lock():
    b = make()
    done = threading.Event()

    def calls():
        for _ in range(1000):
            b.allow().record(HIT)
        done.set()

    with b._lock:  # were the closed path to take it, the thread would hang here
        threading.Thread(target=calls, daemon=True).start()
        assert done.wait(5.0)
    assert b.allow() is b.allow()  # one shared permit while closed: nothing made per call


# --------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------


def test_concurrent_threads_get_exactly_one_probe():
    clock = Clock()
    b = make(clock)
    for round_ in range(20):
        open_breaker(b)
        clock.advance(10.0)
        start = threading.Barrier(16)
        got = []

        def call():
            start.wait()
            got.append(b.allow())

        threads = [threading.Thread(target=call) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        probes = [p for p in got if p]
        assert len(probes) == 1 and probes[0].probe, round_
        probes[0].record(HIT)
        assert b.state == CLOSED
    assert b.snapshot()["probes"] == 20


def test_concurrent_faults_open_it_once():
    b = make(threshold=5)
    start = threading.Barrier(8)

    def worker():
        start.wait()
        for _ in range(200):
            permit = b.allow()
            if permit:
                permit.record(FAULT)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = b.snapshot()
    assert snap["state"] == OPEN and snap["opened_total"] == 1
    assert snap["faults"] >= 5 and snap["refused"] + snap["faults"] == 1600


# --------------------------------------------------------------------------
# A random walk against a reference model (the invariant, step by step)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(25))
def test_random_walk_keeps_the_invariant(seed):
    rng = random.Random(seed)
    clock = Clock()
    b = Breaker(threshold=rng.randint(1, 4), backoff_s=0.5, backoff_max_s=4.0, jitter=0.3,
                probe_timeout_s=20.0, clock=clock, random=rng.random)
    held = []  # permits handed out and not yet answered
    model_run = 0  # faults in a row seen while closed, in the current epoch
    for _step in range(400):
        action = rng.random()
        if action < 0.45:
            state = b.state
            permit = b.allow()
            if state == CLOSED:
                assert permit and not permit.probe
            if permit:
                held.append(permit)
            # never more than one probe of the current epoch out
            assert sum(1 for p in held if p.probe and p.epoch == b._epoch) <= 1
        elif action < 0.85 and held:
            permit = held.pop(rng.randrange(len(held)))
            codes = rng.choice([FAULT, MISS, HIT])
            before, epoch_ok = b.state, permit.epoch == b._epoch
            permit.record(codes)
            if before == CLOSED and epoch_ok:
                model_run = model_run + 1 if codes is FAULT else 0
                assert b.state == (OPEN if model_run >= b.threshold else CLOSED)
                if b.state == OPEN:
                    model_run = 0
            elif before == HALF_OPEN and epoch_ok and permit.probe:
                assert b.state == (OPEN if codes is FAULT else CLOSED)
                model_run = 0
            else:
                assert b.state == before  # a late answer changes nothing
        else:
            clock.advance(rng.choice([0.1, 0.5, 1.0, 3.0]))
        snap = b.snapshot()
        if snap["state"] == OPEN:
            assert 0.0 <= snap["next_probe_in_s"] <= 4.0
        assert snap["consecutive_faults"] < b.threshold or snap["state"] != CLOSED


# --------------------------------------------------------------------------
# Visible: one log line per transition, counters, snapshot
# --------------------------------------------------------------------------


def test_each_transition_logged_once(caplog):
    clock = Clock()
    b = make(clock, threshold=2)
    caplog.set_level(logging.INFO, logger="sglang_simm.breaker")
    fail(b, 2)
    assert not b.allow() and not b.allow()  # refusals are counted, not logged
    clock.advance(1.0)
    b.allow().record(FAULT)
    clock.advance(2.0)
    b.allow().record(HIT)
    b.allow().record(HIT)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert "open after 2 consecutive faults (last: SendRPCFailed(-2300) x2)" in lines[0]
    assert "first probe in 1.00 s" in lines[0]
    assert "half-open: probe #1" in lines[1]
    assert "open again: probe #1 faulted (SendRPCFailed(-2300) x2); next probe in 2.00 s" in lines[2]
    assert "half-open: probe #2" in lines[3]
    assert "closed: probe #2 answered; L3 is back after 3.0 s open" in lines[4]
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "WARNING", "INFO", "WARNING"]


def test_snapshot_fields():
    clock = Clock()
    b = make(clock)
    assert b.snapshot() == {
        "enabled": True, "state": "closed", "prober": False, "consecutive_faults": 0, "threshold": 3,
        "opened_total": 0, "closed_total": 0, "probes": 0, "probe_faults": 0, "refused": 0,
        "faults": 0, "late": 0, "last_cause": None, "next_probe_in_s": None, "open_for_s": None,
    }
    open_breaker(b)
    clock.advance(0.25)
    snap = b.snapshot()
    assert snap["state"] == "open" and snap["next_probe_in_s"] == pytest.approx(0.75)
    assert snap["open_for_s"] == pytest.approx(0.25)


# --------------------------------------------------------------------------
# SGLang's fault reporter (sgl-project/sglang#17521's shape), a stand-in
# --------------------------------------------------------------------------


class StandInFaultManager:
    """What the PR's HiCacheStorageFaultManager offers the backend."""

    def __init__(self, fail=False):
        self.ops = []
        self.fail = fail

    def report_op(self, op: str, fatal: bool, detail: str = "") -> None:
        if self.fail:
            raise RuntimeError("manager broken")
        self.ops.append((op, fatal, detail))


class StandInStorage:
    """The PR's HiCacheStorage base: set_fault_reporter keeps it here."""

    def __init__(self):
        self._fault_reporter = None

    def set_fault_reporter(self, reporter):
        self._fault_reporter = reporter


class StandInController:
    def __init__(self, storage):
        self.storage_backend = storage


def test_finds_the_reporter_through_a_controller_by_duck_typing():
    manager = StandInFaultManager()
    storage = StandInStorage()
    controller = StandInController(storage)
    assert find_fault_reporter(controller) is None  # SGLang 0.5.23: nothing to find
    storage.set_fault_reporter(manager)
    assert find_fault_reporter(controller) is manager
    assert find_fault_reporter(storage) is manager
    assert find_fault_reporter(manager) is manager
    assert find_fault_reporter(object()) is None and find_fault_reporter(None) is None


def test_each_outcome_is_reported_and_refusals_are_not():
    clock = Clock()
    manager = StandInFaultManager()
    reports = FaultReports()
    assert reports.attach(StandInController(StandInStorage())) is False and not reports.active
    storage = StandInStorage()
    storage.set_fault_reporter(manager)
    assert reports.attach(StandInController(storage)) and reports.active
    b = make(clock, threshold=2, reports=reports)
    b.allow().record(HIT, op="batch_get_v1")
    b.allow().record(MISS, op="batch_exists")
    fail(b, 2)
    for _ in range(3):
        assert not b.allow()  # answered without the store: nothing to report
    clock.advance(1.0)
    b.allow().record(HIT, op="batch_set_v1")
    assert manager.ops == [
        ("batch_get_v1", False, ""),
        ("batch_exists", False, ""),
        ("storage_op", True, "SendRPCFailed(-2300) x2"),
        ("storage_op", True, "SendRPCFailed(-2300) x2"),
        ("batch_set_v1", False, ""),
    ]


def test_the_backend_side_set_fault_reporter(caplog):
    reports = FaultReports()
    manager = StandInFaultManager()
    reports.set_fault_reporter(manager)  # what the backend's set_fault_reporter delegates to
    reports.report("batch_get_v1", "Timeout(-1002)")
    assert manager.ops == [("batch_get_v1", True, "Timeout(-1002)")]
    reports.set_fault_reporter(None)
    reports.report("batch_get_v1", None)
    assert len(manager.ops) == 1 and not reports.active
    with caplog.at_level(logging.WARNING):
        reports.set_fault_reporter(object())  # no report_op: ignored, said once
    assert not reports.active and "no report_op" in caplog.text


def test_a_broken_reporter_never_breaks_the_data_path(caplog):
    b = make(reports=FaultReports(StandInFaultManager(fail=True)))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            b.allow().record(HIT, op="batch_get_v1")
    assert b.state == CLOSED
    assert caplog.text.count("fault reporter failed") == 1


# --------------------------------------------------------------------------
# The in-process local store's real answers: misses pass, an outage opens, a
# probe after it comes back closes
# --------------------------------------------------------------------------


@pytest.fixture
def local_store():
    from sglang_simm import local_store
    from sglang_simm.client import connect

    client = connect(SiMMConfig(manager_address="inprocess://breaker-codes", warmup=False))
    faults = functools.partial(faults_instrument.configure_faults, "breaker-codes")
    block = client.allocate(64)
    try:
        yield client, faults, block
    finally:
        faults(down=False, latency_us=0)
        del block
        client.close()


def test_the_local_stores_answers(local_store):
    from time import perf_counter

    client, faults, block = local_store
    clock = Clock()
    b = make(clock, threshold=3)

    def call(fn, *args):
        permit = b.allow()
        if not permit:
            return None
        t0 = perf_counter()
        codes = fn(*args)
        permit.record(codes, seconds=perf_counter() - t0)
        return codes

    for _ in range(10):  # misses: -4003 from mexists, -2101 from the sync get
        assert call(client.mexists_codes, ["a", "b"]) == [errors.DS_KEY_NOT_FOUND] * 2
        assert call(client.mget, ["a"], [block.view()]) == [errors.GET_OBJECT_FAILED]
    assert b.state == CLOSED and b.snapshot()["faults"] == 0
    faults(down=True)
    for _ in range(3):
        assert call(client.mput, ["a"], [block.view()]) == [errors.SEND_RPC_FAILED]
    assert b.state == OPEN and b.snapshot()["last_cause"] == "SendRPCFailed(-2300)"
    assert call(client.mexists_codes, ["a"]) is None  # answered without the store
    clock.advance(1.0)
    assert call(client.mexists_codes, ["a"]) == [errors.SEND_RPC_FAILED]  # the probe: still down
    assert b.state == OPEN
    faults(down=False)
    clock.advance(2.0)
    assert call(client.mexists_codes, ["a"]) == [errors.DS_KEY_NOT_FOUND]  # the probe: back
    assert b.state == CLOSED


def test_a_slow_local_store_opens_it(local_store):
    from time import perf_counter

    client, faults, _block = local_store
    b = make(threshold=2, slow_call_s=0.01)
    faults(latency_us=30_000)
    for _ in range(2):
        permit = b.allow()
        t0 = perf_counter()
        codes = client.mexists_codes(["a"])
        permit.record(codes, seconds=perf_counter() - t0)
        assert codes == [errors.DS_KEY_NOT_FOUND]  # a miss, but it took too long
    assert b.state == OPEN and b.snapshot()["last_cause"].startswith("a call took")
