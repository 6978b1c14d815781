"""``sglang-simm-dev`` (also ``python -m sglang_simm_dev``): the demo and the
bench, run from a clone of the repository (``scripts/demo.sh`` runs the demo).

Each command's module is imported when it runs. The helpers every command
line of this project shares (the console, ``--extra-config``, the exit
through cleanups on SIGTERM) are the ``sglang-simm`` command's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sglang_simm.tools.cli import (
    add_config_args,
    exit_through_cleanup_on_sigterm,
    extra_from_args,
    make_console,
)


def build_parser() -> argparse.ArgumentParser:
    from sglang_simm_dev import __version__

    parser = argparse.ArgumentParser(
        prog="sglang-simm-dev",
        description="sglang-simm's instruments, run from a clone: the demo and the bench.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-simm-dev {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run HiCache's write-back and restore on the local store")
    add_config_args(demo)
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
    from sglang_simm_dev.server_demo import add_arguments as add_server_demo_arguments

    add_server_demo_arguments(demo.add_argument_group("with --server"), shared=True)

    bench = sub.add_parser("bench", help="measure our backend against SGLang's in-tree one")
    bench.add_argument("--pages", default="1,8,32,128,1024", help="batch sizes (pages per call)")
    bench.add_argument("--repeat", type=int, default=None,
                       help="timed repetitions per point (median; default 30, with --server 2)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    bench.add_argument("--store", action="store_true",
                       help="measure the local store against memcpy, SGLang's file backend and the "
                            "in-process local store instead")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="draw a PNG chart (needs matplotlib)")
    bench.add_argument("--server", action="store_true",
                       help="L3 backends side by side in real CPU SGLang servers: ours, file, Mooncake, host tier "
                            "only, no HiCache (minutes; see docs/benchmarks.md)")
    server = bench.add_argument_group("with --server")
    server.add_argument("--backends", help="comma list of ours,ours-events,ours-events-stalled,file,ours-disk,"
                        "mooncake,mooncake-standalone,host,none (default: ours,file,mooncake,host,none; --quick: "
                        "ours,file; ours-events*: ours with kv_events on, its stream read or stalled; ours-disk: "
                        "ours with its store on a disk, and file's folder on that disk too)")
    server.add_argument("--disk-dir", metavar="DIR",
                        help="with ours-disk: a directory on the disk for its store and file's folder "
                             "(default: the temp directory)")
    server.add_argument("--preset", help="model (llama-tiny, llama-demo; default llama-demo, --quick llama-tiny)")
    server.add_argument("--python", help="the Python the servers run (default: this one)")
    server.add_argument("--no-restart", action="store_true", help="skip the restart on the same L3")
    server.add_argument("--small", action="store_true",
                        help="a lighter workload for a loaded machine (1,536-token prompt, 4 clients x 3 rounds "
                             "of 384 tokens, a 2,048-token device pool)")
    server.add_argument("--host-ratio", type=float, metavar="R",
                        help="host pool size over the device pool's (default 2.5); below the multi-turn "
                             "working set, later rounds read from L3")
    server.add_argument("--workloads", metavar="LIST",
                        help="comma list of long,turns,itl,restart (default: all); itl: decoders' inter-token "
                             "latency while other prompts go to and come back from L3")
    server.add_argument("--docs", metavar="PATH",
                        help="replace the server bench's section of this results page (docs/benchmarks.md) with this run")
    return parser


#: KV-demo options that mean nothing to --server (it runs a real model: --preset)
_NOT_WITH_SERVER = {"model": "--model", "pages": "--pages", "direct": "--direct"}
#: server-demo options that mean nothing without --server
_ONLY_WITH_SERVER = {"preset": "--preset", "model_dir": "--model-dir", "system_tokens": "--system-tokens",
                     "question_tokens": "--question-tokens", "new_tokens": "--new-tokens", "route": "--route",
                     "workdir": "--workdir", "startup_timeout": "--startup-timeout", "seed": "--seed",
                     "keep_running": "--keep-running"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_through_cleanup_on_sigterm()
    try:
        console = make_console()
    except ImportError as exc:
        print(f"error: sglang-simm-dev needs rich ({exc}): pip install 'rich>=13'", file=sys.stderr)
        return 2
    try:
        if args.command == "demo" and args.server:
            from sglang_simm_dev.server_demo import run as run_server_demo

            from sglang_simm_dev.tiny_model import PRESETS as SERVER_PRESETS

            given = [flag for name, flag in _NOT_WITH_SERVER.items() if getattr(args, name) not in (None, False)]
            if given:
                console.print(f"[red]error:[/red] {', '.join(given)} belong to the KV demo (without --server); "
                              f"the server demo runs a model of --preset ({', '.join(sorted(SERVER_PRESETS))})")
                return 2

            return run_server_demo(args)
        if args.command == "demo":
            defaults = vars(parser.parse_args(["demo"]))
            given = [flag for name, flag in _ONLY_WITH_SERVER.items() if getattr(args, name) != defaults[name]]
            if given:  # said, not ignored: the KV demo has no model to run
                console.print(f"[red]error:[/red] {', '.join(given)} belong to the server demo: add --server "
                              "(the KV demo takes --model, see --list-models)")
                return 2
            from sglang_simm_dev.demo import run_demo

            return run_demo(console, args, extra_from_args(args))
        if args.command == "bench":
            from sglang_simm_dev.bench import run_bench

            return run_bench(console, args)
    except (ValueError, OSError) as exc:
        from rich.markup import escape

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
