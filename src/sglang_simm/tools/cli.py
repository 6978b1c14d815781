"""``sglang-simm`` (also ``python -m sglang_simm``): the operator's commands (doctor, store).

Each command's module is imported when it runs, and rich with it, so
importing this module stays cheap. The demo and the bench are not in the
wheel: they live in the repository's ``dev/`` (``sglang-simm-dev demo``,
``sglang-simm-dev bench``), which imports this module's helpers; ``demo``
and ``bench`` here only say where they went.
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


def make_console() -> Any:
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
    Every problem is a ValueError naming ``option``, what is wrong and an example."""
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
        data = _json(text, option, f": {text!r}. Example: {EXTRA_CONFIG_EXAMPLE}")
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
    return _json(text, where)


def _json(text: str, where: str, tail: str = "") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        problem = f"{where} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        raise ValueError(problem + tail) from None


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


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--extra-config",
        metavar="JSON|@FILE",
        help="the same value you pass to --hicache-storage-backend-extra-config",
    )
    p.add_argument("--manager", metavar="ADDR", help="shortcut for manager_address (host:port, local, local://NAME)")


def extra_from_args(args: argparse.Namespace) -> dict[str, Any]:
    extra = parse_extra_config(args.extra_config)
    if args.manager:
        extra["manager_address"] = args.manager
    return extra


def build_parser() -> argparse.ArgumentParser:
    from sglang_simm import __version__

    parser = argparse.ArgumentParser(
        prog="sglang-simm",
        description="SiMM as SGLang's HiCache L3 tier: check a setup (doctor), run local stores (store).",
    )
    parser.add_argument("--version", action="version", version=f"sglang-simm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check configuration, client, RDMA devices and SGLang")
    add_config_args(doctor)
    doctor.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    doctor.add_argument("--server", metavar="URL", action="append",
                        help="read a running SGLang server (http://host:port) and name every reason its L3 "
                             "does not hit; repeat for servers that should share pages")
    doctor.add_argument("--api-key", metavar="KEY",
                        help="with --server: the server's admin API key (for /hicache/storage-backend)")

    for name in MOVED:  # every argument accepted, so that the answer is where it went
        moved = sub.add_parser(name, help=f"not in this package: run from a clone (sglang-simm-dev {name})",
                               add_help=False, prefix_chars="\0")
        moved.add_argument("rest", nargs=argparse.REMAINDER)
    from sglang_simm.tools.store import add_arguments as add_store_arguments

    add_store_arguments(sub)
    return parser


#: Commands that left the wheel for the repository's dev/ project (``sglang-simm-dev``).
MOVED = ("demo", "bench")


def moved_message(command: str, rest: Sequence[str] = ()) -> str:
    """What ``sglang-simm demo`` or ``sglang-simm bench`` answers: where it
    went and the command to run instead (rich markup)."""
    import shlex

    from rich.markup import escape

    args = "".join(" " + shlex.quote(a) for a in rest)
    lines = [
        f"`sglang-simm {command}` is not part of the sglang-simm package: the demo and the bench run from a "
        "clone of its repository (https://github.com/sglang-simm/sglang-simm):",
        f"  bash scripts/demo.sh{args if command == 'demo' else ' --help'}"
        "    (builds .venv-test once: CPU torch, SGLang, this plugin and sglang-simm-dev)",
        f"  .venv-test/bin/sglang-simm-dev {command}{args}",
        "or, where sglang-simm is installed: pip install -e './dev[bench]' (from the clone), "
        f"then sglang-simm-dev {command}{args}",
    ]
    return "[red]error:[/red] " + escape("\n".join(lines))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_through_cleanup_on_sigterm() -> None:
    """`kill` or a timeout sends SIGTERM, which would skip every cleanup (a
    demo's own store process, a bench's stores and servers): exit through
    them instead, only where nobody set another handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_through_cleanup_on_sigterm()
    try:
        console = make_console()
    except ImportError as exc:
        print(f"error: the sglang-simm command needs rich ({exc}): pip install 'rich>=13' "
              "(or, from a clone of this repo, pip install '.[cli]')", file=sys.stderr)
        return 2
    try:
        if args.command == "doctor" and args.server:
            from sglang_simm.tools.doctor_server import run_doctor_server

            return run_doctor_server(console, args.server, api_key=args.api_key)
        if args.command == "doctor":
            from sglang_simm.tools.doctor import run_doctor

            return run_doctor(console, extra_from_args(args), sysfs_root=args.sysfs_root)
        if args.command in MOVED:
            console.print(moved_message(args.command, args.rest))
            return 2
        if args.command == "store":
            from sglang_simm.tools.store import run_store

            return run_store(console, args)
    except (ValueError, OSError) as exc:
        from rich.markup import escape

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
