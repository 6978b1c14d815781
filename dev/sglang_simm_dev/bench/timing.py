"""How the bench samples a call: interleaved, warmed up, looped to about a millisecond, gc off.

Two clocks: ``perf_counter`` (wall time, for calls whose work spreads over
other threads or waits on a store process) and ``thread_time`` (this
thread's CPU time, for calls that do all their work on the calling thread:
on a shared machine it leaves out the time the thread was not running).
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

#: Target length of one timing sample (calls are looped up to this).
SAMPLE_SECONDS = 1e-3

Timer = Callable[[], float]


def time_once(fn: Callable[[], Any], inner: int, timer: Timer = time.perf_counter) -> float:
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls."""
    t0 = timer()
    for _ in range(inner):
        fn()
    return (timer() - t0) / inner


def calibrate(fn: Callable[[], Any], target: float = SAMPLE_SECONDS, limit: int = 1000) -> int:
    """How many calls make one sample of about ``target`` seconds."""
    one = min(time_once(fn, 1) for _ in range(3))
    return max(1, min(limit, int(target / one) if one > 0 else limit))


@contextmanager
def _no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def time_samples(
    fns: dict[str, Callable[[], Any]],
    *,
    repeat: int,
    warmup: int = 2,
    setup: dict[str, Callable[[], Any]] | None = None,
    prepare: dict[str, Callable[[int], Any]] | None = None,
    loop: bool = True,
    timer: Timer = time.perf_counter,
) -> dict[str, list[float]]:
    """Interleaved samples (seconds per call) of each function.

    Each round takes one sample of every function, in an order that rotates
    each round. ``setup[name]()`` runs untimed before each of its samples
    (then a sample is a single call). ``prepare[name](k)`` runs untimed
    before a sample of ``k`` looped calls (to get ready what those calls
    will use). ``loop`` repeats cheap calls inside a sample.
    """
    setup = setup or {}
    prepare = prepare or {}
    inner = {name: (calibrate(fn) if loop and name not in setup else 1) for name, fn in fns.items()}
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    with _no_gc():
        for r in range(warmup + repeat):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                if name in setup:
                    setup[name]()
                if name in prepare:
                    prepare[name](inner[name])
                dt = time_once(fns[name], inner[name], timer)
                if r >= warmup:
                    out[name].append(dt)
    return out


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples)) if samples else float("nan")


def spread(samples: Sequence[float]) -> float:
    """Interquartile range over median: how noisy a point was (0.1 = 10%)."""
    if len(samples) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(samples, n=4)
    mid = statistics.median(samples)
    return float((q3 - q1) / mid) if mid > 0 else float("nan")
