"""``sglang-simm demo``: the command (``run_demo``, ``--list-models``), dispatching to the KV or the hybrid demo.

HiCache's L3 write-back and restore, replayed on a CPU. ``kv`` runs a
KV-only model's pages through SGLang's own cache controller or the backend
directly (``drivers``); ``hybrid`` runs a hybrid model's KV pages and Mamba
states through v1 and v2; ``common`` holds what both share.
"""

from __future__ import annotations

from typing import Any

from sglang_simm.tools.demo import hybrid, kv
from sglang_simm.tools.demo.common import EXIT_OK, DemoOptions


def run_demo(console: Any, args: Any, extra: dict[str, Any]) -> int:
    """The ``demo`` command. 0: every check passed; 1: a check failed;
    2: the demo could not run with these options here."""
    if getattr(args, "list_models", False):
        return list_models(console)
    opts = DemoOptions.from_args(args)
    if hybrid.is_hybrid_preset(opts.model):  # a KV pool plus a Mamba state pool (v2)
        return hybrid.run(console, opts, extra)
    return kv.run(console, opts, extra)


def list_models(console: Any) -> int:
    from rich.table import Table

    table = Table(title="geometry presets (one TP rank)")
    for col in ("preset", "model", "layers", "KV heads", "head dim", "page", "dtype", "page bytes"):
        table.add_column(col, justify="left" if col in ("preset", "model", "dtype") else "right")
    for row in kv.list_rows() + hybrid.list_rows():
        table.add_row(*row)
    console.print(table)
    return EXIT_OK
