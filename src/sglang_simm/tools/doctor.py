"""``sglang-simm doctor``: everything that decides whether a start will work.

Reads the same sources the backend reads, so what it prints is what the
backend would do. Each check adds rows; a check that would block a start
adds a problem, and any problem makes the exit status 1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang_simm import __version__
from sglang_simm.client import connect, import_real_client
from sglang_simm.config import (
    SOURCES,
    SiMMConfig,
    client_flag,
    find_deprecated_names,
    find_unknown_keys,
    load_config,
    with_client_flag,
    with_current_names,
)
from sglang_simm.errors import ClientNotInstalledError
from sglang_simm.numa import list_rdma_devices, select_nics

#: Where SGLang comes from: PyPI has it (this package is not on an index yet).
SGLANG_INSTALL = "pip install 'sglang>=0.5.8,<0.6'"

PLUGIN_SINCE = (0, 5, 11)


@dataclass
class Report:
    #: what blocks a start (exit status 1)
    problems: list[str] = field(default_factory=list)
    #: what works but is likely not what was meant (an ignored key, a store of another size)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _grid(title: str, *columns: str, right: tuple[str, ...] = (), dim: tuple[str, ...] = ()) -> Any:
    """A titled table with ``columns``; those in ``right`` right-aligned (numbers), in ``dim`` dimmed."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", title_style="bold", show_header=True, header_style="dim")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", style="dim" if column in dim else None)
    return table


def version_tuple(text: Any) -> tuple[int, ...]:
    """``"0.5.11rc1"`` -> ``(0, 5, 11)``; ``()`` for no version."""
    out = []
    for piece in str(text or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def sglang_status() -> dict[str, Any]:
    """SGLang's version and which of our routes it offers; imports no SGLang."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        sglang_version = None
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "simm"]
    ours = [ep for ep in eps if ep.value.startswith("sglang_simm")]
    plugin_ok = bool(sglang_version) and version_tuple(sglang_version) >= PLUGIN_SINCE
    return {
        "version": sglang_version,
        "entry_point": ours[0].value if ours else None,
        "other_simm_entry_points": [ep.value for ep in eps if ep not in ours],
        "plugin_route": plugin_ok and bool(ours),
        "dynamic_route": bool(sglang_version),
    }


#: Extra-config keys that only choose SGLang's route; each launch line sets its own.
_ROUTE_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")

#: The HiCache settings under which L3 pays, each with why: every launch line
#: this project writes carries them (tests/test_examples.py), set explicitly
#: since SGLang's defaults differ by release.
RECOMMENDED: tuple[tuple[str, str], ...] = (
    ("--hicache-ratio 2", "a host pool twice the GPU KV pool, so pages outlive their GPU copy; it needs that "
     "much free host memory per server (twice the GPU KV pool's bytes, beyond the 10 GiB SGLang keeps free), "
     "else SGLang refuses to start ('Not enough host memory available'): lower it, or use --hicache-size GB, "
     "on a small host"),
    ("--hicache-storage-prefetch-policy timeout", "a request waits for its L3 read, up to prefetch_timeout_base "
     "(1 s) plus 0.25 s per 1,024 tokens (wait_complete: no bound); best_effort, the default before 0.5.23, "
     "cuts most L3 reads short"),
    ("--hicache-write-policy write_through", "pages go to L3 as soon as they are computed (write_back: only "
     "when the GPU pool evicts them)"),
)


def launch_lines(extra: dict[str, Any]) -> dict[str, str]:
    """Ready-to-paste launch commands for both routes, carrying ``extra``
    (a valid configuration's own keys) as the extra config and the
    ``RECOMMENDED`` settings."""
    base = {k: v for k, v in extra.items() if k not in _ROUTE_KEYS}
    dynamic = {
        "backend_name": "simm",
        "module_path": "sglang_simm",
        "class_name": "HiCacheSiMM",
        "interface_v1": 1,
        **base,
    }
    common = ("python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache --hicache-mem-layout "
              "page_first " + " ".join(flag for flag, _why in RECOMMENDED))
    return {
        "plugin (SGLang >= 0.5.11)": f"{common} --hicache-storage-backend simm "
        f"--hicache-storage-backend-extra-config '{json.dumps(base)}'",
        "dynamic (any SGLang)": f"{common} --hicache-storage-backend dynamic "
        f"--hicache-storage-backend-extra-config '{json.dumps(dynamic)}'",
    }


def address_only(extra: dict[str, Any]) -> Any:
    """A configuration of the manager address alone, as the sources resolve
    it (None when it is missing or invalid): what the client checks go by
    when another field is wrong."""
    for _name, source in SOURCES:
        try:
            found = source(extra, os.environ)
        except ValueError:
            continue
        if "manager_address" in found:
            try:
                return SiMMConfig(manager_address=found["manager_address"][0])
            except ValueError:
                return None
    return None


def _store_description(config: Any) -> str:
    if config.local_store_scope == "host":
        return f"local store {config.local_store_name!r} (one store process shared by this host's processes, no cluster)"
    return f"in-process local store {config.local_store_name!r} (inside one process, no cluster)"


@contextlib.contextmanager
def _quiet_config_log() -> Iterator[None]:
    """The config's warnings go into the report as problems instead."""
    log = logging.getLogger("sglang_simm.config")
    saved = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(saved)


def _text(value: Any) -> str:
    """A value shown as it is: rich would read ``[sglang]`` or ``[0]`` in it
    as markup and drop it."""
    from rich.markup import escape

    return escape(str(value))


def run_doctor(console: Any, extra: dict[str, Any], *, sysfs_root: str = "/sys") -> int:
    report = Report()
    console.print(f"[bold]sglang-simm {__version__} doctor[/bold]")

    # 1. configuration
    config = resolved = None
    unknown = find_unknown_keys(extra)
    # a near miss of a name of ours is a setting that silently does not apply:
    # a problem here (a deployment gate must not pass it), though the server
    # itself only warns; added after the round trip, which it does not concern
    typos = [f"configuration: {u.message()} The backend ignores it, so what it was meant to set does not "
             f"apply: rename it" for u in unknown if u.near_miss]
    report.warnings += [f"configuration: {u.message()} Remove it: the backend ignores it"
                        for u in unknown if not u.near_miss]
    # the launch lines carry what the backend reads, not the keys it ignores
    ignored = {u.key for u in unknown if u.source == "extra_config"}
    extra = {k: v for k, v in extra.items() if k not in ignored}
    # and the new names of renamed fields and flags, each old one a warning
    report.warnings += [f"configuration: {line}" for line in find_deprecated_names(extra)]
    extra = with_current_names(extra)
    try:
        with _quiet_config_log():
            resolved = load_config(extra)
        config = resolved.config
        table = _grid("Configuration", "field", "value", "source", dim=("source",))
        for name, value, source in resolved.describe():
            table.add_row(_text(name), _text(value), _text(source))
        console.print(table)
    except ValueError as exc:
        report.problems.append(f"configuration: {exc}")
    # Where the rest of the configuration is wrong, the address alone still
    # says which client the checks below are about.
    target = config
    if target is None:
        with _quiet_config_log():
            target = address_only(extra)

    # 2. the client
    table = _grid("SiMM client", "check", "result")
    if target is not None and target.is_local_store:
        table.add_row("client", _text(_store_description(target)))
    else:
        try:
            kv = import_real_client()
            table.add_row("simm.kv", _text(f"SiMM client at {getattr(kv, '__file__', '?')}"))
        except ClientNotInstalledError as exc:
            table.add_row("simm.kv", "[red]not usable[/red]")
            if target is not None:
                report.problems.append(str(exc))
            else:
                report.notes.append(str(exc))
        if target is not None and target.host:
            # the client's own round trip needs SiCL and RDMA; whether the manager
            # listens at all is one TCP connect, which every machine can try
            reached = _reach(target.host, target.port)
            table.add_row(f"manager {target.host}:{target.port}",
                          "reachable (TCP)" if reached is None else f"[red]not reachable[/red]: {_text(reached)}")
            if reached is not None:
                report.problems.append(
                    f"the cluster manager {target.host}:{target.port} does not accept a TCP "
                    f"connection ({reached}): check manager_address, the manager process and the firewall"
                )
    console.print(table)

    # 3. RDMA devices
    devices = list_rdma_devices(sysfs_root)
    table = _grid("RDMA devices", "device", "NUMA node", "ports", "active", right=("NUMA node",))
    for dev in devices:
        ports = ", ".join(f"{n}: {s}" for n, s in sorted(dev.port_states.items())) or "-"
        table.add_row(_text(dev.name), str(dev.numa_node), _text(ports), "yes" if dev.active else "[yellow]no[/yellow]")
    if not devices:
        table.add_row("(none)", "-", "-", "-")
    console.print(table)
    if config is not None and not config.is_local_store:
        choice = select_nics(config, sysfs_root=sysfs_root)
        if choice.devices:
            console.print(f"NICs this process would use: [bold]{_text(','.join(choice.devices))}[/bold] ({_text(choice.reason)})")
        else:
            report.problems.append(
                f"no usable RDMA device ({choice.reason}). SiMM's client moves data over RDMA: "
                "load the RDMA drivers (check /sys/class/infiniband), name devices with "
                "rdma_devices, or set manager_address to 'local' to run on the local store"
            )

    # 4. SGLang
    status = sglang_status()
    table = _grid("SGLang", "check", "result")
    table.add_row("installed", _text(status["version"]) if status["version"] else "[red]no[/red]")
    table.add_row("entry point 'simm'",
                  _text(status["entry_point"]) if status["entry_point"] else "[yellow]not registered[/yellow]")
    table.add_row("--hicache-storage-backend simm", "yes" if status["plugin_route"] else "no (needs 0.5.11+)")
    table.add_row("--hicache-storage-backend dynamic", "yes" if status["dynamic_route"] else "no")
    for other in status["other_simm_entry_points"]:
        table.add_row("[yellow]another 'simm' plugin[/yellow]", _text(other))
    console.print(table)
    if not status["version"]:
        report.notes.append(f"SGLang is not installed here: {SGLANG_INSTALL} (on a CPU machine, see the README's Install)")

    if resolved is None:
        console.print("[bold]Launch lines[/bold]: [yellow]none until the configuration problems below are fixed[/yellow]")
    else:
        _print_launch_lines(console, extra, resolved)

    # 5. a round trip
    if config is not None and not report.problems:
        if config.local_store_scope == "host":
            _host_round_trip(console, extra, config, report)
        else:
            _round_trip(console, config, report)

    report.problems += typos
    for word, style, lines in (("note", "yellow", report.notes), ("warning", "yellow", report.warnings),
                               ("problem", "red", report.problems)):
        for line in lines:
            console.print(f"[{style}]{word}:[/{style}] {_text(line)}", soft_wrap=True)  # paths stay whole, to copy
    if report.problems:
        console.print(f"[red]{len(report.problems)} problem(s) block a start.[/red]")
        return 1
    if report.warnings:
        console.print(f"[yellow]No problem blocks a start; {len(report.warnings)} warning(s) above.[/yellow]")
        return 0
    console.print("[green]No problem found.[/green]")
    return 0


def _reach(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else why not."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _print_launch_lines(console: Any, extra: dict[str, Any], resolved: Any) -> None:
    """Launch lines with the extra config's own keys; fields that come from
    the environment or a file stay out of them (a pasted value would
    override them), and a note says so."""
    console.print("[bold]Launch lines[/bold]")
    for flag, why in RECOMMENDED:
        console.print(f"[dim]# {_text(flag)}: {_text(why)}[/dim]", soft_wrap=True)
    for route, line in launch_lines(extra).items():
        console.print(f"[dim]# {route}[/dim]")
        console.print(line, soft_wrap=True, markup=False)
    outside = {n: s for n, s in resolved.sources.items() if s not in ("extra_config", "default")}
    if outside:
        fields, elsewhere = list(outside), sorted(set(outside.values()))
        verb = "comes" if len(fields) == 1 else "come"
        console.print(
            f"[dim]# {', '.join(fields)} {verb} from {', '.join(elsewhere)}, not from these lines: "
            "start the server with the same environment[/dim]",
            soft_wrap=True,
        )


def _host_round_trip(console: Any, extra: dict[str, Any], config: Any, report: Report) -> None:
    """The round trip on the running local store of the config's name; where
    none runs, on a store of doctor's own in a private directory, stopped
    after it, so that no server finds a store of doctor's choosing."""
    from sglang_simm.local_store import get_flag, set_flag
    from sglang_simm.local_store.admin import (
        StorePaths,
        StoreUnreachable,
        capacity_problem,
        human_bytes,
        private_store_dir,
        running_status,
        store_dir,
    )

    name = config.local_store_name
    parent = client_flag(extra, "local_store_dir") or config.local_store_dir
    root = store_dir(parent)
    running = None
    if os.path.exists(StorePaths(root, name).socket):
        try:
            running = running_status(root, name)
        except StoreUnreachable as exc:
            report.problems.append(f"the local store {name!r} in {root} does not answer ({exc}); "
                                   f"its log: {StorePaths(root, name).log}")
            return
    if running is not None:
        held, asked = running["capacity_bytes"], config.local_store_capacity_bytes
        console.print(f"local store {name!r} is running (pid {running['pid']}, {running.get('medium', 'memory')}, "
                      f"capacity {human_bytes(held)}, {running['policy']} eviction, {running['objects']} objects)")
        if asked is not None and held != asked:
            report.warnings.append(
                f"local_store_capacity_bytes asks for {human_bytes(asked)}, and the running local store {name!r} "
                f"has {human_bytes(held)}: a running store keeps its own, and servers get it; to change it, "
                f"'sglang-simm store stop {name}' (its objects are kept), then 'sglang-simm store start {name} "
                f"--capacity {human_bytes(asked).replace(' ', '')}'")
        _round_trip(console, config, report)
        return
    os.makedirs(root, mode=0o700, exist_ok=True)
    from sglang_simm.local_store import default_capacity_bytes
    from sglang_simm.local_store.admin import Backing

    capacity = config.local_store_capacity_bytes or default_capacity_bytes(root)
    refusal, warning = capacity_problem(root, capacity)
    if refusal:
        report.problems.append(f"local_store_capacity_bytes: no store in {root} can start with it: {refusal}")
        return
    if warning:
        report.warnings.append(f"local_store_capacity_bytes: {warning}")
    console.print(f"no local store {name!r} is running in {root} ({Backing.of(root).figures()}): the first server "
                  f"starts it with capacity {human_bytes(capacity)}; the round trip below runs on a store of "
                  "doctor's own, stopped after it")
    # the client's flags are process-global, as SiMM's are: the private
    # directory's flag must not outlive this round trip
    saved = get_flag("local_store_dir")
    try:
        with private_store_dir("sglang-simm-doctor-", parent=parent) as private:
            with _quiet_config_log():
                own = load_config(with_client_flag(extra, "local_store_dir", private)).config
            _round_trip(console, own, report)
    finally:
        set_flag("local_store_dir", saved)


def _round_trip(console: Any, config: Any, report: Report, *, size: int = 1 << 20, rounds: int = 5) -> None:
    """Put, exists, get and delete a 1 MiB object a few times; median latency."""
    import statistics
    import uuid

    try:
        client = connect(config)
    except Exception as exc:
        report.problems.append(f"connect: {exc}")
        return
    timings: dict[str, list[float]] = {"put": [], "exists": [], "get": []}
    try:
        src, dst = client.allocate(size), client.allocate(size)
        src.as_ref().copy_(_pattern(size))
        for _ in range(rounds):
            key = f"sglang_simm_doctor_{uuid.uuid4().hex}"
            t0 = time.perf_counter()
            code = client.put(key, src.view())
            t1 = time.perf_counter()
            found = client.exists(key)
            t2 = time.perf_counter()
            got = client.get(key, dst.view())
            t3 = time.perf_counter()
            client.delete(key)
            if code != 0 or not found or got != size or not bool((dst.as_ref() == src.as_ref()).all()):
                report.problems.append(
                    f"round trip to {client.description} failed: put={code}, exists={found}, get={got}"
                )
                return
            timings["put"].append(t1 - t0)
            timings["exists"].append(t2 - t1)
            timings["get"].append(t3 - t2)
    finally:
        client.close()
    table = _grid(f"Round trip to {client.description} ({size >> 20} MiB, median of {rounds})", "call", "latency",
                  right=("latency",))
    for call, values in timings.items():
        table.add_row(call, f"{statistics.median(values) * 1e6:,.0f} us")
    console.print(table)


def _pattern(size: int) -> Any:
    import torch

    return torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8)
