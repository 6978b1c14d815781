"""``sglang-simm-dev bench --server``: L3 backends side by side in real SGLang servers.

One CPU server per backend (``server_backends``: ours, ``file``, Mooncake,
host tier only, no HiCache), the same model, flags and prompts, all started
side by side and left idle with ``--sleep-on-idle`` while another works.
Each repetition runs the workloads of ``server_workloads`` (a long prompt
from scratch, from the host tier and from L3; a multi-turn conversation)
on every server in turn, in an order rotated per repetition, and the
decoders' inter-token latency under L3 traffic (``server_itl``); backups are
let finish before the next server's turn. Then the L3 servers are restarted
on the same L3 and asked for what they stored. Per backend, the storage
histograms of SGLang's ``/metrics`` (``server_metrics``) and the timing of
every L3 call (``server_tap``) give the per-operation bandwidth by batch
size. ``server_render`` prints the tables, the Markdown of
``docs/benchmarks.md`` and the chart.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from sglang_simm_dev.bench.server_backends import (
    BACKENDS,
    DEFAULT_BACKENDS,
    DISK_BACKENDS,
    EVENT_BACKENDS,
    L3_BACKENDS,
    MOONCAKE_BACKENDS,
    OURS_BACKENDS,
    RESTART_KEEPS_L3,
    Environment,
    Shape,
)
from sglang_simm_dev.bench.server_events import Listeners
from sglang_simm_dev.bench.server_metrics import scrape, summary
from sglang_simm_dev.bench.server_itl import against, decode_under_l3, pooled
from sglang_simm_dev.bench.server_tap import RESERVE_ENV, TAP_ENV, by_size, read_ops, write_tap
from sglang_simm_dev.bench.server_workloads import (
    BACKUP_WAIT_S,
    Backups,
    Workload,
    after_restart,
    compare_turns,
    long_prompt,
    multi_turn,
    restart_prompts,
    rotated,
    store_for_restart,
)
from sglang_simm_dev.sglang_server import SGLangServer, ServerError
from sglang_simm_dev.tiny_model import PRESETS, write_model

#: the host RAM SGLang keeps free when it sizes a host pool, in the bench's
#: servers (SGLang's own: 10 GiB, see ``server_tap._patch_host_reserve``)
HOST_RESERVE_BYTES = 1 << 30

#: the goal of issue 20: ours over Mooncake, per-operation GiB/s, every batch size
GOAL_RATIO = 2.0

#: what ``--workloads`` picks from, in the order they run
WORKLOADS = ("long", "turns", "itl", "restart")


@dataclass
class ServerPlan:
    backends: list[str]
    repeat: int = 2
    preset: str = "llama-demo"
    workload: Workload = field(default_factory=Workload)
    device_tokens: int = 4096
    hicache_ratio: float = 2.5
    page_size: int = 16
    restart: bool = True
    python: str = ""
    workdir: str | None = None
    model_dir: str | None = None
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    #: where ``DISK_BACKENDS`` keep their store (and ``file`` its folder
    #: beside it when both run): a directory on a disk; None: the temp directory
    disk_dir: str | None = None


#: SGLang reads L3 only for a miss of at least 256 tokens (its default
#: storage prefetch threshold): every quick prompt that should hit is longer
QUICK_WORKLOAD = Workload(long_tokens=512, filler_tokens=1024, filler_chunk=256, new_tokens=4, clients=2,
                          rounds=2, turn_tokens=160, answer_tokens=8, restart_prompts=2, restart_tokens=320,
                          itl_decoders=2, itl_prompt_tokens=32, itl_answer_tokens=128, itl_lead_tokens=8,
                          itl_stored=4, itl_fresh=4, itl_bg_tokens=320, itl_bg_spacing_tokens=8)


#: ``--small``: the same shapes at about a third of the prefill work (a
#: shared two-core machine prefills a few hundred tokens a second)
SMALL_WORKLOAD = Workload(long_tokens=1536, filler_tokens=2048, filler_chunk=1024, warmup_tokens=512, clients=4,
                          rounds=3, turn_tokens=384, answer_tokens=32, restart_prompts=3, restart_tokens=512,
                          itl_answer_tokens=320, itl_stored=6, itl_fresh=6, itl_bg_tokens=512, itl_bg_spacing_tokens=16)


def plan_from_args(args: Any) -> ServerPlan:
    """``--backends``, ``--repeat``, ``--quick``, ``--preset``, ``--python``, ``--no-restart``,
    ``--small``, ``--host-ratio``, ``--workloads``, ``--disk-dir``."""
    quick = bool(getattr(args, "quick", False))
    names = getattr(args, "backends", None)
    backends = [b.strip() for b in names.split(",") if b.strip()] if names else (
        ["ours", "file"] if quick else list(DEFAULT_BACKENDS))
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"--backends takes a comma list of {', '.join(BACKENDS)}; got {names!r}")
    repeat = getattr(args, "repeat", None)
    repeat = (1 if quick else 2) if repeat is None else int(repeat)
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    preset = getattr(args, "preset", None) or ("llama-tiny" if quick else "llama-demo")
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    asked = getattr(args, "workloads", None)
    workloads = tuple(x.strip() for x in asked.split(",") if x.strip()) if asked else WORKLOADS
    if not workloads or any(x not in WORKLOADS for x in workloads):
        raise ValueError(f"--workloads takes a comma list of {', '.join(WORKLOADS)}; got {asked!r}")
    workloads = tuple(x for x in WORKLOADS if x in workloads)
    plan = ServerPlan(backends=backends, repeat=repeat, preset=preset, python=getattr(args, "python", None) or "",
                      restart=not getattr(args, "no_restart", False) and "restart" in workloads,
                      workloads=workloads, disk_dir=getattr(args, "disk_dir", None))
    if quick:
        plan = replace(plan, workload=QUICK_WORKLOAD, device_tokens=1024)
    elif getattr(args, "small", False):
        plan = replace(plan, workload=SMALL_WORKLOAD, device_tokens=2048)
    ratio = getattr(args, "host_ratio", None)
    if ratio is not None:
        # SGLang refuses a host pool no larger than the device pool
        if not 1.0 < float(ratio) <= 64.0:
            raise ValueError(f"--host-ratio must be above 1 (SGLang's host pool must be larger than the "
                             f"device pool) and at most 64, got {ratio!r}")
        plan = replace(plan, hicache_ratio=float(ratio))
    return plan


def _model_dir(plan: ServerPlan) -> str:
    if plan.model_dir:
        return plan.model_dir
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sglang-simm", "models", f"{plan.preset}-seed{plan.seed}")


def _versions(python: str) -> dict[str, Any]:
    import subprocess
    import sys

    code = ("import importlib.metadata as m\n"
            "for d in ('sglang', 'torch', 'mooncake-transfer-engine-non-cuda', 'sglang-simm'):\n"
            "    try: print(d, m.version(d))\n"
            "    except Exception: print(d, '-')\n")
    out = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def machine(python: str) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "versions": _versions(python)}


def _spread(values: list[float]) -> dict[str, float] | None:
    """Median, min and max over repetitions."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over repetitions of every TTFT, per backend, and the
    decoders' inter-token latency over every repetition's tokens (pure)."""
    out: dict[str, Any] = {}
    for name, reps in result.get("itl", {}).items():
        if reps:
            out.setdefault(name, {})["itl"] = pooled(reps)
    for name, reps in result["long_prompt"].items():
        by_label: dict[str, list[float]] = {}
        for rep in reps:
            for r in rep["requests"]:
                by_label.setdefault(r["label"], []).append(r["ttft_s"])
        out.setdefault(name, {})["long_ttft_s"] = {k: _spread(v) for k, v in by_label.items()}
    for name, reps in result["multi_turn"].items():
        rounds: dict[int, dict[str, list[float]]] = {}
        means: list[float] = []
        for rep in reps:
            all_ttft: list[float] = []
            for rnd in rep["rounds"]:
                d = rounds.setdefault(rnd["round"], {"ttft": [], "hit": []})
                d["ttft"].append(statistics.fmean(rnd["ttft_s"]))
                d["hit"].append(rnd["hit_rate"])
                all_ttft += rnd["ttft_s"]
            means.append(statistics.fmean(all_ttft))
        out.setdefault(name, {})["multi_turn"] = {
            "mean_ttft_s": _spread(means),
            "rounds": {r: {"ttft_s": _spread(d["ttft"]), "hit_rate": _spread(d["hit"])} for r, d in sorted(rounds.items())},
        }
    return out


def _error_line(why: str) -> str:
    """What went wrong with a server that did not start, in a line: the
    last exception in its log's tail, else the message's first line."""
    lines = [line.strip() for line in why.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", line):
            return line
    return lines[0] if lines else "no output"


def _failure(exc: Exception, keep: int = 3000) -> str:
    """A start failure for the report: its first line (which server, its
    status, its log's path) and the end of the log tail after it."""
    text = str(exc)
    if len(text) <= keep:
        return text
    head = text.split("\n", 1)[0]
    return f"{head}\n...\n{text[-keep:]}"


def goals(per_op: dict[str, Any]) -> list[dict[str, Any]]:
    """Ours against each Mooncake server measured (``against``), median
    GiB/s per operation, per batch size class both measured; ``met`` when
    ours >= ``GOAL_RATIO`` x."""
    ours = per_op.get("ours") or {}
    rows = []
    for against in MOONCAKE_BACKENDS:
        theirs = per_op.get(against) or {}
        for op in ("get", "set"):
            for size, d in (ours.get(op) or {}).items():
                other = (theirs.get(op) or {}).get(size)
                if not d or not other:
                    continue
                ratio = d["median"] / other["median"] if other["median"] else float("inf")
                rows.append({"against": against, "op": op, "pages": size, "ours": d["median"],
                             "mooncake": other["median"], "ratio": ratio, "met": ratio >= GOAL_RATIO})
    return rows


#: the disk's goals: ours-disk's L3-hit TTFT at or below file's (hot, and
#: cold after a restart), the decoders' p99 within this of no HiCache's
DISK_TTFT_RATIO = 1.0


def disk_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``ours-disk`` against ``file`` (both on the disk): the long prompt's
    TTFT from L3 after a flush (hot: the files in the page cache), per
    repetition and median; the restart's prompts (cold: page cache dropped
    between stop and start), median over the prompts; and the decoders'
    p99 over no HiCache's, pooled and per repetition. Pure."""
    from sglang_simm_dev.bench.server_itl import ITL_GOAL_RATIO, pooled

    out: list[dict[str, Any]] = []
    for disk in (n for n in result["settings"]["backends"] if n in DISK_BACKENDS):
        hot = {n: [rep["requests"][-1]["ttft_s"] for rep in result["long_prompt"].get(n) or []]
               for n in (disk, "file")}
        if hot[disk] and hot["file"]:
            mine, theirs = statistics.median(hot[disk]), statistics.median(hot["file"])
            out.append({"what": "L3-hit TTFT, hot (long prompt after a flush)", "backend": disk, "against": "file",
                        "value": mine, "other": theirs, "ratio": mine / theirs, "each": hot[disk],
                        "other_each": hot["file"], "met": mine <= theirs * DISK_TTFT_RATIO})
        cold = {n: (result["restart"].get(n) or {}).get("ttft_s") or [] for n in (disk, "file")}
        if cold[disk] and cold["file"]:
            mine, theirs = statistics.median(cold[disk]), statistics.median(cold["file"])
            out.append({"what": "L3-hit TTFT, cold (after a restart, page cache dropped)", "backend": disk,
                        "against": "file", "value": mine, "other": theirs, "ratio": mine / theirs,
                        "each": cold[disk], "other_each": cold["file"], "met": mine <= theirs * DISK_TTFT_RATIO})
        itl = result.get("itl") or {}
        ref = result.get("itl_vs")
        if itl.get(disk) and ref and itl.get(ref):
            ratio = (result.get("itl_ratios", {}).get(disk) or {}).get("p99")
            each = []
            for mine, theirs in zip(itl[disk], itl[ref]):
                a, b = (pooled([r]).get("under") or {} for r in (mine, theirs))
                each.append(a["p99"] / b["p99"] if a.get("p99") and b.get("p99") else None)
            out.append({"what": f"decoders' ITL p99 over {ref}'s", "backend": disk, "against": ref, "value": ratio,
                        "each": each, "met": ratio is not None and ratio <= ITL_GOAL_RATIO})
    return out


def _l3_dirs(env: Environment, names: list[str]) -> dict[str, dict[str, str]]:
    """Where each L3 backend's files live, and on what medium."""
    from sglang_simm.local_store.admin import medium_of

    out = {}
    for name in names:
        where = env.l3_dir(name)
        if where:
            out[name] = {"dir": where, "medium": medium_of(where)}
    return out


def _launch(env: Environment, shape: Shape, names: list[str], root: str, tap: str) -> dict[str, SGLangServer]:
    servers: dict[str, SGLangServer] = {}
    for name in names:
        config = env.config(name, shape)
        config = replace(config, pythonpath=(tap,), env={**config.env, TAP_ENV: os.path.join(env.tap_dir, name),
                                                         RESERVE_ENV: str(HOST_RESERVE_BYTES)})
        servers[name] = SGLangServer(config, os.path.join(root, name), name=name).launch()
    return servers


def run(plan: ServerPlan, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The whole bench, as one JSON-able dict; servers, stores and the master
    are stopped whatever happens."""
    import sys

    python = plan.python or sys.executable
    started = time.monotonic()
    load_before = os.getloadavg()
    workdir = plan.workdir or tempfile.mkdtemp(prefix="sglang-simm-bench-server-")
    os.makedirs(workdir, exist_ok=True)
    preset = PRESETS[plan.preset]
    progress(f"writing the {plan.preset} model")
    model = write_model(_model_dir(plan), plan.preset, seed=plan.seed)
    shape = Shape(model_path=model, page_size=plan.page_size, device_tokens=plan.device_tokens,
                  hicache_ratio=plan.hicache_ratio, python=python)
    on_disk = any(b in DISK_BACKENDS for b in plan.backends)
    env = Environment.create(python, want_mooncake=any(b in MOONCAKE_BACKENDS for b in plan.backends),
                             want_standalone="mooncake-standalone" in plan.backends, workdir=workdir,
                             segment_bytes=shape.l3_bytes,
                             disk_dir=(plan.disk_dir or tempfile.gettempdir()) if on_disk else None,
                             file_on_disk=on_disk)
    names = [b for b in plan.backends if env.available(b)]
    tap = write_tap(os.path.join(workdir, "tap-site"))
    result: dict[str, Any] = {
        "machine": machine(python),
        "settings": {"backends": names, "asked": plan.backends, "repeat": plan.repeat, "preset": plan.preset,
                     "kv_bytes_per_token": preset.kv_bytes_per_token(), "page_size": plan.page_size,
                     "device_tokens": plan.device_tokens, "hicache_ratio": plan.hicache_ratio,
                     "host_memory_reserve_bytes": HOST_RESERVE_BYTES,
                     "workload": asdict(plan.workload), "workloads": list(plan.workloads),
                     "l3_dirs": _l3_dirs(env, names)},
        "mooncake": {"available": env.mooncake.available, "why": env.mooncake.why,
                     "standalone_why": env.standalone_why},
        "long_prompt": {n: [] for n in names}, "multi_turn": {n: [] for n in names}, "itl": {n: [] for n in names},
        "server_start_s": {}, "histograms": {}, "per_op": {}, "calls": {}, "restart": {}, "failed": {},
        "kv_events": {},
    }
    servers: dict[str, SGLangServer] = {}
    listeners: Listeners | None = None
    try:
        for name in names:
            if name in OURS_BACKENDS:
                env.hold_store(shape, backend=name)
        progress(f"starting {len(names)} servers side by side ({', '.join(names)})")
        servers = _launch(env, shape, names, os.path.join(workdir, "servers"), tap)
        for name, server in list(servers.items()):
            try:
                server.wait_ready()
            except ServerError as exc:  # the others still run; the report says why this one did not
                result["failed"][name] = _failure(exc)
                del servers[name]
                continue
            result["server_start_s"][name] = server.started_in_s
        names = [n for n in names if n in servers]
        if not names:
            raise ServerError("no server started: " + "; ".join(result["failed"].values()))
        result["settings"]["backends"] = names
        listeners = Listeners(env, names)
        backups = {n: Backups(os.path.join(env.tap_dir, n)) if n in L3_BACKENDS else None for n in names}
        w, vocab = plan.workload, preset.vocab_size
        for rep in range(plan.repeat):
            order = rotated(names, rep)
            seed = plan.seed * 1000 + rep
            for name in order if "long" in plan.workloads else ():
                progress(f"repetition {rep + 1}/{plan.repeat}: long prompt on {name}")
                result["long_prompt"][name].append(long_prompt(servers[name], backups[name], w, seed, vocab))
            for name in order if "turns" in plan.workloads else ():
                progress(f"repetition {rep + 1}/{plan.repeat}: multi-turn on {name}")
                result["multi_turn"][name].append(multi_turn(servers[name], backups[name], w, seed + 500, vocab))
            for name in order if "itl" in plan.workloads else ():
                progress(f"repetition {rep + 1}/{plan.repeat}: decoders under L3 traffic on {name}")
                result["itl"][name].append(decode_under_l3(servers[name], backups[name], w, seed + 700, vocab))
        for name, server in servers.items():
            result["histograms"][name] = summary(scrape(server.url))
        if listeners is not None:
            time.sleep(1.0)  # the last batches out, the servers' counters pushed
            result["kv_events"] = listeners.report({n: servers[n].metrics() for n in names if n in EVENT_BACKENDS})
        l3 = [n for n in names if n in L3_BACKENDS]
        if plan.restart and l3:
            prompts = restart_prompts(w, plan.seed * 1000 + 999, vocab)
            before = {}
            for name in l3:
                progress(f"restart: storing {len(prompts)} prompts on {name}")
                before[name] = store_for_restart(servers[name], backups[name], prompts, w)
            for server in servers.values():
                server.stop()
            dropped = {}
            for name in l3:  # the restarted servers read their L3 cold
                progress(f"restart: dropping {name}'s L3 files from the page cache")
                dropped[name] = env.drop_l3_cache(name)
            progress(f"restart: starting {', '.join(l3)} again on the same L3")
            servers = _launch(env, shape, l3, os.path.join(workdir, "restarted"), tap)
            for name in l3:
                try:
                    servers[name].wait_ready()
                except ServerError as exc:
                    result["failed"][f"{name} (restarted)"] = _failure(exc)
                    continue
                result["restart"][name] = {**after_restart(servers[name], backups[name], prompts, before[name], w,
                                                           plan.seed * 1000 + 998, vocab),
                                           "page_cache": dropped[name]}
        for name in names:
            ops = read_ops(os.path.join(env.tap_dir, name))
            if ops:
                result["per_op"][name] = by_size(ops)
                # every call, for a look past the quantiles: op, pages, pages that succeeded, µs
                result["calls"][name] = [[o.op, o.pages, o.ok, round(o.seconds * 1e6)] for o in ops]
    finally:
        if listeners is not None:
            listeners.close()
        for server in servers.values():
            server.stop()
        env.close()
        if plan.workdir is None and not os.environ.get("SGLANG_SIMM_KEEP_BENCH"):
            shutil.rmtree(workdir, ignore_errors=True)
    names = result["settings"]["backends"]
    result["long_prompt"] = {n: v for n, v in result["long_prompt"].items() if n in names}
    result["multi_turn"] = {n: v for n, v in result["multi_turn"].items() if n in names}
    result["itl"] = {n: v for n, v in result["itl"].items() if n in names and v}
    result["answers_vs"] = "none" if "none" in names else names[0]
    result["multi_turn_answers"] = compare_turns(result["multi_turn"], result["answers_vs"])
    result["summary"] = aggregate(result)
    itl = {n: d["itl"] for n, d in result["summary"].items() if "itl" in d}
    result["itl_vs"] = next((n for n in ("none", "host") if n in itl), None)
    result["itl_ratios"] = against(itl, result["itl_vs"]) if result["itl_vs"] else {}
    result["goals"] = goals(result["per_op"])
    result["disk_goals"] = disk_goals(result)
    result["checks"] = checks(result)
    result["load"] = {"before": load_before, "after": os.getloadavg()}
    result["seconds"] = time.monotonic() - started
    return result


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """What must hold for the figures to mean anything: every repeated long
    prompt gave the first answer; L3 backends served the flushed prompt from
    L3; multi-turn answers agree across backends; restarts gave the same
    answers where they hit."""
    failures: list[str] = [f"{name} did not start: {_error_line(why)}" for name, why in result.get("failed", {}).items()]
    for name, reps in result["long_prompt"].items():
        for i, rep in enumerate(reps):
            for r in rep["requests"]:
                if r["ok"] is False:
                    failures.append(f"{name} rep {i + 1}: {r['label']} answer differs from scratch")
            if name in L3_BACKENDS:
                if rep.get("backed_up") is False:
                    failures.append(f"{name} rep {i + 1}: the long prompt's pages did not all reach L3 "
                                    f"within {BACKUP_WAIT_S:.0f} s of its answer")
                flushed = rep["requests"][-1]
                if flushed["cached"]["storage"] != rep["expected_prefix"]:
                    failures.append(f"{name} rep {i + 1}: after flush {flushed['cached']['storage']} tokens from L3, "
                                    f"expected {rep['expected_prefix']}")
    for name, reps in result.get("itl", {}).items():
        for i, rep in enumerate(reps):
            if rep.get("backed_up") is False:
                failures.append(f"{name} rep {i + 1}: the stored background prompts did not all reach L3 "
                                f"within {BACKUP_WAIT_S:.0f} s")
            if name in L3_BACKENDS and rep["l3_tokens"] != rep["expected_l3_tokens"]:
                failures.append(f"{name} rep {i + 1}: the background read {rep['l3_tokens']} tokens from L3 "
                                f"during the decoding, expected {rep['expected_l3_tokens']}")
    for name, d in result["multi_turn_answers"].items():
        if d["same"] != d["of"]:
            failures.append(f"{name}: {d['of'] - d['same']} of {d['of']} multi-turn answers differ from "
                            f"{result['answers_vs']}'s")
    for name, d in result["restart"].items():
        if d.get("backed_up") is False:
            failures.append(f"{name}: the restart's prompts did not all reach L3 within {BACKUP_WAIT_S:.0f} s "
                            "before the stop")
        if name in RESTART_KEEPS_L3 and d["l3_hits"] != d["prompts"]:
            failures.append(f"{name}: {d['prompts'] - d['l3_hits']} of {d['prompts']} prompts were not served "
                            "from L3 after the restart")
        if d["same_answers"] != d["prompts"]:
            failures.append(f"{name}: {d['prompts'] - d['same_answers']} answers after the restart differ")
    return {"ok": not failures, "failures": failures}
