"""How the bench samples a call: interleaved, warmed up, looped to about a millisecond, gc off."""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

#: Target length of one timing sample (calls are looped up to this).
SAMPLE_SECONDS = 1e-3


def time_once(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


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
    loop: bool = True,
) -> dict[str, list[float]]:
    """Interleaved samples (seconds per call) of each function.

    Each round takes one sample of every function, in an order that rotates
    each round. ``setup[name]`` runs untimed before each of its samples (then
    a sample is a single call). ``loop`` repeats cheap calls inside a sample.
    """
    setup = setup or {}
    inner = {name: (calibrate(fn) if loop and name not in setup else 1) for name, fn in fns.items()}
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    with _no_gc():
        for r in range(warmup + repeat):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                if name in setup:
                    setup[name]()
                dt = time_once(fns[name], inner[name])
                if r >= warmup:
                    out[name].append(dt)
    return out


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples)) if samples else float("nan")
