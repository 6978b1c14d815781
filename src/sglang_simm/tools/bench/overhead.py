"""Measurement 1 and 3: each backend's own cost per call, ours against the in-tree one, and how ours scales.

``set`` is timed on pages not yet stored, every call on new page keys (its
mexists answers False, then mput runs); ``exists`` and ``get`` on stored
pages. Ours and the in-tree backend alternate sample by sample.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sglang_simm.tools.bench.backends import make_intree, make_ours, set_exists_answer
from sglang_simm.tools.bench.checks import Checks, check_result
from sglang_simm.tools.bench.pages import bytes_of, host_indices, page_keys
from sglang_simm.tools.bench.timing import median, time_samples
from sglang_simm.tools.pools import ModelGeometry, build_host_pool

OPS = ("set", "exists", "get")

#: The overhead part's page: SGLang's usual 64 tokens, 2 x 32 KiB objects,
#: so 2 x 1024 pages (source and destination) fit in 128 MiB.
OVERHEAD_GEOMETRY = ModelGeometry("bench-64k", layer_num=1, head_num=2, head_dim=128, page_size=64)

#: Distinct page keys the set measurement cycles through.
FRESH_KEYS = 1 << 17


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
                set_exists_answer(b, False)
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
                set_exists_answer(b, op != "set")

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
