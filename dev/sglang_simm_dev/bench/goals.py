"""The goals a run is held to (reported, never enforced: a noisy machine should not fail a run).

They stand on serving's pattern of keys (``overhead``): ``get`` is the read
after a lookup, ``get-cold`` a read with none, held to the same goals."""

from __future__ import annotations

from typing import Any

from sglang_simm_dev.bench.overhead import OPS

GOAL_RATIO = {"set": 5.0, "exists": 2.0, "get": 5.0, "get-cold": 5.0}
GOAL_US_PER_PAGE = 1.0
GOAL_BANDWIDTH_FRACTION = 0.70
GOAL_SCALING = 2.0
GOAL_PAGES = 128


def evaluate_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    null = {(r["op"], r["pages"]): r for r in result["overhead"] if r["client"] == "null"}
    for op in OPS:
        r = null.get((op, GOAL_PAGES))
        goals.append({
            "goal": f"{op}: in-tree/ours, {GOAL_PAGES} pages, null client",
            "target": f">= {GOAL_RATIO[op]:g}x", "value": r["ratio"] if r else None,
            "unit": "x", "met": (r["ratio"] >= GOAL_RATIO[op]) if r else None,
        })
    for op in OPS:
        r = null.get((op, GOAL_PAGES))
        goals.append({
            "goal": f"{op}: ours per page, {GOAL_PAGES} pages, null client",
            "target": f"< {GOAL_US_PER_PAGE:g} us", "value": r["ours_us_per_page"] if r else None,
            "unit": "us", "met": (r["ours_us_per_page"] < GOAL_US_PER_PAGE) if r else None,
        })
    for row in result["bandwidth"]:
        if min(row["object_bytes"]) < (1 << 20):
            continue
        for op in ("set", "get"):
            v = row[f"{op}_ratio"]
            goals.append({
                "goal": f"{op}: bandwidth / torch copy, {row['case']}",
                "target": f">= {GOAL_BANDWIDTH_FRACTION:.0%}", "value": v, "unit": "%",
                "met": v >= GOAL_BANDWIDTH_FRACTION,
            })
    for client in ("null", "local"):
        sc = result["scaling"].get(client, {})
        for op in OPS:
            s = sc.get(op)
            goals.append({
                "goal": f"{op}: ours per page, max/min 8..1024, {client}",
                "target": f"< {GOAL_SCALING:g}x", "value": s["max_over_min"] if s else None,
                "unit": "x", "met": (s["max_over_min"] < GOAL_SCALING) if s else None,
            })
    return goals
