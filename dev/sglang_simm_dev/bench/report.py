"""What every bench command does around its run: --plot checked first, a status line, the table, --json and --plot."""

from __future__ import annotations

import json
from typing import Any, Callable


def check_plot_extra(args: Any) -> None:
    """Fail before a run, not after it, when --plot cannot draw."""
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise OSError(f"--plot needs matplotlib ({exc}): pip install -e './dev[bench]'") from exc


def run_and_report(console: Any, args: Any, label: str, run_with: Callable[[Callable[[str], None]], dict[str, Any]],
                   render_with: Callable[[Any, dict[str, Any]], None],
                   plot_with: Callable[[dict[str, Any], str], None]) -> dict[str, Any]:
    """One bench run under a status line, its table, then --json and --plot."""
    with console.status(label) as status:
        result = run_with(lambda text: status.update(f"{label}: {text}"))
    render_with(console, result)
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        console.print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        plot_with(result, args.plot)
        console.print(f"wrote {args.plot}")
    return result

