"""``sglang-simm`` (also ``python -m sglang_simm``): the one door into the tools (doctor, demo, bench).

Each command's module is imported when it runs, and rich with it, so
importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Sequence


#: The narrowest output to a pipe or a file: rich would take 80 columns (or
#: $COLUMNS, which describes a terminal; pytest-xdist sets it to 80) and cut
#: table cells to fit, and whoever reads a pipe wants every value whole.
PIPE_WIDTH = 240


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal and console.width < PIPE_WIDTH:
        console = Console(highlight=False, width=PIPE_WIDTH)
    return console


#: What every extra-config error shows as the way to write it.
EXTRA_CONFIG_EXAMPLE = (
    "--extra-config '{\"manager_address\": \"10.0.0.1:30001\"}' (a JSON object; strings in double "
    "quotes), or --extra-config @path/to/config.json (also .yaml, .yml, .toml)"
)
#: The @file extensions SGLang reads (its extra-config parser picks the format by extension).
FILE_FORMATS = (".json", ".toml", ".yaml", ".yml")


def parse_extra_config(text: str | None, *, option: str = "--extra-config") -> dict[str, Any]:
    """Like SGLang's ``--hicache-storage-backend-extra-config``: JSON, or
    ``@path`` to a JSON, YAML or TOML file (by extension, as SGLang reads it).

    Every problem is a ValueError naming ``option``, what is wrong and an
    example; nothing here raises anything else for bad input.
    """
    if not text:
        return {}
    if text.startswith("@"):
        path = text[1:]
        where = f"{option} @{path}"
        ext = os.path.splitext(path)[1].lower()
        if ext not in FILE_FORMATS:
            raise ValueError(
                f"{where}: SGLang reads an @file by its extension, one of {', '.join(FILE_FORMATS)}; "
                f"got {ext or 'none'}. Example: {EXTRA_CONFIG_EXAMPLE}"
            )
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the file ({exc.strerror or exc})") from None
        data = _parse_file(raw, ext, where)
    else:
        where = option
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{option} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
                f"{text!r}. Example: {EXTRA_CONFIG_EXAMPLE}"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{where} must hold a JSON object ({{...}}), got {type(data).__name__}. Example: {EXTRA_CONFIG_EXAMPLE}"
        )
    return data


def _parse_file(raw: bytes, ext: str, where: str) -> Any:
    """One @file's contents, by extension; ValueError naming ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: the file is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if ext == ".toml":
        toml = _toml_module(where)
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as exc:
            raise ValueError(f"{where} is not valid TOML ({exc})") from None
    if ext in (".yaml", ".yml"):
        try:
            import yaml  # SGLang depends on PyYAML
        except ImportError:
            raise ValueError(f"{where}: reading YAML needs PyYAML (pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{where} is not valid YAML ({' '.join(str(exc).split())})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None


def _toml_module(where: str) -> Any:
    """``tomllib`` (Python 3.11+), else ``tomli`` (the same parser, for 3.10)."""
    try:
        import tomllib

        return tomllib
    except ImportError:
        pass
    try:
        import tomli

        return tomli
    except ImportError:
        raise ValueError(
            f"{where}: reading TOML needs Python 3.11+ or the tomli package (pip install tomli, or "
            "pip install 'sglang-simm[cli]'). SGLang reads an @file.toml with tomllib, so on Python "
            "3.10 pass SGLang a .json or .yaml file instead"
        ) from None


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--extra-config",
        metavar="JSON|@FILE",
        help="the same value you pass to --hicache-storage-backend-extra-config",
    )
    p.add_argument("--manager", metavar="ADDR", help="shortcut for manager_address (host:port, local, local://NAME)")


def _extra_from_args(args: argparse.Namespace) -> dict[str, Any]:
    extra = parse_extra_config(args.extra_config)
    if args.manager:
        extra["manager_address"] = args.manager
    return extra


def build_parser() -> argparse.ArgumentParser:
    from sglang_simm import __version__

    parser = argparse.ArgumentParser(
        prog="sglang-simm",
        description="SiMM as SGLang's HiCache L3 tier: check a setup, run the demo, measure.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-simm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check configuration, client, RDMA devices and SGLang")
    _add_config_args(doctor)
    doctor.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)

    demo = sub.add_parser("demo", help="run HiCache's write-back and restore on the embedded store")
    _add_config_args(demo)
    demo.add_argument("--model", default=None,
                      help="page geometry preset (see --list-models); not with --server, which takes --preset")
    demo.add_argument("--list-models", action="store_true", help="list the geometry presets and exit")
    demo.add_argument("--pages", type=int, default=None, help="pages in the first request's prefix (default: 192)")
    demo.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the preset's)")
    demo.add_argument("--layout", default="page_first", choices=["page_first", "page_first_direct", "page_head"])
    demo.add_argument("--direct", action="store_true", help="call the backend directly, not SGLang's controller")
    demo.add_argument("--json", metavar="PATH", help="write the results as JSON")
    demo.add_argument("--server", action="store_true",
                      help="the main job as users see it: a real SGLang server on the CPU, time to first token "
                           "from scratch, from the host tier and from L3 (a few minutes)")
    from sglang_simm.tools.server_demo import add_arguments as add_server_demo_arguments

    add_server_demo_arguments(demo.add_argument_group("with --server"), shared=True)

    bench = sub.add_parser("bench", help="measure our backend against SGLang's in-tree one")
    bench.add_argument("--pages", default="1,8,32,128,1024", help="batch sizes (pages per call)")
    bench.add_argument("--repeat", type=int, default=None,
                       help="timed repetitions per point (median; default 30, with --server 2)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    bench.add_argument("--store", action="store_true",
                       help="measure the host store (local) against memcpy, SGLang's file backend and the "
                            "in-process store instead")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="draw a PNG chart (needs matplotlib)")
    bench.add_argument("--server", action="store_true",
                       help="L3 backends side by side in real CPU SGLang servers: ours, file, Mooncake, host tier "
                            "only, no HiCache (minutes; see docs/benchmarks.md)")
    server = bench.add_argument_group("with --server")
    server.add_argument("--backends", help="comma list of ours,file,mooncake,mooncake-standalone,host,none "
                        "(default: all but mooncake-standalone; --quick: ours,file)")
    server.add_argument("--preset", help="model (llama-tiny, llama-demo; default llama-demo, --quick llama-tiny)")
    server.add_argument("--python", help="the Python the servers run (default: this one)")
    server.add_argument("--no-restart", action="store_true", help="skip the restart on the same L3")
    server.add_argument("--small", action="store_true",
                        help="a lighter workload for a loaded machine (1,536-token prompt, 4 clients x 3 rounds "
                             "of 384 tokens, a 2,048-token device pool)")
    server.add_argument("--host-ratio", type=float, metavar="R",
                        help="host pool size over the device pool's (default 2.5); below the multi-turn "
                             "working set, later rounds read from L3")
    server.add_argument("--docs", metavar="PATH", help="write this run's section of a Markdown results file")
    server.add_argument("--label", default="latest", help="the section's name in --docs (default: %(default)s)")
    from sglang_simm.tools.store import add_arguments as add_store_arguments

    add_store_arguments(sub)
    return parser


#: KV-demo options that mean nothing to --server (it runs a real model: --preset)
_NOT_WITH_SERVER = {"model": "--model", "pages": "--pages", "direct": "--direct"}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `kill` or a timeout sends SIGTERM, which would skip every cleanup: a
    # demo's own store process, a bench's stores and servers. Exit through
    # them instead (only where nobody set another handler).
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        console = _console()
    except ImportError as exc:
        print(f"error: the sglang-simm command needs rich ({exc}): pip install 'rich>=13' "
              "(or, from a clone of this repo, pip install '.[cli]')", file=sys.stderr)
        return 2
    try:
        if args.command == "doctor":
            from sglang_simm.tools.doctor import run_doctor

            return run_doctor(console, _extra_from_args(args), sysfs_root=args.sysfs_root)
        if args.command == "demo" and args.server:
            from sglang_simm.tools.server_demo import run as run_server_demo

            from sglang_simm.tools.tiny_model import PRESETS as SERVER_PRESETS

            given = [flag for name, flag in _NOT_WITH_SERVER.items() if getattr(args, name) not in (None, False)]
            if given:
                console.print(f"[red]error:[/red] {', '.join(given)} belong to the KV demo (without --server); "
                              f"the server demo runs a model of --preset ({', '.join(sorted(SERVER_PRESETS))})")
                return 2

            return run_server_demo(args)
        if args.command == "demo":
            from sglang_simm.tools.demo import run_demo

            return run_demo(console, args, _extra_from_args(args))
        if args.command == "store":
            from sglang_simm.tools.store import run_store

            return run_store(console, args)
        if args.command == "bench":
            from sglang_simm.tools.bench import run_bench

            return run_bench(console, args)
    except (ValueError, OSError) as exc:
        from rich.markup import escape

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
