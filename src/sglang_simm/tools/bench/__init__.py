"""``sglang-simm bench``: our backend against SGLang's in-tree one, in one process.

Three measurements over real SGLang host pools on the CPU:

1. **Own overhead per call** of ``batch_set_v1``, ``batch_exists`` and
   ``batch_get_v1``, ours (``sglang_simm.backend.HiCacheSiMM``) against
   SGLang's in-tree ``HiCacheSiMM``, on two clients, both reached through the
   ``simm.kv`` surface so each backend takes its real-client code path:

   * the **null client** (``sglang_simm.tools.nullkv``), which answers every batch
     call at once without touching memory, so only the backends' own work is
     timed (keys, pointers, views, result handling);
   * the **embedded store** (``sglang_simm.embedded``), the whole data path.

   ``set`` is timed on pages not yet stored, every call on new page keys
   (its mexists answers False, then mput runs); ``exists`` and ``get`` on
   stored pages.
2. **Bandwidth** of set and get, ours on the embedded store, for real-model
   page sizes, against a ``torch`` copy of the same bytes into tensors of
   the same sizes, measured in the same run (the physical limit here).
3. **Scaling**: our per-page cost from 8 to 1024 pages per call.

Method: every point is warmed up, then sampled ``--repeat`` times; the
median counts. Ours and the in-tree backend alternate sample by sample (and
swap order every sample), so a noisy machine hits both alike; the ratios are
what matters. Short calls are looped so one sample lasts about a millisecond.
Every call's result is checked (pages reported stored, found, read), and
the bytes read back are compared with the bytes written.

The helpers (``OverheadRig``, ``BandwidthRig``, ``time_samples``) are shared
with ``benchmarks/`` (pytest-benchmark).
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from sglang_simm.tools.pools import PRESETS, ModelGeometry, build_host_pool, storage_config

logger = logging.getLogger(__name__)

INTREE_MODULE = "sglang.srt.mem_cache.storage.simm.hicache_simm"
EMBEDDED_NAME = "bench"
OPS = ("set", "exists", "get")
DEFAULT_PAGES = "1,8,32,128,1024"

#: The overhead part's page: SGLang's usual 64 tokens, 2 x 32 KiB objects,
#: so 2 x 1024 pages (source and destination) fit in 128 MiB.
OVERHEAD_GEOMETRY = ModelGeometry("bench-64k", layer_num=1, head_num=2, head_dim=128, page_size=64)

#: Bandwidth cases: (label, geometry). Object sizes 1 MiB, 4 MiB (K and V), 4.3 MiB (MLA).
BANDWIDTH_CASES: dict[str, ModelGeometry] = {
    "1mib": ModelGeometry("bench-1mib", layer_num=8, head_num=8, head_dim=128, page_size=64),
    "llama3-8b": PRESETS["llama3-8b"],
    "deepseek-v3": PRESETS["deepseek-v3"],
    # for smoke tests: 32 KiB objects
    "small": OVERHEAD_GEOMETRY,
}

# -- goals -------------------------------------------------------------------------

GOAL_RATIO = {"set": 5.0, "get": 5.0, "exists": 2.0}
GOAL_US_PER_PAGE = 1.0
GOAL_BANDWIDTH_FRACTION = 0.70
GOAL_SCALING = 2.0
GOAL_PAGES = 128

#: Target length of one timing sample (calls are looped up to this).
SAMPLE_SECONDS = 1e-3
#: Distinct page keys the set measurement cycles through.
FRESH_KEYS = 1 << 17


# -- timing ---------------------------------------------------------------------------


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


# -- page keys and host indices ----------------------------------------------------------


def page_keys(n: int, salt: str) -> list[str]:
    """SGLang-like page keys: sha256 hex digests."""
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def host_indices(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """The token slots of ``pages``, as SGLang's controller hands them over."""
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (compares bit patterns: random bf16 has NaNs)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fill_pool(pool: Any, seed: int = 0) -> None:
    """Distinct bytes everywhere, so a read of the wrong page shows."""
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    n8 = flat.numel() // 8
    words = flat[: n8 * 8].view(torch.int64)
    torch.arange(n8, out=words)
    words.mul_(0x9E3779B97F4A7C15 - (1 << 64)).add_(seed)


# -- the two backends ---------------------------------------------------------------------------


def load_intree_class(kv_module: Any) -> type:
    """SGLang's in-tree ``HiCacheSiMM`` imported against ``kv_module`` as ``simm.kv``.

    The in-tree module binds ``Store``, ``BlockView``, ``register_mr`` and
    ``set_flag`` at import, so each client gets a private, fresh import (any
    cached one is set aside and restored).
    """
    saved = sys.modules.pop(INTREE_MODULE, None)
    try:
        if getattr(kv_module, "__simm_embedded__", False):
            from sglang_simm.embedded import alias_as_simm_kv
        else:
            from sglang_simm.tools.nullkv import alias_as_simm_kv as _alias

            alias_as_simm_kv = lambda: _alias(kv_module)  # noqa: E731
        with alias_as_simm_kv():
            try:
                module = importlib.import_module(INTREE_MODULE)
            except ModuleNotFoundError as exc:
                if not (exc.name and INTREE_MODULE.startswith(exc.name)):
                    raise
                raise ValueError(
                    f"this SGLang has no in-tree SiMM backend ({INTREE_MODULE}) to compare with"
                ) from exc
    finally:
        sys.modules.pop(INTREE_MODULE, None)
        if saved is not None:
            sys.modules[INTREE_MODULE] = saved
    # Without /sys/class/infiniband its NIC lookup returns a list, and its
    # constructor then fails on list.get() on any host with NUMA nodes. The
    # NIC choice is outside the data path: answer "no RDMA devices" properly.
    module.get_numa_nic_mapping = dict
    return module.HiCacheSiMM


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _storage_config(geom: ModelGeometry, extra: dict[str, Any]) -> Any:
    return storage_config(model_name=geom.name, is_mla_model=geom.is_mla, extra_config=extra)


def make_ours(pool: Any, geom: ModelGeometry, client: str, *, capacity: int | None = None) -> Any:
    """Our backend on the null client or the embedded store ``bench``."""
    from sglang_simm.backend import HiCacheSiMM

    extra: dict[str, Any] = {"manager_address": f"local://{EMBEDDED_NAME}"}
    if capacity:
        extra["embedded_capacity_bytes"] = int(capacity)
    sc = _storage_config(geom, extra)
    with _quiet("sglang_simm.backend", "sglang_simm.embedded"):
        if client == "null":
            from sglang_simm.tools import nullkv
            from sglang_simm.client import KVClient

            kv = KVClient(nullkv, nullkv.Store(), description="null client", embedded=True)
            return HiCacheSiMM(sc, pool, client=kv)
        return HiCacheSiMM(sc, pool)


def make_intree(pool: Any, geom: ModelGeometry, client: str) -> Any:
    """SGLang's in-tree backend with ``simm.kv`` = the null client or the
    embedded store (its ``manager_address`` ``bench:0`` names server ``bench``)."""
    if client == "null":
        from sglang_simm.tools import nullkv as kv_module
    else:
        from sglang_simm import embedded as kv_module
    cls = load_intree_class(kv_module)
    sc = _storage_config(geom, {"manager_address": f"{EMBEDDED_NAME}:0"})
    with _quiet(INTREE_MODULE):
        backend = cls(sc, None)
        backend.register_mem_pool_host(pool)
    return backend


@contextmanager
def embedded_server(capacity: int) -> Iterator[Any]:
    """A fresh embedded server ``bench``; flags restored and server dropped after."""
    from sglang_simm import embedded

    names = ("cm_primary_node_ip", "embedded_capacity_bytes")
    saved = {n: embedded.get_flag(n) for n in names}
    embedded.reset_servers(EMBEDDED_NAME)
    embedded.set_flag("cm_primary_node_ip", EMBEDDED_NAME)
    embedded.set_flag("embedded_capacity_bytes", str(int(capacity)))
    server = embedded.get_server(EMBEDDED_NAME)
    try:
        yield server
    finally:
        server.clear()
        embedded.reset_servers(EMBEDDED_NAME)
        for n, v in saved.items():
            embedded.set_flag(n, v if v is not None else "")


def _set_exists_answer(backend: Any, answer: bool) -> None:
    store = backend.client.store if hasattr(backend, "client") else backend.store
    store.exists_answer = answer


# -- checks --------------------------------------------------------------------------------------


@dataclass
class Checks:
    """Every result the bench verified: ``what`` -> ok, with a detail on failure."""

    items: dict[str, bool] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def expect(self, what: str, ok: bool, detail: str = "") -> None:
        self.items[what] = self.items.get(what, True) and bool(ok)
        if not ok:
            self.failures.append(f"{what}: {detail}" if detail else what)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_result(checks: Checks, what: str, op: str, result: Any, n: int) -> None:
    if op == "exists":
        checks.expect(what, result == n, f"batch_exists answered {result}, expected {n}")
    else:
        good = isinstance(result, list) and len(result) == n and all(result)
        checks.expect(what, good, f"{sum(bool(x) for x in result or [])}/{n} pages True")


# -- 1. own overhead -------------------------------------------------------------------------------


class OverheadRig:
    """One host pool, ours and the in-tree backend on one client.

    Pages ``src`` (stored, for exists/get; also the source of sets) and
    ``dst`` (where gets land) are disjoint and shuffled like a real pool's.
    """

    def __init__(self, client: str, max_pages: int, *, geom: ModelGeometry = OVERHEAD_GEOMETRY,
                 pool: Any = None, seed: int = 1):
        self.client = client
        self.geom = geom
        self.max_pages = max_pages
        self.pool = pool if pool is not None else build_host_pool(geom, tokens=max_pages * geom.page_size)
        host_pages = int(self.pool.size) // geom.page_size
        if host_pages < 2 * max_pages:
            raise ValueError(f"host pool of {host_pages} pages cannot hold 2 x {max_pages}")
        perm = np.random.default_rng(seed).permutation(host_pages)
        self.src_pages = perm[:max_pages].tolist()
        self.dst_pages = perm[max_pages: 2 * max_pages].tolist()
        self.backends = {"ours": make_ours(self.pool, geom, client), "in-tree": make_intree(self.pool, geom, client)}
        self.stored = page_keys(max_pages, "stored")
        # Sets write pages never seen before: every set call takes the next
        # batch of a ring of distinct keys, so no cache of keys (in a backend
        # or a client) can make a repeated set look cheaper than a new one.
        self.fresh = page_keys(max(FRESH_KEYS, 2 * max_pages), "fresh")
        self._last_set: dict[str, list[str]] = {}
        self._stored_done = False

    def server(self) -> Any:
        return self.backends["ours"].client.store.server

    def indices(self, n: int, which: str = "src") -> torch.Tensor:
        pages = self.src_pages if which == "src" else self.dst_pages
        return host_indices(pages[:n], self.geom.page_size)

    def store_pages(self, checks: Checks) -> None:
        """Store ``stored`` pages with each backend (untimed, verified)."""
        if self._stored_done:
            return
        # both backends talk to the client under test through the simm.kv surface
        expected = "sglang_simm.tools.nullkv" if self.client == "null" else "sglang_simm.embedded._client"
        for name, store in (("ours", self.backends["ours"].client.store),
                            ("in-tree", self.backends["in-tree"].store)):
            module = type(store).__module__
            checks.expect(f"{self.client}/{name}/client", module == expected,
                          f"its store is a {module}.{type(store).__name__}, expected one from {expected}")
        idx = self.indices(self.max_pages, "src")
        for name, b in self.backends.items():
            if self.client == "null":
                _set_exists_answer(b, False)
            res = b.batch_set_v1(self.stored, idx)
            check_result(checks, f"{self.client}/{name}/store", "set", res, self.max_pages)
        self._stored_done = True

    def call(self, name: str, op: str, n: int) -> Callable[[], Any]:
        """A zero-argument call of one operation on ``n`` pages."""
        b = self.backends[name]
        if op == "set":
            idx = self.indices(n, "src")
            ring = itertools.cycle([self.fresh[i:i + n] for i in range(0, len(self.fresh) - n + 1, n)])
            last = self._last_set

            def set_call() -> Any:
                keys = last[name] = next(ring)
                return b.batch_set_v1(keys, idx)

            return set_call
        keys = self.stored[:n]
        if op == "exists":
            return lambda: b.batch_exists(keys)
        idx = self.indices(n, "dst")
        return lambda: b.batch_get_v1(keys, idx)

    def prepare(self, op: str) -> None:
        """Null client: the answer that sends each op down its full path."""
        if self.client == "null":
            for b in self.backends.values():
                _set_exists_answer(b, op != "set")

    def unset(self, name: str) -> Callable[[], None]:
        """Embedded: delete the pages the backend's last set stored (keeps
        the store small; the ring's next batch is new anyway)."""
        b = self.backends[name]
        delete = self.server().delete
        suffixes = ("_0_k",) if self.geom.is_mla else ("_0_k", "_0_v")

        def unset() -> None:
            keys = self._last_set.pop(name, None)
            if not keys:
                return
            if name == "ours":
                obj_keys = b._kv.page_object_keys(keys)[1]
            else:
                obj_keys = [f"{k}{s}" for k in keys for s in suffixes]
            for k in obj_keys:
                delete(k)

        return unset

    def verify_bytes(self, checks: Checks, n: int) -> None:
        """After gets into ``dst``, those pages hold the ``src`` pages' bytes."""
        buf = _bytes_of(self.pool.kv_buffer).numpy()
        ps = self.geom.page_size
        bad = 0
        for s, d in zip(self.src_pages[:n], self.dst_pages[:n]):
            # page_first: token slots are dim 1 (MHA: [2, tokens, ...]) or 0 (MLA)
            if self.geom.is_mla:
                same = np.array_equal(buf[s * ps:(s + 1) * ps], buf[d * ps:(d + 1) * ps])
            else:
                same = np.array_equal(buf[:, s * ps:(s + 1) * ps], buf[:, d * ps:(d + 1) * ps])
            bad += not same
        checks.expect(f"{self.client}/bytes", bad == 0, f"{bad}/{n} pages read back different bytes")

    def close(self) -> None:
        for b in self.backends.values():
            try:
                b.close()
            except Exception:  # the in-tree backend has no close() worth trusting
                pass


def measure_overhead(rig: OverheadRig, sizes: Sequence[int], repeat: int, checks: Checks,
                     *, warmup: int = 2) -> list[dict[str, Any]]:
    """Rows of per-call cost, ours and in-tree, for each op and batch size."""
    rows = []
    rig.store_pages(checks)
    for op in OPS:
        rig.prepare(op)
        for n in sizes:
            fns = {name: rig.call(name, op, n) for name in rig.backends}
            embedded_set = rig.client == "embedded" and op == "set"
            for name, fn in fns.items():  # one verified call each, untimed
                check_result(checks, f"{rig.client}/{name}/{op}", op, fn(), n)
                if embedded_set:
                    rig.unset(name)()
            setup = {name: rig.unset(name) for name in fns} if embedded_set else None
            samples = time_samples(fns, repeat=repeat, warmup=warmup, setup=setup)
            ours, intree = median(samples["ours"]), median(samples["in-tree"])
            rows.append({
                "client": rig.client, "op": op, "pages": n,
                "ours_us": ours * 1e6, "intree_us": intree * 1e6,
                "ours_us_per_page": ours * 1e6 / n, "intree_us_per_page": intree * 1e6 / n,
                "ratio": intree / ours if ours > 0 else float("nan"),
                "samples": len(samples["ours"]),
            })
            for name, fn in fns.items():  # and once more after the timing
                if embedded_set:
                    rig.unset(name)()
                check_result(checks, f"{rig.client}/{name}/{op}", op, fn(), n)
                if embedded_set:
                    rig.unset(name)()
        if op == "get" and rig.client == "embedded":
            rig.verify_bytes(checks, max(sizes))
    return rows


# -- 2. bandwidth -----------------------------------------------------------------------------------


class BandwidthRig:
    """Our backend on the embedded store over a pool of real-size pages."""

    def __init__(self, label: str, geom: ModelGeometry, pages: int, *, capacity: int):
        self.label = label
        self.geom = geom
        self.pages = pages
        self.pool = build_host_pool(geom, tokens=pages * geom.page_size)
        fill_pool(self.pool, seed=len(label))
        host_pages = int(self.pool.size) // geom.page_size
        self.src_pages = list(range(pages))
        self.dst_pages = list(range(pages, min(2 * pages, host_pages)))
        self.ours = make_ours(self.pool, geom, "embedded", capacity=capacity)
        b = self.ours._kv
        self.object_sizes = sorted(set(b.sizes_list))
        self.page_bytes = b.page_bytes
        self.keys = page_keys(pages, f"bw-{label}")
        self.src = host_indices(self.src_pages, geom.page_size)
        self.dst = host_indices(self.dst_pages, geom.page_size)
        # the same bytes as torch tensors: every object of the source pages
        from sglang_simm.embedded._server import wrap_memory

        starts = np.asarray(self.src_pages, dtype=np.int64) * geom.page_size
        ptrs = b.geometry.pointers(starts).tolist()
        sizes = b.sizes_list * pages
        self.torch_src = [wrap_memory(p, s) for p, s in zip(ptrs, sizes)]
        self.torch_dst = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        for t in self.torch_dst:  # touch the pages once
            t.fill_(0)

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def set(self) -> list[bool]:
        return self.ours.batch_set_v1(self.keys, self.src)

    def get(self) -> list[bool]:
        return self.ours.batch_get_v1(self.keys, self.dst)

    def unset(self) -> None:
        self.ours.clear()

    def torch_copy(self) -> None:
        """``copy_`` of every object, torch's default intra-op threads."""
        for d, s in zip(self.torch_dst, self.torch_src):
            d.copy_(s)

    def torch_copy_1t(self) -> None:
        """The same on one thread: on busy cores the default one's thread
        barrier can collapse, so the better of the two is the limit."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.torch_copy()
        finally:
            torch.set_num_threads(threads)

    def verify(self, checks: Checks) -> None:
        buf = _bytes_of(self.pool.kv_buffer)
        ps = self.geom.page_size
        n = len(self.dst_pages)
        buf = buf.numpy()
        if self.geom.is_mla:
            a, b = buf[: n * ps], buf[n * ps: 2 * n * ps]
        else:
            a, b = buf[:, : n * ps], buf[:, n * ps: 2 * n * ps]
        checks.expect(f"bandwidth/{self.label}/bytes", np.array_equal(a, b), "pages read back different bytes")

    def close(self) -> None:
        self.ours.close()
        self.torch_src = self.torch_dst = []


def measure_bandwidth(rig: BandwidthRig, repeat: int, checks: Checks, *, warmup: int = 1) -> dict[str, Any]:
    rig.unset()
    check_result(checks, f"bandwidth/{rig.label}/set", "set", rig.set(), rig.pages)
    check_result(checks, f"bandwidth/{rig.label}/get", "get", rig.get(), len(rig.dst_pages))
    rig.verify(checks)
    # set: ours (fresh pages every sample) against torch; get: the pages stay stored
    baselines = {"torch": rig.torch_copy, "torch-1t": rig.torch_copy_1t}
    set_s = time_samples({"ours": rig.set, **baselines}, repeat=repeat, warmup=warmup,
                         setup={"ours": rig.unset}, loop=False)
    rig.unset()
    check_result(checks, f"bandwidth/{rig.label}/set", "set", rig.set(), rig.pages)
    get_s = time_samples({"ours": rig.get, **baselines}, repeat=repeat, warmup=warmup, loop=False)
    check_result(checks, f"bandwidth/{rig.label}/get", "get", rig.get(), len(rig.dst_pages))
    rig.verify(checks)
    gb = rig.nbytes / 1e9
    torch_default = gb / median(set_s["torch"] + get_s["torch"])
    torch_one = gb / median(set_s["torch-1t"] + get_s["torch-1t"])
    row = {
        "case": rig.label, "model": rig.geom.name, "pages": rig.pages,
        "object_bytes": rig.object_sizes, "page_bytes": rig.page_bytes, "bytes": rig.nbytes,
        "set_gbps": gb / median(set_s["ours"]), "get_gbps": gb / median(get_s["ours"]),
        "torch_gbps": max(torch_default, torch_one),
        "torch_default_threads_gbps": torch_default, "torch_one_thread_gbps": torch_one,
    }
    row["set_ratio"] = row["set_gbps"] / row["torch_gbps"]
    row["get_ratio"] = row["get_gbps"] / row["torch_gbps"]
    return row


# -- 3. scaling ------------------------------------------------------------------------------------------


def scaling(rows: list[dict[str, Any]], client: str, lo: int = 8, hi: int = 1024) -> dict[str, Any]:
    """Per op: our per-page cost at each size in [lo, hi], and max/min."""
    out: dict[str, Any] = {}
    for op in OPS:
        pts = {r["pages"]: r["ours_us_per_page"] for r in rows
               if r["client"] == client and r["op"] == op and lo <= r["pages"] <= hi}
        if len(pts) >= 2:
            out[op] = {"us_per_page": {str(k): v for k, v in sorted(pts.items())},
                       "max_over_min": max(pts.values()) / min(pts.values())}
    return out


# -- goals ------------------------------------------------------------------------------------------------


def evaluate_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    null = {(r["op"], r["pages"]): r for r in result["overhead"] if r["client"] == "null"}
    for op in OPS:
        r = null.get((op, GOAL_PAGES))
        goals.append({
            "goal": f"{op}: in-tree/ours, {GOAL_PAGES} pages, null client",
            "target": f">= {GOAL_RATIO[op]:g}x", "value": r["ratio"] if r else None,
            "unit": "x", "met": (r["ratio"] >= GOAL_RATIO[op]) if r else None,
        })
    for op in OPS:
        r = null.get((op, GOAL_PAGES))
        goals.append({
            "goal": f"{op}: ours per page, {GOAL_PAGES} pages, null client",
            "target": f"< {GOAL_US_PER_PAGE:g} us", "value": r["ours_us_per_page"] if r else None,
            "unit": "us", "met": (r["ours_us_per_page"] < GOAL_US_PER_PAGE) if r else None,
        })
    for row in result["bandwidth"]:
        if min(row["object_bytes"]) < (1 << 20):
            continue
        for op in ("set", "get"):
            v = row[f"{op}_ratio"]
            goals.append({
                "goal": f"{op}: bandwidth / torch copy, {row['case']}",
                "target": f">= {GOAL_BANDWIDTH_FRACTION:.0%}", "value": v, "unit": "%",
                "met": v >= GOAL_BANDWIDTH_FRACTION,
            })
    for client in ("null", "embedded"):
        sc = result["scaling"].get(client, {})
        for op in OPS:
            s = sc.get(op)
            goals.append({
                "goal": f"{op}: ours per page, max/min 8..1024, {client}",
                "target": f"< {GOAL_SCALING:g}x", "value": s["max_over_min"] if s else None,
                "unit": "x", "met": (s["max_over_min"] < GOAL_SCALING) if s else None,
            })
    return goals


# -- machine ------------------------------------------------------------------------------------------------


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


# -- the command ------------------------------------------------------------------------------------------------


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
    repeat = int(getattr(args, "repeat", None) or 30)
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
                     "overhead_page_tokens": OVERHEAD_GEOMETRY.page_size},
        "overhead": [], "bandwidth": [], "scaling": {},
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
    rig = OverheadRig("null", max_pages, pool=pool)
    try:
        result["overhead"] += measure_overhead(rig, plan.sizes, plan.repeat, checks)
    finally:
        rig.close()

    bw_bytes = max((BANDWIDTH_CASES[c].page_bytes() * plan.bw_pages for c in plan.bw_cases), default=0)
    overhead_bytes = 4 * max_pages * OVERHEAD_GEOMETRY.page_bytes()
    capacity = max(256 << 20, 2 * (bw_bytes + overhead_bytes))
    with embedded_server(capacity) as server:
        phase("own overhead, embedded store")
        rig = OverheadRig("embedded", max_pages, pool=pool)
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
        result["embedded_stats"] = server.stats()
    del pool, rig
    gc.collect()

    phase("")
    gc.unfreeze()
    result["phases_seconds"] = phases
    for client in ("null", "embedded"):
        result["scaling"][client] = scaling(result["overhead"], client)
    result["goals"] = evaluate_goals(result)
    result["checks"] = {"ok": checks.ok, "verified": checks.items, "failures": checks.failures}
    result["seconds"] = time.perf_counter() - t_start
    return result


# -- output ---------------------------------------------------------------------------------------------------


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None or v != v:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def render(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    m = result["machine"]
    console.print(
        f"[bold]sglang-simm bench[/bold]  {m['cpu']}, {m['usable_cores']} cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads), SGLang {m['sglang']}"
    )
    s = result["settings"]
    console.print(
        f"median of {s['repeat']} samples per point; overhead pages: {s['overhead_page_tokens']} tokens, "
        f"{s['overhead_page_bytes'] // 1024} KiB (2 objects)"
    )
    titles = {
        "null": "Own overhead per call, null client (only the backends' work)",
        "embedded": "Per call on the embedded store (backend + store)",
    }
    for client in ("null", "embedded"):
        rows = [r for r in result["overhead"] if r["client"] == client]
        if not rows:
            continue
        t = Table(title=titles[client], title_justify="left")
        t.add_column("op")
        t.add_column("pages", justify="right")
        t.add_column("in-tree\nus/call", justify="right")
        t.add_column("ours\nus/call", justify="right")
        t.add_column("in-tree\nus/page", justify="right")
        t.add_column("ours\nus/page", justify="right")
        t.add_column("in-tree\n/ ours", justify="right")
        last_op = None
        for r in rows:
            if last_op is not None and r["op"] != last_op:
                t.add_section()
            last_op = r["op"]
            t.add_row(r["op"], str(r["pages"]), _fmt(r["intree_us"]), _fmt(r["ours_us"]),
                      _fmt(r["intree_us_per_page"], 3), _fmt(r["ours_us_per_page"], 3),
                      f"{r['ratio']:.2f}x")
        console.print(t)
    if result["bandwidth"]:
        t = Table(title="Bandwidth, ours on the embedded store vs torch copy of the same bytes",
                  title_justify="left")
        for name in ("case", "object", "pages", "MiB\n/call", "set\nGB/s", "get\nGB/s", "torch\nGB/s",
                     "set /\ntorch", "get /\ntorch"):
            t.add_column(name, justify="left" if name == "case" else "right")
        for r in result["bandwidth"]:
            obj = "/".join(f"{b / (1 << 20):.3g} MiB" if b >= 1 << 20 else f"{b // 1024} KiB"
                           for b in r["object_bytes"])
            t.add_row(r["case"], obj, str(r["pages"]), f"{r['bytes'] / (1 << 20):.0f}",
                      _fmt(r["set_gbps"]), _fmt(r["get_gbps"]), _fmt(r["torch_gbps"]),
                      f"{r['set_ratio']:.0%}", f"{r['get_ratio']:.0%}")
        console.print(t)
    for client, sc in result["scaling"].items():
        if not sc:
            continue
        sizes = list(next(iter(sc.values()))["us_per_page"])
        t = Table(title=f"Scaling: our us per page vs pages per call ({client})", title_justify="left")
        t.add_column("op")
        for n in sizes:
            t.add_column(n, justify="right")
        t.add_column("max/min", justify="right")
        for op, v in sc.items():
            t.add_row(op, *[_fmt(v["us_per_page"].get(n), 3) for n in sizes], f"{v['max_over_min']:.2f}x")
        console.print(t)
    t = Table(title="Goals", title_justify="left")
    t.add_column("goal")
    t.add_column("target", justify="right")
    t.add_column("measured", justify="right")
    t.add_column("", justify="left")
    for g in result["goals"]:
        v = g["value"]
        shown = "-" if v is None else (f"{v:.0%}" if g["unit"] == "%" else f"{_fmt(v)}{' us' if g['unit'] == 'us' else 'x'}")
        status = "[dim]not measured[/dim]" if g["met"] is None else ("[green]met[/green]" if g["met"] else "[red]missed[/red]")
        t.add_row(g["goal"], g["target"], shown, status)
    console.print(t)
    c = result["checks"]
    if c["ok"]:
        console.print(f"[green]results verified[/green]: {len(c['verified'])} checks "
                      "(pages stored, found and read by both backends; bytes read back compared)")
    else:
        console.print(f"[red]result checks failed[/red]: {'; '.join(c['failures'][:10])}")
    console.print(f"[dim]{result['seconds']:.1f} s[/dim]")


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise OSError(f"--plot needs matplotlib ({exc}): pip install 'sglang-simm[bench]'") from exc
    clients = [c for c in ("null", "embedded") if any(r["client"] == c for r in result["overhead"])]
    ncols = len(clients) + (1 if result["bandwidth"] else 0)
    fig, axes = plt.subplots(1, max(1, ncols), figsize=(5.5 * max(1, ncols), 4.2), squeeze=False)
    colors = {"set": "tab:blue", "exists": "tab:green", "get": "tab:orange"}
    for ax, client in zip(axes[0], clients):
        for op in OPS:
            rows = [r for r in result["overhead"] if r["client"] == client and r["op"] == op]
            if not rows:
                continue
            x = [r["pages"] for r in rows]
            ax.plot(x, [r["ours_us_per_page"] for r in rows], "-o", color=colors[op], label=f"{op} ours")
            ax.plot(x, [r["intree_us_per_page"] for r in rows], "--x", color=colors[op], label=f"{op} in-tree")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["pages"] for r in result["overhead"] if r["client"] == client})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("pages per call")
        ax.set_ylabel("us per page")
        ax.set_title(f"{client} client" if client == "null" else "embedded store")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if result["bandwidth"]:
        ax = axes[0][len(clients)]
        rows = result["bandwidth"]
        x = np.arange(len(rows))
        w = 0.27
        ax.bar(x - w, [r["set_gbps"] for r in rows], w, label="set (ours)")
        ax.bar(x, [r["get_gbps"] for r in rows], w, label="get (ours)")
        ax.bar(x + w, [r["torch_gbps"] for r in rows], w, label="torch copy")
        ax.set_xticks(x, [r["case"] for r in rows])
        ax.set_ylabel("GB/s")
        ax.set_title("bandwidth, embedded store")
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"sglang-simm bench: {m['cpu']}, {m['usable_cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(console: Any, args: Any) -> int:
    """The ``bench`` command. 0 when every result checked out, 1 if not.

    Goals are reported, not enforced (a noisy machine should not fail a run).
    """
    plan = plan_from_args(args)
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise OSError(f"--plot needs matplotlib ({exc}): pip install 'sglang-simm[bench]'") from exc
    with console.status("bench") as status:
        result = run(plan, progress=lambda text: status.update(f"bench: {text}"))
    render(console, result)
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        console.print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if result["checks"]["ok"] else 1
