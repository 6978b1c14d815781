"""``sglang-simm store``: start, inspect, clear and stop host stores.

A host store (``manager_address: "local"`` or ``"local://NAME"``) starts by
itself with its first client; these commands are for the operator who
wants to size it before servers start, look inside, or let it go. They
never start a store by accident: only ``start`` does.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from sglang_simm.embedded._host import HostServer, StoreUnreachable, pid_alive, wait_gone
from sglang_simm.embedded._index import EVICTION_POLICIES
from sglang_simm.embedded._paths import StorePaths, read_pid, store_dir, store_names

_DEFAULT_NAME = "default"


def add_arguments(sub: Any) -> None:
    store = sub.add_parser("store", help="start, inspect, clear or stop the host store (manager_address: local)")
    actions = store.add_subparsers(dest="store_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", metavar="DIR", help="the store directory (default: $SGLANG_SIMM_STORE_DIR or "
                       "/dev/shm/sglang-simm-<uid>)")

    status = actions.add_parser("status", help="capacity, bytes used, objects, hits and misses, clients")
    status.add_argument("name", nargs="?", help="one store (default: every store in the directory)")
    status.add_argument("--json", action="store_true", help="print JSON")
    common(status)
    start = actions.add_parser("start", help="start a store now, with a capacity and eviction policy")
    start.add_argument("name", nargs="?", default=_DEFAULT_NAME)
    start.add_argument("--capacity", default="4GiB", help="bytes of objects it holds (e.g. 512MiB, 8GiB)")
    start.add_argument("--eviction", choices=EVICTION_POLICIES, default="fifo")
    common(start)
    clear = actions.add_parser("clear", help="remove every object of a store")
    clear.add_argument("name")
    common(clear)
    stop = actions.add_parser("stop", help="stop a store (its objects are gone)")
    stop.add_argument("name", nargs="?")
    stop.add_argument("--all", action="store_true", help="stop every store in the directory")
    common(stop)


def _handle(root: str, name: str) -> HostServer:
    server = HostServer(name, root=root, capacity=1, spawn=False, timeout_s=5.0)
    server.open(wait_s=1.0)
    return server


def _human(n: int) -> str:
    from sglang_simm.embedded._copy import human_bytes

    return human_bytes(int(n))


def _status_of(root: str, name: str) -> dict[str, Any]:
    try:
        server = _handle(root, name)
    except StoreUnreachable as exc:
        pid = read_pid(StorePaths(root, name))
        return {"name": name, "running": False, "why": str(exc), "pid": pid if pid_alive(pid) else None}
    try:
        status = server.status()
    finally:
        server.close()
    status["running"] = True
    return status


def run_store(console: Any, args: argparse.Namespace) -> int:
    from sglang_simm.values import parse_byte_size

    root = store_dir(args.dir)
    what = args.store_command
    if what == "status":
        names = [args.name] if args.name else store_names(root)
        statuses = [_status_of(root, n) for n in names]
        if args.json:
            console.print_json(json.dumps(statuses))
        else:
            _print_status(console, root, statuses)
        return 0 if all(s["running"] for s in statuses) else 1
    if what == "start":
        capacity = parse_byte_size(args.capacity)
        server = HostServer(args.name, root=root, capacity=capacity, policy=args.eviction, timeout_s=5.0)
        server.open()
        status = server.status()
        server.close()
        if status["capacity_bytes"] != capacity or status["policy"] != args.eviction:
            console.print(
                f"store {args.name!r} was already running (pid {status['pid']}) with capacity "
                f"{_human(status['capacity_bytes'])} and {status['policy']} eviction; "
                f"stop it first to change them: sglang-simm store stop {args.name}"
            )
            return 1
        console.print(f"store {args.name!r} running: pid {status['pid']}, capacity {_human(capacity)}, "
                      f"{args.eviction} eviction, socket {StorePaths(root, args.name).socket}")
        return 0
    if what == "clear":
        server = _handle(root, args.name)
        try:
            removed = server.admin("clear")["removed"]
        finally:
            server.close()
        console.print(f"store {args.name!r}: removed {removed} objects")
        return 0
    if what == "stop":
        if not args.all and not args.name:
            raise ValueError("name a store to stop, or pass --all")
        names = store_names(root) if args.all else [args.name]
        code = 0
        for name in names:
            code |= _stop(console, root, name)
        return code
    raise ValueError(f"unknown store command {what!r}")


def _stop(console: Any, root: str, name: str) -> int:
    paths = StorePaths(root, name)
    try:
        server = _handle(root, name)
    except StoreUnreachable:
        pid = read_pid(paths)
        if pid_alive(pid):
            console.print(f"store {name!r} (pid {pid}) does not answer; stopping it with SIGTERM")
            import os
            import signal

            os.kill(pid, signal.SIGTERM)
            if wait_gone(paths, pid, 10.0):
                return 0
            console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
            return 1
        console.print(f"store {name!r} is not running")
        return 0
    pid = server.pid
    started = time.monotonic()
    if server.stop():
        console.print(f"store {name!r} (pid {pid}) stopped in {time.monotonic() - started:.2f} s")
        return 0
    console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
    return 1


def _print_status(console: Any, root: str, statuses: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not statuses:
        console.print(f"no host store in {root}")
        return
    for s in statuses:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        if not s["running"]:
            grid.add_row("state", "not running" + (f" (pid {s['pid']} does not answer)" if s.get("pid") else ""))
            console.print(f"[bold]store {s['name']!r}[/bold] in {root}")
            console.print(grid)
            continue
        total = s["hits"] + s["misses"]
        capacity = _human(s["capacity_bytes"])
        if s.get("memory_limited"):
            capacity += f" (lowered: shared memory ran out: {s.get('memory_error')})"
        rows = [
            ("pid", f"{s['pid']}, up {s['uptime_s']:.0f} s"),
            ("capacity", f"{capacity}, {s['policy']} eviction"),
            ("used", f"{_human(s['used_bytes'])} in {s['objects']} objects"
                     + (f", {_human(s['reserved_bytes'])} being written" if s["reserved_bytes"] else "")),
            ("shared memory", f"{_human(s['committed_bytes'])} committed of a {_human(s['arena_bytes'])} arena"),
            ("gets", f"{s['hits']} hits, {s['misses']} misses"
                     + (f" ({s['hits'] / total:.0%} hit rate)" if total else "")),
            ("puts", f"{s['puts']} stored ({_human(s['bytes_in'])}), {s['evictions']} evicted, "
                     f"{s['rejected'] + s['out_of_memory']} refused"),
            ("clients", ", ".join(map(str, s["clients"])) or "none connected"),
        ]
        for key, value in rows:
            grid.add_row(key, value)
        console.print(f"[bold]store {s['name']!r}[/bold] in {root}")
        console.print(grid)
