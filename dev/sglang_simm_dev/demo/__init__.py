"""``sglang-simm-dev demo``: the command (``run_demo``, ``--list-models``), dispatching to the KV or the hybrid demo.

HiCache's L3 write-back and restore, replayed on a CPU. ``kv`` runs a
KV-only model's pages through SGLang's own cache controller or the backend
directly (``drivers``); ``hybrid`` runs a hybrid model's KV pages and Mamba
states through v1 and v2; ``common`` holds what both share.
"""

from __future__ import annotations

from typing import Any

from sglang_simm_dev.demo import hybrid, kv
from sglang_simm_dev.demo.common import EXIT_OK, EXIT_SETUP, DemoOptions, names_own_store


def preset_names() -> list[str]:
    """Every ``--model`` preset: the KV-only ones, then the hybrid ones."""
    from sglang_simm_dev.pools import PRESETS

    return [*PRESETS, *hybrid.HYBRID_PRESETS]


def run_demo(console: Any, args: Any, extra: dict[str, Any]) -> int:
    """The ``demo`` command. 0: every check passed; 1: a check failed;
    2: the demo could not run with these options here."""
    if getattr(args, "list_models", False):
        return list_models(console)
    opts = DemoOptions.from_args(args)
    if opts.model not in preset_names():
        console.print(f"[red]error:[/red] unknown model preset {opts.model!r}; choose one of: "
                      f"{', '.join(preset_names())} (--list-models shows them)", soft_wrap=True)
        return EXIT_SETUP
    if not names_own_store(extra):
        return _run(console, opts, extra)
    from sglang_simm.config import client_flag, with_client_flag
    from sglang_simm.local_store.admin import private_store_dir

    # the demo's own store lives in, and goes with, a directory of this run's
    # (under the one a config names, and named to the store in its place)
    with private_store_dir("sglang-simm-demo-", parent=client_flag(extra, "local_store_dir")) as root:
        return _run(console, opts, with_client_flag(extra, "local_store_dir", root))


def _run(console: Any, opts: DemoOptions, extra: dict[str, Any]) -> int:
    if hybrid.is_hybrid_preset(opts.model):  # a KV pool plus a Mamba state pool (v2)
        return hybrid.run(console, opts, extra)
    return kv.run(console, opts, extra)


def list_models(console: Any) -> int:
    """The presets, one row each: the name ``--model`` takes (never wrapped
    or cut, whatever the terminal's width) and its geometry, which wraps."""
    from rich import box
    from rich.table import Table

    rows = kv.list_rows() + hybrid.list_rows()
    table = Table(title="geometry presets (one TP rank)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    table.add_column("preset", no_wrap=True, min_width=max(len(r[0]) for r in rows))
    table.add_column("page geometry and model", overflow="fold")
    for preset, model, layers, heads, dim, page, dtype, page_bytes in rows:
        kv_shape = f"MLA {dim}" if heads == "MLA" else f"{heads} KV heads x {dim}"
        table.add_row(preset, f"{page_bytes} a page: {layers} layers x {kv_shape}, {page} tokens, {dtype}; {model}")
    console.print(table)
    return EXIT_OK
