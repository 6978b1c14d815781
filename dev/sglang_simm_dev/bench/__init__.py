"""``sglang-simm-dev bench``: the command (plan, run, JSON) measuring our backend against SGLang's in-tree one.

Four measurements over real SGLang host pools on the CPU:

1. **Own overhead per call** of ``batch_set_v1``, ``batch_exists`` and
   ``batch_get_v1``, ours (``sglang_simm.backend.HiCacheSiMM``) against
   SGLang's in-tree ``HiCacheSiMM``, on two clients, both reached through the
   ``simm.kv`` surface so each backend takes its real-client code path:

   * the **null client** (``sglang_simm_dev.nullkv``), which answers every batch
     call at once without touching memory, so only the backends' own work is
     timed (keys, pointers, views, result handling);
   * the **local store** (``local``, ``sglang_simm.local_store``), the whole data path.

   Keys follow serving (``overhead``): ``set`` and ``exists`` on new keys
   every call, ``get`` after a ``batch_exists`` of the same keys, and
   ``get-cold`` on new keys never looked up.
2. **Bandwidth** of set and get, ours on the local store, for real-model
   page sizes, against a ``torch`` copy of the same bytes into tensors of
   the same sizes, measured in the same run (the physical limit here).
3. **Scaling**: our per-page cost from 8 to 1024 pages per call.
4. **GIL**: the longest stretch one call holds the GIL (``gil``).

Method: every point is warmed up, then sampled ``--repeat`` times; the
median counts, and the interquartile range over the median (``spread``)
says how noisy it was. Ours and the in-tree backend alternate sample by
sample (and swap order every sample), so a noisy machine hits both alike;
the ratios are what matters. Short calls are looped so one sample lasts
about a millisecond. Every call's result is checked (pages reported
stored, found, read), and the bytes read back are compared with the bytes
written.

Modules: ``timing`` (sampling), ``backends`` (ours and the in-tree backend
set up on one client), ``overhead``, ``bandwidth`` and ``gil`` (the rigs and
measurements), ``checks``, ``goals``, ``render`` (tables) and ``plot``
(chart); this one is the command. The helpers re-exported here
(``OverheadRig``, ``BandwidthRig``, ``time_samples``, ...) are shared with
``benchmarks/`` (pytest-benchmark).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from sglang_simm_dev.bench.backends import INTREE_MODULE, local_store_server, load_intree_class, make_intree, make_ours
from sglang_simm_dev.bench.bandwidth import BANDWIDTH_CASES, BandwidthRig, measure_bandwidth
from sglang_simm_dev.bench.checks import Checks, check_result
from sglang_simm_dev.bench.gil import longest_hold, measure_gil
from sglang_simm_dev.bench.goals import evaluate_goals
from sglang_simm_dev.bench.overhead import (
    FRESH_HOST_PAGES,
    NULL_GEOMETRY,
    OP_MEANING,
    OPS,
    OVERHEAD_GEOMETRY,
    OverheadRig,
    Timed,
    measure_overhead,
    scaling,
)
from sglang_simm_dev.bench.pages import KeyRing, fill_pool, host_indices, page_keys
from sglang_simm_dev.bench.plot import plot
from sglang_simm_dev.bench.render import render
from sglang_simm_dev.bench.report import check_plot_extra, run_and_report
from sglang_simm_dev.bench.timing import median, time_samples
from sglang_simm_dev.pools import build_host_pool

__all__ = [
    "BANDWIDTH_CASES",
    "DEFAULT_PAGES",
    "INTREE_MODULE",
    "KeyRing",
    "OPS",
    "OP_MEANING",
    "OVERHEAD_GEOMETRY",
    "NULL_GEOMETRY",
    "FRESH_HOST_PAGES",
    "BandwidthRig",
    "Checks",
    "OverheadRig",
    "Plan",
    "Timed",
    "check_result",
    "local_store_server",
    "fill_pool",
    "host_indices",
    "load_intree_class",
    "make_intree",
    "make_ours",
    "measure_bandwidth",
    "longest_hold",
    "measure_gil",
    "measure_overhead",
    "median",
    "page_keys",
    "plan_from_args",
    "plot",
    "run",
    "run_bench",
    "time_samples",
]

DEFAULT_PAGES = "1,8,32,128,1024"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:
        sglang_version = None
    from sglang_simm import __version__

    return {
        "cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable, "memory_bytes": mem,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "sglang": sglang_version,
        "sglang_simm": __version__, "numpy": np.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _parse_pages(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--pages takes comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--pages takes positive integers, got {text!r}")
    return sizes


@dataclass
class Plan:
    sizes: list[int]
    repeat: int
    bw_cases: list[str]
    bw_pages: int
    bw_repeat: int


def plan_from_args(args: Any) -> Plan:
    """``--pages``, ``--repeat``, ``--quick``; and two settings without a
    flag (for tests): ``bandwidth_cases`` (names of ``BANDWIDTH_CASES``, or
    empty for none) and ``bandwidth_pages``."""
    quick = bool(getattr(args, "quick", False))
    pages = getattr(args, "pages", None) or DEFAULT_PAGES
    if quick and pages == DEFAULT_PAGES:
        pages = "1,8,128,1024"
    sizes = _parse_pages(pages)
    repeat = getattr(args, "repeat", None)
    repeat = 30 if repeat is None else int(repeat)
    if quick:
        repeat = min(repeat, 7)
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    cases = getattr(args, "bandwidth_cases", None)
    if cases is None:
        cases = ["1mib", "llama3-8b"] if quick else ["1mib", "llama3-8b", "deepseek-v3"]
    unknown = [c for c in cases if c not in BANDWIDTH_CASES]
    if unknown:
        raise ValueError(f"unknown bandwidth case(s) {unknown}; known: {sorted(BANDWIDTH_CASES)}")
    bw_pages = int(getattr(args, "bandwidth_pages", None) or (8 if quick else 64))
    bw_repeat = min(repeat, 3 if quick else 11)
    return Plan(sizes, repeat, list(cases), bw_pages, bw_repeat)


def run(plan: Plan, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Everything, as one JSON-able dict (``checks`` lists what was verified)."""
    checks = Checks()
    phases: dict[str, float] = {}
    last = [time.perf_counter(), ""]

    def phase(text: str) -> None:
        now = time.perf_counter()
        if last[1]:
            phases[last[1]] = round(now - last[0], 3)
        last[0], last[1] = now, text
        if text:
            progress(text)

    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {"pages": plan.sizes, "repeat": plan.repeat, "bandwidth_cases": plan.bw_cases,
                     "bandwidth_pages": plan.bw_pages, "bandwidth_repeat": plan.bw_repeat,
                     "overhead_page_bytes": OVERHEAD_GEOMETRY.page_bytes(),
                     "overhead_page_tokens": OVERHEAD_GEOMETRY.page_size,
                     "null_pool_pages": FRESH_HOST_PAGES, "null_page_bytes": NULL_GEOMETRY.page_bytes(),
                     "null_host_pages": "new every call (a ring over the pool)"},
        "operations": dict(OP_MEANING),
        "overhead": [], "bandwidth": [], "scaling": {}, "gil": {},
    }
    t_start = time.perf_counter()
    max_pages = max(plan.sizes)
    phase("building the host pool (imports SGLang)")
    pool = build_host_pool(OVERHEAD_GEOMETRY, tokens=max_pages * OVERHEAD_GEOMETRY.page_size)
    fill_pool(pool)
    # SGLang's import leaves a large heap: set it aside once, so no
    # collection walks it mid-measurement (timing runs with gc off anyway).
    gc.collect()
    gc.freeze()

    phase("own overhead, null client")
    null_tokens = max(2 * max_pages, FRESH_HOST_PAGES) * NULL_GEOMETRY.page_size
    null_pool = build_host_pool(NULL_GEOMETRY, tokens=null_tokens // 2)
    rig = OverheadRig("null", max_pages, geom=NULL_GEOMETRY, pool=null_pool)
    try:
        result["overhead"] += measure_overhead(rig, plan.sizes, plan.repeat, checks)
        phase("GIL holds, null client")
        result["gil"] = measure_gil(rig, plan.sizes, checks)
    finally:
        rig.close()
        del null_pool

    bw_bytes = max((BANDWIDTH_CASES[c].page_bytes() * plan.bw_pages for c in plan.bw_cases), default=0)
    overhead_bytes = 4 * max_pages * OVERHEAD_GEOMETRY.page_bytes()
    capacity = max(256 << 20, 2 * (bw_bytes + overhead_bytes))
    with local_store_server(capacity) as server:
        phase("per call, local store")
        rig = OverheadRig("local", max_pages, pool=pool)
        try:
            result["overhead"] += measure_overhead(rig, plan.sizes, plan.repeat, checks)
        finally:
            rig.close()
            server.clear()
        for case in plan.bw_cases:
            geom = BANDWIDTH_CASES[case]
            phase(f"bandwidth, {case}")
            bw = BandwidthRig(case, geom, plan.bw_pages, capacity=capacity)
            try:
                result["bandwidth"].append(measure_bandwidth(bw, plan.bw_repeat, checks))
            finally:
                bw.close()
                server.clear()
                del bw
                gc.collect()
        result["local_store_stats"] = server.stats()
        result["local_store"] = {"kind": "local store (manager_address local)", "name": getattr(server, "name", None)}
    del pool, rig
    gc.collect()

    phase("")
    gc.unfreeze()
    result["phases_seconds"] = phases
    for client in ("null", "local"):
        result["scaling"][client] = scaling(result["overhead"], client)
    result["goals"] = evaluate_goals(result)
    result["checks"] = {"ok": checks.ok, "verified": checks.items, "failures": checks.failures}
    result["seconds"] = time.perf_counter() - t_start
    return result


def run_bench(console: Any, args: Any) -> int:
    """The ``bench`` command. 0 when every result checked out, 1 if not.

    Goals are reported, not enforced (a noisy machine should not fail a run).
    """
    from sglang_simm.local_store.admin import private_store_dir

    # the local stores it starts (and its servers' stores) live and go with it
    with private_store_dir("sglang-simm-bench-"):
        if getattr(args, "store", False):
            return run_store_bench(console, args)
        if getattr(args, "server", False):
            from sglang_simm_dev.bench.server_cli import run_server_bench

            return run_server_bench(console, args)
        plan = plan_from_args(args)
        check_plot_extra(args)
        result = run_and_report(console, args, "bench", lambda progress: run(plan, progress=progress), render, plot)
        return 0 if result["checks"]["ok"] else 1


def run_store_bench(console: Any, args: Any) -> int:
    """``bench --store``: the local store against memcpy, SGLang's ``file``
    backend and the in-process local store (``tools.bench.store``)."""
    from sglang_simm_dev.bench import store

    repeat = 5 if getattr(args, "quick", False) else max(int(getattr(args, "repeat", None) or 30), 5)
    with console.status("bench --store: local store, file backend, memcpy"):
        result = store.measure(repeat=repeat)
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
    store.render(console, result)
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        console.print(f"wrote {args.json}")
    return 0
