"""``bench --server``'s output: rich tables, the Markdown of
``docs/benchmarks.md``, and the chart (matplotlib)."""

from __future__ import annotations

import statistics
from typing import Any

from sglang_simm_dev.bench.server_backends import EVENT_BACKENDS, L3_BACKENDS, MOONCAKE_INSTALL
from sglang_simm_dev.bench.server_itl import ITL_GOAL_RATIO
from sglang_simm_dev.bench.server_tap import SIZE_CLASSES, size_class

#: how each backend is named in tables
TITLES = {"ours": "ours (local store)", "ours-events": "ours, kv_events on, subscriber reading",
          "ours-events-stalled": "ours, kv_events on, subscriber stalled", "ours-disk": "ours (local store on a disk)",
          "file": "file (/dev/shm)", "mooncake": "Mooncake (TCP)",
          "mooncake-standalone": "Mooncake (standalone client)", "host": "host tier only", "none": "no HiCache"}

LONG_LABELS = (("scratch", "from scratch"), ("after traffic", "host tier"), ("after flush", "L3 after flush"))


def _ms(d: dict[str, float] | None) -> str:
    if not d:
        return "-"
    text = f"{d['median'] * 1e3:.0f}"
    if d["n"] > 1:
        text += f" ({d['min'] * 1e3:.0f}-{d['max'] * 1e3:.0f})"
    return text


def _pct(d: dict[str, float] | None) -> str:
    return "-" if not d else f"{d['median']:.2f}"


def _gbs(d: dict[str, float] | None) -> str:
    if not d:
        return "-"
    return f"{d['p10']:.2f} / {d['median']:.2f} / {d['p90']:.2f} ({d['n']})"


def titles(result: dict[str, Any]) -> dict[str, str]:
    """``TITLES``, with ``file`` named by where this run kept its folder."""
    out = dict(TITLES)
    if (result["settings"].get("l3_dirs", {}).get("file") or {}).get("medium") == "disk":
        out["file"] = "file (disk)"
    return out


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table as (title, header, rows): one source for rich and Markdown."""
    s, summ = result["settings"], result["summary"]
    TITLES = titles(result)  # noqa: N806 (the module's, with this run's media)
    names = s["backends"]
    out = []
    rows = []
    for n in names if any(result["long_prompt"].get(n) for n in names) else ():
        long = summ.get(n, {}).get("long_ttft_s", {})
        tiers = [f"{r['cached']['host']}/{r['cached']['storage']}" for r in result["long_prompt"][n][-1]["requests"][1:]]
        rows.append([TITLES.get(n, n), *(_ms(long.get(k)) for k, _ in LONG_LABELS), " ".join(tiers)])
    if rows:
        out.append((f"Long prompt ({s['workload']['long_tokens']} tokens), TTFT ms: median (min-max) of {s['repeat']}",
                    ["backend", *(t for _, t in LONG_LABELS), "tokens host/L3 (last rep)"], rows))
    rounds = range(1, s["workload"]["rounds"] + 1)
    rows = []
    for n in names if any(result["multi_turn"].get(n) for n in names) else ():
        mt = summ.get(n, {}).get("multi_turn", {})
        rr = mt.get("rounds", {})
        rows.append([TITLES.get(n, n), _ms(mt.get("mean_ttft_s")),
                     *(f"{_ms(rr.get(r, {}).get('ttft_s'))} [{_pct(rr.get(r, {}).get('hit_rate'))}]" for r in rounds)])
    w = s["workload"]
    if rows:
        out.append((f"Multi-turn ({w['clients']} clients x {w['rounds']} rounds of {w['turn_tokens']}-token turns): "
                    f"mean TTFT ms, and per round TTFT [hit rate]",
                    ["backend", "mean TTFT", *(f"round {r}" for r in rounds)], rows))
    if result.get("itl"):
        out.append(itl_table(result))
    rows = []
    for n in names:
        per = result["per_op"].get(n) or {}
        for op, label in (("get", "read (prefetch)"), ("set", "write (backup)")):
            for size, d in (per.get(op) or {}).items():
                rows.append([TITLES.get(n, n), label, size, _gbs(d)])
    if rows:
        out.append(("Per L3 call, timed around each backend in the server: GiB/s p10 / median / p90 (calls)",
                    ["backend", "op", "pages", "GiB/s"], rows))
    rows = []
    for n, h in result["histograms"].items():
        for metric in ("sglang:prefetch_bandwidth", "sglang:backup_bandwidth"):
            d = (h or {}).get(metric)
            if d:
                rows.append([TITLES.get(n, n), metric.split(":")[1], _gbs(d)])
    if rows:
        out.append(("SGLang's /metrics histograms as each backend reports them (GB/s, estimated inside coarse "
                    "buckets; Mooncake counts only K bytes on reads)", ["backend", "histogram", "p10 / median / p90 (ops)"],
                    rows))
    if result["goals"]:
        out.append((f"Ours against Mooncake, median per call (goal >= 2x)", ["against", "op", "pages", "ours GiB/s",
                    "Mooncake GiB/s", "ours / Mooncake"],
                    [[TITLES.get(g.get("against", "mooncake"), "?"), g["op"], g["pages"], f"{g['ours']:.2f}",
                      f"{g['mooncake']:.2f}", f"{g['ratio']:.2f}x" + ("" if g["met"] else " (behind)")]
                     for g in result["goals"]]))
    if result.get("kv_events"):
        out.append(("L3 events (kv_events): pages announced and dropped by each server (its /metrics), "
                    "and what a reading subscriber received",
                    ["backend", "subscriber", "pages announced", "dropped", "batches", "pages received"],
                    [[TITLES.get(n, n), d["subscriber"], str(d["pages_announced"]), str(d["pages_dropped"]),
                      str(d["batches"]), str(d.get("pages_received", "-"))] for n, d in result["kv_events"].items()]))
    if result["restart"]:
        out.append(("Restart on the same L3 (backups waited for with the scheduler idle, before the stop; L3 files "
                    "on a disk dropped from the page cache between stop and start): TTFT ms median (min-max) of the "
                    "prompts",
                    ["backend", "L3 hits", "L3 tokens", "TTFT", "same answers", "pages in L3 after (s)",
                     "page cache dropped (MiB before / after)"],
                    [[TITLES.get(n, n), f"{d['l3_hits']}/{d['prompts']}",
                      f"{sum(d['l3_tokens'])}/{sum(d['expected_l3_tokens'])}" if "l3_tokens" in d else "-",
                      _ms(_spread_of(d.get("ttft_s"))), f"{d['same_answers']}/{d['prompts']}",
                      _seconds(d.get("backup_s")), _dropped(d.get("page_cache"))]
                     for n, d in result["restart"].items()]))
    if result.get("disk_goals"):
        out.append(disk_table(result))
    return out


def disk_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """ours on a disk against ``file`` on the same disk, and its decoders against no HiCache's."""
    names = titles(result)
    rows = []
    for g in result["disk_goals"]:
        if "ITL" in g["what"]:
            value, other = _x(g["value"]), "1.00"
            each = ", ".join(_x(v) for v in g["each"])
            goal = f"<= {ITL_GOAL_RATIO:.2f}x"
        else:
            value, other = f"{g['value'] * 1e3:.0f}", f"{g['other'] * 1e3:.0f}"
            each = (", ".join(f"{v * 1e3:.0f}" for v in g["each"]) + " vs "
                    + ", ".join(f"{v * 1e3:.0f}" for v in g["other_each"]))
            goal = "<= the other's"
        rows.append([g["what"], names.get(g["backend"], g["backend"]), names.get(g["against"], g["against"]), value,
                     other, each, goal, "met" if g["met"] else "missed"])
    return ("The local store on a disk against SGLang's file backend on the same disk (TTFT ms: medians; each: "
            "every repetition's, or every prompt's after the restart), and its decoders' p99 over no HiCache's",
            ["figure", "backend", "against", "value", "other's", "each", "goal", ""], rows)


def _spread_of(values: list[float] | None) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _dropped(d: dict[str, Any] | None) -> str:
    if not d or d.get("medium") is None:
        return "-"
    if not d.get("dropped"):
        return f"no ({d['medium']})"
    return f"{d['resident_before'] / 2**20:.0f} / {d['resident_after'] / 2**20:.0f}"


def itl_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """The decoders' inter-token latency under L3 traffic, per backend."""
    s, w = result["settings"], result["settings"]["workload"]
    TITLES = titles(result)  # noqa: N806
    ref = result.get("itl_vs")
    rows = []
    for n in s["backends"]:
        d = result["summary"].get(n, {}).get("itl")
        if not d:
            continue
        under, quiet, pre = d.get("under") or {}, d.get("quiet") or {}, d.get("prefill") or {}
        ratio = result.get("itl_ratios", {}).get(n, {})
        reads = f"{d['l3_tokens']}/{d['expected_l3_tokens']}" if n in L3_BACKENDS else "-"
        rows.append([TITLES.get(n, n), _ms1(under.get("p50")), _ms1(under.get("p99")), _ms1(under.get("max")),
                     _x(ratio.get("p50")), _x(ratio.get("p99")), str(under.get("tokens", 0)),
                     f"{_ms1(quiet.get('p50'))} / {_ms1(quiet.get('p99'))}",
                     f"{pre.get('tokens', 0)}: {_ms1(pre.get('p50'))} / {_ms1(pre.get('max'))}", reads,
                     "-" if d.get("covered") is None else f"{d['covered']:.0%}"])
    title = (f"Decoders under L3 traffic: {w['itl_decoders']} clients streaming {w['itl_answer_tokens']} tokens while "
             f"{w['itl_stored']} prompts of {w['itl_bg_tokens']} tokens come back from L3 after a flush and "
             f"{w['itl_fresh']} new ones are backed up, one every {w['itl_bg_spacing_tokens']} decode steps; inter-token latency ms of the decode steps under that "
             f"traffic over {s['repeat']} repetition(s)" + (f", ratios over {TITLES.get(ref, ref)}" if ref else "")
             + "; gaps holding a background prefill apart; quiet: the same server with no background")
    return (title, ["backend", "p50", "p99", "max", "p50 x", "p99 x", "tokens", "quiet p50 / p99",
                    "prefill gaps: n: p50 / max", "L3 tokens read", "window decoded"], rows)


def _ms1(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _seconds(s: float | None) -> str:
    return "not within the wait" if s is None else f"{s:.1f}"


def notes(result: dict[str, Any]) -> list[str]:
    m, s = result["machine"], result["settings"]
    TITLES = titles(result)  # noqa: N806
    v = m.get("versions", {})
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {(m.get('memory_bytes') or 0) / 2**30:.0f} GiB; {m['platform']}",
        f"versions: SGLang {v.get('sglang')}, torch {v.get('torch')}, sglang-simm {v.get('sglang-simm')}, "
        f"Mooncake {v.get('mooncake-transfer-engine-non-cuda')}",
        f"model: {s['preset']} ({s['kv_bytes_per_token'] // 1024} KiB KV/token), page {s['page_size']} tokens, "
        f"device pool {s['device_tokens']} tokens, host pool x{s['hicache_ratio']}; SGLang's host-memory reserve "
        f"lowered from 10 to {s.get('host_memory_reserve_bytes', 0) / 2**30:.0f} GiB in these servers",
        f"load average (1/5/15 min): before {_load(result['load']['before'])}, after {_load(result['load']['after'])}; "
        f"whole run {result['seconds']:.0f} s; servers healthy after "
        + ", ".join(f"{n} {t:.0f} s" for n, t in result["server_start_s"].items()),
        *([("L3 files: " + "; ".join(f"{n} in {d['dir']} ({d['medium']})" for n, d in s["l3_dirs"].items()))]
          if s.get("l3_dirs") else []),
        f"answers: long prompts checked against their first answer (ids and logprobs); multi-turn answers against "
        f"{result['answers_vs']}'s: " + ", ".join(f"{n} {d['same']}/{d['of']}" for n, d in result["multi_turn_answers"].items()),
    ]
    ratio = (result.get("itl_ratios", {}).get("ours") or {}).get("p99")
    if ratio is not None:
        peers = {n: r.get("p99") for n, r in result["itl_ratios"].items()
                 if n in L3_BACKENDS and n != "ours" and n not in EVENT_BACKENDS}
        behind = [n for n, r in peers.items() if r is not None and r < ratio]
        lines.append(f"decoders' p99 inter-token latency under L3 traffic: ours {ratio:.2f}x "
                     f"{TITLES.get(result['itl_vs'], result['itl_vs'])} (goal <= {ITL_GOAL_RATIO:.2f}x: "
                     f"{'met' if ratio <= ITL_GOAL_RATIO else 'behind'})"
                     + (f"; peers {', '.join(f'{n} {r:.2f}x' for n, r in peers.items() if r is not None)}"
                        + (f" (ours behind {', '.join(behind)})" if behind else " (ours no worse)") if peers else ""))
    ratios = result.get("itl_ratios", {})
    events = {n: r["p99"] for n, r in ratios.items() if n in EVENT_BACKENDS and r.get("p99") is not None}
    if events:
        off = (ratios.get("ours") or {}).get("p99")
        lines.append(f"decoders' p99 inter-token latency with L3 events on, over {TITLES.get(result['itl_vs'], '?')}: "
                     + ", ".join(f"{TITLES.get(n, n)} {r:.2f}x" for n, r in events.items())
                     + (f" (events off: {off:.2f}x)" if off is not None else ""))
    asked = [b for b in s["asked"] if b.startswith("mooncake")]
    if not result["mooncake"]["available"] and asked:
        lines.append(f"Mooncake left out: {result['mooncake']['why']}")
    elif not asked:
        lines.append(f"Mooncake not asked for (install: {MOONCAKE_INSTALL})")
    elif result["mooncake"].get("standalone_why") and "mooncake-standalone" in asked:
        lines.append(f"Mooncake's standalone client left out: {result['mooncake'].get('standalone_why')}")
    for f in result["checks"]["failures"]:
        lines.append(f"CHECK FAILED: {f}")
    return lines


def _load(values) -> str:
    return "/".join(f"{x:.1f}" for x in values)


def render(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    console.print("[bold]sglang-simm-dev bench --server[/bold]")
    for title, header, rows in tables(result):
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    for line in notes(result):
        console.print(line)


def markdown(result: dict[str, Any], command: str) -> str:
    """One run's section of ``docs/benchmarks.md``."""
    lines = [f"### `{command}`", ""]
    for line in notes(result):
        lines.append(f"- {line}")
    lines.append("")
    for title, header, rows in tables(result):
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Per-call median GiB/s by batch size, reads and writes, per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (op, label) in zip(axes, (("get", "reads (prefetch)"), ("set", "writes (backup)"))):
        classes = [size_class(lo) for lo, _ in SIZE_CLASSES]
        used = [c for c in classes if any(c in (per.get(op) or {}) for per in result["per_op"].values())]
        for name, per in result["per_op"].items():
            d = per.get(op) or {}
            sizes = [c for c in used if c in d]
            if sizes:
                ax.errorbar([used.index(c) for c in sizes], [d[k]["median"] for k in sizes],
                            yerr=[[d[k]["median"] - d[k]["p10"] for k in sizes], [d[k]["p90"] - d[k]["median"] for k in sizes]],
                            marker="o", capsize=3, label=TITLES.get(name, name))
        ax.set_xticks(range(len(used)), used)
        ax.set_title(f"L3 {label}, per call (p10-p90)")
        ax.set_xlabel("pages per call")
        ax.set_ylabel("GiB/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
