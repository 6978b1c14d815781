"""``sglang-simm-dev bench --store``: the local store against what a single host has.

Three measurements, each side by side in one run (candidates alternate
within every repetition; medians), timed the way serving uses the store:
backups write fresh page keys, a restore's lookup is new and its get follows
an exists on the same keys.

1. bandwidth: our backend's v1 set and get (real SGLang host pool, the local
   store in its own process, data copied by this process through shared
   memory) against a same-run memcpy of the same bytes;
2. against SGLang's ``file`` backend on /dev/shm (one file per page, the
   single-host alternative), same pages, same host pool, each through the
   path SGLang's controller takes with it;
3. per-batch control cost: the same calls with tiny pages, where copying
   costs nothing, local store against the in-process local store.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class Sample:
    name: str
    seconds: list[float] = field(default_factory=list)
    nbytes: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / 1e9 if self.seconds and self.nbytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "median_s": self.median, "gbps": self.gbps, "bytes": self.nbytes,
                "repeats": len(self.seconds)}


class _Buffers:
    """Two private, pre-faulted buffers and a memcpy between them."""

    def __init__(self, nbytes: int) -> None:
        self.src = (ctypes.c_char * nbytes)()
        self.dst = (ctypes.c_char * nbytes)()
        ctypes.memset(self.src, 1, nbytes)
        ctypes.memset(self.dst, 2, nbytes)
        self.nbytes = nbytes

    def copy(self, object_bytes: int) -> int:
        src, dst = ctypes.addressof(self.src), ctypes.addressof(self.dst)
        for off in range(0, self.nbytes - object_bytes + 1, object_bytes):
            ctypes.memmove(dst + off, src + off, object_bytes)
        return self.nbytes


def _plugin_root() -> str:
    """The folder this process imports ``sglang_simm`` from (a tree's
    ``src``, or site-packages), for a child's ``PYTHONPATH``."""
    import sglang_simm

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang_simm.__file__)))


def _storage_config(extra: dict[str, Any], geom: Any) -> Any:
    from sglang_simm_dev.pools import storage_config

    return storage_config(extra_config=extra, is_mla_model=geom.is_mla, model_name=geom.name)


@contextlib.contextmanager
def _simm_backend(manager: str, geom: Any, host: Any, capacity: int) -> Iterator[Any]:
    from sglang_simm.backend import HiCacheSiMM

    cfg = _storage_config({"manager_address": manager, "local_store_capacity_bytes": capacity}, geom)
    backend = HiCacheSiMM(cfg, host)
    try:
        yield backend
    finally:
        backend.close()
        from sglang_simm.local_store import reset_servers

        reset_servers(manager.split("://", 1)[-1])


@contextlib.contextmanager
def _file_backend(geom: Any) -> Iterator[Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    root = tempfile.mkdtemp(prefix="sglang-simm-bench-file-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    previous = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = root
    try:
        yield HiCacheFile(_storage_config({}, geom))
    finally:
        if previous is None:
            os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
        else:
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = previous
        shutil.rmtree(root, ignore_errors=True)


def _keys(tag: str, rep: int, n: int) -> list[str]:
    """Page keys no call has seen (made before the timing starts)."""
    run = uuid.uuid4().hex
    return [f"{run}{tag}{rep:04d}{i:06d}" for i in range(n)]


def _ours(backend: Any, write_idx: Any, read_idx: Any, pages: int, page_bytes: int):
    """set(rep) and exists(rep) on fresh keys; get(rep) after an exists on
    keys stored just before. ``prepare(rep)`` makes the keys and stores the
    get's pages, untimed."""
    keys: dict[tuple[str, int], list[str]] = {}

    def prepare(rep: int) -> None:
        for what in ("set", "miss"):
            keys[what, rep] = _keys(what, rep, pages)
        keys["get", rep] = _keys("get", rep, pages)
        assert all(backend.batch_set_v1(keys["get", rep], write_idx))

    def set_(rep: int) -> int:
        ok = backend.batch_set_v1(keys.pop(("set", rep)), write_idx)
        assert all(ok), "the backend refused a backup"
        return pages * page_bytes

    def exists(rep: int) -> int:
        assert backend.batch_exists(keys.pop(("miss", rep))) == 0
        return 0

    def get(rep: int) -> int:
        got = keys.pop(("get", rep))
        assert backend.batch_exists(got) == pages
        assert all(backend.batch_get_v1(got, read_idx))
        return pages * page_bytes

    return prepare, set_, exists, get


def _file(backend: Any, host: Any, write_idx: Any, read_idx: Any, pages: int, page_bytes: int, page_size: int):
    """The controller's generic page path, the one SGLang takes with ``file``
    (``_generic_page_set`` / ``_generic_page_get``)."""
    stored: dict[int, list[str]] = {}
    fresh: dict[int, list[str]] = {}

    def put(keys: list[str]) -> None:
        data = [host.get_data_page(write_idx[i * page_size]) for i in range(len(keys))]
        assert backend.batch_set(keys, data)

    def prepare(rep: int) -> None:
        stored[rep] = _keys("fget", rep, pages)
        fresh[rep] = _keys("fset", rep, pages)
        put(stored[rep])

    def set_(rep: int) -> int:
        put(fresh.pop(rep))
        return pages * page_bytes

    def get(rep: int) -> int:
        keys = stored.pop(rep)
        assert backend.batch_exists(keys) == pages
        dummies = [host.get_dummy_flat_data_page() for _ in keys]
        data = backend.batch_get(keys, dummies)
        for i in range(len(keys)):
            assert data[i] is not None
            host.set_from_flat_data_page(read_idx[i * page_size], data[i])
        return pages * page_bytes

    return prepare, set_, get


def _timed_pair(prepare_fns: list[Callable[[int], None]], fns: dict[str, Callable[[int], int]],
                repeat: int) -> dict[str, Sample]:
    out = {name: Sample(name) for name in fns}
    for rep in range(repeat):
        for prepare in prepare_fns:
            prepare(rep)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            moved = fn(rep)
            out[name].seconds.append(time.perf_counter() - t0)
            out[name].nbytes = moved
    return out


#: Control-cost batch sizes (pages a call): small backups, a typical one, a big one.
SMALL_BATCHES = (8, 40, 128)


def measure(*, repeat: int = 15, pages: int = 128, bandwidth_page_size: int = 16,
            control_pages: int = 128) -> dict[str, Any]:
    import torch

    from sglang_simm_dev.pools import PRESETS, build_host_pool

    results: dict[str, Any] = {"pages": pages, "repeat": repeat}
    name = f"bench-{uuid.uuid4().hex[:8]}"

    # 1 + 2: llama3-8b pages of bandwidth_page_size tokens (objects of 1 MiB at 16)
    geom = PRESETS["llama3-8b"]
    geom = type(geom)(**{**asdict(geom), "page_size": bandwidth_page_size})
    page_bytes = geom.page_bytes()
    host = build_host_pool(geom, tokens=2 * pages * geom.page_size, layout="page_first")
    host.kv_buffer.view(torch.uint8).fill_(7)  # every page touched once, like a warm server
    ps = geom.page_size
    write_idx = torch.arange(0, pages * ps, dtype=torch.int64)
    read_idx = torch.arange(pages * ps, 2 * pages * ps, dtype=torch.int64)
    results["page_bytes"] = page_bytes
    results["object_bytes"] = page_bytes // 2
    capacity = 6 * pages * page_bytes
    buffers = _Buffers(pages * page_bytes)
    with _simm_backend(f"local://{name}", geom, host, capacity) as ours, _file_backend(geom) as file:
        o_prep, o_set, _, o_get = _ours(ours, write_idx, read_idx, pages, page_bytes)
        f_prep, f_set, f_get = _file(file, host, write_idx, read_idx, pages, page_bytes, ps)
        # A warm server's store: every byte of its memory committed and mapped
        # once (fill it past capacity), so timed calls see steady state.
        for warm in range(capacity // (pages * page_bytes) + 2):
            o_prep(-1 - warm)
            o_get(-1 - warm)
        samples = _timed_pair(
            [o_prep, f_prep],
            {
                "memcpy": lambda rep: buffers.copy(page_bytes // 2),
                "ours set": o_set,
                "ours get": o_get,
                "file set": f_set,
                "file get": f_get,
            },
            repeat,
        )
    results["bandwidth"] = {k: v.as_dict() for k, v in samples.items()}
    del buffers, host

    # 3: control cost, tiny pages (copying costs ~nothing), at the batch sizes
    # serving sends: SGLang's backups in a multi-turn workload are ~40 pages.
    tiny = PRESETS["tiny"]
    most = max(SMALL_BATCHES)
    host = build_host_pool(tiny, tokens=2 * most * tiny.page_size, layout="page_first")
    tps = tiny.page_size
    results["control_by_pages"] = {}
    with _simm_backend(f"local://{name}-c", tiny, host, 256 << 20) as hostb, \
            _simm_backend(f"inprocess://{name}-c", tiny, host, 256 << 20) as inproc:
        for n in SMALL_BATCHES:
            w = torch.arange(0, n * tps, dtype=torch.int64)
            r = torch.arange(most * tps, (most + n) * tps, dtype=torch.int64)
            h_prep, h_set, h_exists, h_get = _ours(hostb, w, r, n, tiny.page_bytes())
            i_prep, i_set, i_exists, i_get = _ours(inproc, w, r, n, tiny.page_bytes())
            control = _timed_pair(
                [h_prep, i_prep],
                {
                    "host exists": h_exists, "in-process exists": i_exists,
                    "host set": h_set, "in-process set": i_set,
                    "host get": h_get, "in-process get": i_get,
                },
                max(repeat, 30),
            )
            results["control_by_pages"][str(n)] = {k: v.as_dict() for k, v in control.items()}
    results["control"] = results["control_by_pages"][str(control_pages)]
    results["control_pages"] = control_pages
    return results


def render(console: Any, results: dict[str, Any]) -> None:
    from rich.table import Table

    bw = results["bandwidth"]
    memcpy = bw["memcpy"]["gbps"]
    t = Table(title=f"Bandwidth, {results['pages']} pages of {results['page_bytes'] >> 20} MiB a call "
                    f"(objects of {results['object_bytes'] >> 20} MiB), medians of {results['repeat']}")
    for col in ("call", "GB/s", "vs memcpy", "vs file"):
        t.add_column(col, justify="right" if col != "call" else "left")
    for op in ("set", "get"):
        ours, file = bw[f"ours {op}"]["gbps"], bw[f"file {op}"]["gbps"]
        t.add_row(f"ours {op} (local store)", f"{ours:.2f}", f"{ours / memcpy:.0%}", f"{ours / file:.2f}x")
        t.add_row(f"file {op} (/dev/shm)", f"{file:.2f}", f"{file / memcpy:.0%}", "")
    t.add_row("memcpy (same bytes)", f"{memcpy:.2f}", "100%", "")
    console.print(t)
    by_pages = results.get("control_by_pages") or {str(results["control_pages"]): results["control"]}
    t = Table(title="Control cost per call, tiny pages (copies ~free)")
    for col in ("pages", "call", "local store us", "in-process us", "local / in-process"):
        t.add_column(col, justify="right" if col != "call" else "left")
    for n, c in by_pages.items():
        for op in ("exists", "set", "get"):
            h, i = c[f"host {op}"]["median_s"] * 1e6, c[f"in-process {op}"]["median_s"] * 1e6
            t.add_row(n, op, f"{h:.0f}", f"{i:.0f}", f"{h / i:.2f}x")
    console.print(t)


# -- the store as a server: folds, fairness, stalls, crashes ----------------------


def _host_store(name: str, capacity: int, **kw: Any) -> Any:
    from sglang_simm.local_store.admin import StoreHandle

    server = StoreHandle(name, capacity=capacity, timeout_s=kw.pop("timeout_s", 10.0), **kw)
    server.open()
    return server


def measure_fold(repeat: int = 30, object_bytes: int = 4096) -> dict[str, Any]:
    """A backup of fresh keys at each small batch size, per call: the
    backend's exists + put (three requests) against ``mput_absent``'s
    folded put (two), side by side."""
    buf = ctypes.create_string_buffer(object_bytes)
    ptr = ctypes.addressof(buf)
    name = f"bench-fold-{uuid.uuid4().hex[:8]}"
    server = _host_store(name, 256 << 20, idle_exit_s=30.0)
    out: dict[str, Any] = {"object_bytes": object_bytes}
    try:
        for n in SMALL_BATCHES:
            objects = 2 * n  # a page is a K and a V object
            two = Sample(f"exists+put {n}")
            one = Sample(f"put absent {n}")
            for rep in range(repeat):
                for sample, fold in ((two, False), (one, True)):
                    keys = _keys("fold" if fold else "two", rep, objects)
                    items = [(k, ptr, object_bytes) for k in keys]
                    t0 = time.perf_counter()
                    if fold:
                        codes = server.put_from(items, False)
                    else:
                        assert not any(c == 0 for c in server.lookup(keys))
                        codes = server.put_from(items, True)
                    sample.seconds.append(time.perf_counter() - t0)
                    sample.nbytes = objects * object_bytes
                    assert not any(codes)
            out[str(n)] = {"exists+put": two.as_dict(), "put absent": one.as_dict()}
    finally:
        server.stop(discard=True)
    return out


_HAMMER = """
import ctypes, sys, time
from sglang_simm.local_store.admin import StoreHandle
name, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
c = StoreHandle(name, capacity=1, spawn=False, timeout_s=30)
c.open()
buf = ctypes.create_string_buffer(64)
keys = [f"hammer{i}" for i in range(n)]
c.put_from([(k, ctypes.addressof(buf), 64) for k in keys], True)
print("ready", flush=True)
end = time.monotonic() + seconds
calls = 0
while time.monotonic() < end:
    c.lookup(keys)
    c.get_into([(k, ctypes.addressof(buf), 64) for k in keys])
    calls += 2
print(calls, flush=True)
"""


def measure_fairness(samples: int = 2000) -> dict[str, Any]:
    """A 1-key get's latency from one client while another sends the
    largest batch the store allows (LOOKUP and GET of ``max_batch`` keys,
    back to back), against the same get on an idle store."""
    import subprocess
    import sys

    name = f"bench-fair-{uuid.uuid4().hex[:8]}"
    server = _host_store(name, 256 << 20, idle_exit_s=30.0)
    buf = ctypes.create_string_buffer(4096)
    item = [("one", ctypes.addressof(buf), 4096)]
    assert server.put_from(item, True) == [0]
    out: dict[str, Any] = {"max_batch": server.max_batch}

    def gets() -> list[float]:
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            assert server.get_into(item) == [4096]
            times.append(time.perf_counter() - t0)
        return times

    try:
        out["idle"] = _percentiles(gets())
        env = dict(os.environ)
        src = _plugin_root()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-c", _HAMMER, name, str(server.max_batch), "600"],
                                stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "ready"
            out["under largest batch"] = _percentiles(gets())
        finally:
            proc.kill()
            proc.wait()
        t0 = time.perf_counter()
        server.lookup([f"hammer{i}" for i in range(server.max_batch)])
        out["largest batch lookup_s"] = time.perf_counter() - t0
    finally:
        server.stop(discard=True)
    return out


def _percentiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"p50_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3, "max_ms": times[-1] * 1e3, "n": len(times)}


def measure_stalled(calls: int = 5, timeout_ms: int = 1000) -> dict[str, Any]:
    """Each call's duration while the store process is stopped (SIGSTOP),
    with a ``timeout_ms`` time limit: the first times out on its request,
    the next ones on their reconnect's handshake."""
    import signal

    from sglang_simm.local_store.admin import StoreUnreachable

    name = f"bench-stall-{uuid.uuid4().hex[:8]}"
    server = _host_store(name, 16 << 20, idle_exit_s=30.0, timeout_s=timeout_ms / 1000)
    pid = server.pid
    durations, codes = [], []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            try:
                server.lookup(["x"])
                codes.append(0)
            except StoreUnreachable as exc:
                codes.append(exc.code)
            durations.append(time.perf_counter() - t0)
            time.sleep(2.1)  # past the reconnect back-off, so each call tries the store
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop(discard=True)
    return {"timeout_ms": timeout_ms, "durations_s": durations, "codes": codes}


_CRASH_WRITER = """
import ctypes, sys
from sglang_simm.local_store.admin import StoreHandle
name, size = sys.argv[1], int(sys.argv[2])
c = StoreHandle(name, capacity=1, spawn=False, timeout_s=30)
c.open()
bufs = [ctypes.create_string_buffer(bytes([i + 1]) * size, size) for i in range(251)]
i = 0
while True:
    c.put_from([(f"w{j}", ctypes.addressof(bufs[j % 251]), size) for j in range(i, i + 16)], True)
    i += 16
    if i == 16:
        print("writing", flush=True)
"""


def measure_crash(capacity: int = 1 << 30, object_bytes: int = 1 << 20) -> dict[str, Any]:
    """kill -9 of a store holding ``capacity`` bytes while a writer keeps
    writing: objects recovered by the next store process, wrong bytes
    among them, and the takeover time (the store's own, and the time until
    a new client's first answer)."""
    import signal
    import subprocess
    import sys

    from sglang_simm.local_store.admin import StoreHandle, pid_alive

    name = f"bench-crash-{uuid.uuid4().hex[:8]}"
    server = _host_store(name, capacity, idle_exit_s=0.0)
    pid = server.pid
    env = dict(os.environ)
    src = _plugin_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    writer = subprocess.Popen([sys.executable, "-c", _CRASH_WRITER, name, str(object_bytes)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert writer.stdout.readline().strip() == "writing"
        while server.status()["used_bytes"] < capacity - 32 * object_bytes:
            time.sleep(0.05)
        time.sleep(0.5)  # evicting and writing: the kill lands mid-batch
        held = server.status()["objects"]
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.01)
    finally:
        writer.kill()
        writer.wait()
    server.close()
    t0 = time.perf_counter()
    again = StoreHandle(name, capacity=1 << 20, timeout_s=30.0)  # starts the next store process
    again.open()
    status = again.status()
    first_answer_s = time.perf_counter() - t0
    out = ctypes.create_string_buffer(object_bytes)
    wrong = read = 0
    for key in again.keys():
        assert again.get_into([(key, ctypes.addressof(out), object_bytes)]) == [object_bytes]
        wrong += object_bytes - out.raw.count(bytes([int(key[1:]) % 251 + 1]))
        read += 1
    again.stop(discard=True)
    return {"capacity_bytes": capacity, "object_bytes": object_bytes, "objects_before_kill": held,
            "recovered": status["recovered"], "read_back": read, "wrong_bytes": wrong,
            "dropped_as_unsound": status["recovery_dropped"], "takeover_s": status["takeover_s"],
            "restart_to_first_answer_s": first_answer_s}


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang_simm_dev.bench.store [fold|fairness|stalled|crash ...] [--json PATH]``:
    the server measurements of ``bench --store`` on their own (crash: 1 GiB)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m sglang_simm_dev.bench.store")
    parser.add_argument("what", nargs="*", default=["fold", "fairness", "stalled"],
                        choices=["fold", "fairness", "stalled", "crash"])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--crash-gib", type=float, default=1.0)
    args = parser.parse_args(argv)
    fns = {"fold": measure_fold, "fairness": measure_fairness, "stalled": measure_stalled,
           "crash": lambda: measure_crash(int(args.crash_gib * (1 << 30)))}
    result = {what: fns[what]() for what in args.what}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
