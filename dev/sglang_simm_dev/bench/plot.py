"""The bench's chart (matplotlib, optional)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_simm_dev.bench.overhead import OPS


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise OSError(f"--plot needs matplotlib ({exc}): pip install -e './dev[bench]'") from exc
    clients = [c for c in ("null", "local") if any(r["client"] == c for r in result["overhead"])]
    ncols = len(clients) + (1 if result["bandwidth"] else 0)
    fig, axes = plt.subplots(1, max(1, ncols), figsize=(5.5 * max(1, ncols), 4.2), squeeze=False)
    colors = {"set": "tab:blue", "exists": "tab:green", "get": "tab:orange", "get-cold": "tab:red"}
    for ax, client in zip(axes[0], clients):
        for op in OPS:
            rows = [r for r in result["overhead"] if r["client"] == client and r["op"] == op]
            if not rows:
                continue
            x = [r["pages"] for r in rows]
            ax.plot(x, [r["ours_us_per_page"] for r in rows], "-o", color=colors[op], label=f"{op} ours")
            ax.plot(x, [r["intree_us_per_page"] for r in rows], "--x", color=colors[op], label=f"{op} in-tree")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["pages"] for r in result["overhead"] if r["client"] == client})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("pages per call")
        ax.set_ylabel("us per page")
        ax.set_title("null client (CPU time)" if client == "null" else "local store (wall time)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if result["bandwidth"]:
        ax = axes[0][len(clients)]
        rows = result["bandwidth"]
        x = np.arange(len(rows))
        w = 0.27
        ax.bar(x - w, [r["set_gbps"] for r in rows], w, label="set (ours)")
        ax.bar(x, [r["get_gbps"] for r in rows], w, label="get (ours)")
        ax.bar(x + w, [r["torch_gbps"] for r in rows], w, label="torch copy")
        ax.set_xticks(x, [r["case"] for r in rows])
        ax.set_ylabel("GB/s")
        ax.set_title("bandwidth, local store")
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"sglang-simm-dev bench: {m['cpu']}, {m['usable_cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
