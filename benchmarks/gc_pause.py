"""How long a full garbage collection takes with a large host pool attached and every page touched.

    python benchmarks/gc_pause.py [--pages 1048576] [--repeat 5] [--json PATH]

The backend lives in SGLang's scheduler process, where a full collection
stalls every request. This builds a real SGLang host pool of ``--pages``
pages (one-slot pages of 32 bytes, so a million pages fit in tens of MiB),
then times ``gc.collect()`` (median of ``--repeat``) three times over:

* ``none``: the pool built, no backend;
* ``attached``: our backend attached to it (null client: no store);
* ``touched``: after a write, a lookup and a read of every page, in
  batches of 128 as SGLang's threads make them.

It also prints the number of objects the collector tracks at each step,
which is what a full collection walks. A diagnostic, not part of the suite.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np
import torch


def _collect_time(repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from sglang_simm_dev.bench.backends import make_ours
    from sglang_simm_dev.bench.pages import page_keys
    from sglang_simm_dev.pools import ModelGeometry, build_host_pool

    geom = ModelGeometry("gc-probe", layer_num=1, head_num=1, head_dim=8, page_size=1)
    pool = build_host_pool(geom, tokens=args.pages // 2, ratio=2.0)
    pages = int(pool.size) // geom.page_size
    rows = []

    def step(name: str) -> None:
        tracked = len(gc.get_objects())
        seconds = _collect_time(args.repeat)
        rows.append({"step": name, "gc_collect_ms": seconds * 1e3, "tracked_objects": tracked})
        print(f"{name:>9}: full gc.collect() {seconds * 1e3:8.1f} ms, {tracked:>10,} objects tracked", flush=True)

    step("none")
    backend = make_ours(pool, geom, "null")
    step("attached")
    keys = page_keys(pages, "gc")
    batch = 128
    for lo in range(0, pages, batch):
        n = min(batch, pages - lo)
        idx = torch.from_numpy(np.arange(lo, lo + n, dtype=np.int64))
        backend.batch_set_v1(keys[lo:lo + n], idx)
        backend.batch_exists(keys[lo:lo + n])
        backend.batch_get_v1(keys[lo:lo + n], idx)
    del keys
    step("touched")
    backend.close()
    result = {"pages": pages, "page_bytes": geom.page_bytes(), "repeat": args.repeat, "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
