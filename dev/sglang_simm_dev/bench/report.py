"""What every bench command does around its run: --plot checked first, a status line, the table, --json, --plot
and --docs (the bench's section of ``docs/benchmarks.md``, replaced by the latest result)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from typing import Any, Callable

#: a bench's section of the results page lies between these two lines
SECTION_START = "<!-- bench:{name} latest -->"
SECTION_END = "<!-- /bench:{name} -->"


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



def source_commit(cwd: str | None = None) -> str:
    """The commit the bench ran from (``abc1234``, ``+dirty`` when the tree had changes), or ``unknown``."""
    where = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def write_docs_section(path: str, name: str, body: str, *, commit: str | None = None,
                       today: datetime.date | None = None) -> None:
    """Replace bench ``name``'s section of the results page ``path`` with ``body``, stamped with the commit and date.

    The page keeps one result per bench, the latest; earlier results are in git's history. The rest of
    the page (what each bench measures, its command) is written by hand and left as it is. A page
    without the section gets it at its end; ``path`` must exist (the page is the docs', not the bench's).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = SECTION_START.format(name=name), SECTION_END.format(name=name)
    stamp = f"Latest result: commit `{commit or source_commit()}`, {(today or datetime.date.today()).isoformat()}."
    section = f"{start}\n{stamp}\n\n{body.strip()}\n{end}"
    if start in text:
        head, rest = text.split(start, 1)
        if end not in rest:
            raise ValueError(f"{path}: {start!r} has no {end!r} after it")
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
