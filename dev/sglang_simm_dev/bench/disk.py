"""The local store on a disk, filled past RAM and read back cold, beside ``dd``.

``python -m sglang_simm_dev.bench.disk [--dir DIR] [--gib 27] [--sizes 1MiB,64KiB] [--json PATH] [--quick]``

Per object size, a store of its own in ``DIR`` (a disk: refused on tmpfs),
started with the operator's settings, is filled with ``--gib`` GiB of
objects through the clients' own path (``StoreHandle.put_from``, batches of
``--batch`` objects, overwrite on), its files synced, their page cache
dropped (``POSIX_FADV_DONTNEED``; what stayed resident is measured with
``mincore``), then every object is read back in random order
(``get_into``) and every byte checked: each object's bytes are derived from
its key's number and their place in it, so a missing, torn, shifted or
foreign object is counted wrong, never passed. The store is stopped with
``--discard`` before the next size.

Beside it, in the same run and on the same filesystem: ``dd`` with
``O_DIRECT`` and 4 MiB blocks (``oflag=direct`` writing zeros, then
``iflag=direct`` reading them back) just before each size's writes,
between its writes and its reads, and after its reads: each phase is
compared with the mean of the dd runs on either side of it (a shared
machine's disk and CPUs change speed within minutes).

Figures per size: write GB/s to the disk (puts plus the final ``fsync``;
and as far as the puts returning), cold read GB/s, each over ``dd``'s; how
much of its calls' time the client thread was on a CPU and how much it
waited for one (``schedstat``; a copy through the page cache is the
caller's system time: the two near 100% say the CPU, not the disk, set
the pace) and the store process's CPU seconds; the store
process's private memory (``RssAnon``, sampled through the run) and its
growth per object; objects wrong and missing. Wall-clock times over a
whole phase: the bench fills (or checks) the next batch on a thread of its
own while the store's client copies the current one, so a figure is the
store's, not the checker's, unless the checker is the slower. Nothing here
is a test: the issue's targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import mmap
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

GIB = 1 << 30
DEFAULT_GIB = 27.0
DEFAULT_SIZES = (1 << 20, 64 << 10)
DEFAULT_BATCH = 64
DEFAULT_DD_GIB = 4.0
DD_BLOCK = 4 << 20
#: ``--quick``: a smoke run of the instrument, no figure worth reporting
QUICK_GIB, QUICK_DD_GIB, QUICK_BATCH = 1 / 64, 1 / 64, 16
#: what the store keeps free of its filesystem (``local_store._server.DISK_WATERMARK``), and a margin beyond it
WATERMARK, MARGIN = 0.05, 1 * GIB
#: the issue's targets
GOAL_OVER_DD = 0.70
GOAL_RSS_ANON = 256 << 20
#: how often the store's RssAnon is sampled during a phase
RSS_EVERY_S = 0.5
_K = np.uint64(0x9E3779B97F4A7C15)


# -- self-describing objects ------------------------------------------------------------------


class Pattern:
    """The bytes of object ``i`` of one size: 64-bit word ``w`` is
    ``w * K ^ tag(i)``, with ``tag`` a 64-bit mix of ``i`` (never 0). Any
    word in the wrong place, from another object or left as a hole fails."""

    def __init__(self, size: int) -> None:
        if size < 64 or size % 8:
            raise ValueError(f"an object size must be a multiple of 8 bytes, at least 64; got {size}")
        self.size, self.words = size, size // 8
        self.base = np.arange(self.words, dtype=np.uint64) * _K

    @staticmethod
    def tags(numbers: np.ndarray) -> np.ndarray:
        """splitmix64 of each number: distinct numbers give distinct tags."""
        z = numbers.astype(np.uint64) + _K
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        return np.where(z == 0, np.uint64(1), z)

    def fill(self, rows: np.ndarray, numbers: np.ndarray) -> None:
        np.bitwise_xor(self.base[None, :], self.tags(numbers)[:, None], out=rows[:len(numbers)])

    def wrong(self, rows: np.ndarray, numbers: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """Which of ``rows[:len(numbers)]`` are not those objects' bytes."""
        n = len(numbers)
        np.bitwise_xor(rows[:n], self.tags(numbers)[:, None], out=scratch[:n])
        return ~(scratch[:n] == self.base[None, :]).all(axis=1)


def key_of(size: int, number: int) -> str:
    return f"disk-bench/{size}/{number:010d}"


# -- the machine ------------------------------------------------------------------------------------


def rss_anon(pid: int) -> int | None:
    """A process's private memory (``RssAnon``), in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_cpu_s(pid: int) -> float:
    """A process's user and system CPU seconds so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_sched() -> tuple[float, float]:
    """This thread's seconds on a CPU and waiting on a run queue (``schedstat``)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on, waiting = f.read().split()[:2]
        return int(on) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def mount_of(path: str) -> dict[str, str]:
    """The mount ``path`` lies on: its point, device and filesystem type."""
    path, best = os.path.realpath(path), {"point": "/", "device": "?", "fs": "?"}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point, rest = parts[4], parts[parts.index("-") + 1:]
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best["point"]):
                best = {"point": point, "device": rest[1], "fs": rest[0]}
    return best


def machine(path: str) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": ram, "platform": platform.platform(),
            "python": platform.python_version(), "disk": mount_of(path)}


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident_bytes(path: str) -> int:
    """How much of a file the page cache holds now (``mincore`` over a
    read-only mapping: address space only, nothing read)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path}")
    try:
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path}")
        return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * mmap.PAGESIZE
    finally:
        _libc.munmap(addr, size)


def sync(paths: list[str], *, drop: bool = False) -> float:
    """Write the files' dirty pages out and, with ``drop``, drop them from
    the page cache (what ``drop_caches``, unwritable here, would do);
    seconds spent."""
    t = time.perf_counter()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if drop:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return time.perf_counter() - t


# -- dd ------------------------------------------------------------------------------------------------


_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.]+) s", re.M)


def parse_dd(text: str) -> tuple[int, float]:
    """``(bytes, seconds)`` from dd's last line (``LC_ALL=C``)."""
    found = _DD_LINE.findall(text)
    if not found:
        raise RuntimeError(f"dd printed no summary line: {text.strip()[-300:]!r}")
    nbytes, seconds = found[-1]
    return int(nbytes), float(seconds)


def run_dd(path: str, nbytes: int) -> dict[str, Any]:
    """dd's write and read of ``nbytes`` with O_DIRECT, 4 MiB blocks; the file removed after."""
    count = max(1, nbytes // DD_BLOCK)
    env = {**os.environ, "LC_ALL": "C"}
    out: dict[str, Any] = {"bytes": count * DD_BLOCK, "block": DD_BLOCK}
    try:
        for op, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct", f"count={count}"]),
                         ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run(["dd", f"bs={DD_BLOCK}", *args], capture_output=True, text=True, env=env,
                                  timeout=3600)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            out[f"{op}_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            if done.returncode != 0:
                raise RuntimeError(f"dd ({op}) exited with {done.returncode}: {done.stderr.strip()[-300:]}")
            moved, seconds = parse_dd(done.stderr)
            out[f"{op}_gbps"] = moved / seconds / 1e9
            out[f"{op}_s"] = seconds
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return out


# -- the store ---------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One pass over every object: bytes moved, wall time, time inside the
    store's calls, the CPU time of the thread making them (its copies
    through the page cache are system time) and of the store process, and
    dd's figures just before and just after it."""

    bytes: int = 0
    wall_s: float = 0.0
    call_s: float = 0.0
    call_cpu_s: float = 0.0
    #: of the calls' time, how long the calling thread waited for a CPU (runnable, not running)
    call_runqueue_s: float = 0.0
    store_cpu_s: float = 0.0
    calls: int = 0
    dd_gbps: list[float] = field(default_factory=list)

    def dd(self) -> float | None:
        return statistics.fmean(self.dd_gbps) if self.dd_gbps else None

    def gbps(self, extra_s: float = 0.0) -> float:
        return self.bytes / (self.wall_s + extra_s) / 1e9 if self.wall_s + extra_s > 0 else 0.0


@dataclass
class SizeResult:
    object_bytes: int
    objects: int
    bytes: int
    capacity_bytes: int
    write: Phase = field(default_factory=Phase)
    read: Phase = field(default_factory=Phase)
    sync_s: float = 0.0
    resident_after_write: int = 0
    resident_after_drop: int = 0
    rss_anon_start: int = 0
    rss_anon_filled: int = 0
    rss_anon_peak: int = 0
    wrong: int = 0
    missing: int = 0
    refused: int = 0
    evictions: int = 0
    restarted: bool = False
    first_wrong: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """Rates, each over the mean of dd's just before and just after its phase."""
        write, read = self.write.gbps(self.sync_s), self.read.gbps()
        dd_write, dd_read = self.write.dd(), self.read.dd()
        growth = max(self.rss_anon_filled - self.rss_anon_start, 0)
        return {
            "write_gbps": write, "write_gbps_puts_returned": self.write.gbps(), "read_gbps": read,
            "dd_write_gbps": dd_write, "dd_read_gbps": dd_read,
            "write_over_dd": write / dd_write if dd_write else None,
            "read_over_dd": read / dd_read if dd_read else None,
            "rss_anon_bytes_per_object": growth / self.objects if self.objects else None,
        }


class Sampler:
    """The store process's RssAnon, its peak over samples at most ``RSS_EVERY_S`` apart."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._next = pid, 0, 0.0

    def sample(self, force: bool = False) -> int:
        now = time.monotonic()
        if not force and now < self._next:
            return self.peak
        self._next = now + RSS_EVERY_S
        value = rss_anon(self.pid) or 0
        self.peak = max(self.peak, value)
        return value


def _batches(numbers: np.ndarray, batch: int) -> list[np.ndarray]:
    return [numbers[i:i + batch] for i in range(0, len(numbers), batch)]


def _pipelined(batches: list[np.ndarray], before: Callable[[int, np.ndarray], None] | None,
               call: Callable[[int, np.ndarray], None], after: Callable[[int, np.ndarray], None] | None) -> float:
    """``call(slot, batch)`` for every batch on this thread, with ``before``
    (filling) done a batch ahead and ``after`` (checking) a batch behind on
    a worker thread, over two buffer slots. Wall seconds."""
    pending: list[Future | None] = [None, None]
    with ThreadPoolExecutor(1, thread_name_prefix="disk-bench") as worker:
        start = time.perf_counter()
        if before is not None and batches:
            pending[0] = worker.submit(before, 0, batches[0])
        for b, numbers in enumerate(batches):
            slot = b % 2
            if pending[slot] is not None:
                pending[slot].result()  # this slot filled, or its last batch checked
                pending[slot] = None
            if before is not None and b + 1 < len(batches):
                other = 1 - slot
                if pending[other] is not None:
                    pending[other].result()
                pending[other] = worker.submit(before, other, batches[b + 1])
            call(slot, numbers)
            if after is not None:
                pending[slot] = worker.submit(after, slot, numbers)
        for f in pending:
            if f is not None:
                f.result()
        return time.perf_counter() - start


def measure_size(root: str, name: str, size: int, total: int, batch: int, *, restart: bool, seed: int,
                 progress: Callable[[str], None], dd: Callable[[], dict[str, Any]] | None = None) -> SizeResult:
    """Fill a store of its own with ``total`` bytes of ``size``-byte objects, drop its page cache, read
    every object back in random order checking every byte; the store is stopped and discarded after.
    ``dd()`` runs dd (its figures) before the writes, between the writes and the reads, and after
    the reads: each phase is compared with the dd runs on either side of it."""
    from sglang_simm.local_store.admin import StoreHandle, StorePaths
    from sglang_simm.simm_rules import OK

    pattern = Pattern(size)
    n = max(1, total // size)
    capacity = n * size + max(n * size // 16, 64 << 20)
    res = SizeResult(object_bytes=size, objects=n, bytes=n * size, capacity_bytes=capacity)
    # page-aligned, as SGLang's pinned host pool on a GPU server is
    rows = [np.frombuffer(mmap.mmap(-1, batch * size), dtype=np.uint64).reshape(batch, pattern.words)
            for _ in range(2)]
    scratch = np.empty((batch, pattern.words), dtype=np.uint64)
    addresses = [[row.ctypes.data + i * size for i in range(batch)] for row in rows]
    keys = [key_of(size, i) for i in range(n)]

    def start() -> StoreHandle:
        handle = StoreHandle(name, root=root, capacity=capacity, started_by="operator", idle_exit_s=0,
                             timeout_s=120.0)
        handle.open(wait_s=120.0)
        return handle

    handle = start()
    try:
        sampler, peaks = Sampler(handle.pid), []
        res.rss_anon_start = sampler.sample(force=True)

        def put(slot: int, numbers: np.ndarray) -> None:
            items = [(keys[i], addresses[slot][j], size) for j, i in enumerate(numbers.tolist())]
            t, (c, q) = time.perf_counter(), thread_sched()
            codes = handle.put_from(items, True)
            res.write.call_s += time.perf_counter() - t
            c2, q2 = thread_sched()
            res.write.call_cpu_s += c2 - c
            res.write.call_runqueue_s += q2 - q
            res.write.calls += 1
            res.refused += sum(code != OK for code in codes)
            sampler.sample()

        before = dd() if dd else None
        progress(f"{size // 1024} KiB objects: writing {n:,} ({res.bytes / GIB:.1f} GiB)")
        res.write.bytes = res.bytes
        store_cpu = process_cpu_s(handle.pid)
        res.write.wall_s = _pipelined(_batches(np.arange(n), batch),
                                      lambda slot, numbers: pattern.fill(rows[slot], numbers), put, None)
        res.write.store_cpu_s = process_cpu_s(handle.pid) - store_cpu
        paths = StorePaths(root, name)
        segments = list(paths.segments().values())
        res.sync_s = sync(segments)  # on the disk: what dd's O_DIRECT writes are
        res.rss_anon_filled = sampler.sample(force=True)
        status = handle.status()
        res.evictions = int(status.get("evictions", 0) or 0)
        res.resident_after_write = sum(resident_bytes(p) for p in segments)
        if restart:
            progress(f"{size // 1024} KiB objects: restarting the store")
            handle.stop(wait_s=120.0)
            handle = start()
            peaks.append(sampler.peak)
            sampler = Sampler(handle.pid)
            res.restarted = True
        sync(paths.data_files(), drop=True)
        between = dd() if dd else None
        if before and between:
            res.write.dd_gbps = [before["write_gbps"], between["write_gbps"]]
        sync(paths.data_files(), drop=True)  # again: dd ran meanwhile
        res.resident_after_drop = sum(resident_bytes(p) for p in list(paths.segments().values()))

        def get(slot: int, numbers: np.ndarray) -> None:
            items = [(keys[i], addresses[slot][j], size) for j, i in enumerate(numbers.tolist())]
            t, (c, q) = time.perf_counter(), thread_sched()
            got = handle.get_into(items)
            res.read.call_s += time.perf_counter() - t
            c2, q2 = thread_sched()
            res.read.call_cpu_s += c2 - c
            res.read.call_runqueue_s += q2 - q
            res.read.calls += 1
            sizes[slot] = np.asarray(got, dtype=np.int64)
            sampler.sample()

        def check(slot: int, numbers: np.ndarray) -> None:
            hit = sizes[slot] == size
            res.missing += int((~hit).sum())
            bad = pattern.wrong(rows[slot], numbers, scratch) & hit
            if bad.any():
                res.wrong += int(bad.sum())
                res.first_wrong += [keys[int(i)] for i in numbers[bad][:5]][:5 - len(res.first_wrong)]

        sizes: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * 2
        order = np.random.default_rng(seed).permutation(n)
        progress(f"{size // 1024} KiB objects: reading {n:,} back in random order, cold")
        res.read.bytes = res.bytes
        store_cpu = process_cpu_s(handle.pid)
        res.read.wall_s = _pipelined(_batches(order, batch), None, get, check)
        res.read.store_cpu_s = process_cpu_s(handle.pid) - store_cpu
        sampler.sample(force=True)
        res.rss_anon_peak = max(peaks + [sampler.peak])
    finally:
        handle.stop(wait_s=120.0, discard=True)
    after = dd() if dd else None
    if between and after:
        res.read.dd_gbps = [between["read_gbps"], after["read_gbps"]]
    return res


# -- the run -------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|K|MiB|M|GiB|G)?\s*", text, re.I)
    if not m:
        raise ValueError(f"an object size is a number with KiB, MiB or GiB; got {text!r}")
    unit = (m.group(2) or "B").upper()[0]
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30}[unit]


def room_problem(directory: str, total: int, dd_bytes: int) -> str | None:
    """Why the run cannot be done in ``directory``, or None."""
    from sglang_simm.local_store.admin import medium_of

    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    if medium_of(directory) != "disk":
        return f"{directory} is on memory (tmpfs): this bench measures a disk; give --dir on one"
    st = os.statvfs(directory)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    need = max(total, dd_bytes) + int(WATERMARK * size) + MARGIN
    if free < need:
        return (f"{directory} has {free / GIB:.1f} GiB free; the run needs {need / GIB:.1f} GiB: "
                f"{total / GIB:.1f} GiB of objects (one size at a time), the {WATERMARK:.0%} of the filesystem "
                f"({size / GIB:.0f} GiB) the store keeps free, and {MARGIN / GIB:.0f} GiB more: "
                "lower --gib or choose another --dir")
    return None


def run(directory: str, gib: float, sizes: list[int], *, batch: int, dd_gib: float, restart: bool = False,
        seed: int = 0, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from sglang_simm.local_store.admin import private_store_dir

    from sglang_simm_dev.bench.report import source_commit

    total, dd_bytes = int(gib * GIB), max(DD_BLOCK, int(dd_gib * GIB) // DD_BLOCK * DD_BLOCK)
    why = room_problem(directory, total, dd_bytes)
    if why:
        raise SystemExit(f"bench disk: {why}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    started, load_before = time.monotonic(), os.getloadavg()
    result: dict[str, Any] = {
        "bench": "disk", "commit": source_commit(), "date": datetime.date.today().isoformat(),
        "machine": machine(directory),
        "settings": {"dir": os.path.abspath(directory), "gib": gib, "bytes_per_size": total, "sizes": sizes,
                     "batch": batch, "dd_bytes": dd_bytes, "dd_block": DD_BLOCK, "restart_before_reads": restart,
                     "larger_than_ram": total > ram, "seed": seed},
        "dd": [], "sizes": [],
    }
    run_dir = tempfile.mkdtemp(prefix="sglang-simm-disk-bench-", dir=directory)
    try:
        with private_store_dir("store-", parent=run_dir) as root:
            dd_file = os.path.join(run_dir, "dd.bin")

            def dd() -> dict[str, Any]:
                progress("dd: writing and reading with O_DIRECT")
                result["dd"].append(run_dd(dd_file, dd_bytes))
                return result["dd"][-1]

            for i, size in enumerate(sizes):
                result["sizes"].append(measure_size(root, f"disk{i}", size, total, batch, restart=restart,
                                                    seed=seed + i, progress=progress, dd=dd))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    dd = {k: statistics.median(d[k] for d in result["dd"]) for k in ("write_gbps", "read_gbps")}
    result["dd_reference"] = dd
    result["sizes"] = [{**asdict(r), "write": asdict(r.write), "read": asdict(r.read), **r.figures()}
                       for r in result["sizes"]]
    result["wrong"] = sum(s["wrong"] for s in result["sizes"])
    result["missing"] = sum(s["missing"] for s in result["sizes"])
    result["goals"] = goals(result)
    result["load"] = {"before": load_before, "after": os.getloadavg()}
    result["seconds"] = time.monotonic() - started
    return result


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run's figures."""
    out = []
    for s in result["sizes"]:
        label = _label(s["object_bytes"])
        out.append({"what": f"write, {label} objects, over dd's", "goal": f">= {GOAL_OVER_DD:.2f}",
                    "value": s["write_over_dd"], "met": (s["write_over_dd"] or 0) >= GOAL_OVER_DD})
        if s["object_bytes"] >= 1 << 20:
            out.append({"what": f"cold read, {label} objects, over dd's", "goal": f">= {GOAL_OVER_DD:.2f}",
                        "value": s["read_over_dd"], "met": (s["read_over_dd"] or 0) >= GOAL_OVER_DD})
            out.append({"what": f"store RssAnon, {label} objects", "goal": f"< {GOAL_RSS_ANON >> 20} MiB",
                        "value": s["rss_anon_peak"], "met": s["rss_anon_peak"] < GOAL_RSS_ANON})
    out.append({"what": "objects wrong", "goal": "0", "value": result["wrong"], "met": result["wrong"] == 0})
    out.append({"what": "objects missing", "goal": "0", "value": result["missing"], "met": result["missing"] == 0})
    return out


# -- output ------------------------------------------------------------------------------------------------------


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and not size % (1 << 20) else f"{size >> 10} KiB"


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["objects", "count", "GiB", "write GB/s", "dd beside", "x dd", "cold read GB/s", "dd beside", "x dd",
            "client thread on + waiting for a CPU, w / r", "store CPU s w / r", "store RssAnon peak",
            "RssAnon B/object", "wrong", "missing"]
    rows = []
    for s in result["sizes"]:
        per = s["rss_anon_bytes_per_object"]
        on_cpu = " / ".join(f"{p['call_cpu_s'] / p['call_s']:.0%} + {p['call_runqueue_s'] / p['call_s']:.0%}"
                            if p["call_s"] else "-" for p in (s["write"], s["read"]))
        rows.append([_label(s["object_bytes"]), f"{s['objects']:,}", f"{s['bytes'] / GIB:.2f}",
                     f"{s['write_gbps']:.2f}", _f2(s["dd_write_gbps"]), _f2(s["write_over_dd"]),
                     f"{s['read_gbps']:.2f}", _f2(s["dd_read_gbps"]), _f2(s["read_over_dd"]), on_cpu,
                     f"{s['write']['store_cpu_s']:.1f} / {s['read']['store_cpu_s']:.1f}",
                     f"{s['rss_anon_peak'] / (1 << 20):.0f} MiB", f"{per:.0f}" if per is not None else "-",
                     str(s["wrong"]), str(s["missing"])])
    return head, rows


def _f2(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def dd_line(result: dict[str, Any]) -> str:
    return ("dd O_DIRECT, 4 MiB blocks, in run order (write / read GB/s): "
            + ", ".join(f"{d['write_gbps']:.2f} / {d['read_gbps']:.2f}" for d in result["dd"]))


def cpu_line(result: dict[str, Any]) -> str:
    """CPU seconds per GiB moved: the store's client thread against dd."""
    parts = []
    for s in result["sizes"]:
        gib = s["bytes"] / GIB
        parts.append(f"{_label(s['object_bytes'])} objects, client thread {s['write']['call_cpu_s'] / gib:.2f} / "
                     f"{s['read']['call_cpu_s'] / gib:.2f}")
    dd = [d for d in result["dd"] if "write_cpu_s" in d]
    if dd:
        gib = dd[0]["bytes"] / GIB
        parts.append(f"dd {statistics.median(d['write_cpu_s'] for d in dd) / gib:.2f} / "
                     f"{statistics.median(d['read_cpu_s'] for d in dd) / gib:.2f}")
    return "CPU seconds per GiB, write / read: " + "; ".join(parts)


def render(result: dict[str, Any], console: Any = None) -> None:
    s, m = result["settings"], result["machine"]
    lines = [f"The local store on a disk: {s['bytes_per_size'] / GIB:.1f} GiB of objects per size "
             f"(RAM {m['memory_bytes'] / GIB:.1f} GiB{'' if s['larger_than_ram'] else ': NOT larger than RAM'}), "
             f"{m['disk']['device']} ({m['disk']['fs']}), batches of {s['batch']}; each phase over the mean of "
             "dd's just before and just after it",
             f"commit {result['commit']}, {result['date']}, {m['cpu']}, {m['cores']} cores; load "
             f"{'/'.join(f'{x:.1f}' for x in result['load']['before'])} before, "
             f"{'/'.join(f'{x:.1f}' for x in result['load']['after'])} after; {result['seconds']:.0f} s"]
    head, rows = table_rows(result)
    lines_after = [dd_line(result), cpu_line(result)]
    goal_lines = [f"{'met   ' if g['met'] else 'MISSED'} {g['what']}: {_goal_value(g)} (goal {g['goal']})"
                  for g in result["goals"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("\n".join(lines))
        print(" | ".join(head))
        for row in rows:
            print(" | ".join(row))
        print("\n".join(lines_after + goal_lines))
        return
    console = console or Console(width=max(Console().width, 160))
    for line in lines:
        console.print(line, highlight=False)
    t = Table(title_justify="left")
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    console.print(t)
    for line in lines_after + goal_lines:
        console.print(line, highlight=False)


def _goal_value(g: dict[str, Any]) -> str:
    v = g["value"]
    if v is None:
        return "-"
    if "RssAnon" in g["what"]:
        return f"{v / (1 << 20):.0f} MiB"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm_dev.bench.disk", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a directory on the disk to measure (default: the temp directory)")
    parser.add_argument("--gib", type=float, help=f"GiB of objects per size (default {DEFAULT_GIB:g}: past RAM)")
    parser.add_argument("--sizes", default="1MiB,64KiB", help="object sizes, a comma list (default 1MiB,64KiB)")
    parser.add_argument("--batch", type=int, help=f"objects per put or get (default {DEFAULT_BATCH})")
    parser.add_argument("--dd-gib", type=float, help=f"GiB dd writes and reads each time (default {DEFAULT_DD_GIB:g})")
    parser.add_argument("--restart", action="store_true",
                        help="restart the store between writing and reading (reads verify checksums)")
    parser.add_argument("--seed", type=int, default=0, help="the read order's seed")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="a tiny run (a smoke test of the instrument)")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
        for size in sizes:
            Pattern(size)
    except ValueError as exc:
        parser.error(str(exc))
    gib = args.gib if args.gib is not None else QUICK_GIB if args.quick else DEFAULT_GIB
    dd_gib = args.dd_gib if args.dd_gib is not None else QUICK_DD_GIB if args.quick else min(DEFAULT_DD_GIB, gib)
    batch = args.batch or (QUICK_BATCH if args.quick else DEFAULT_BATCH)
    if not sizes or gib <= 0 or dd_gib <= 0 or batch < 1:
        parser.error("--sizes needs a size, --gib and --dd-gib must be > 0, --batch >= 1")
    result = run(args.dir, gib, sizes, batch=batch, dd_gib=dd_gib, restart=args.restart, seed=args.seed,
                 progress=lambda text: print(text, file=sys.stderr, flush=True))
    render(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if result["wrong"] == 0 and result["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
