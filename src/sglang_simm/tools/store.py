"""``sglang-simm store``: start, inspect, clear and stop local stores.

A local store (``manager_address: "local"`` or ``"local://NAME"``) starts by
itself with its first client; these commands are for the operator who
wants to size it before servers start, look inside, or let it go. They
never start a store by accident: only ``start`` does (and it takes a dead
store's objects over, with that store's settings). ``status`` shows dead
stores and the memory they still hold; ``stop`` frees it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from sglang_simm.embedded.admin import (
    EVICTION_POLICIES,
    HostServer,
    StorePaths,
    StoreUnreachable,
    check_name,
    held_bytes,
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


def add_arguments(sub: Any) -> None:
    store = sub.add_parser("store", help="start, inspect, clear or stop the local store (manager_address: local)")
    actions = store.add_subparsers(dest="store_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", metavar="DIR", help="the store directory (default: $SGLANG_SIMM_STORE_DIR or "
                       "/dev/shm/sglang-simm-<uid>)")

    status = actions.add_parser("status", help="capacity, bytes used, objects, hits and misses, clients")
    status.add_argument("name", nargs="?", help="one store (default: every store in the directory)")
    status.add_argument("--all", action="store_true",
                        help="list stopped stores too (by default: running stores and dead ones holding memory)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--prometheus", action="store_true",
                        help="print the counters in Prometheus text format (sglang_simm:store_*)")
    common(status)
    start = actions.add_parser("start", help="start a store now, with a capacity and eviction policy")
    start.add_argument("name", nargs="?", default=_DEFAULT_NAME)
    start.add_argument("--capacity", default="4GiB", help="bytes of objects it holds (e.g. 512MiB, 8GiB)")
    start.add_argument("--eviction", choices=EVICTION_POLICIES, default="fifo")
    start.add_argument("--idle-exit", type=float, default=0.0, metavar="S",
                       help="exit (freeing its memory) after S seconds with no client (default 0: never)")
    start.add_argument("--max-connections", type=int, help="connections at once (default 1024)")
    start.add_argument("--max-objects", type=int, help="objects at once (default: one per 4 KiB of capacity)")
    start.add_argument("--force", action="store_true",
                       help="start even with a capacity beyond what the store directory's filesystem (or, on "
                            "tmpfs, the host's memory) can back: a warning instead of a refusal")
    common(start)
    clear = actions.add_parser("clear", help="remove every object of a store")
    clear.add_argument("name")
    common(clear)
    stop = actions.add_parser("stop", help="stop a store (its objects are gone)")
    stop.add_argument("name", nargs="?")
    stop.add_argument("--all", action="store_true", help="stop every store in the directory (asks first)")
    stop.add_argument("--yes", action="store_true", help="with --all: do not ask")
    common(stop)


def _human(n: int) -> str:
    from sglang_simm.embedded.admin import human_bytes

    return human_bytes(int(n))


def _status_of(root: str, name: str) -> dict[str, Any]:
    paths = StorePaths(root, name)
    try:
        return running_status(root, name)
    except StoreUnreachable as exc:
        pid = read_pid(paths)
        held = held_bytes(paths)
        return {"name": name, "running": False, "why": str(exc), "pid": pid if pid_alive(pid) else None,
                "dead": not lock_held(paths) and (held > 0 or os.path.exists(paths.settings)),
                "held_bytes": held}


def run_store(console: Any, args: argparse.Namespace) -> int:
    from sglang_simm.values import parse_byte_size

    root = store_dir(args.dir)
    what = args.store_command
    if what == "status":
        names = [check_name(args.name)] if args.name else store_names(root)
        statuses = [_status_of(root, n) for n in names]
        hidden = 0
        if not args.name and not args.all:  # what an operator acts on; a stopped store holds nothing
            shown = [st for st in statuses if st["running"] or st.get("dead") or st.get("pid")]
            hidden, statuses = len(statuses) - len(shown), shown
        if args.prometheus:
            from sglang_simm.embedded.admin import render_metrics as render

            print(render(statuses), end="")
        elif args.json:
            console.print_json(json.dumps(statuses))
        elif args.name:
            _print_status(console, root, statuses)
        else:
            _print_table(console, root, statuses, hidden)
        return 0 if all(s["running"] for s in statuses) else 1
    if what == "start":
        capacity = parse_byte_size(args.capacity)
        limits = {k: v for k, v in (("max_connections", args.max_connections), ("max_objects", args.max_objects))
                  if v is not None}
        if args.idle_exit < 0:
            raise ValueError(f"--idle-exit must be >= 0 seconds (0: never), got {args.idle_exit:g}")
        from sglang_simm.embedded.admin import StoreLimits

        StoreLimits.from_dict(limits)  # a bad value fails here, naming the option's field
        paths = StorePaths(root, check_name(args.name))
        running = os.path.exists(paths.socket) and lock_held(paths)
        if not running:
            # before anything is started or any memory taken: what this host can back
            from sglang_simm.embedded.admin import Backing

            os.makedirs(root, mode=0o700, exist_ok=True)
            backing = Backing.of(root)
            refusal, warning = backing.check(capacity)
            if refusal and not args.force:
                console.print(f"store {args.name!r} not started: {refusal}. Choose a smaller --capacity "
                              f"(or --force to start it anyway)")
                return 1
            if refusal or warning:
                console.print(f"warning: {refusal or warning}")
            console.print(f"starting store {args.name!r} in {root}: capacity {_human(capacity)}, "
                          f"{args.eviction} eviction ({backing.figures()})")
        server = HostServer(check_name(args.name), root=root, capacity=capacity, policy=args.eviction,
                            timeout_s=5.0, idle_exit_s=args.idle_exit, started_by="operator", limits=limits,
                            force=args.force)
        t0 = time.monotonic()
        server.open()
        status = server.status()
        server.close()
        if not running:
            console.print(f"store {args.name!r} answered in {time.monotonic() - t0:.2f} s; its log: {paths.log}")
        if status.get("recovered"):
            console.print(f"store {args.name!r} took over {status['recovered']} objects of the store process "
                          f"that died, with the settings it was started with")
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
        # what the files hold: after a clear with a put still being copied, more than the committed prefix
        console.print(f"store {args.name!r}: removed {done['removed']} objects; "
                      f"{_human(held_bytes(server.paths))} of shared memory still held")
        return 0
    if what == "stop":
        if not args.all and not args.name:
            raise ValueError("name a store to stop, or pass --all")
        names = store_names(root) if args.all else [check_name(args.name)]
        if args.all and names and not _confirmed(console, root, names, args.yes):
            return 1
        code = 0
        for name in names:
            code |= _stop(console, root, name)
        return code
    raise ValueError(f"unknown store command {what!r}")


def _confirmed(console: Any, root: str, names: list[str], yes: bool) -> bool:
    """``stop --all`` stops what other servers of this user may be using:
    say which, and ask (or, without a terminal, want ``--yes``)."""
    running = [st for st in (_status_of(root, n) for n in names) if st["running"]]
    if not running:
        return True
    listing = ", ".join(f"{st['name']!r} ({len(st['clients'])} clients)" for st in running)
    console.print(f"this stops {len(running)} running stores in {root}: {listing}; their objects are lost, "
                  "and SGLang servers using them read misses")
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ValueError("stop --all stops every store of this user in the directory: pass --yes to confirm, "
                         "or name one store")
    return input("stop them? [y/N] ").strip().lower() in ("y", "yes")


def _why(exc: StoreUnreachable) -> str:
    """What went wrong, without the transport code an operator cannot act on."""
    return str(exc).partition(": ")[2] or str(exc)


def _known(root: str) -> str:
    names = store_names(root)
    return f"stores in this directory: {', '.join(names)}" if names else "no store has run in this directory"


def _stop(console: Any, root: str, name: str) -> int:
    paths = StorePaths(root, name)
    if name not in store_names(root) and not os.path.exists(paths.lock):
        console.print(f"[red]no store named {name!r} in {root}[/red]; {_known(root)} "
                      "(--dir or $SGLANG_SIMM_STORE_DIR names another directory)")
        return 1
    try:
        server = open_running(root, name)
    except StoreUnreachable:
        pid = read_pid(paths)
        if pid_alive(pid):
            console.print(f"store {name!r} (pid {pid}) does not answer; stopping it with SIGTERM")
            import signal

            os.kill(pid, signal.SIGTERM)
            if wait_gone(paths, pid, 10.0):
                return 0
            console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
            return 1
        return _free_dead(console, paths)
    pid = server.pid
    started = time.monotonic()
    if server.stop():
        console.print(f"store {name!r} (pid {pid}) stopped in {time.monotonic() - started:.2f} s")
        return 0
    console.print(f"[red]store {name!r} (pid {pid}) did not stop[/red]")
    return 1


def _free_dead(console: Any, paths: StorePaths) -> int:
    """A store whose process died: free the memory its files hold, holding
    the name's lock so that no store starts meanwhile."""
    import fcntl

    from sglang_simm.embedded.admin import arena_held, remove_files

    if any(arena_held(a) for a in paths.arenas()):  # its lock file removed, a store process still serves
        console.print(f"store {paths.name!r}: a live store process holds its arena; stop that process")
        return 1
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                console.print(f"store {paths.name!r} is starting or stopping; try again")
                return 1
        held = held_bytes(paths)
        remove_files(paths, objects=True)
    finally:
        if fd is not None:
            os.close(fd)
    if held:
        console.print(f"store {paths.name!r} was not running: freed the {_human(held)} its files held")
    else:
        console.print(f"store {paths.name!r} is not running")
    return 0


def _print_table(console: Any, root: str, statuses: list[dict[str, Any]], hidden: int) -> None:
    """Every store of the directory, a line each."""
    from rich.table import Table

    if not statuses:
        console.print(f"no running local store in {root}" + (f" ({hidden} stopped: --all lists them)" if hidden else ""))
        return
    table = Table(title=f"local stores in {root}", title_justify="left")
    for column in ("store", "state", "used", "objects", "hit rate", "clients"):
        table.add_column(column, justify="left" if column in ("store", "state") else "right", no_wrap=True)
    for st in statuses:
        if not st["running"]:
            state = (f"dead, holds {_human(st.get('held_bytes', 0))}" if st.get("dead")
                     else f"pid {st['pid']} does not answer" if st.get("pid") else "stopped")
            table.add_row(st["name"], state, "", "", "", "")
            continue
        total = st["hits"] + st["misses"]
        table.add_row(st["name"], f"pid {st['pid']}", f"{_human(st['used_bytes'])}/{_human(st['capacity_bytes'])}", str(st["objects"]),
                      f"{st['hits'] / total:.0%}" if total else "-", str(len(st["clients"])))
    console.print(table)
    if hidden:
        console.print(f"{hidden} stopped stores not shown (--all lists them); 'sglang-simm store status NAME' "
                      "shows one in full")


def _print_status(console: Any, root: str, statuses: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not statuses:
        console.print(f"no local store in {root}")
        return
    for s in statuses:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        if not s["running"]:
            state = "not running" + (f" (pid {s['pid']} does not answer)" if s.get("pid") else "")
            if s.get("dead"):
                state = (f"dead: its process is gone, its files hold {_human(s.get('held_bytes', 0))}; "
                         f"'sglang-simm store start {s['name']}' takes its objects over, "
                         f"'sglang-simm store stop {s['name']}' frees them")
            grid.add_row("state", state)
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
            ("shared memory", f"{_human(s['held_bytes'])} held "
                              f"({_human(s['committed_bytes'])} committed) of a {_human(s['arena_bytes'])} arena"),
            ("gets", f"{s['hits']} hits, {s['misses']} misses"
                     + (f" ({s['hits'] / total:.0%} hit rate)" if total else "")),
            ("puts", f"{s['puts']} stored ({_human(s['bytes_in'])}), {s['evictions']} evicted, "
                     f"{s['rejected'] + s['out_of_memory']} refused"),
            ("clients", ", ".join(map(str, s["clients"])) or "none connected"),
            ("leases", f"{s['open_leases']} open"
                       + (f", {s['closed_leases']} of closed connections holding {_human(s['closed_held_bytes'])} "
                          f"for pids {', '.join(map(str, s['closed_pids']))} until they fence or exit"
                          if s.get("closed_leases") else "")),
            ("refused", ", ".join(f"{k[len('refused_'):]} {v}" for k, v in sorted(s.items())
                                  if k.startswith("refused_") and v) or "nothing"),
            ("idle exit", f"after {s['idle_exit_s']:g} s with no client" if s.get("idle_exit_s") else "never"),
        ]
        if s.get("recovered"):
            rows.append(("recovered", f"{s['recovered']} objects taken over in {s.get('takeover_s', 0):.3f} s"))
        for key, value in rows:
            grid.add_row(key, value)
        console.print(f"[bold]store {s['name']!r}[/bold] in {root}")
        console.print(grid)
