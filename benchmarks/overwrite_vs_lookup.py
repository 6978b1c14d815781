"""What a write of pages already stored costs against asking ``mexists`` first, on the local store.

    python benchmarks/overwrite_vs_lookup.py [--pages 128] [--repeat 9] [--release head|v0.1.0.post1]

Our zero-copy writes put every page without a lookup first (serving's
backups are new pages). This measures, on a local store of this run's own,
with 64 KiB pages (2 objects) from a real SGLang host pool, median of
``--repeat`` calls each:

* ``mexists``: the lookup a write would ask first (of pages not stored);
* ``mput new``: a put of pages not stored;
* ``mexists stored``: the lookup of the same pages, now stored;
* ``mput stored``: a put of pages already stored (SiMM HEAD deletes and
  re-puts them; the v0.1.0.post1 tag refuses them, -4005).

The lookup pays off only where a batch is mostly stored already and
``mput stored`` costs more than ``mexists`` + ``mput new`` of the rest.
A diagnostic, not part of the suite.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--release", default="head", choices=["head", "v0.1.0.post1"])
    args = parser.parse_args()

    from sglang_simm.backend import HiCacheSiMM
    from sglang_simm.local_store import reset_servers
    from sglang_simm_dev.bench.overhead import OVERHEAD_GEOMETRY as geom
    from sglang_simm_dev.bench.pages import fill_pool, host_indices, page_keys
    from sglang_simm_dev.pools import build_host_pool, storage_config

    name = f"overwrite-{uuid.uuid4().hex[:8]}"
    pool = build_host_pool(geom, tokens=args.pages * geom.page_size)
    fill_pool(pool)
    extra = {"manager_address": f"local://{name}", "local_store_capacity_bytes": 1 << 30,
             "client_flags": {"local_store_simm_release": args.release}}
    backend = HiCacheSiMM(storage_config(model_name=geom.name, extra_config=extra), pool)
    try:
        b, client = backend.pools.kv, backend.client
        idx = host_indices(list(range(args.pages)), geom.page_size)
        times: dict[str, list[float]] = {"mexists": [], "mput new": [], "mexists stored": [], "mput stored": []}
        for r in range(args.repeat):
            batch = b.batch(page_keys(args.pages, f"r{r}"), idx)
            keys, views = batch.keys, batch.views
            for what in times:
                t0 = time.perf_counter()
                codes = client.mexists(keys) if what.startswith("mexists") else client.mput(keys, views)
                times[what].append(time.perf_counter() - t0)
                if what == "mput new":
                    assert not any(codes), codes[:4]
        print(f"local store, {args.pages} pages of {geom.page_bytes() // 1024} KiB, SiMM {args.release}, "
              f"median of {args.repeat}:")
        for what, ts in times.items():
            print(f"  {what:12} {statistics.median(ts) * 1e6:9.0f} us")
    finally:
        backend.close()
        reset_servers(name)


if __name__ == "__main__":
    main()
