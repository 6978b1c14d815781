"""``sglang-simm store``: start, inspect, clear and stop local stores.

A local store (``manager_address: "local"`` or ``"local://NAME"``) starts by
itself with its first client; these commands are for the operator who wants
to size it before servers start, look inside, or let it go. Only ``start``
starts a store. A store keeps its objects when it stops (``stop --discard``
and ``clear`` drop them); ``status`` shows stopped stores and what their
files hold.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from sglang_simm.local_store.admin import (
    EVICTION_POLICIES,
    StorePaths,
    StoreUnreachable,
    check_name,
    files_bytes,
    lock_held,
    open_running,
    pid_alive,
    read_pid,
    running_status,
    store_dir,
    store_names,
    wait_gone,
)

_DEFAULT_NAME = "default"
#: The smallest capacity a store is started with: a few pages of a large
#: model, and SiMM's largest object (64 MiB) with room to spare.
MIN_CAPACITY = 64 << 20


def add_arguments(sub: Any) -> None:
    store = sub.add_parser("store", help="start, inspect, clear or stop the local store (manager_address: local)")
    actions = store.add_subparsers(dest="store_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", metavar="DIR", help="the store directory (default: $SGLANG_SIMM_STORE_DIR or "
                       "/dev/shm/sglang-simm-<uid>); memory (tmpfs) or a disk")

    status = actions.add_parser("status", help="capacity, bytes used, objects, hits and misses, clients")
    status.add_argument("name", nargs="?", help="one store (default: every store in the directory)")
    status.add_argument("--all", action="store_true", help="list stores that hold nothing too")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--prometheus", action="store_true", help="print Prometheus text (sglang_simm:store_*)")
    common(status)
    start = actions.add_parser("start", help="start a store now, with a capacity and eviction policy")
    start.add_argument("name", nargs="?", default=_DEFAULT_NAME)
    start.add_argument("--capacity", help="bytes of objects it holds (e.g. 512MiB, 8GiB; default 4 GiB on "
                       "memory, half the free space on a disk)")
    start.add_argument("--eviction", choices=EVICTION_POLICIES, default="fifo")
    start.add_argument("--idle-exit", type=float, default=0.0, metavar="S",
                       help="exit after S seconds with no client (default 0: never)")
    start.add_argument("--max-connections", type=int, help="connections at once (default 1024)")
    start.add_argument("--max-objects", type=int, help="objects at once (default: one per 4 KiB of capacity)")
    start.add_argument("--force", action="store_true",
                       help="start even with a capacity beyond what is free or backed now (never beyond what a "
                            "client can map)")
    common(start)
    clear = actions.add_parser("clear", help="remove every object of a store")
    clear.add_argument("name")
    common(clear)
    stop = actions.add_parser("stop", help="stop a store (its objects are kept for its next start)")
    stop.add_argument("name", nargs="?")
    stop.add_argument("--discard", action="store_true", help="drop its objects too, and free what they hold")
    stop.add_argument("--all", action="store_true", help="stop every store in the directory (asks first)")
    stop.add_argument("--yes", action="store_true", help="with --all: do not ask")
    common(stop)


def _human(n: int) -> str:
    from sglang_simm.local_store.admin import human_bytes

    return human_bytes(int(n))


def _status_of(root: str, name: str) -> dict[str, Any]:
    paths = StorePaths(root, name)
    try:
        return running_status(root, name)
    except StoreUnreachable as exc:
        pid = read_pid(paths)
        return {"name": name, "dir": root, "running": False, "why": _why(exc),
                "pid": pid if pid_alive(pid) else None, "files_bytes": files_bytes(paths),
                "kept": bool(paths.segments())}


def parse_capacity(text: str) -> int:
    """``--capacity`` in bytes: a size above the floor, or a clear error."""
    from sglang_simm.values import parse_byte_size

    stripped = text.strip()
    if stripped.startswith("-"):
        raise ValueError(f"--capacity must be a positive size such as 512MiB or 8GiB, got {text!r}")
    capacity = parse_byte_size(stripped)
    if capacity < MIN_CAPACITY:
        raise ValueError(f"--capacity {text} is below the smallest store, {_human(MIN_CAPACITY)}: a store must hold "
                         "SiMM's largest object (64 MiB); give 64MiB or more")
    return capacity


def run_store(console: Any, args: argparse.Namespace) -> int:
    root = store_dir(args.dir)
    what = args.store_command
    if what == "status":
        names = [check_name(args.name)] if args.name else store_names(root)
        statuses = [_status_of(root, n) for n in names]
        hidden = 0
        if not args.name and not args.all:  # what an operator acts on: running, or files held
            shown = [s for s in statuses if s["running"] or s.get("files_bytes") or s.get("pid")]
            hidden, statuses = len(statuses) - len(shown), shown
        if args.prometheus:
            from sglang_simm.local_store.admin import render_metrics

            print(render_metrics(statuses), end="")
        elif args.json:
            console.print_json(json.dumps(statuses))
        elif args.name:
            _print_status(console, root, statuses)
        else:
            _print_table(console, root, statuses, hidden)
        return 0 if all(s["running"] for s in statuses) else 1
    if what == "start":
        return _start(console, root, args)
    if what == "clear":
        try:
            server = open_running(root, check_name(args.name))
        except StoreUnreachable as exc:
            console.print(f"[red]store {args.name!r} is not running in {root}[/red] ({_why(exc)}): nothing to "
                          f"clear; {_known(root)}")
            return 1
        try:
            done = server.admin("clear")
        finally:
            server.close()
        console.print(f"store {args.name!r}: removed {done['removed']} objects; its files hold "
                      f"{_human(files_bytes(server.paths))}")
        return 0
    if what == "stop":
        if not args.all and not args.name:
            raise ValueError("name a store to stop, or pass --all")
        names = store_names(root) if args.all else [check_name(args.name)]
        if args.all and names and not _confirmed(console, root, names, args.yes):
            return 1
        return max((_stop(console, root, name, args.discard) for name in names), default=0)
    raise ValueError(f"unknown store command {what!r}")


def _start(console: Any, root: str, args: argparse.Namespace) -> int:
    from sglang_simm.local_store.admin import Backing, StoreHandle, StoreLimits, capacity_problem

    limits = {k: v for k, v in (("max_connections", args.max_connections), ("max_objects", args.max_objects))
              if v is not None}
    if args.idle_exit < 0:
        raise ValueError(f"--idle-exit must be >= 0 seconds (0: never), got {args.idle_exit:g}")
    StoreLimits.from_dict(limits)  # a bad value fails here, naming the option's field
    paths = StorePaths(root, check_name(args.name))
    if os.path.exists(paths.socket) and lock_held(paths):
        status = running_status(root, args.name)
        console.print(f"store {args.name!r} is already running (pid {status['pid']}): capacity "
                      f"{_human(status['capacity_bytes'])}, {status['policy']} eviction, {status['medium']} in {root}")
        asked = parse_capacity(args.capacity) if args.capacity else status["capacity_bytes"]
        if (asked, args.eviction) != (status["capacity_bytes"], status["policy"]):
            console.print(f"to change them, stop it first (its objects are kept): sglang-simm store stop {args.name}")
            return 1
        return 0
    os.makedirs(root, mode=0o700, exist_ok=True)
    from sglang_simm.local_store import default_capacity_bytes

    backing = Backing.of(root)
    capacity = parse_capacity(args.capacity) if args.capacity else default_capacity_bytes(root)
    refusal, warning = capacity_problem(root, capacity, force=args.force)
    if refusal:
        console.print(f"store {args.name!r} not started: {refusal}. Choose a smaller --capacity"
                      + ("" if "map" in refusal else " (or --force to start it anyway)"))
        return 1
    if warning:
        console.print(f"warning: {warning}")
    console.print(f"starting store {args.name!r} in {root}: capacity {_human(capacity)}, {args.eviction} eviction "
                  f"({backing.figures()})")
    server = StoreHandle(args.name, root=root, capacity=capacity, policy=args.eviction, timeout_s=5.0,
                         idle_exit_s=args.idle_exit, started_by="operator", limits=limits, force=args.force, data=False)
    t0 = time.monotonic()
    server.open()
    status = server.status()
    server.close()
    console.print(f"store {args.name!r} running: pid {status['pid']}, capacity {_human(status['capacity_bytes'])}, "
                  f"{status['policy']} eviction, answered in {time.monotonic() - t0:.2f} s; socket {paths.socket}, "
                  f"log {paths.log}")
    if status.get("recovered"):
        console.print(f"it serves {status['recovered']} objects kept from its last run")
    return 0


def _confirmed(console: Any, root: str, names: list[str], yes: bool) -> bool:
    """``stop --all`` stops what other servers of this user may be using: say which, and ask."""
    running = [s for s in (_status_of(root, n) for n in names) if s["running"]]
    if not running:
        return True
    listing = ", ".join(f"{s['name']!r} ({len(s['clients'])} clients)" for s in running)
    console.print(f"this stops {len(running)} running stores in {root}: {listing}; SGLang servers using them read "
                  "misses until a store starts again")
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ValueError("stop --all stops every store of this user in the directory: pass --yes to confirm, "
                         "or name one store")
    return input("stop them? [y/N] ").strip().lower() in ("y", "yes")


def _why(exc: StoreUnreachable) -> str:
    return str(exc).partition(": ")[2] or str(exc)


def _known(root: str) -> str:
    names = store_names(root)
    return f"stores in this directory: {', '.join(names)}" if names else "no store has run in this directory"


def _stop(console: Any, root: str, name: str, discard: bool) -> int:
    paths = StorePaths(root, name)
    if name not in store_names(root) and not os.path.exists(paths.lock):
        console.print(f"[red]no store named {name!r} in {root}[/red]; {_known(root)} "
                      "(--dir or $SGLANG_SIMM_STORE_DIR names another directory)")
        return 1
    try:
        server = open_running(root, name)
    except StoreUnreachable:
        pid = read_pid(paths)
        if pid_alive(pid) and lock_held(paths):
            console.print(f"store {name!r} (pid {pid}) does not answer; stopping it with SIGTERM")
            os.kill(pid, signal.SIGTERM)
            if not wait_gone(paths, pid, 10.0):
                console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
                return 1
        return _discard(console, paths) if discard else _say_kept(console, paths)
    pid, started = server.pid, time.monotonic()
    if not server.stop(discard=discard):
        console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
        return 1
    console.print(f"store {name!r} (pid {pid}) stopped in {time.monotonic() - started:.2f} s; "
                  + ("its objects are discarded" if discard else
                     f"its files keep {_human(files_bytes(paths))} for its next start ('stop --discard' frees them)"))
    return 0


def _say_kept(console: Any, paths: StorePaths) -> int:
    held = files_bytes(paths)
    console.print(f"store {paths.name!r} is not running" + (f"; its files keep {_human(held)} for its next start "
                                                          "('stop --discard' frees them)" if held else ""))
    return 0


def _discard(console: Any, paths: StorePaths) -> int:
    """A store not running: free what its files hold, holding the name's lock
    so that no store starts meanwhile."""
    from sglang_simm.local_store.admin import lock_name, remove_files

    fd = lock_name(paths, wait_s=0.5)
    if fd is None:
        console.print(f"store {paths.name!r} is starting or stopping; try again")
        return 1
    try:
        held = files_bytes(paths)
        remove_files(paths)
    finally:
        os.close(fd)
    console.print(f"store {paths.name!r} is not running: freed the {_human(held)} its files held")
    return 0


def _print_table(console: Any, root: str, statuses: list[dict[str, Any]], hidden: int) -> None:
    from rich.table import Table

    if not statuses:
        console.print(f"no local store in {root}" + (f" ({hidden} stopped and empty: --all lists them)"
                                                     if hidden else ""))
        return
    table = Table(title=f"local stores in {root}", title_justify="left")
    for column in ("store", "state", "used", "objects", "hit rate", "clients"):
        table.add_column(column, justify="left" if column in ("store", "state") else "right", no_wrap=True)
    for s in statuses:
        if not s["running"]:
            state = (f"pid {s['pid']} does not answer" if s.get("pid") else
                     f"stopped, keeps {_human(s['files_bytes'])}" if s.get("files_bytes") else "stopped")
            table.add_row(s["name"], state, "", "", "", "")
            continue
        total = s["hits"] + s["misses"]
        table.add_row(s["name"], f"pid {s['pid']}, {s['medium']}",
                      f"{_human(s['used_bytes'])}/{_human(s['capacity_bytes'])}", str(s["objects"]),
                      f"{s['hits'] / total:.0%}" if total else "-", str(len(s["clients"])))
    console.print(table)
    if hidden:
        console.print(f"{hidden} stopped stores holding nothing not shown (--all lists them)")


def _print_status(console: Any, root: str, statuses: list[dict[str, Any]]) -> None:
    from rich.table import Table

    for s in statuses:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        console.print(f"[bold]store {s['name']!r}[/bold] in {root}")
        if not s["running"]:
            state = "not running" + (f" (pid {s['pid']} does not answer)" if s.get("pid") else "")
            if s.get("files_bytes"):
                state += (f"; its files keep {_human(s['files_bytes'])}: 'sglang-simm store start {s['name']}' "
                          f"serves them, 'sglang-simm store stop --discard {s['name']}' frees them")
            grid.add_row("state", state)
            console.print(grid)
            continue
        total = s["hits"] + s["misses"]
        capacity = _human(s["capacity_bytes"])
        if s.get("memory_limited"):
            capacity += f" (lowered: {s.get('memory_error') or 'the disk is nearly full'})"
        rows = [
            ("pid", f"{s['pid']}, up {s['uptime_s']:.0f} s"),
            ("medium", f"{s['medium']}: {_human(s['fs_free_bytes'])} free of {_human(s['fs_total_bytes'])}"),
            ("capacity", f"{capacity}, {s['policy']} eviction; a client holds at most "
                         f"{_human(s['client_share_bytes'])} in grants"),
            ("used", f"{_human(s['used_bytes'])} in {s['objects']} objects"
                     + (f", {_human(s['reserved_bytes'])} being written" if s["reserved_bytes"] else "")),
            ("files", f"{_human(s['files_bytes'])} in {s['segments']} segments"
                      + (f", {_human(s['held_bytes'])} held for an earlier store process's clients"
                         if s.get("earlier_held") else "")),
            ("gets", f"{s['hits']} hits, {s['misses']} misses" + (f" ({s['hits'] / total:.0%})" if total else "")),
            ("puts", f"{s['puts']} stored ({_human(s['bytes_in'])}), {s['evictions']} evicted, "
                     f"{s['rejected'] + s['out_of_memory']} refused"),
            ("clients", ", ".join(map(str, s["clients"])) or "none connected"),
            ("grants", f"{s['open_grants']} open" + (f", {s['orphaned_grants']} of closed connections, held until "
                                                    f"pids {', '.join(map(str, s['orphan_pids']))} finish their "
                                                    "copies" if s.get("orphaned_grants") else "")),
            ("refused", ", ".join(f"{k[len('refused_'):]} {v}" for k, v in sorted(s.items())
                                  if k.startswith("refused_") and v) or "nothing"),
            ("idle exit", f"after {s['idle_exit_s']:g} s with no client" if s.get("idle_exit_s") else "never"),
        ]
        if s.get("recovered"):
            rows.append(("recovered", f"{s['recovered']} objects kept from its last run"
                                      + (f", {s['checksum_failures']} failed their checksum" if
                                         s.get("checksum_failures") else "")))
        for key, value in rows:
            grid.add_row(key, value)
        console.print(grid)
