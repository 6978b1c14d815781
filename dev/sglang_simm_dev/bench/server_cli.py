"""``sglang-simm-dev bench --server``: run, print, write JSON, the chart and this
run's section of the results file (``--docs``)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Any

from sglang_simm_dev.bench.report import check_plot_extra, run_and_report
from sglang_simm_dev.bench.server import plan_from_args, run
from sglang_simm_dev.bench.server_render import markdown, plot, render

#: the results file's opening, written when it does not exist yet
DOCS_HEADER = """# Benchmarks: L3 backends side by side in real SGLang servers

Written by `sglang-simm-dev bench --server --docs docs/benchmarks.md --label NAME`:
each run replaces its own section (between its markers) and keeps the
others. What is measured and how: `dev/sglang_simm_dev/bench/server.py`
and its modules; the method in short:

- one CPU SGLang server per backend, same model, flags, pool sizes and
  prompts, started side by side with `--sleep-on-idle`; one server works at a
  time, in an order rotated every repetition, and its backups finish before
  the next one starts;
- TTFT is the time to the first streamed chunk; hit rates come from
  `cached_tokens_details`; every repeated prompt's answer is checked against
  its first answer (ids and logprobs), multi-turn answers across backends;
- per-operation bandwidth: every `batch_get_v1` / `batch_set_v1` call timed
  the same way around each backend inside the server (bytes of the pages
  that succeeded over the call's wall time), and SGLang's own `/metrics`
  histograms as each backend reports them (`file` reports none; Mooncake
  counts K and V objects as pages on writes and only the K bytes on reads);
- the decoders under L3 traffic (`--workloads itl`,
  `dev/sglang_simm_dev/bench/server_itl.py`): clients stream long answers
  (every token's arrival timed) while another client sends prompts that
  come back from L3 after a `/flush_cache` and new prompts that are backed
  up, one request every few decode steps (paced in steps, so every backend
  decodes as many steps per request); the decoders' inter-token latency (p50, p99, max) of the decode steps
  under that traffic, per backend and over no HiCache's, measured in one
  run; gaps that hold a background prefill are counted apart (backends
  without L3 recompute the stored prompts there), and the same decoders
  with no background give each server's noise floor. SGLang runs the
  backend's threads in the scheduler's process, so a backend's GIL holds
  show up as longer decode steps. Goal: ours' p99 within 5% of no
  HiCache's, and no worse than the other L3 backends';
- figures are medians with their min-max over repetitions; the machine is
  shared, its load average is stamped on each run.

Run it:

```
pip install -e './dev[bench]'                  # rich, numpy, matplotlib
pip install mooncake-transfer-engine-non-cuda     # optional: Mooncake (leaves torch alone)
apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200   # what Mooncake's binaries link
sglang-simm-dev bench --server --json out.json --plot out.png --docs docs/benchmarks.md --label NAME
sglang-simm-dev bench --server --quick                # ours and file, tiny model, one repetition
sglang-simm-dev bench --server --workloads itl --backends ours,file,host,none   # the decoders alone
```

Options: `--backends ours,file,mooncake,mooncake-standalone,host,none` (default
all but `mooncake-standalone`), `--repeat N` (default 2), `--preset
llama-tiny|llama-demo` (16 KiB of KV per token), `--python` (the servers'
interpreter), `--no-restart`, `--workloads long,turns,itl,restart` (default
all), `--small` (a lighter workload), `--host-ratio R`
(the host pool over the device pool, default 2.5: below the multi-turn working
set, later rounds read from L3). Without Mooncake importable in the servers'
Python the bench prints the install line and runs the others. The bench
starts `mooncake_master` (and, for `mooncake-standalone`, a `mooncake_client`
holding the segment) on 127.0.0.1 itself and stops them by their pids;
the servers run with `--sleep-on-idle` and with SGLang's 10 GiB host-memory
reserve lowered to 1 GiB (several servers on one small machine otherwise
refuse a host pool of megabytes). Exit status 1 when an answer differed or a
server did not start; goals are reported, not enforced.

Known limits: on this CPU the suffix's prefill hides most of the transfer in
TTFT, so the per-call bandwidth tables are where backends differ. `mooncake`
keeps its segment inside the server (SGLang's default), so a restart loses
its pages, and its reads are a copy within the server's own memory;
`mooncake-standalone` (SGLang's `standalone_storage`) keeps them in a
`mooncake_client` process, as ours keeps them in its host store, but with
SGLang 0.5.23 it does not start on the bench's `page_first` host pool: SGLang
registers the pool's K and V halves apart, and Mooncake 0.3.13's dummy client
refuses a buffer smaller than the allocation it mapped ("Invalid buffer
address or size for registration"); the bench reports that and runs the
others.
"""

_SECTION = "<!-- bench-server:{label} -->"
_END = "<!-- /bench-server:{label} -->"


def update_docs(path: str, label: str, body: str) -> None:
    """Replace (or append) ``label``'s section of ``path``."""
    if not re.fullmatch(r"[\w.-]+", label):
        raise ValueError(f"--label takes letters, digits, '.', '_' or '-', got {label!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = DOCS_HEADER
    start, end = _SECTION.format(label=label), _END.format(label=label)
    section = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


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
        update_docs(args.docs, getattr(args, "label", "latest") or "latest", markdown(result, command))
        console.print(f"wrote {os.path.abspath(args.docs)} (section {args.label})")
    return 0 if result["checks"]["ok"] else 1
