"""The bench's tables, printed with rich."""

from __future__ import annotations

from typing import Any


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None or v != v:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def _noise(row: dict[str, Any]) -> str:
    """The larger interquartile range over median of the two backends' samples."""
    values = [v for v in (row.get("ours_spread"), row.get("intree_spread")) if v is not None and v == v]
    return f"{max(values):.0%}" if values else "-"


def render(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    m = result["machine"]
    console.print(
        f"[bold]sglang-simm-dev bench[/bold]  {m['cpu']}, {m['usable_cores']} cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads), SGLang {m['sglang']}"
    )
    s = result["settings"]
    console.print(
        f"median of {s['repeat']} samples per point; overhead pages: {s['overhead_page_tokens']} tokens, "
        f"{s['overhead_page_bytes'] // 1024} KiB (2 objects)"
        + (f"; null client: new host pages every call, over a pool of {s['null_pool_pages']:,} pages"
           if s.get("null_pool_pages") else "")
    )
    ops = result.get("operations") or {}
    if ops:
        console.print("operations: " + "; ".join(f"[bold]{op}[/bold] {what}" for op, what in ops.items()))
    titles = {
        "null": "Own overhead per call, null client (only the backends' work; thread CPU time)",
        "local": "Per call on the local store (backend + store; wall time)",
    }
    for client in ("null", "local"):
        rows = [r for r in result["overhead"] if r["client"] == client]
        if not rows:
            continue
        t = Table(title=titles[client], title_justify="left")
        t.add_column("op")
        t.add_column("pages", justify="right")
        t.add_column("in-tree\nus/call", justify="right")
        t.add_column("ours\nus/call", justify="right")
        t.add_column("in-tree\nus/page", justify="right")
        t.add_column("ours\nus/page", justify="right")
        t.add_column("in-tree\n/ ours", justify="right")
        t.add_column("noise\n(IQR)", justify="right")
        last_op = None
        for r in rows:
            if last_op is not None and r["op"] != last_op:
                t.add_section()
            last_op = r["op"]
            t.add_row(r["op"], str(r["pages"]), _fmt(r["intree_us"]), _fmt(r["ours_us"]),
                      _fmt(r["intree_us_per_page"], 3), _fmt(r["ours_us_per_page"], 3),
                      f"{r['ratio']:.2f}x", _noise(r))
        console.print(t)
    gil = result.get("gil") or {}
    if gil.get("rows"):
        t = Table(title="Longest GIL hold per call, null client releasing the GIL in its batch calls "
                        "as SiMM's client does (median of calls; the most in brackets)", title_justify="left")
        for name in ("op", "pages", "in-tree\nus", "ours\nus", "in-tree\n/ ours"):
            t.add_column(name, justify="left" if name == "op" else "right")
        last_op = None
        for r in gil["rows"]:
            if last_op is not None and r["op"] != last_op:
                t.add_section()
            last_op = r["op"]
            ratio = r["intree_us"] / r["ours_us"] if r["ours_us"] > 0 else float("nan")
            t.add_row(r["op"], str(r["pages"]), f"{_fmt(r['intree_us'])} ({_fmt(r['intree_max_us'])})",
                      f"{_fmt(r['ours_us'])} ({_fmt(r['ours_max_us'])})", f"{ratio:.2f}x")
        console.print(t)
    if result["bandwidth"]:
        t = Table(title="Bandwidth, ours on the local store vs torch copy of the same bytes",
                  title_justify="left")
        for name in ("case", "object", "pages", "MiB\n/call", "set\nGB/s", "get\nGB/s", "torch\nGB/s",
                     "set /\ntorch", "get /\ntorch"):
            t.add_column(name, justify="left" if name == "case" else "right")
        for r in result["bandwidth"]:
            obj = "/".join(f"{b / (1 << 20):.3g} MiB" if b >= 1 << 20 else f"{b // 1024} KiB"
                           for b in r["object_bytes"])
            t.add_row(r["case"], obj, str(r["pages"]), f"{r['bytes'] / (1 << 20):.0f}",
                      _fmt(r["set_gbps"]), _fmt(r["get_gbps"]), _fmt(r["torch_gbps"]),
                      f"{r['set_ratio']:.0%}", f"{r['get_ratio']:.0%}")
        console.print(t)
    for client, sc in result["scaling"].items():
        if not sc:
            continue
        sizes = list(next(iter(sc.values()))["us_per_page"])
        t = Table(title=f"Scaling: our us per page vs pages per call ({client})", title_justify="left")
        t.add_column("op")
        for n in sizes:
            t.add_column(n, justify="right")
        t.add_column("max/min", justify="right")
        for op, v in sc.items():
            t.add_row(op, *[_fmt(v["us_per_page"].get(n), 3) for n in sizes], f"{v['max_over_min']:.2f}x")
        console.print(t)
    t = Table(title="Goals", title_justify="left")
    t.add_column("goal")
    t.add_column("target", justify="right")
    t.add_column("measured", justify="right")
    t.add_column("", justify="left")
    for g in result["goals"]:
        v = g["value"]
        shown = "-" if v is None else (f"{v:.0%}" if g["unit"] == "%" else f"{_fmt(v)}{' us' if g['unit'] == 'us' else 'x'}")
        status = "[dim]not measured[/dim]" if g["met"] is None else ("[green]met[/green]" if g["met"] else "[red]missed[/red]")
        t.add_row(g["goal"], g["target"], shown, status)
    console.print(t)
    c = result["checks"]
    if c["ok"]:
        console.print(f"[green]results verified[/green]: {len(c['verified'])} checks "
                      "(pages stored, found and read by both backends; bytes read back compared)")
    else:
        console.print(f"[red]result checks failed[/red]: {'; '.join(c['failures'][:10])}")
    console.print(f"[dim]{result['seconds']:.1f} s[/dim]")
