"""Measurement 4: the longest time one call holds the GIL, ours against the in-tree one.

SGLang's scheduler thread shares the GIL with the controller's backup and
prefetch threads, which call the backend: while a call holds the GIL, the
scheduler waits (at most the interpreter's switch interval, 5 ms, for pure
Python; a C call that keeps the GIL, as long as it runs). SiMM's client
lets go of the GIL for the whole of its native batch calls (``mexists``,
``mget``, ``mput``), so a call holds it in stretches: from its start to the
first batch call, between batch calls, and from the last one to its return.

On the null client with ``release_points`` on, each batch call notes the
time it was made, and the longest stretch of a call is its longest hold.
That is each backend's own work (the null client's answer itself is part
of it, for both alike). Wall time: a thread preempted while it holds the
GIL keeps the scheduler waiting too.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

from sglang_simm_dev.bench.checks import Checks
from sglang_simm_dev.bench.overhead import OPS, OverheadRig, check_call
from sglang_simm_dev.bench.timing import median

#: Calls measured per backend, operation and size.
GIL_CALLS = 21


def longest_hold(fn: Callable[[], Any], points: list[float]) -> tuple[float, int, Any]:
    """(longest stretch of ``fn`` between the client's release points,
    the number of release points, ``fn()``)."""
    points.clear()
    t0 = time.perf_counter()
    result = fn()
    t1 = time.perf_counter()
    marks = [t0, *points, t1]
    return max(b - a for a, b in zip(marks, marks[1:])), len(points), result


def measure_gil(rig: OverheadRig, sizes: Sequence[int], checks: Checks, *, calls: int = GIL_CALLS,
                ops: Sequence[str] = OPS) -> dict[str, Any]:
    """The longest GIL hold per call (median over ``calls`` calls, and the
    most), ours and in-tree, for each op and size."""
    if rig.client != "null":
        raise ValueError("the GIL is measured on the null client")
    points: list[float] = []
    stores = [rig.backends["ours"].client.store, rig.backends["in-tree"].store]
    for store in stores:
        store.release_points = points
    rows = []
    try:
        for op in ops:
            rig.prepare(op)
            for n in sizes:
                timed = {name: rig.call(name, op, n) for name in rig.backends}
                holds: dict[str, list[float]] = {name: [] for name in timed}
                releases: dict[str, int] = {}
                for i in range(calls):
                    for name in (list(timed) if i % 2 == 0 else list(timed)[::-1]):
                        t = timed[name]
                        t.ready()
                        held, releases[name], _ = longest_hold(t.fn, points)
                        holds[name].append(held)
                for name, t in timed.items():
                    check_call(checks, rig, name, op, t, n)
                rows.append({
                    "client": rig.client, "op": op, "pages": n,
                    "ours_us": median(holds["ours"]) * 1e6, "intree_us": median(holds["in-tree"]) * 1e6,
                    "ours_max_us": max(holds["ours"]) * 1e6, "intree_max_us": max(holds["in-tree"]) * 1e6,
                    "ours_batch_calls": releases["ours"], "intree_batch_calls": releases["in-tree"],
                    "calls": calls,
                })
    finally:
        for store in stores:
            store.release_points = None
    return {"rows": rows, "switch_interval_us": sys.getswitchinterval() * 1e6}
