"""GIL releases, blocking waits and time of a backup and a restore on the local store.

``python -m sglang_simm_dev.bench.backup_gil [--pages 1,4,8,32,128] [--repeat 30]
[--before REV] [--rounds 2] [--json PATH]``

In a server, SGLang's backup and prefetch threads share the GIL with a busy
scheduler thread. Each time our client lets the GIL go (a socket call, a
``ctypes.memmove``: foreign calls that release it), taking it back can cost
up to ``sys.getswitchinterval()`` (5 ms) while the scheduler runs Python.
So this bench counts, for one ``batch_set_v1`` (backup) and one
``batch_get_v1`` (restore) per size, on a real SGLang host pool and our
backend over a local store in its own process:

* ``releases``: calls in our client that release the GIL (socket sends and
  receives, ``ctypes.memmove``); the copies and sends made holding it are
  counted apart (``held``);
* ``waits``: replies waited for (the first receive or held wait after a
  request is sent, however many receives the reply takes), and sends that
  found no room to write (a zero-timeout ``select`` first);

and times the same calls idle and beside a thread running pure Python
(``busy``), medians over ``--repeat`` calls per size. Counting runs apart
from timing (the counters' own ``select`` would be in the figures).

``--before REV[,REV...]`` runs the same bench on the local store client of
those git revisions (each one's ``src`` exported to a temporary directory,
this bench run from this tree), all trees taking turns ``--rounds`` times each, so
every column shares the machine's load; ``--before none`` measures this
tree only. Torch's own
GIL releases in the backend (outside the local store client) are not counted;
the busy time shows them with the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

from sglang_simm.local_store.admin import private_store_dir

DEFAULT_SIZES = (1, 4, 8, 32, 128)
OPS = ("backup", "restore")


class Counts:
    """What the client did during one call."""

    def __init__(self) -> None:
        self.releases = 0
        self.waits = 0
        self.held = 0

    def reset(self) -> None:
        self.releases = self.waits = self.held = 0


class CountingSocket:
    """Stands in for a connection's socket: every call that releases the GIL
    is counted. A wait is a reply the call cannot go on without: the first
    receive after a request is sent (however many receives that reply
    takes, and whatever earlier replies come with it), or a send that finds
    no room to write (checked with a zero-timeout ``select``)."""

    def __init__(self, sock: Any, counts: Counts) -> None:
        self._sock = sock
        self._counts = counts
        self._asked = False

    def _counted(self, name: str, write: bool) -> Callable[..., Any]:
        fn = getattr(self._sock, name)
        counts = self._counts

        def call(*args: Any, **kwargs: Any) -> Any:
            if write:
                _, w, _ = select.select([], [self._sock.fileno()], [], 0)
                if not w:
                    counts.waits += 1
                self._asked = True
            elif self._asked:
                counts.waits += 1
                self._asked = False
            counts.releases += 1
            return fn(*args, **kwargs)

        return call

    def sent_held(self) -> None:
        """A request sent without releasing the GIL (its reply is still a wait)."""
        self._asked = True

    def waited_held(self) -> None:
        """A wait for the reply that keeps the GIL: a wait, not a release."""
        if self._asked:
            self._counts.waits += 1
            self._asked = False

    def __getattr__(self, name: str) -> Any:
        if name in ("send", "sendall", "sendmsg"):
            return self._counted(name, True)
        if name in ("recv", "recv_into", "recvmsg"):
            return self._counted(name, False)
        return getattr(self._sock, name)


def _plugin_root() -> str:
    """The folder this process imports ``sglang_simm`` from (a tree's
    ``src``, or site-packages), for a child's ``PYTHONPATH``."""
    import sglang_simm

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang_simm.__file__)))


def _install_counters(server: Any, counts: Counts) -> Callable[[], None]:
    """Count the GIL releases of ``server``'s connection and of the copies;
    returns what undoes it."""
    from sglang_simm.local_store import _copy, _handle

    conn = server._current()
    real_sock = conn.sock
    conn.sock = CountingSocket(real_sock, counts)
    saved: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str, field: str, then: Callable[[], None] | None = None) -> None:
        fn = getattr(module, name, None)
        if fn is None:
            return

        def counted(*args: Any) -> Any:
            setattr(counts, field, getattr(counts, field) + 1)
            if then is not None:
                then()
            return fn(*args)

        saved.append((module, name, fn))
        setattr(module, name, counted)

    wrap(_copy, "_memmove", "releases")  # a CFUNCTYPE call: releases the GIL
    wrap(_copy, "_memmove_held", "held")  # a PyDLL call: keeps it
    wrap(_handle, "_send_held", "held", conn.sock.sent_held)  # MSG_DONTWAIT send through PyDLL: keeps it
    wrap(_handle, "_recv_held", "held")  # MSG_DONTWAIT receive through PyDLL: keeps it
    wrap(_handle, "_ppoll_held", "held", conn.sock.waited_held)  # a short wait for a reply through PyDLL: keeps it

    def undo() -> None:
        conn.sock = real_sock
        for module, name, fn in saved:
            setattr(module, name, fn)

    return undo


def measure(sizes: list[int], repeat: int, warmup: int = 5) -> dict[str, Any]:
    """Per size and op: releases, waits and held calls of one call (medians),
    and wall µs idle and busy (p10 / median / p90)."""
    import time

    from sglang_simm_dev.bench.pages import host_indices, page_keys
    from sglang_simm_dev.bench.server_backup import _backend, _quantiles, busy_thread

    pool_pages = max(sizes) * 4
    name = f"backup-gil-{os.getpid()}"
    out: dict[str, Any] = {"sizes": {}, "repeat": repeat, "switch_interval_s": sys.getswitchinterval()}
    with _backend(pool_pages, name) as (backend, geom):
        server = backend.client.store.server
        half = pool_pages // 2
        call = 0

        def one(n: int) -> tuple[Callable[[], list[bool]], Callable[[], list[bool]]]:
            nonlocal call
            keys = page_keys(n, f"{name}-{call}")
            first = (call * n) % (half - n + 1)
            src = host_indices(range(first, first + n), geom.page_size)
            dst = host_indices(range(half + first, half + first + n), geom.page_size)
            call += 1
            return (lambda: backend.batch_set_v1(keys, src)), (lambda: backend.batch_get_v1(keys, dst))

        def checked(what: str, n: int, row: list[bool]) -> None:
            if not all(row):
                raise RuntimeError(f"a {what} of {n} pages did {sum(row)}: the figures would mean nothing")

        counts = Counts()
        per: dict[tuple[int, str], dict[str, list[int]]] = {
            (n, op): {"releases": [], "waits": [], "held": []} for n in sizes for op in OPS}
        undo = _install_counters(server, counts)
        try:
            for r in range(3 + warmup):
                for n in sizes:
                    backup, restore = one(n)
                    for op, fn in (("backup", backup), ("restore", restore)):
                        counts.reset()
                        checked(op, n, fn())
                        if r >= warmup:
                            for field in ("releases", "waits", "held"):
                                per[(n, op)][field].append(getattr(counts, field))
        finally:
            undo()
        spins = [0]
        stalls: dict[tuple[int, str], list[float]] = {(n, op): [] for n in sizes for op in OPS}
        times: dict[tuple[int, str, bool], list[float]] = {
            (n, op, busy): [] for n in sizes for op in OPS for busy in (False, True)}
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for busy in (False, True):
                with busy_thread(busy, spins):
                    rate = 0.0
                    if busy:  # the busy thread's loops per µs with nothing beside it
                        s0, t0 = spins[0], time.perf_counter_ns()
                        time.sleep(0.3)
                        rate = (spins[0] - s0) / ((time.perf_counter_ns() - t0) / 1000)
                        out["busy_spins_per_us_alone"] = rate
                    t_busy = time.perf_counter()
                    for r in range(warmup + repeat):
                        for n in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:
                            backup, restore = one(n)
                            for op, fn in (("backup", backup), ("restore", restore)):
                                s0, t0 = spins[0], time.perf_counter_ns()
                                row = fn()
                                dt = (time.perf_counter_ns() - t0) / 1000
                                ran = spins[0] - s0
                                checked(op, n, row)
                                if r >= warmup:
                                    times[(n, op, busy)].append(dt)
                                    if busy and rate:
                                        stalls[(n, op)].append(max(dt - ran / rate, 0.0))
                    if busy:
                        out["busy_spins_per_ms"] = spins[0] / ((time.perf_counter() - t_busy) * 1000)
        finally:
            if gc_was:
                gc.enable()
        for n in sizes:
            entry: dict[str, Any] = {}
            for op in OPS:
                c = per[(n, op)]
                entry[op] = {
                    **{field: statistics.median(c[field]) for field in c},
                    "idle_us": _quantiles(times[(n, op, False)]),
                    "busy_us": _quantiles(times[(n, op, True)]),
                    # of the call's wall time, how long the busy thread did not run
                    "stall_us": _quantiles(stalls[(n, op)]),
                }
            out["sizes"][str(n)] = entry
    out["page_bytes"] = geom.page_bytes()
    out["load"] = os.getloadavg()
    return out


# -- before and after, taking turns ---------------------------------------------


def _export(rev: str, into: str) -> str:
    """``src`` of git revision ``rev`` under ``into``, the path to put on
    PYTHONPATH (this bench runs from this tree's ``sglang_simm_dev``)."""
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    archive = subprocess.run(["git", "-C", repo, "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "src")


def _child(src: str, sizes: list[int], repeat: int, path: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "sglang_simm_dev.bench.backup_gil", "--child", "--pages",
           ",".join(map(str, sizes)), "--repeat", str(repeat), "--json", path]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of one tree: counts and times are the
    medians of the runs' medians."""
    first = runs[0]
    out = {k: first[k] for k in ("page_bytes", "repeat", "switch_interval_s")}
    out["runs"] = len(runs)
    out["busy_spins_per_ms"] = statistics.median(r.get("busy_spins_per_ms", 0.0) for r in runs)
    out["sizes"] = {}
    for n in first["sizes"]:
        entry = {}
        for op in OPS:
            rows = [r["sizes"][n][op] for r in runs]
            entry[op] = {field: statistics.median(row[field] for row in rows) for field in ("releases", "waits", "held")}
            for clock in ("idle_us", "busy_us", "stall_us"):
                entry[op][clock] = statistics.median(row[clock]["median"] for row in rows)
                entry[op][clock + "_runs"] = [row[clock]["median"] for row in rows]
        out["sizes"][n] = entry
    return out


def render(results: dict[str, dict[str, Any]]) -> str:
    """A Markdown table: per size and op, each tree's releases, waits and
    median µs idle and busy."""
    names = list(results)
    head = "| pages | op | " + " | ".join(
        f"{t}: releases / waits | {t}: idle µs | {t}: busy µs | {t}: stall µs" for t in names) + " |"
    lines = [head, "|---|---|" + "---|---|---|---|" * len(names)]
    sizes = list(next(iter(results.values()))["sizes"])
    for n in sizes:
        for op in OPS:
            cells = []
            for t in names:
                e = results[t]["sizes"][n][op]
                cells.append(f"{e['releases']:g} / {e['waits']:g} | {e['idle_us']:.0f} | {e['busy_us']:.0f} | "
                             f"{e['stall_us']:.0f}")
            lines.append(f"| {n} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm_dev.bench.backup_gil",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pages", default=",".join(map(str, DEFAULT_SIZES)), help="pages per call (comma list)")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per size, op and mode (default 30)")
    parser.add_argument("--before", default="main",
                        help="git revisions (comma list) whose client is measured too, taking turns "
                             "(default main; 'none': skip)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated (default 2)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(p) for p in args.pages.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--pages takes a comma list of page counts, got {args.pages!r}")
    if not sizes or min(sizes) < 1 or args.repeat < 1 or args.rounds < 1:
        parser.error("--pages needs counts >= 1, --repeat and --rounds counts >= 1")
    if args.child:
        result = measure(sizes, args.repeat)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
        return 0
    here = _plugin_root()
    # the children's stores live in, and go with, a directory of this run's
    with tempfile.TemporaryDirectory(prefix="backup-gil-") as tmp, private_store_dir("sglang-simm-bench-"):
        trees: dict[str, str] = {}
        revs = [] if args.before == "none" else [r.strip() for r in args.before.split(",") if r.strip()]
        for i, rev in enumerate(revs):
            into = os.path.join(tmp, f"rev{i}")
            os.makedirs(into)
            trees[rev] = _export(rev, into)
        trees["after"] = here
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
        for r in range(args.rounds):
            for i, (t, src) in enumerate(list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                runs[t].append(_child(src, sizes, args.repeat, os.path.join(tmp, f"{r}-{i}.json")))
        results = {t: merge(rs) for t, rs in runs.items()}
    print(render(results))
    print("\nstall: of a busy call's wall time, how long the busy thread beside it did not run (its loops "
          "during the call against its rate alone): what the call cost a scheduler. The busy thread's loops "
          "per ms over the whole busy run: " + ", ".join(f"{t} {r['busy_spins_per_ms']:.0f}" for t, r in results.items()))
    print(f"Medians over {args.rounds} run(s) of each tree, taken in turns, {args.repeat} calls per size, op "
          f"and mode in each; pages of {results['after']['page_bytes'] >> 10} KiB; busy: beside a thread "
          f"running pure Python (switch interval {results['after']['switch_interval_s'] * 1000:g} ms); "
          f"load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": {t: ("working tree" if t == "after" else f"git revision {t}") for t in trees},
                       "load": os.getloadavg(), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
