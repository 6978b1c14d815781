"""What SiMM's native views and batch calls cost next to the null client's.

    benchmarks/native_views/measure.py [--python PY] [--repeat 200] [--json PATH]

``sglang_simm_dev.nullkv`` stands in for SiMM with pure-Python "native"
classes (a ``DataView`` with ``__slots__`` and an ``__init__``, a
``KVStore`` whose batch calls return a list). SiMM's are nanobind classes.
This builds ``views.cpp`` (same class names, constructors and batch-call
signatures as SiMM's ``_kv``, calls that touch no memory) for the timing
interpreter and times both, case by case, interleaved repeat by repeat:

1. one ``DataView(ptr, size, mr)``;
2. ``list(map(DataView, ptrs, sizes, mrs))`` for 2, 16, 256 objects (our
   backend's way of making views);
3. ``KVStore.MPut`` / ``MGet`` / ``MExists`` on prebuilt views and keys;
4. the in-tree backend's path, SiMM's Python layer (``BlockView`` wrapping
   one view, ``Store.mput`` unwrapping them in a loop) over each native
   layer, against ours (native views, ``_impl.MPut``), 256 objects.

Each repeat runs a case ``number`` times with gc off (as timeit does) and
takes both the wall clock and the thread's CPU clock; min and median per
call over the repeats. Run it with the interpreter the bench uses (the
module is built for it); it runs again under that one if started elsewhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_PYTHON = "/work/main/.venv-test/bin/python"
SIZES = (2, 16, 256)


def build(python: str) -> Path:
    out = subprocess.run([str(HERE / "build.sh"), python], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def python_layer(native: Any) -> tuple[type, type]:
    """SiMM's public Python layer, written the way ``simm/kv/__init__.py``
    is: a ``BlockView`` holding one native view, made by a classmethod, and a
    ``Store`` over a native ``KVStore`` that unwraps views in a loop."""

    class BlockView:
        __slots__ = ("_data",)

        def __init__(self, data: Any) -> None:
            self._data = data

        @classmethod
        def from_buffer(cls, buf_ptr: int, buf_size: int, mr_ext: Any) -> "BlockView":
            return BlockView(native.DataView(buf_ptr, buf_size, mr_ext))

    class Store:
        def __init__(self) -> None:
            self._impl = native.KVStore()

        def mput(self, keys: list[str], blocks: list[BlockView]) -> list[int]:
            datas = []
            for block in blocks:
                datas.append(block._data)
            return self._impl.MPut(keys, datas)

    return BlockView, Store


def compile_case(stmt: str, namespace: dict[str, Any]) -> Callable[[int], None]:
    """``stmt`` in a loop, as a function, so only the statement is timed."""
    src = f"def _run(_n):\n    for _ in range(_n):\n        {stmt}\n"
    exec(compile(src, "<case>", "exec"), namespace)
    return namespace["_run"]


def time_cases(cases: dict[str, Callable[[int], None]], repeat: int, target_s: float) -> dict[str, dict[str, float]]:
    numbers = {}
    for name, run in cases.items():  # calibrate: about target_s per repeat
        n = 1
        while True:
            t0 = time.perf_counter()
            run(n)
            if time.perf_counter() - t0 >= target_s / 4 or n >= 1 << 20:
                break
            n *= 2
        numbers[name] = max(1, int(n * target_s / max(time.perf_counter() - t0, 1e-9)))
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):  # interleaved: every case once per round
            for name, run in cases.items():
                n = numbers[name]
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                run(n)
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                wall[name].append((t1 - t0) / n)
                cpu[name].append((c1 - c0) / n)
    finally:
        if gc_was:
            gc.enable()
    return {
        name: {
            "number": numbers[name],
            "wall_min_ns": min(wall[name]),
            "wall_median_ns": statistics.median(wall[name]),
            "cpu_min_ns": min(cpu[name]),
            "cpu_median_ns": statistics.median(cpu[name]),
        }
        for name in cases
    }


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    version_file = HERE / "build" / "nanobind-version.txt"  # written by build.sh
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "nanobind": version_file.read_text().strip() if version_file.exists() else "unknown",
    }


def run(repeat: int, target_s: float) -> dict[str, Any]:
    import _nullkv_native as nb_kv

    from sglang_simm_dev import nullkv

    layers = {"nanobind": nb_kv, "null": nullkv._kv}
    mrs_of = {"nanobind": nb_kv.register_mr(1 << 20, 1 << 30), "null": nullkv.MrExt(1 << 20, 1 << 30)}
    cases: dict[str, Callable[[int], None]] = {}
    for impl, native in layers.items():
        mr = mrs_of[impl]
        ns: dict[str, Any] = {"DV": native.DataView, "mr": mr, "p": 1 << 21, "s": 65536}
        cases[f"{impl}:view:1"] = compile_case("DV(p, s, mr)", ns)
        for n in SIZES:
            ptrs = [(1 << 21) + i * 65536 for i in range(n)]
            keys = [f"{i:064x}" for i in range(n)]
            impl_store = native.KVStore()
            bv, store_cls = python_layer(native) if impl == "nanobind" else (nullkv.BlockView, nullkv.Store)
            store = store_cls()
            ns = {
                "DV": native.DataView,
                "ptrs": ptrs,
                "sizes": [65536] * n,
                "mrs": [mr] * n,
                "mr": mr,
                "keys": keys,
                "views": [native.DataView(p, 65536, mr) for p in ptrs],
                "impl": impl_store,
                "BV": bv,
                "store": store,
            }
            cases[f"{impl}:map:{n}"] = compile_case("list(map(DV, ptrs, sizes, mrs))", ns)
            cases[f"{impl}:MPut:{n}"] = compile_case("impl.MPut(keys, views)", ns)
            cases[f"{impl}:MGet:{n}"] = compile_case("impl.MGet(keys, views)", ns)
            cases[f"{impl}:MExists:{n}"] = compile_case("impl.MExists(keys)", ns)
            if n == 256:
                cases[f"{impl}:in-tree:{n}"] = compile_case(
                    "store.mput(keys, [BV.from_buffer(q, z, mr) for q, z in zip(ptrs, sizes)])", ns
                )
                if impl == "null":  # control: this script's Python layer over the null's native one
                    mbv, mstore = python_layer(native)
                    ns_m = dict(ns, BV=mbv, store=mstore())
                    cases["null:in-tree-mirror:256"] = compile_case(
                        "store.mput(keys, [BV.from_buffer(q, z, mr) for q, z in zip(ptrs, sizes)])", ns_m
                    )
                cases[f"{impl}:ours:{n}"] = compile_case(
                    "store._impl.MPut(keys, list(map(DV, ptrs, sizes, mrs)))", ns
                )
    # same answers from both, so both do the work the table says
    for impl, native in layers.items():
        mr = mrs_of[impl]
        v = [native.DataView(4096, 100, mr), native.DataView(8192, 7, mr)]
        assert list(native.KVStore().MGet(["a", "b"], v)) == [100, 7], impl
        assert list(native.KVStore().MPut(["a", "b"], v)) == [0, 0], impl
    timings = time_cases(cases, repeat, target_s)
    tracked = {
        impl: {
            "DataView": gc.is_tracked(native.DataView(4096, 1, mrs_of[impl])),
            "MrExt": gc.is_tracked(mrs_of[impl]),
        }
        for impl, native in layers.items()
    }
    tracked["nanobind"]["BlockView (Python layer)"] = gc.is_tracked(python_layer(nb_kv)[0](None))
    tracked["null"]["BlockView (Python layer)"] = gc.is_tracked(nullkv.BlockView(None))
    return {"null_client": nullkv.__file__, "timings": timings, "gc_tracked": tracked}


ORDER = [("view", 1)] + [(c, n) for c in ("map", "MPut", "MGet", "MExists") for n in SIZES]
ORDER += [("in-tree", 256), ("ours", 256)]
WHAT = {
    "view": "`DataView(ptr, size, mr)`",
    "map": "`list(map(DataView, ptrs, sizes, mrs))`",
    "MPut": "`KVStore.MPut(keys, views)`",
    "MGet": "`KVStore.MGet(keys, views)`",
    "MExists": "`KVStore.MExists(keys)`",
    "in-tree": "`store.mput(keys, [BlockView.from_buffer(...) ...])`",
    "ours": "`store._impl.MPut(keys, list(map(DataView, ...)))`",
}


def table(result: dict[str, Any]) -> str:
    t = result["timings"]
    lines = [
        "| call | n | nanobind min / median (CPU) | null min / median (CPU) | null / nanobind (median) |",
        "|---|---|---|---|---|",
    ]

    def cell(d: dict[str, float]) -> str:
        def us(x: float) -> str:
            return f"{x / 1000:.2f}" if x < 10_000 else f"{x / 1000:.1f}"
        return f"{us(d['wall_min_ns'])} / {us(d['wall_median_ns'])} ({us(d['cpu_median_ns'])})"

    for case, n in ORDER:
        a, b = t[f"nanobind:{case}:{n}"], t[f"null:{case}:{n}"]
        ratio = b["wall_median_ns"] / a["wall_median_ns"]
        lines.append(f"| {WHAT[case]} | {n} | {cell(a)} | {cell(b)} | {ratio:.2f} |")
    r = result["in_tree_over_ours"]
    lines.append("")
    lines.append(
        "In-tree / ours at 256 objects, wall min | thread CPU median: "
        + "; ".join(f"{impl} {r[impl]['wall_min']:.2f} | {r[impl]['cpu_median']:.2f}" for impl in r)
        + "."
    )
    m = t["null:in-tree-mirror:256"]
    lines.append(
        "Control: this script's Python layer over the null's native layer, 256 objects: "
        f"{m['wall_min_ns'] / 1000:.1f} / {m['wall_median_ns'] / 1000:.1f} µs (min / median), "
        "against the null's own BlockView/Store in the in-tree row."
    )
    g = result["gc_tracked"]
    lines.append(
        "gc.is_tracked: "
        + "; ".join(f"{impl}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for impl, d in g.items())
        + "."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=DEFAULT_PYTHON, help="the interpreter to build for and time with")
    ap.add_argument("--repeat", type=int, default=200, help="repeats per case (min and median over them)")
    ap.add_argument("--target-ms", type=float, default=2.0, help="about this long per repeat")
    ap.add_argument("--json", default=str(REPO / "benchmarks/results/native-views.json"))
    ap.add_argument("--no-build", action="store_true", help="use the module already in build/")
    args = ap.parse_args()
    # a venv's python is a link to its base interpreter: compare the paths, not their targets
    if Path(sys.executable).absolute() != Path(args.python).absolute() and not os.environ.get("_NATIVE_VIEWS_CHILD"):
        env = dict(os.environ, _NATIVE_VIEWS_CHILD="1")
        # a PYTHONPATH given first: it may name another tree's null client
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO / "src")]))
        sys.exit(subprocess.call([args.python, __file__, *sys.argv[1:]], env=env))
    build_dir = HERE / "build" if args.no_build else build(args.python)
    sys.path.insert(0, str(build_dir))
    result = {"machine": machine(), "repeat": args.repeat, "target_ms": args.target_ms}
    result.update(run(args.repeat, args.target_ms / 1000))
    t = result["timings"]
    # the ratio the per-call bench reports, on the figures least moved by a shared machine
    result["in_tree_over_ours"] = {
        impl: {
            stat: t[f"{impl}:in-tree:256"][f"{stat}_ns"] / t[f"{impl}:ours:256"][f"{stat}_ns"]
            for stat in ("wall_min", "cpu_median")
        }
        for impl in ("nanobind", "null")
    }
    m = result["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, load {m['load'][0]:.1f}; CPython {m['python']}, nanobind {m['nanobind']}")
    print("µs per call, wall min / median over repeats, (thread CPU median):\n")
    print(table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
