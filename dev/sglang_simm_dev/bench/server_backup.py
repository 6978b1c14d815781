"""Where a small backup's time goes on the local store, layer by layer.

``python -m sglang_simm_dev.bench.server_backup [--pages 1,4,8] [--busy] [--json PATH]``

A backup in a server is one ``batch_set_v1`` of new pages from SGLang's
backup thread. Here the same call runs on a real SGLang host pool of the
bench's model (``llama-demo``: 16 KiB of KV per token, 16-token pages) and
our backend on a local store of its own (its store process started here, a
separate process, as in a server). Each layer's entry point is wrapped with
a timer for the run, so one call gives the time spent in every layer:

* ``backend``: ``HiCacheSiMM.batch_set_v1`` itself (``backend.py``,
  ``transfer.py``, ``binding.py``: keys, views, answers, counters);
* ``client``: ``Store.mput`` (``local_store/_kv.py``: argument and region
  checks; no fault code runs while no fault is set);
* ``handle``: ``StoreHandle.put_from`` (``local_store/_handle.py``: framing and
  parsing, outside the requests below);
* ``put``: the PUT request (send, the store process reserves room, reply);
* ``populate``: faulting in the arena's pages (once per new high mark);
* ``copy``: ``copy_many``, the page bytes into the arena;
* ``commit``: the COMMIT request (send, the store process publishes, reply);
* ``ping``: for scale, a LOOKUP of one absent key on the same connection
  (a round trip with next to no work in the store process).

Every layer's own time is its total less the layers inside it. Sizes are
interleaved call by call, every call writes new keys, gc is off; medians and
p10/p90 over ``--repeat`` calls per size. Wall time: on a shared machine
every figure includes the time this process or the store process waited
for a core (the load average is printed with the table). ``--busy`` runs
the same calls beside a thread running Python, as a server's scheduler runs
beside its backup thread: then every blocking call waits for the GIL.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from sglang_simm.local_store.admin import private_store_dir

#: the layers, outermost first, each with what it covers
LAYERS = {
    "backend": "HiCacheSiMM.batch_set_v1 less Store.mput (backend, transfer, binding)",
    "client": "Store.mput less StoreHandle.put_from (local_store/_kv.py)",
    "handle": "StoreHandle.put_from less its requests and copy (local_store/_handle.py)",
    "put": "PUT round trip (store process reserves)",
    "populate": "arena pages faulted in",
    "copy": "copy_many into the arena",
    "commit": "COMMIT round trip (store process publishes)",
}


class Clock:
    """Nanoseconds per layer for the call in progress, on two clocks: wall
    time (``ns``) and this thread's CPU time (``cpu``); wall less CPU is
    time spent waiting: on the store process, or for a core."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.cpu: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.ns, self.cpu, self.calls = {}, {}, {}

    def add(self, layer: str, ns: int, cpu: int) -> None:
        self.ns[layer] = self.ns.get(layer, 0) + ns
        self.cpu[layer] = self.cpu.get(layer, 0) + cpu
        self.calls[layer] = self.calls.get(layer, 0) + 1

    def wrap(self, layer: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        wall, cpu = time.perf_counter_ns, time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = wall(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(layer(*args, **kwargs) if callable(layer) else layer, wall() - t0, cpu() - c0)

        return timed

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` timed as the outermost layer (``batch``)."""
        return self.wrap("batch", fn)()


@dataclass(frozen=True)
class Overhead:
    """What one timer costs, µs: ``inside`` the window it measures, and
    ``outside`` it, in its caller's window. ``thread_time`` is a system call
    (3-4 µs on a VM): without this correction a layer with four timed
    callees would be charged some 30 µs that serving never pays."""

    inside: float = 0.0
    outside: float = 0.0


def overhead(clock: str, rounds: int = 3000) -> Overhead:
    """``Overhead`` of ``Clock.wrap`` on ``clock`` (``ns`` or ``cpu``),
    measured with a timed no-op inside a timed caller (medians)."""
    c = Clock()
    outer = c.wrap("outer", c.wrap("inner", lambda: None))
    inside, own = [], []
    for _ in range(rounds):
        c.reset()
        outer()
        d = getattr(c, clock)
        inside.append(d["inner"] / 1000)
        own.append((d["outer"] - d["inner"]) / 1000)
    i = statistics.median(inside)
    return Overhead(inside=i, outside=max(statistics.median(own) - i, 0.0))


#: each layer's timed callees, outermost first
NESTING = {"batch": ("mput",), "mput": ("put_from",), "put_from": ("put", "populate", "copy", "commit")}
#: the timed function whose window each reported layer is the own part of
WINDOW = {"backend": "batch", "client": "mput", "handle": "put_from", "put": "put", "populate": "populate",
          "copy": "copy", "commit": "commit"}


def self_times(total_ns: dict[str, int], calls: dict[str, int] | None = None,
               cost: Overhead = Overhead()) -> dict[str, float]:
    """Each layer's own microseconds from the nested totals of one call
    (pure): a window less its timed callees' windows, less the timers' own
    cost (``cost.inside`` once per call of the window, ``cost.outside`` per
    call of each callee); ``total`` is their sum."""
    us = {k: v / 1000 for k, v in total_ns.items()}
    calls = calls or {k: 1 for k in total_ns}
    out: dict[str, float] = {}
    for layer, window in WINDOW.items():
        callees = NESTING.get(window, ())
        own = us.get(window, 0.0) - sum(us.get(c, 0.0) for c in callees)
        own -= calls.get(window, 0) * cost.inside + sum(calls.get(c, 0) for c in callees) * cost.outside
        out[layer] = own
    out["total"] = sum(out.values())
    return out


def _quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        v = values[0] if values else 0.0
        return {"p10": v, "median": v, "p90": v}
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"p10": deciles[0], "median": statistics.median(values), "p90": deciles[-1]}


@contextmanager
def _backend(pages_in_pool: int, name: str) -> Iterator[tuple[Any, Any]]:
    """Our backend on a fresh local store ``name`` and a real host pool of the
    bench's model; the store process is stopped after."""
    import torch

    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_simm import local_store
    from sglang_simm.plugin import register
    from sglang_simm_dev.bench.pages import fill_pool
    from sglang_simm_dev.pools import ModelGeometry, build_host_pool, storage_config

    from sglang.srt.mem_cache.pool_host import base

    # a pool of megabytes on a shared machine: SGLang's 10 GiB free-RAM
    # reserve would refuse it (as in the bench's servers, server_tap)
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(base.HICACHE_HOST_MEMORY_RESERVE_BYTES, 1 << 30)
    # llama-demo (tools/tiny_model.py) served in float32: 8 layers x 4 KV heads x 64
    geom = ModelGeometry("llama-demo", 8, 4, 64, 16, dtype=torch.float32)
    pool = build_host_pool(geom, tokens=pages_in_pool * geom.page_size, ratio=1.0)
    fill_pool(pool)
    register()
    extra = {"manager_address": f"local://{name}", "local_store_capacity_bytes": 2 << 30,
             "request_timeout_ms": 10_000}
    backend = StorageBackendFactory.create_backend("simm", storage_config(extra_config=extra), pool)
    backend.register_mem_pool_host(pool)
    try:
        yield backend, geom
    finally:
        backend.close()
        local_store.reset_servers(name)


@contextmanager
def busy_thread(on: bool, spins: list[int] | None = None) -> Iterator[None]:
    """A thread running pure Python for the block (``on``), as a server's
    scheduler does beside its backup thread: every time a backup releases
    the GIL (a socket call), getting it back can take up to
    ``sys.getswitchinterval()`` (5 ms). ``spins[0]`` counts its loops: how
    much of the GIL it got."""
    if not on:
        yield
        return
    import threading

    stop = threading.Event()
    count = spins if spins is not None else [0]

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin, name="busy-python", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def measure(sizes: list[int], repeat: int, warmup: int = 20, *, busy: bool = False) -> dict[str, Any]:
    """Per size, each layer's own microseconds (p10 / median / p90);
    ``busy``: beside a thread running Python (``busy_thread``)."""
    from sglang_simm.local_store import _maps
    from sglang_simm.local_store._protocol import Op
    from sglang_simm_dev.bench.pages import host_indices, page_keys

    pool_pages = max(sizes) * 8
    name = f"backup-breakdown-{os.getpid()}"
    clock = Clock()
    cost = {"ns": overhead("ns"), "cpu": overhead("cpu")}
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    cpu_samples: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    pings: list[float] = []
    with _backend(pool_pages, name) as (backend, geom):
        server = backend.client.store.server
        saved = (backend.client.mput_views, _maps.copy_many, _maps.SegmentMap._fault)
        backend.client.mput_views = clock.wrap("mput", backend.client.mput_views)
        server.put_from = clock.wrap("put_from", server.put_from)
        server._request = clock.wrap(lambda op, *a, **k: {Op.PUT: "put", Op.COMMIT: "commit"}.get(op, "other"),
                                     server._request)
        _maps.copy_many = clock.wrap("copy", _maps.copy_many)
        _maps.SegmentMap._fault = clock.wrap("populate", _maps.SegmentMap._fault)
        gc_was = gc.isenabled()
        gc.disable()
        try:
            call = 0
            with busy_thread(busy):
                for r in range(warmup + repeat):
                    for n in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:
                        keys = page_keys(n, f"{name}-{call}")
                        first = (call * n) % (pool_pages - n + 1)
                        indices = host_indices(range(first, first + n), geom.page_size)
                        call += 1
                        clock.reset()
                        row = clock.call(lambda: backend.batch_set_v1(keys, indices))
                        if not all(row):
                            raise RuntimeError(f"a backup of {n} pages stored {sum(row)}: the figures would mean nothing")
                        if r >= warmup:
                            samples[n].append(self_times(clock.ns, clock.calls, cost["ns"]))
                            cpu_samples[n].append(self_times(clock.cpu, clock.calls, cost["cpu"]))
                    t0 = time.perf_counter_ns()
                    server.lookup([f"{name}-absent-{r}"])
                    if r >= warmup:
                        pings.append((time.perf_counter_ns() - t0) / 1000)
        finally:
            if gc_was:
                gc.enable()
            backend.client.mput_views, _maps.copy_many, _maps.SegmentMap._fault = saved
            for attr in ("put_from", "_request"):
                server.__dict__.pop(attr, None)
    page_bytes = geom.page_bytes()
    out: dict[str, Any] = {"page_bytes": page_bytes, "repeat": repeat, "ping_us": _quantiles(pings),
                           "timer_cost_us": {k: asdict(v) for k, v in cost.items()},
                           "busy_thread": busy, "load": os.getloadavg(), "sizes": {}}
    for n, rows in samples.items():
        layers = {k: _quantiles([row[k] for row in rows]) for k in (*LAYERS, "total")}
        cpu = {k: _quantiles([row[k] for row in cpu_samples[n]]) for k in (*LAYERS, "total")}
        total = layers["total"]["median"]
        out["sizes"][str(n)] = {"layers": layers, "cpu": cpu,
                                "gib_per_s": n * page_bytes / 2**30 / (total / 1e6) if total else 0.0}
    return out


def render(result: dict[str, Any]) -> str:
    """A Markdown table: one row per layer, one column per size (median
    wall and CPU µs)."""
    sizes = list(result["sizes"])
    head = "| layer | what | " + " | ".join(f"{n} page{'s' if n != '1' else ''}: wall (CPU) µs" for n in sizes) + " |"
    lines = [head, "|---|---|" + "---|" * len(sizes)]

    def cell(q: dict[str, float]) -> str:
        return f"{q['median']:.0f} ({q['p10']:.0f}-{q['p90']:.0f})"

    for layer, what in (*LAYERS.items(), ("total", "batch_set_v1")):
        row = [f"{result['sizes'][n]['layers'][layer]['median']:.0f} ({result['sizes'][n]['cpu'][layer]['median']:.0f})"
               for n in sizes]
        lines.append(f"| {layer} | {what} | " + " | ".join(row) + " |")
    lines.append("| GiB/s | page bytes over the median total | "
                 + " | ".join(f"{result['sizes'][n]['gib_per_s']:.2f}" for n in sizes) + " |")
    ping = result["ping_us"]
    lines.append("")
    lines.append(f"Medians of {result['repeat']} calls per size; wall: perf_counter, CPU: the calling thread's "
                 f"thread_time (wall less CPU: waiting on the store process or for a core). Round trip with no "
                 f"work (LOOKUP of one absent key), wall: {cell(ping)} µs (median, p10-p90); page "
                 f"{result['page_bytes'] >> 10} KiB; {'beside a busy Python thread; ' if result['busy_thread'] else ''}each timer's own cost taken out (wall "
                 f"{result['timer_cost_us']['ns']['inside']:.1f} + {result['timer_cost_us']['ns']['outside']:.1f} µs, CPU "
                 f"{result['timer_cost_us']['cpu']['inside']:.1f} + {result['timer_cost_us']['cpu']['outside']:.1f} µs); load average {'/'.join(f'{x:.1f}' for x in result['load'])}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm_dev.bench.server_backup", description=__doc__.split("\n")[0])
    parser.add_argument("--pages", default="1,4,8", help="batch sizes, pages per backup (default 1,4,8)")
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per size (default 200)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--busy", action="store_true",
                        help="beside a thread running Python, as the scheduler runs beside a server's backup thread")
    args = parser.parse_args(argv)
    try:
        sizes = [int(p) for p in args.pages.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--pages takes a comma list of page counts, got {args.pages!r}")
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        parser.error("--pages needs counts >= 1 and --repeat a count >= 1")
    with private_store_dir("sglang-simm-bench-"):  # its store's files go with it
        result = measure(sizes, args.repeat, busy=args.busy)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
