"""Our per-call cost before and after a change, side by side in one session.

    python benchmarks/per_call_ab.py --before /path/to/old/src --runs 2 \
        --json benchmarks/results/per-call-ab.json

Runs ``python -m sglang_simm_dev bench --pages 1,8,128`` with the old tree's
``src`` and with this one's, taking turns (before, after, before, ...), each
in a fresh process, and prints in-tree/ours and our cost per call for every
op and size from each run. The bench harness and the null client are this
tree's ``dev/`` (installed with ``pip install -e ./dev``) for both, so both
backends are timed by the same harness over the same client: only the
backend core differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"


def run(src: Path, pages: str, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-m", "sglang_simm_dev", "bench", "--pages", pages, "--json", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the old tree's src folder")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--pages", default="1,8,128")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, src in (("before", args.before), ("after", HERE)):
                data = run(src, args.pages, Path(tmp) / f"{name}-{i}.json")
                results[name].append({"machine": data["machine"], "load": os.getloadavg(),
                                      "overhead": data["overhead"], "gil": data.get("gil"),
                                      "null_native": os.environ.get("SGLANG_SIMM_NULL_NATIVE") and "nanobind"
                                      or "python"})
                print(f"{name} run {i + 1} done (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"{'op':9s} {'pages':>5s} " + " ".join(
        f"{w + ' ' + str(i + 1):>22s}" for i in range(args.runs) for w in ("before", "after")))
    first = results["after"][0]["overhead"]
    for k, row in enumerate(first):
        if row["client"] != "null":
            continue
        cells = []
        for i in range(args.runs):
            for w in ("before", "after"):
                r = results[w][i]["overhead"][k]
                cells.append(f"{r['ratio']:5.2f}x {r['ours_us']:7.1f}/{r['intree_us']:7.1f}")
        print(f"{row['op']:9s} {row['pages']:5d} " + " ".join(f"{c:>22s}" for c in cells))
    print("cells: in-tree/ours, then ours/in-tree us per call (null client, thread CPU time, median)")
    gil = [results[w][i]["gil"] for i in range(args.runs) for w in ("before", "after")]
    if all(g and g.get("rows") for g in gil):
        print("longest GIL hold per call, ours (median of calls, us), before/after per run:")
        for k, row in enumerate(gil[0]["rows"]):
            cells = [f"{g['rows'][k]['ours_us']:8.1f}" for g in gil]
            print(f"{row['op']:9s} {row['pages']:5d} " + " ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"before_src": str(args.before), "results": results}, indent=1))


if __name__ == "__main__":
    main()
