"""``sglang-simm-dev bench --server``: run, print, write JSON, the chart and the
server bench's section of the results page (``--docs``, replaced by this run)."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from sglang_simm_dev.bench.report import check_plot_extra, run_and_report, write_docs_section
from sglang_simm_dev.bench.server import plan_from_args, run
from sglang_simm_dev.bench.server_render import markdown, plot, render


def run_server_bench(console: Any, args: Any) -> int:
    """0 when every answer checked out, 1 if not (goals are reported, not enforced)."""
    plan = plan_from_args(args)
    check_plot_extra(args)
    if any(b.startswith("mooncake") for b in plan.backends):
        console.print("Mooncake is used when the servers' Python imports it")
    result = run_and_report(console, args, "bench --server", lambda progress: run(plan, progress=progress),
                            render, plot)
    if getattr(args, "docs", None):
        command = "sglang-simm-dev " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "bench --server"
        write_docs_section(args.docs, "server", markdown(result, command))
        console.print(f"wrote {os.path.abspath(args.docs)} (the server bench's section)")
    return 0 if result["checks"]["ok"] else 1
