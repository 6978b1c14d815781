"""The main job as users see it: a real SGLang server, HiCache on, this plugin
as L3, and the time to first token of a long shared prompt served four ways.

It writes a random-weight Llama large enough that prefill costs seconds on a
CPU, starts ``python -m sglang.launch_server`` on 127.0.0.1 (CPU flags, the
CPU stand-ins, ``--hicache-storage-backend simm``), and sends a workload of
users who share one long system prompt, each with a question of their own:

1. the first user, on empty caches: the prompt is computed from scratch;
2. a second user right after: the system prompt is on the device (L1);
3. a third, after other traffic pushed it off the device: it comes from the
   host tier (L2);
4. a fourth, after ``/flush_cache`` emptied the device and host tiers: it
   comes from L3, this plugin's store.

Every answer is checked against a fresh computation of the same prompt (under
its own ``extra_key``, which namespaces every tier): same greedy tokens, same
logprobs. The table gives the time to first token, the KV bytes each tier
moved, and whether outputs matched, nearest tier first (device, host, L3),
then the computation from scratch; ``--json`` writes it all, in that order.
Notes under it say what every cached row keeps (what a request costs the
server at all, timed on the question sent alone, and SGLang's CPU attention
over the whole prompt, cached or not) and why the cached rows' times come
out in no order among themselves (``notes``).

Run: ``sglang-simm-dev demo --server`` (or ``python -m sglang_simm_dev.server_demo``;
add ``--json out.json``). L3 is a local store of the demo's own
(``local://server-demo-...``), stopped when the demo ends, unless
``--manager`` names another. The model and the server's folder (its log,
the last run's) live under ``~/.cache/sglang-simm`` (``$XDG_CACHE_HOME``);
``--keep-running`` leaves the server up after the table, for
``sglang-simm doctor --server URL``, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from sglang_simm_dev.sglang_server import Generation, SGLangServer, ServerConfig, ServerError
from sglang_simm_dev.tiny_model import PRESETS, write_model


@dataclass
class Row:
    served: str
    tier: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    kv_bytes_moved: int
    matches_fresh: bool
    #: TTFT of the fresh computation it was checked against
    fresh_ttft_s: float | None = None


DEFAULT_PAGE_SIZE = 16

#: where each row's system prompt came from, in the order the table and the
#: JSON list them: the tiers nearest first, then no tier (the reference)
TIERS = ("device hit (L1)", "host-tier hit (L2)", "L3 hit (SiMM)", "computed from scratch")
DEVICE, HOST, L3, NONE = TIERS


def add_arguments(parser: Any, *, shared: bool = False) -> None:
    """The server demo's options; ``shared``: the parser (``sglang-simm
    demo``) already has ``--page-size``, ``--manager`` and ``--json``."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-demo",
                        help="with --server: model size (default: %(default)s)")
    parser.add_argument("--model-dir", help="with --server: where to write the model (default: a cache folder, reused)")
    parser.add_argument("--system-tokens", type=int, default=2048, help="with --server: the shared system prompt's length")
    parser.add_argument("--question-tokens", type=int, default=64, help="with --server: each user's question's length")
    parser.add_argument("--new-tokens", type=int, default=16, help="with --server: tokens generated per answer")
    parser.add_argument("--route", choices=("simm", "dynamic"), default="simm", help="with --server: how SGLang finds us")
    parser.add_argument("--workdir", help="with --server: the server's log and files (default: "
                        f"{_display_path(_default_workdir())}, the last run's kept)")
    parser.add_argument("--keep-running", action="store_true",
                        help="with --server: keep the server up after the table (for sglang-simm doctor --server "
                             "URL) until Ctrl-C")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="with --server: seconds to wait for health")
    parser.add_argument("--seed", type=int, default=0, help="with --server: weights and prompts")
    if not shared:
        parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
        parser.add_argument("--manager", help="SiMM manager_address (default: a local store of the demo's own)")
        parser.add_argument("--json", help="write the results here")


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _cache_root() -> str:
    """``~/.cache/sglang-simm`` (``$XDG_CACHE_HOME/sglang-simm``): the demo's
    models and its server's folder, kept between runs, never under /tmp."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sglang-simm")


def _default_model_dir(preset: str, seed: int) -> str:
    return os.path.join(_cache_root(), "models", f"{preset}-seed{seed}")


def _default_workdir() -> str:
    """The server's folder: its log (the last run's, kept for reading), the
    stand-ins' ``sitecustomize``, its temporary files (removed with it)."""
    return os.path.join(_cache_root(), "demo-server")


def _display_path(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if path.startswith(home + os.sep) else path


def _check(got: Generation, want: Generation) -> bool:
    return got.output_ids == want.output_ids and got.logprobs == want.logprobs


def _say(text: str) -> None:
    print(f"  {text}", flush=True)


def run_workload(server: SGLangServer, args: argparse.Namespace, vocab: int, kv_bytes_per_token: int,
                 say: Callable[[str], None] = _say) -> tuple[list[Row], float]:
    """The rows in ``TIERS`` order, and the TTFT of a question sent alone
    (no system prompt): what a request costs this server with no prefix
    to attend over, part of the floor every cached row keeps (``notes``)."""
    rng = random.Random(args.seed)
    system = _tokens(rng, args.system_tokens, vocab)
    users = [system + _tokens(rng, args.question_tokens, vocab) for _ in range(4)]
    n = args.new_tokens

    def ask(i: int, **kw: Any) -> Generation:
        return server.generate(users[i], max_new_tokens=n, stream=True, **kw)

    def fresh(i: int) -> Generation:
        return server.generate(users[i], max_new_tokens=n, stream=True, extra_key=f"fresh-{i}")

    # A first prefill pays one-off costs (allocations, first calls into the
    # BLAS): spend them on a prompt of its own, namespaced away from the rest.
    say("warm-up request (first-call costs, on a prompt of its own) ...")
    stored = server.l3_pages_stored()
    server.generate(_tokens(rng, args.system_tokens, vocab), max_new_tokens=1, extra_key="warm-up")
    # its backup first, so that the wait for the first user's counts none of it
    stored = server.wait_l3_stored(stored + args.system_tokens // args.page_size, timeout=300)

    rows: list[Row] = []
    say("1/4 first user: the whole prompt computed from scratch ...")
    first = ask(0)
    rows.append(Row("first user, empty caches", NONE, first.prompt_tokens,
                    first.cached_tokens, first.ttft_s or 0.0, 0, True, first.ttft_s))
    # the backup thread writes L3 after the answer: wait for it (whole pages;
    # the last generated token has no KV)
    say("waiting for the backup thread to write the prompt's pages to L3 ...")
    server.wait_l3_stored(stored + (first.prompt_tokens + n - 1) // args.page_size, timeout=300)

    say("2/4 second user (and the same prompt computed fresh, to compare) ...")
    second = ask(1)
    ref = fresh(1)
    rows.append(Row("second user, right after", DEVICE, second.prompt_tokens, second.device_tokens,
                    second.ttft_s or 0.0, 0, _check(second, ref), ref.ttft_s))

    # Other traffic, enough to push the system prompt off the device pool
    # (but not out of the host pool, which is larger).
    say("other traffic, to push the system prompt off the device ...")
    filler = 0
    while filler < server.config.max_total_tokens:
        server.generate(_tokens(rng, args.system_tokens, vocab), max_new_tokens=1)
        filler += args.system_tokens
    say("3/4 third user (and its fresh computation) ...")
    third = ask(2)
    ref = fresh(2)
    rows.append(Row("third user, after other traffic", HOST, third.prompt_tokens,
                    third.host_tokens, third.ttft_s or 0.0, third.host_tokens * kv_bytes_per_token,
                    _check(third, ref) and third.device_tokens == 0, ref.ttft_s))

    server.flush_cache()
    say("4/4 fourth user, after /flush_cache (and its fresh computation) ...")
    fourth = ask(3)
    ref = fresh(3)
    rows.append(Row("fourth user, after /flush_cache", L3, fourth.prompt_tokens,
                    fourth.storage_tokens, fourth.ttft_s or 0.0, fourth.storage_tokens * kv_bytes_per_token,
                    _check(fourth, ref) and fourth.storage_tokens > 0, ref.ttft_s))

    say("a question alone, no system prompt (part of the cached rows' floor) ...")
    alone = server.generate(_tokens(rng, args.question_tokens, vocab), max_new_tokens=n, stream=True)
    return in_tier_order(rows), alone.ttft_s or 0.0


def in_tier_order(rows: list[Row]) -> list[Row]:
    """The rows in ``TIERS`` order, whatever order they were measured in."""
    return sorted(rows, key=lambda r: TIERS.index(r.tier))


def _print(rows: list[Row], question_alone_s: float, summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    table = Table(title="Time to first token: one long shared system prompt, served four ways")
    for name, justify in (("request", "left"), ("system prompt from", "left"), ("prefix tokens", "right"),
                          ("TTFT ms", "right"), ("fresh TTFT ms", "right"), ("vs fresh", "right"),
                          ("KV bytes moved", "right"), ("outputs = fresh", "center")):
        table.add_column(name, justify=justify)
    for r in rows:
        moved = _human(r.kv_bytes_moved) if r.kv_bytes_moved else "-"
        fresh = f"{r.fresh_ttft_s * 1e3:.0f}" if r.fresh_ttft_s else "-"
        table.add_row(r.served, r.tier, f"{r.cached_tokens}/{r.prompt_tokens}", f"{r.ttft_s * 1e3:.0f}",
                      fresh, speedup(r), moved, "yes" if r.matches_fresh else "[red]NO[/red]")
    console.print(table)
    for line in notes(rows, question_alone_s):
        console.print(line, soft_wrap=True, markup=False)
    grid = Table.grid(padding=(0, 2))
    for key, value in summary.items():
        grid.add_row(key, str(value))
    console.print(grid)


def speedup(row: Row) -> str:
    """TTFT of the same prompt computed fresh, side by side, over this row's
    (the first row is its own reference)."""
    if not row.cached_tokens or not row.fresh_ttft_s or not row.ttft_s:
        return "1.0x"
    return f"{row.fresh_ttft_s / row.ttft_s:.1f}x"


def notes(rows: list[Row], question_alone_s: float) -> list[str]:
    """What the table cannot say by itself, printed whenever there are cached
    rows: the floor they all keep, and why their times come out in no order.

    The floor is what a request costs with its prefix cached: what the
    question sent alone costs (``question_alone_s``: the server's own
    per-request costs, the question's prefill, the first token), and SGLang's
    CPU attention (``--attention-backend torch_native``,
    ``_run_sdpa_forward_extend``), which for every request runs causal
    attention over the whole prompt, the cached prefix's positions included,
    and keeps the new tokens' part. So a cached row saves the prefix's
    projections and MLP but not its attention, a cost set by the prompt's
    length and the same for every tier; a GPU attention backend attends from
    the new tokens only."""
    cached = [r for r in rows if r.cached_tokens]
    if not cached:
        return []
    fastest, slowest = min(r.ttft_s for r in cached), max(r.ttft_s for r in cached)
    prompt = max(r.prompt_tokens for r in cached)
    question = min(r.prompt_tokens - r.cached_tokens for r in cached)
    out = [
        f"Every cached row sits on a floor no tier removes, about {fastest * 1e3:.0f} ms here: what a request "
        f"costs this server at all (the {question}-token question sent alone, no system prompt, took "
        f"{question_alone_s * 1e3:.0f} ms), plus SGLang's CPU attention (torch_native), which attends over the "
        f"whole {prompt}-token prompt on every request, cached prefix included (a GPU attention backend attends "
        "from the uncached tokens only); 'vs fresh' divides each row's fresh computation of the same prompt by "
        "its TTFT."
    ]
    if len(cached) > 1:
        copies = " and ".join(f"{_human(r.kv_bytes_moved)} for the {r.tier}" for r in cached if r.kv_bytes_moved)
        out.append(
            "The cached rows are listed nearest tier first. What sets them apart is the copy into the device "
            f"({copies or 'none'}; a device hit copies nothing), small next to that floor: their spread here "
            f"({fastest * 1e3:.0f}-{slowest * 1e3:.0f} ms), and which of them comes out faster, is timing noise "
            "of a shared CPU that changes from run to run, not the tiers."
        )
    return out


def l3_written(metrics: dict[str, float], page_bytes: int) -> str:
    """Pages this backend reported writing to L3 (SGLang's histogram of its
    ``backup_pgs`` per batch), not ``sglang:hicache_backup_bytes_total``,
    which counts device-to-host (L2) backups."""
    pages = metrics.get("sglang:backup_pgs_sum")
    tokens = metrics.get("sglang:backuped_tokens_total")
    if pages is None:
        return "not reported (needs --enable-metrics and SGLang's storage metrics)"
    extra = f", {tokens:.0f} tokens by SGLang's count" if tokens is not None else ""
    return f"{pages:.0f} pages, {_human(pages * page_bytes)} (the backend's own count{extra})"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


#: how to get SGLang where it is missing (PyPI has it; on a CPU see the README's Install)
SGLANG_HINT = ("install it into this environment (pip install 'sglang>=0.5.8,<0.6'), or run "
               "scripts/demo.sh, which builds a CPU environment with SGLang")


def missing_sglang() -> str | None:
    """Why ``python -m sglang.launch_server`` cannot run here, or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sglang.launch_server") is not None
    except ModuleNotFoundError:
        found = False
    if found:
        return None
    return f"demo --server starts python -m sglang.launch_server, and SGLang is not installed here: {SGLANG_HINT}"


def run(args: argparse.Namespace) -> int:
    problem = missing_sglang()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.page_size = args.page_size or DEFAULT_PAGE_SIZE
    if args.manager:
        return _run(args)
    from sglang_simm.config import client_flag, with_client_flag
    from sglang_simm.local_store.admin import StoreHandle, StoreUnreachable
    from sglang_simm.local_store.admin import private_store_dir

    own_store = f"server-demo-{os.getpid()}"
    args.manager = f"local://{own_store}"
    # the demo's own store lives in, and goes with, a directory of this run's
    # (under the one a config names, and named to the server in its place)
    with private_store_dir("sglang-simm-demo-", parent=client_flag({}, "local_store_dir")) as root:
        args.extra_config = with_client_flag({}, "local_store_dir", root)
        try:
            return _run(args)
        finally:
            try:
                StoreHandle(own_store, root=root, capacity=1, spawn=False, data=False).stop(discard=True)
            except (StoreUnreachable, OSError):
                pass


def _run(args: argparse.Namespace) -> int:
    preset = PRESETS[args.preset]
    started = time.monotonic()
    # absolute: the server runs in its own folder, where a relative path names another place
    model_dir = os.path.abspath(args.model_dir or _default_model_dir(args.preset, args.seed))
    print(f"writing the {args.preset} model (random weights, seed {args.seed}) to {model_dir} ...", flush=True)
    write_model(model_dir, preset, seed=args.seed)
    workdir = os.path.abspath(args.workdir or _default_workdir())
    system_and_question = args.system_tokens + args.question_tokens + args.new_tokens
    config = ServerConfig(
        model_path=model_dir,
        route=args.route,
        extra_config={**getattr(args, "extra_config", {}), "manager_address": args.manager},
        page_size=args.page_size,
        # the device pool holds one prompt (and a little), the host pool four
        max_total_tokens=system_and_question + 4 * args.page_size,
        hicache_ratio=4.0,
        enable_metrics=True,
        startup_timeout_s=args.startup_timeout,
    )
    server = SGLangServer(config, workdir, name="demo-server")
    print(f"starting python -m sglang.launch_server on the CPU (log {server.log_path}) ...", flush=True)
    try:
        with server.launch():
            server.wait_ready(progress=lambda s: _say(f"still starting ({s:.0f} s; most of it imports) ..."))
            print(f"server healthy after {server.started_in_s:.1f} s; sending the workload ...", flush=True)
            rows, question_alone_s = run_workload(server, args, preset.vocab_size, preset.kv_bytes_per_token())
            metrics = server.metrics()
            code = _report(args, server, rows, question_alone_s, metrics, started)
            if getattr(args, "keep_running", False):
                keep_running(server)
    except ServerError as exc:
        # what failed and SGLang's reason, then the log's tail; the log is kept
        first, _, tail = str(exc).partition("\n")
        print(f"error: {first}", file=sys.stderr)
        if tail:
            print("last lines of the server's log:\n" + "\n".join(tail.splitlines()[-15:]), file=sys.stderr)
        return 1
    return code


def _report(args: argparse.Namespace, server: SGLangServer, rows: list[Row], question_alone_s: float,
            metrics: dict[str, float], started: float) -> int:
    """The table, the notes, the summary and ``--json``; the exit status."""
    preset = PRESETS[args.preset]
    summary = {
        "model": f"{args.preset}: Llama, {preset.layers} layers, hidden {preset.hidden_size}, "
        f"{preset.heads} heads ({preset.kv_heads} KV), fp32, random weights",
        "KV per token": _human(preset.kv_bytes_per_token()),
        "server start": f"{server.started_in_s:.1f} s to healthy",
        "L3 written": l3_written(metrics, args.page_size * preset.kv_bytes_per_token()),
        "L3 prefetch hits (SGLang metric)": f"{metrics.get('sglang:storage_prefetch_hit_tokens_total', 0.0):.0f} tokens",
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "whole demo": f"{time.monotonic() - started:.0f} s",
        "server log": server.log_path,
    }
    _print(rows, question_alone_s, summary)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": [asdict(r) for r in rows], "question_alone_ttft_s": question_alone_s, "summary": summary,
                       "server_start_s": server.started_in_s, "metrics": metrics,
                       "args": vars(args)}, f, indent=2)
        print(f"wrote {args.json}")
    ok = all(r.matches_fresh for r in rows) and any(r.tier == L3 and r.cached_tokens > 0 for r in rows)
    if not ok:
        print("FAILED: an answer differed from its fresh computation, or L3 was not hit", file=sys.stderr)
    return 0 if ok else 1


def keep_running(server: SGLangServer, poll_s: float = 1.0) -> None:
    """Leave the server up until Ctrl-C (or SIGTERM, or its own end), saying
    how to read it: what ``--keep-running`` is for."""
    print(f"the server keeps running at {server.url} (log {server.log_path}); in another shell:\n"
          f"  sglang-simm doctor --server {server.url}\n"
          f"  curl -s {server.url}/metrics | grep sglang_simm:\n"
          "Ctrl-C stops it.", flush=True)
    try:
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("stopping the server ...", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_simm_dev.server_demo", description=__doc__.split("\n\n", 1)[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
