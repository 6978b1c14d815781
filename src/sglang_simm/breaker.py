"""A circuit breaker per backend: fail fast while the store is down, probe, heal.

A failing L3 must cost serving nothing: while the store hangs or cannot be
reached, every data-path call would wait out the client's time limit on a
request's path. The breaker turns those calls into immediate misses, probes
now and then, and closes as soon as the store answers.

States and transitions::

                          threshold consecutive faults
          +----------+ -------------------------------> +--------+
          |  CLOSED  |                                  |  OPEN  | <---------+
          +----------+ <-----------+                    +--------+           |
                                   | the probe answers      |                |
                                   | (no fault)             | backoff over:  | the probe faults:
                                   |                        | the next call  | next backoff,
                                   |                  +-----------+ is the   | twice as long
                                   +----------------- | HALF_OPEN | probe    | (capped, jittered)
                                                      +-----------+ ---------+

Invariant, kept under one lock (the closed path only reads):

* CLOSED: every call goes to the client; fewer than ``threshold`` faults in
  a row since the last healthy answer (a miss is healthy, ``errors.is_fault``).
* OPEN: no call touches the client; each answers a miss at once, holding no
  host memory and writing nothing, until the next probe is due.
* HALF_OPEN: exactly one call, the probe, is in flight to the client; its
  answer closes the breaker or opens it again with the next backoff. A
  probe that ends without an answer frees the slot; one that never reports
  is replaced after ``probe_timeout_s``, so the breaker never stays open.
* Who probes: the breaker's own thread where the backend gave it a prober
  (``set_prober``), so no request waits out a hung store's time limit;
  else the first data-path call after the backoff.
* The backoff before probe k (k = 0 right after opening) is
  ``min(cap, base * 2**k) * (1 - jitter * u)``, ``u`` uniform in [0, 1).
* Every transition starts a new epoch; an answer to a call let through in an
  earlier epoch is ignored (counted as ``late``), so a slow call admitted
  before the breaker opened can neither close it nor open it again.

Use at the call to the client (``allow`` is one attribute read when closed;
``record`` takes the lock only for a fault, or the first healthy answer
after one)::

    permit = breaker.allow()
    if not permit:                       # open, or a probe is in flight
        return misses
    with permit:                         # an exception in here: a fault if it is the store's
        t0 = perf_counter()
        codes = client.mget_views(keys, views)
        permit.record(codes, seconds=perf_counter() - t0, op="batch_get_v1")

Each transition is logged once and counted (``snapshot()``). Where SGLang's
controller hands the backend a fault reporter (``set_fault_reporter``, the
shape of sgl-project/sglang#17521), each outcome is reported to it too
(``FaultReports``). Clock and random source are injected for tests.
"""

from __future__ import annotations

import logging
import random as _random
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from sglang_simm.errors import code_name, is_fault

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.config import SiMMConfig

__all__ = [
    "CLOSED",
    "HALF_OPEN",
    "OPEN",
    "REFUSED",
    "SLOW_FRACTION",
    "Breaker",
    "FaultReports",
    "Permit",
    "fault_of",
    "find_fault_reporter",
    "is_fault_exception",
]

logger = logging.getLogger("sglang_simm.breaker")

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"

#: A call that took this share of the client's request time limit counts as
#: a timeout whatever it answered: the real client's ``mexists`` reads a
#: timeout as "absent" (a fault looks like a miss), so time is the only sign
#: a hung store leaves on lookups.
SLOW_FRACTION = 0.9

#: How long a probe may go without reporting before another call may probe
#: (at least; ``from_config`` raises it to four request time limits).
PROBE_TIMEOUT_S = 60.0


def is_fault_exception(exc: BaseException) -> bool:
    """An exception from the client that says the store is unreachable: one
    carrying a fault ``code``, else any ``OSError``. Others (a refused
    argument, a closed client, our own checks) are not the store's."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return is_fault(code)
    return isinstance(exc, OSError)


def fault_of(
    codes: Iterable[int] = (),
    *,
    seconds: float = 0.0,
    slow_s: float | None = None,
    exc: BaseException | None = None,
) -> str | None:
    """The cause if one client call was a fault, else None: an exception
    that is the store's, a call that took ``slow_s`` or longer, or one whose
    every answer is a fault code. One healthy answer makes it no fault: one
    unreachable server of a cluster must not switch L3 off for the others."""
    if exc is not None:
        if not is_fault_exception(exc):
            return None
        return f"{type(exc).__name__}: {exc}"[:200]
    if slow_s is not None and seconds >= slow_s:
        return f"a call took {seconds:.2f} s (the time limit is {slow_s / SLOW_FRACTION:.2f} s)"
    first = None
    n = 0
    for code in codes:
        if not is_fault(code):
            return None
        if first is None:
            first = int(code)
        n += 1
    if first is None:
        return None
    return f"{code_name(first)} x{n}" if n > 1 else code_name(first)


class Permit:
    """Leave to call the client once (truthy); ``REFUSED`` is falsy.
    ``record`` reports what the call answered; leaving a ``with permit:``
    block records the store's exceptions and frees an unreported probe's slot."""

    __slots__ = ("_breaker", "epoch", "probe", "_pending")

    def __init__(self, breaker: Breaker | None, epoch: int, *, probe: bool) -> None:
        self._breaker = breaker
        self.epoch = epoch
        #: True for the one call let through while the breaker is not closed
        self.probe = probe
        self._pending = probe  # a probe awaits its verdict

    def __bool__(self) -> bool:
        return self._breaker is not None or self is _PASS

    def __repr__(self) -> str:
        kind = "probe" if self.probe else "refused" if not self else "call"
        return f"<Permit {kind} epoch={self.epoch}>"

    def record(self, codes: Iterable[int] = (), *, seconds: float = 0.0, op: str = "") -> str | None:
        """Report one client call's answer (its codes, how long it took);
        the fault's cause, or None for a healthy answer."""
        if self._breaker is None:
            return None
        cause = fault_of(codes, seconds=seconds, slow_s=self._breaker.slow_call_s)
        self._report(cause, op)
        return cause

    def fault(self, cause: str, *, op: str = "") -> None:
        """Report a fault found some other way (``cause`` says what)."""
        if self._breaker is not None:
            self._report(cause, op)

    def release(self, exc: BaseException | None = None, *, op: str = "") -> None:
        """The call is over: an exception that is the store's is a fault; a
        probe that reported nothing gives its slot back. Idempotent."""
        if self._breaker is None:
            return
        if exc is not None and is_fault_exception(exc):
            self._report(fault_of(exc=exc), op)
        elif self._pending:
            self._pending = False
            self._breaker._give_back(self)

    def _report(self, cause: str | None, op: str) -> None:
        if self.probe:  # a closed permit is shared by every call: never written
            self._pending = False
        self._breaker._record(self, cause, op)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self.release(exc)
        return False


#: The answer while open: call nothing, answer a miss.
REFUSED = Permit(None, -1, probe=False)
#: The answer of a disabled breaker: always call, record nothing.
_PASS = Permit(None, -1, probe=False)


class Breaker:
    """One per backend, shared by its pools and threads (see the module
    docstring for the states, the invariant and the use)."""

    def __init__(
        self,
        *,
        threshold: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        jitter: float = 0.2,
        slow_call_s: float | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        random: Callable[[], float] = _random.random,
        reports: FaultReports | None = None,
        name: str = "SiMM L3",
        log: logging.Logger | None = None,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {threshold!r}")
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"breaker backoff must satisfy 0 < base <= cap, got base={backoff_s!r}, "
                             f"cap={backoff_max_s!r}")
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"breaker jitter must be in [0, 1), got {jitter!r}")
        if probe_timeout_s <= 0:
            raise ValueError(f"breaker probe_timeout_s must be > 0, got {probe_timeout_s!r}")
        self.threshold = int(threshold)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.jitter = float(jitter)
        #: a call at least this long is a timeout (None: time is not looked at)
        self.slow_call_s = slow_call_s
        self.probe_timeout_s = float(probe_timeout_s)
        self.enabled = bool(enabled)
        self.reports = reports if reports is not None else FaultReports()
        self.name = name
        self._clock = clock
        self._random = random
        self._log = log or logger
        self._lock = threading.Lock()
        #: wakes the prober: a transition, a new prober, or the breaker closing for good
        self._wake = threading.Condition(self._lock)
        #: the probe call when the breaker probes by itself (``set_prober``)
        self._probe_fn: Callable[[], Iterable[int]] | None = None
        self._prober: threading.Thread | None = None
        self._state = CLOSED
        self._epoch = 0
        #: the permit every call gets while closed (None otherwise): the one
        #: attribute the closed path reads
        self._closed_permit: Permit | None = Permit(self, 0, probe=False) if self.enabled else None
        self._consecutive = 0
        self._attempt = 0  # probes that faulted since the breaker opened
        self._next_probe_at = 0.0
        self._probe_started = 0.0
        self._opened_at = 0.0
        self._last_cause: str | None = None
        self.opened_total = 0
        self.closed_total = 0
        self.probes = 0
        self.probe_faults = 0
        self.refused = 0
        self.faults = 0
        self.late = 0

    @classmethod
    def from_config(cls, config: SiMMConfig, **kwargs: Any) -> Breaker:
        """The breaker ``config`` asks for (``breaker_*`` fields); a call
        that takes ``SLOW_FRACTION`` of ``request_timeout_ms`` is a timeout."""
        timeout_s = config.request_timeout_ms / 1000.0
        kwargs.setdefault("slow_call_s", timeout_s * SLOW_FRACTION)
        kwargs.setdefault("probe_timeout_s", max(PROBE_TIMEOUT_S, 4 * timeout_s))
        return cls(
            threshold=config.breaker_threshold,
            backoff_s=config.breaker_backoff_ms / 1000.0,
            backoff_max_s=config.breaker_backoff_max_ms / 1000.0,
            jitter=config.breaker_jitter,
            enabled=config.breaker_enabled,
            **kwargs,
        )

    @property
    def state(self) -> str:
        return self._state

    def allow(self) -> Permit:
        """A permit to call the client (truthy), or ``REFUSED`` (falsy): then
        answer a miss without touching the client."""
        permit = self._closed_permit
        if permit is not None:  # closed: one read, no lock
            return permit
        if not self.enabled:
            return _PASS
        return self._allow_slow()

    def _allow_slow(self) -> Permit:
        log = None
        with self._lock:
            if self._state == CLOSED:  # closed since the read above
                return self._closed_permit or REFUSED
            now = self._clock()
            stale = self._state == HALF_OPEN and now - self._probe_started >= self.probe_timeout_s
            if (self._state == OPEN and (self._probe_fn is not None or now < self._next_probe_at)
                    or self._state == HALF_OPEN and not stale):
                self.refused += 1
                return REFUSED
            if stale:
                log = (logging.WARNING, "%s breaker: probe #%d gave no answer in %.0f s; another call probes",
                       self.name, self.probes, now - self._probe_started)
            permit, half_open = self._half_open(now)
        self._log.log(*(log or half_open))
        return permit

    def _half_open(self, now: float) -> tuple[Permit, tuple[Any, ...]]:
        """To HALF_OPEN (lock held): the probe's permit, and the line to log
        once the lock is let go."""
        self._state = HALF_OPEN
        self._epoch += 1
        self._probe_started = now
        self.probes += 1
        log = (logging.INFO, "%s breaker half-open: probe #%d goes to the store (open for %.1f s)",
               self.name, self.probes, now - self._opened_at)
        return Permit(self, self._epoch, probe=True), log

    def set_prober(self, probe: Callable[[], Iterable[int]] | None) -> None:
        """Probe off the request path from now on: while the breaker is not
        closed, a daemon thread calls ``probe()`` (one cheap client call that
        answers its codes) each time a backoff ends. None: data-path calls
        probe again."""
        with self._lock:
            self._probe_fn = probe if self.enabled else None
            self._start_prober()
            self._wake.notify_all()

    def close(self) -> None:
        """No more probes (the backend is closing): the prober ends."""
        self.set_prober(None)

    def _start_prober(self) -> None:
        """Start the prober if the breaker is not closed and none runs (lock held)."""
        if self._probe_fn is not None and self._state != CLOSED and self._prober is None:
            self._prober = threading.Thread(target=self._probe_loop, name=f"{self.name} breaker probe", daemon=True)
            self._prober.start()

    def _probe_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    fn = self._probe_fn
                    if fn is None or self._state == CLOSED:
                        self._prober = None  # under the lock: an opening after this starts a new one
                        return
                    wait = self._next_probe_at - self._clock() if self._state == OPEN else self.probe_timeout_s
                    if self._state == OPEN and wait <= 0:
                        break
                    self._wake.wait(min(max(wait, 0.001), self.backoff_max_s))
                permit, log = self._half_open(self._clock())
            self._log.log(*log)
            start = time.perf_counter()
            try:
                with permit:
                    permit.record(fn(), seconds=time.perf_counter() - start, op="probe")
            except Exception as exc:  # recorded above when it is the store's; the thread goes on
                self._log.debug("%s breaker: probe raised %s: %s", self.name, type(exc).__name__, exc)

    def _record(self, permit: Permit, cause: str | None, op: str) -> None:
        reports = self.reports
        if reports._reporter is not None:
            reports.report(op or "storage_op", cause)
        if cause is None and permit is self._closed_permit and self._consecutive == 0:
            return  # the common case: healthy and nothing to reset
        log = None
        with self._lock:
            if cause is not None:
                self.faults += 1
                self._last_cause = cause
            if permit.epoch != self._epoch:
                self.late += 1
                return
            now = self._clock()
            if self._state == CLOSED:
                if cause is None:
                    self._consecutive = 0
                    return
                self._consecutive += 1
                if self._consecutive >= self.threshold:
                    self._attempt = 0
                    self._opened_at = now
                    self.opened_total += 1
                    delay = self._open(now)
                    log = (logging.WARNING,
                           "%s breaker open after %d consecutive faults (last: %s); every L3 call "
                           "answers a miss without touching the store; first probe in %.2f s",
                           self.name, self._consecutive, cause, delay)
            elif self._state == HALF_OPEN and permit.probe:
                if cause is None:
                    self._close()
                    log = (logging.WARNING,
                           "%s breaker closed: probe #%d answered; L3 is back after %.1f s open",
                           self.name, self.probes, now - self._opened_at)
                else:
                    self.probe_faults += 1
                    self._attempt += 1
                    delay = self._open(now)
                    log = (logging.WARNING, "%s breaker open again: probe #%d faulted (%s); next probe in %.2f s",
                           self.name, self.probes, cause, delay)
        if log is not None:
            self._log.log(*log)

    def _give_back(self, permit: Permit) -> None:
        """A probe that ended without an answer: the next call probes."""
        with self._lock:
            if permit.epoch != self._epoch or self._state != HALF_OPEN:
                return
            self._state = OPEN
            self._epoch += 1
            # the prober waits a backoff again (it would only spin on a probe
            # that cannot answer); without it the next call probes
            self._next_probe_at = self._clock() + (self.backoff(self._attempt) if self._probe_fn else 0.0)
            self._wake.notify_all()
        self._log.debug("%s breaker: probe #%d ended without an answer", self.name, self.probes)

    def _open(self, now: float) -> float:
        """To OPEN (lock held); the delay until the next probe."""
        delay = self.backoff(self._attempt)
        self._state = OPEN
        self._epoch += 1
        self._closed_permit = None
        self._next_probe_at = now + delay
        self._start_prober()
        self._wake.notify_all()
        return delay

    def _close(self) -> None:
        """To CLOSED (lock held)."""
        self._state = CLOSED
        self._epoch += 1
        self._consecutive = 0
        self._attempt = 0
        self.closed_total += 1
        self._closed_permit = Permit(self, self._epoch, probe=False)
        self._wake.notify_all()

    def backoff(self, attempt: int) -> float:
        """Seconds before probe ``attempt`` (0 after opening): doubling from
        the base, capped, then shortened by up to ``jitter`` of itself."""
        raw = min(self.backoff_max_s, self.backoff_s * 2.0 ** min(attempt, 64))
        return raw * (1.0 - self.jitter * self._random())

    def snapshot(self) -> dict[str, Any]:
        """State and counters, for ``backend.stats()``."""
        with self._lock:
            now = self._clock()
            state = self._state
            return {
                "enabled": self.enabled,
                "state": state,
                "prober": self._probe_fn is not None,
                "consecutive_faults": self._consecutive,
                "threshold": self.threshold,
                "opened_total": self.opened_total,
                "closed_total": self.closed_total,
                "probes": self.probes,
                "probe_faults": self.probe_faults,
                "refused": self.refused,
                "faults": self.faults,
                "late": self.late,
                "last_cause": self._last_cause,
                "next_probe_in_s": max(0.0, self._next_probe_at - now) if state == OPEN else None,
                "open_for_s": now - self._opened_at if state != CLOSED else None,
            }

    def __repr__(self) -> str:
        return (f"Breaker(state={self._state!r}, threshold={self.threshold}, backoff={self.backoff_s:g}s.."
                f"{self.backoff_max_s:g}s, jitter={self.jitter:g})")


#: Where SGLang's fault reporter (found by duck typing) may hang off its
#: storage backend or cache controller.
_REPORTER_ATTRS = ("_fault_reporter", "fault_reporter", "fault_manager", "storage_fault_manager")


def _is_reporter(obj: Any) -> bool:
    return obj is not None and callable(getattr(obj, "report_op", None))


def find_fault_reporter(obj: Any) -> Any | None:
    """SGLang's fault reporter reachable from ``obj``, or None: ``obj``
    itself when it has ``report_op(op=, fatal=, detail=)``; else such an
    object under one of ``_REPORTER_ATTRS``; else, for a cache controller,
    the same on its ``storage_backend``."""
    if _is_reporter(obj):
        return obj
    for holder in (obj, getattr(obj, "storage_backend", None)):
        if holder is None:
            continue
        for attr in _REPORTER_ATTRS:
            try:
                found = getattr(holder, attr, None)
            except Exception:
                continue
            if _is_reporter(found):
                return found
    return None


class FaultReports:
    """Report each data-path operation's outcome (``fatal``: a fault as the
    breaker sees it) to SGLang's fault reporter, where it has one; calls the
    open breaker answered are not reported. A reporter that raises is logged
    once per 60 s and never breaks the data path."""

    def __init__(self, reporter: Any = None) -> None:
        self._reporter: Any = None
        self._last_error = float("-inf")
        self.set_fault_reporter(reporter)

    @property
    def active(self) -> bool:
        return self._reporter is not None

    def set_fault_reporter(self, reporter: Any) -> None:
        """What the backend's own ``set_fault_reporter`` delegates to; None detaches."""
        self._reporter = reporter if _is_reporter(reporter) else None
        if reporter is not None and self._reporter is None:
            logger.warning("SiMM: the fault reporter %r has no report_op(op, fatal, detail); ignored",
                           type(reporter).__name__)

    def attach(self, obj: Any) -> bool:
        """Find a reporter from SGLang's controller or storage object
        (``find_fault_reporter``); True when one was found."""
        found = find_fault_reporter(obj)
        if found is not None:
            self._reporter = found
        return found is not None

    def report(self, op: str, cause: str | None) -> None:
        reporter = self._reporter
        if reporter is None:
            return
        try:
            reporter.report_op(op=op, fatal=cause is not None, detail=cause or "")
        except Exception as exc:  # never into the data path
            now = time.monotonic()
            if now - self._last_error >= 60.0:
                self._last_error = now
                logger.warning("SiMM: SGLang's fault reporter failed (%s: %s)", type(exc).__name__, exc)
