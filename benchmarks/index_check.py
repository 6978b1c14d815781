"""What the index check's refusal of repeated pages costs: ``page_starts`` with it and without, side by side.

    python benchmarks/index_check.py [--pages 1,8,64,65,128,1024] [--repeat 9]

``geometry.page_starts`` checks that a batch's host indices are distinct,
whole, page-aligned pages inside the pool. This times it on SGLang-shaped
indices (64-slot pages, shuffled over a pool of 65,536 pages, int64, as
the controller hands them over) against ``without_repeat_check`` below: the
same check with the distinctness test taken out (the pool bound then needs
a ``min``/``max`` of its own). Samples of both alternate; thread CPU time,
median of ``--repeat`` samples of a few thousand calls. A diagnostic, not
part of the suite.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from sglang_simm.geometry import _ramps, page_starts


def without_repeat_check(host_indices: np.ndarray, page_size: int, num_keys: int, slots: int) -> np.ndarray | None:
    """``page_starts`` less its test that page starts are distinct."""
    if host_indices.ndim != 1 or host_indices.dtype.kind not in "iu":
        return None
    if host_indices.shape[0] != num_keys * page_size:
        return None
    starts = host_indices[::page_size]
    if num_keys <= 64:
        first = starts.tolist()
        if any(slot % page_size for slot in first):
            return None
        if min(first) < 0 or max(first) >= slots:
            return None
    else:
        if (starts % page_size).any():
            return None
        if starts.min() < 0 or starts.max() >= slots:
            return None
    if page_size > 1:
        offsets = (host_indices - first[0] if num_keys == 1
                   else host_indices.reshape(num_keys, page_size) - starts[:, None])
        if not _ramps(offsets.dtype, page_size, num_keys).startswith(offsets.data):
            return None
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="1,8,64,65,128,1024")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    page, pool_pages = 64, 1 << 16
    print(f"page_starts, {page}-slot pages, median of {args.repeat} samples (thread CPU time):")
    print(f"{'pages':>6} {'with':>9} {'without':>9} {'check costs':>12}")
    for n in (int(x) for x in args.pages.split(",")):
        order = np.random.default_rng(n).permutation(pool_pages)[:n]
        idx = (order[:, None] * page + np.arange(page)[None, :]).ravel().astype(np.int64)
        slots = pool_pages * page
        assert page_starts(idx, page, n, slots) is not None
        assert without_repeat_check(idx, page, n, slots) is not None
        calls = max(200, 20000 // n)
        fns = {"with": lambda: page_starts(idx, page, n, slots),
               "without": lambda: without_repeat_check(idx, page, n, slots)}
        samples: dict[str, list[float]] = {k: [] for k in fns}
        gc.disable()
        try:
            for r in range(args.repeat + 1):
                for name in (list(fns) if r % 2 else list(fns)[::-1]):
                    fn = fns[name]
                    t0 = time.thread_time()
                    for _ in range(calls):
                        fn()
                    if r:
                        samples[name].append((time.thread_time() - t0) / calls)
        finally:
            gc.enable()
        w, wo = (statistics.median(samples[k]) * 1e6 for k in ("with", "without"))
        print(f"{n:>6} {w:>8.2f}us {wo:>8.2f}us {w - wo:>+10.2f}us")


if __name__ == "__main__":
    main()
