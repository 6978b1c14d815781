"""Measurement 1 and 3: each backend's own cost per call, ours against the in-tree one, and how ours scales.

The calls follow serving's pattern of keys, so no cache of keys (ours keeps
the object keys of pages it looked up) sees a page twice unless serving
would:

* ``set``: pages not stored yet, new keys every call (a backup writes new
  pages); its ``mexists`` answers False, then ``mput`` runs;
* ``exists``: new keys every call (a request's first lookup);
* ``get``: new keys, each batch looked up by ``batch_exists`` first (untimed),
  as the prefetch thread does before its I/O thread reads the same pages;
* ``get-cold``: new keys never looked up (a read with no lookup before it).

On the null client the host pages are new every call too: each call takes
the next pages of a shuffled pool, round and round (``PageRing``), as
SGLang's host allocator hands out slots first-in first-out from its free
list, so a page comes back only after the whole pool. The pool
(``NULL_GEOMETRY``, ``FRESH_HOST_PAGES``) holds more pages than any cache
of ours keeps views for, so no cache of views meets a page again within
the pool's turn, as in serving. (A rig of fixed pages let our view cache
answer every call from the second on; that hid the cost of making views.)

On the null client a sample loops calls for about a millisecond and is
timed in this thread's CPU time; on the local store (``local``, the store
every process of a host shares) a sample is one call, timed in wall time,
after an untimed step that stores its pages. Ours and the in-tree backend
alternate sample by sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sglang_simm_dev.bench.backends import make_intree, make_ours, set_exists_answer
from sglang_simm_dev.bench.checks import Checks, check_result
from sglang_simm_dev.bench.pages import KeyRing, bytes_of, host_indices, page_keys
from sglang_simm_dev.bench.timing import Timer, median, spread, time_samples
from sglang_simm_dev.pools import ModelGeometry, build_host_pool

#: Distinct page keys per backend: the ring wraps around only after this
#: many, so every call meets keys new to it, as serving's do.
RING_KEYS = 1 << 16

OPS = ("set", "exists", "get", "get-cold")

#: What each operation's row measures (tables, JSON, README).
OP_MEANING = {
    "set": "new pages, new keys every call",
    "exists": "new keys every call",
    "get": "new keys, after a batch_exists of the same keys",
    "get-cold": "new keys, no lookup before",
}

#: The overhead part's page: SGLang's usual 64 tokens, 2 x 32 KiB objects,
#: so 2 x 1024 pages (source and destination) fit in 128 MiB.
OVERHEAD_GEOMETRY = ModelGeometry("bench-64k", layer_num=1, head_num=2, head_dim=128, page_size=64)

#: The null client's pages: it touches no memory, so pages of 2 x 1 KiB
#: (SGLang's 64 tokens) let a pool hold ``FRESH_HOST_PAGES`` in 128 MiB.
NULL_GEOMETRY = ModelGeometry("bench-null", layer_num=1, head_num=1, head_dim=8, page_size=64)
#: Pages of the null client's pool: half are the sources of sets, half
#: where gets land, each half four times the 8,192 pages (16,384 views) a
#: view cache of ours ever kept.
FRESH_HOST_PAGES = 1 << 16


class PageRing:
    """Host index tensors of ``n`` pages each, the next pages of ``pages``
    every call, wrapping around at the end (made ahead, untimed)."""

    def __init__(self, pages: Sequence[int], n: int, page_size: int):
        count = max(1, len(pages) // n)
        self.batches = [host_indices(pages[i * n:(i + 1) * n], page_size) for i in range(count)]
        self.pos = 0

    def take(self) -> torch.Tensor:
        t = self.batches[self.pos]
        self.pos = (self.pos + 1) % len(self.batches)
        return t


@dataclass
class Timed:
    """One operation of one backend, ready to time: ``fn`` is the call;
    ``setup()`` (before a single-call sample) or ``prepare(k)`` (before a
    sample of ``k`` calls) runs untimed."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    prepare: Callable[[int], Any] | None = None

    def ready(self) -> None:
        """What one untimed, verified call needs first."""
        if self.setup is not None:
            self.setup()
        if self.prepare is not None:
            self.prepare(1)


class OverheadRig:
    """One host pool, ours and the in-tree backend on one client (``null``
    or ``local``, the local store).

    Pages ``src`` (the source of sets) and ``dst`` (where gets land) are
    disjoint and shuffled like a real pool's. Each backend draws its page
    keys from its own ring of distinct keys (``KeyRing``) and, with
    ``rotate`` (the null client's default), its host pages from its own
    ``PageRing`` over the whole of ``src`` or ``dst``; without it every
    call of ``n`` pages uses the first ``n``.
    """

    def __init__(self, client: str, max_pages: int, *, geom: ModelGeometry = OVERHEAD_GEOMETRY,
                 pool: Any = None, seed: int = 1, rotate: bool | None = None):
        self.client = client
        self.rotate = client == "null" if rotate is None else rotate
        self.geom = geom
        self.max_pages = max_pages
        self.pool = pool if pool is not None else build_host_pool(geom, tokens=max_pages * geom.page_size)
        host_pages = int(self.pool.size) // geom.page_size
        if host_pages < 2 * max_pages:
            raise ValueError(f"host pool of {host_pages} pages cannot hold 2 x {max_pages}")
        perm = np.random.default_rng(seed).permutation(host_pages)
        half = host_pages // 2 if self.rotate else max_pages
        self.src_pages = perm[:half].tolist()
        self.dst_pages = perm[half: 2 * half].tolist()
        self.backends = {"ours": make_ours(self.pool, geom, client), "in-tree": make_intree(self.pool, geom, client)}
        keys = page_keys(RING_KEYS + 2 * max_pages, f"fresh-{client}")
        self.rings = {name: KeyRing(keys) for name in self.backends}
        #: the CPU time of this thread for the null client (all its work is
        #: here); wall time on the store (copies on other threads, a store process)
        self.timer: Timer = time.thread_time if client == "null" else time.perf_counter
        self._staged: dict[str, list[str]] = {}
        self._page_rings: dict[tuple[str, str, int], PageRing] = {}

    def page_ring(self, name: str, which: str, n: int) -> PageRing:
        """``name``'s ring of ``n``-page batches over ``src`` or ``dst``."""
        key = (name, which, n)
        ring = self._page_rings.get(key)
        if ring is None:
            pages = self.src_pages if which == "src" else self.dst_pages
            ring = self._page_rings[key] = PageRing(pages, n, self.geom.page_size)
        return ring

    def server(self) -> Any:
        return self.backends["ours"].client.store.server

    def indices(self, n: int, which: str = "src") -> torch.Tensor:
        pages = self.src_pages if which == "src" else self.dst_pages
        return host_indices(pages[:n], self.geom.page_size)

    def check_clients(self, checks: Checks) -> None:
        """Both backends talk to the client under test through the ``simm.kv`` surface."""
        expected = "sglang_simm_dev.nullkv" if self.client == "null" else "sglang_simm.local_store._kv"
        for name, store in (("ours", self.backends["ours"].client.store),
                            ("in-tree", self.backends["in-tree"].store)):
            module = type(store).__module__
            checks.expect(f"{self.client}/{name}/client", module == expected,
                          f"its store is a {module}.{type(store).__name__}, expected one from {expected}")

    def prepare(self, op: str) -> None:
        """Null client: the answer that sends each op down its full path."""
        if self.client == "null":
            for b in self.backends.values():
                set_exists_answer(b, op != "set")

    def call(self, name: str, op: str, n: int) -> Timed:
        """One operation of one backend on ``n`` pages, ready to time."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
        b = self.backends[name]
        src, dst = self.indices(n, "src"), self.indices(n, "dst")
        if self.client != "null":
            return self._staged_call(name, op, n, src, dst)
        ring = self.rings[name]
        if op == "exists":
            return Timed(lambda: b.batch_exists(ring.take(n)))
        if self.rotate:
            pages = self.page_ring(name, "src" if op == "set" else "dst", n)
            if op == "set":
                return Timed(lambda: b.batch_set_v1(ring.take(n), pages.take()))
            fn = lambda: b.batch_get_v1(ring.take(n), pages.take())  # noqa: E731
            return Timed(fn, prepare=self._looked_up(name, n) if op == "get" else None)
        if op == "set":
            return Timed(lambda: b.batch_set_v1(ring.take(n), src))
        fn = lambda: b.batch_get_v1(ring.take(n), dst)  # noqa: E731
        return Timed(fn, prepare=self._looked_up(name, n) if op == "get" else None)

    def _looked_up(self, name: str, n: int) -> Callable[[int], None]:
        """``prepare(k)``: ``batch_exists`` of the next ``k`` batches, as the
        prefetch thread looks up what its I/O thread then reads."""
        b, ring = self.backends[name], self.rings[name]

        def prepare(k: int) -> None:
            for keys in ring.peek(k, n):
                b.batch_exists(keys)

        return prepare

    def _staged_call(self, name: str, op: str, n: int, src: torch.Tensor, dst: torch.Tensor) -> Timed:
        """On the store: every sample is one call on new keys. Before a set
        nothing else happens: the store keeps what earlier samples wrote (a
        serving store is never emptied before a backup; emptying it gives its
        memory back, and each set then paid for faulting fresh memory in,
        25 ms a call). Before an exists or a get the store is emptied and the
        pages stored by the same backend (its writes fill no cache), then
        (get) looked up."""
        b, ring, staged = self.backends[name], self.rings[name], self._staged
        server = self.server()

        def setup() -> None:
            if op != "set":
                server.clear()
            keys = staged[name] = ring.take(n)
            if op != "set":
                b.batch_set_v1(keys, src)
            if op == "get":
                b.batch_exists(keys)

        if op == "set":
            fn = lambda: b.batch_set_v1(staged[name], src)  # noqa: E731
        elif op == "exists":
            fn = lambda: b.batch_exists(staged[name])  # noqa: E731
        else:
            fn = lambda: b.batch_get_v1(staged[name], dst)  # noqa: E731
        return Timed(fn, setup=setup)

    def verify_bytes(self, checks: Checks, n: int) -> None:
        """After gets into ``dst``, those pages hold the ``src`` pages' bytes."""
        buf = bytes_of(self.pool.kv_buffer).numpy()
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
        if self.client != "null":
            try:
                self.server().clear()
            except Exception:
                pass
        for b in self.backends.values():
            try:
                b.close()
            except Exception:  # the in-tree backend has no close() worth trusting
                pass


def check_call(checks: Checks, rig: OverheadRig, name: str, op: str, timed: Timed, n: int) -> None:
    timed.ready()
    check_result(checks, f"{rig.client}/{name}/{op}", op, timed.fn(), n)


def measure_overhead(rig: OverheadRig, sizes: Sequence[int], repeat: int, checks: Checks,
                     *, warmup: int = 2, ops: Sequence[str] = OPS) -> list[dict[str, Any]]:
    """Rows of per-call cost, ours and in-tree, for each op and batch size."""
    rows = []
    rig.check_clients(checks)
    for op in ops:
        rig.prepare(op)
        for n in sizes:
            timed = {name: rig.call(name, op, n) for name in rig.backends}
            for name, t in timed.items():  # one verified call each, untimed
                check_call(checks, rig, name, op, t, n)
            samples = time_samples(
                {name: t.fn for name, t in timed.items()}, repeat=repeat, warmup=warmup, timer=rig.timer,
                setup={name: t.setup for name, t in timed.items() if t.setup is not None},
                prepare={name: t.prepare for name, t in timed.items() if t.prepare is not None},
            )
            ours, intree = median(samples["ours"]), median(samples["in-tree"])
            rows.append({
                "client": rig.client, "op": op, "pages": n,
                "ours_us": ours * 1e6, "intree_us": intree * 1e6,
                "ours_us_per_page": ours * 1e6 / n, "intree_us_per_page": intree * 1e6 / n,
                "ratio": intree / ours if ours > 0 else float("nan"),
                "ours_spread": spread(samples["ours"]), "intree_spread": spread(samples["in-tree"]),
                "samples": len(samples["ours"]),
                "clock": "thread_time" if rig.timer is time.thread_time else "perf_counter",
            })
            for name, t in timed.items():  # and once more after the timing
                check_call(checks, rig, name, op, t, n)
        if op in ("get", "get-cold") and rig.client != "null":
            rig.verify_bytes(checks, max(sizes))
    return rows


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
