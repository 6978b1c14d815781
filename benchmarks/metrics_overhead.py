"""What SGLang's /metrics costs a data-path call: the backend with metrics off and on, side by side.

    python benchmarks/metrics_overhead.py [--pages 1,8,128] [--rounds 7] [--calls 200]

Two backends over one in-process local store and two real SGLang host pools (the
``tiny`` geometry), one built with SGLang's metrics off
(``enable_storage_metrics`` False: no exporter) and one with them on (the
exporter, on a Prometheus registry of this process). Each round times
``--calls`` calls of ``batch_set_v1`` (new pages), ``batch_exists`` and
``batch_get_v1`` (the pages just written) per batch size, taking turns
(off, on, off, ...), in this thread's CPU time, and calls ``get_stats()`` between calls as SGLang's
scheduler does (the exporter flushes there, at most every 0.5 s). Prints
the median microseconds per call of each and the difference; no timed
assertion (a diagnostic, not part of the suite).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid


#: this thread's CPU time: on a shared machine, wall time mostly measures the
#: neighbours (the in-process local store copies on the calling thread)
_clock = time.thread_time


def build(metrics: bool, pool, name: str):
    from sglang_simm.backend import HiCacheSiMM
    from sglang_simm_dev.pools import storage_config

    cfg = storage_config(enable_storage_metrics=metrics, extra_config={"manager_address": f"inprocess://{name}"})
    return HiCacheSiMM(cfg, pool)


def one_round(backend, pages: int, calls: int) -> dict[str, float]:
    import torch

    out = {"set": 0.0, "exists": 0.0, "get": 0.0}
    page = backend.mem_pool_host.page_size
    indices = torch.arange(pages * page, dtype=torch.int64)
    for _ in range(calls):
        keys = [uuid.uuid4().hex * 2 for _ in range(pages)]
        t0 = _clock()
        backend.batch_set_v1(keys, indices)
        t1 = _clock()
        backend.batch_exists(keys)
        t2 = _clock()
        backend.batch_get_v1(keys, indices)
        t3 = _clock()
        backend.get_stats()
        out["set"] += t1 - t0
        out["exists"] += t2 - t1
        out["get"] += t3 - t2
    return {op: s / calls * 1e6 for op, s in out.items()}


def counters_alone(rounds: int, calls: int = 20000) -> dict[bool, list[float]]:
    """What metrics add to a call's counting by itself: one ``record_get``
    and one ``record_set`` per call, with and without an exporter (its
    Prometheus registry this process's own), in ns per call."""
    from prometheus_client import CollectorRegistry

    from sglang_simm.exporter import L3Exporter
    from sglang_simm.metrics import BackendCounters

    labels = {"model_name": "m", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    made = {False: BackendCounters(storage_metrics=False),
            True: BackendCounters(storage_metrics=False, exporter=L3Exporter(labels, registry=CollectorRegistry()))}
    out: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for m, c in made.items():
            t0 = _clock()
            for _ in range(calls):
                c.record_get(8, 0, 8192, 0.0002, 1024)
                c.record_set(8, 0, 0, 8192, 0.0003)
            out[m].append((_clock() - t0) / calls * 1e9)
            c.flush_export()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="1,8,128")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    from sglang_simm_dev.pools import PRESETS, build_host_pool

    geom = PRESETS["tiny"]
    sizes = [int(p) for p in args.pages.split(",")]
    pools = {m: build_host_pool(geom, tokens=max(sizes) * geom.page_size) for m in (False, True)}
    backends = {m: build(m, pools[m], f"metrics-bench-{'on' if m else 'off'}") for m in (False, True)}
    assert backends[False].counters.exporter is None and backends[True].counters.exporter is not None
    try:
        samples: dict[tuple[bool, int, str], list[float]] = {}
        for pages in sizes:
            one_round(backends[False], pages, 20)  # warm up both
            one_round(backends[True], pages, 20)
            for _ in range(args.rounds):
                for m in (False, True):
                    for op, us in one_round(backends[m], pages, args.calls).items():
                        samples.setdefault((m, pages, op), []).append(us)
    finally:
        for b in backends.values():
            b.close()
    alone = counters_alone(args.rounds)
    print(f"counting alone (record_get + record_set), median of {args.rounds} rounds: "
          f"metrics off {statistics.median(alone[False]):.0f} ns, on {statistics.median(alone[True]):.0f} ns "
          f"per call")
    print(f"per call (thread CPU time), median of {args.rounds} rounds of {args.calls} calls, "
          f"{geom.page_size}-token pages of {geom.page_bytes()} bytes, in-process local store")
    print(f"{'op':7s} {'pages':>5s} {'metrics off':>12s} {'metrics on':>12s} {'on - off':>10s} {'spread off':>11s}")
    for pages in sizes:
        for op in ("set", "exists", "get"):
            off, on = samples[(False, pages, op)], samples[(True, pages, op)]
            m_off, m_on = statistics.median(off), statistics.median(on)
            spread = (max(off) - min(off))
            print(f"{op:7s} {pages:5d} {m_off:10.1f}us {m_on:10.1f}us {m_on - m_off:+8.1f}us {spread:9.1f}us")


if __name__ == "__main__":
    main()
