"""How fast this machine copies memory: the ceiling of any L3 read into SGLang's host pool.

    python benchmarks/copy_ceiling.py [--mib 24] [--object-kib 128] [--repeat 15] [--json PATH]

Every read from an L3 tier on the same host ends in a copy from the store's
memory into the host pool SGLang allocated (the local store's arena, Mooncake's
segment or transfer buffer, the ``file`` backend's page cache). So no backend
reads a batch faster than this machine copies it, and a goal of reading N
times faster than another backend cannot be met where that backend already
reads at more than 1/N of this ceiling.

It copies ``--mib`` (default 24: one 95-page read of the server bench's
16 KiB/token model) from shared memory (an anonymous ``MAP_SHARED`` mapping,
as the arena is) into a plain buffer, in objects of ``--object-kib``, with
``memmove`` letting the GIL go, on one thread and split over two, taking
turns; best and median of ``--repeat`` rounds each. Idle machine figures:
a server's scheduler shares the same cores. A diagnostic, not part of the
suite.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import threading
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=24)
    parser.add_argument("--object-kib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    size, chunk = args.mib << 20, args.object_kib << 10
    src = mmap.mmap(-1, size)
    np.frombuffer(src, np.uint8)[:] = 1  # faulted in, as a store's objects are
    dst = np.full(size, 2, np.uint8)
    src_at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_at = dst.ctypes.data
    memmove = ctypes.CDLL(None).memmove
    memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def copy(threads: int) -> float:
        share = size // threads

        def part(i: int) -> None:
            for at in range(i * share, (i + 1) * share, chunk):
                memmove(dst_at + at, src_at + at, min(chunk, size - at))

        workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    runs: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeat):
        for threads in (1, 2):
            runs[threads].append(copy(threads))
    if not (dst == 1).all():
        raise SystemExit("the copy did not copy: the destination differs from the source")
    gib = size / (1 << 30)
    result = {
        "bytes": size, "object_bytes": chunk, "repeat": args.repeat,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "threads": {
            str(t): {"best_ms": min(s) * 1e3, "median_ms": statistics.median(s) * 1e3,
                     "best_gib_s": gib / min(s), "median_gib_s": gib / statistics.median(s)}
            for t, s in runs.items()
        },
    }
    print(f"{args.mib} MiB in {args.object_kib} KiB objects, {os.cpu_count()} CPUs, "
          f"load {'/'.join(f'{x:.1f}' for x in result['machine']['load'])}")
    print("| threads | best ms | median ms | best GiB/s | median GiB/s |")
    print("|---|---|---|---|---|")
    for t, r in result["threads"].items():
        print(f"| {t} | {r['best_ms']:.2f} | {r['median_ms']:.2f} | {r['best_gib_s']:.1f} | {r['median_gib_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
