"""The store's operator surface: what the configuration, ``sglang-simm store``
and ``doctor`` use of the store besides the ``simm.kv`` surface. Every name
is a re-export; nothing outside the store imports its private modules
(``tests/test_layout.py``). Importing this module costs the standard
library's light modules; the rest resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_simm.local_store import lazy_attributes
from sglang_simm.local_store._flags import MOVED_FLAGS, MOVED_WHERE, RENAMED_FLAGS, both_given, deprecated
from sglang_simm.local_store._limits import EVICTION_POLICIES, StoreLimits
from sglang_simm.local_store._paths import (
    NAME_RE,
    NAME_RULE,
    STORE_DIR_ENV,
    StorePaths,
    check_name,
    files_bytes,
    lock_held,
    pid_alive,
    private_store_dir,
    read_pid,
    store_dir,
    store_names,
)

if TYPE_CHECKING:  # pragma: no cover (the same names as _LAZY, for readers and type checkers)
    from sglang_simm.local_store._copy import human_bytes
    from sglang_simm.local_store._handle import (
        DEFAULT_IDLE_EXIT_S,
        StoreHandle,
        StoreUnreachable,
        open_running,
        running_status,
        wait_gone,
    )
    from sglang_simm.local_store._metrics import render_metrics
    from sglang_simm.local_store._segments import Backing, capacity_problem, medium_of
    from sglang_simm.local_store._server import lock_name, remove_files

_LAZY = {
    "StoreHandle": "_handle",  # a handle that starts a store with the operator's settings (``store start``)
    "DEFAULT_IDLE_EXIT_S": "_handle",  # how long a client-started store lives on with no client
    "StoreUnreachable": "_handle",  # what a store that does not answer raises (a ConnectionError with a SiMM code)
    "open_running": "_handle",  # a handle on a running store that never starts one and moves no data
    "running_status": "_handle",  # a running store's status with what its files hold
    "wait_gone": "_handle",  # wait until a stopped store's process is gone
    "Backing": "_segments",  # what can back a store in a directory (medium, size, free)
    "medium_of": "_segments",  # "memory" or "disk": what a store directory's filesystem is
    "capacity_problem": "_segments",  # why a capacity cannot be, or a warning, before anything starts
    "remove_files": "_server",  # a stopped store's files removed (``store stop --discard``)
    "lock_name": "_server",  # the name's lock, held while a stopped store's files are removed
    "render_metrics": "_metrics",  # ``store status --prometheus``
    "human_bytes": "_copy",
}
__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
__all__ = sorted([*_LAZY, "EVICTION_POLICIES", "MOVED_FLAGS", "MOVED_WHERE", "NAME_RE", "NAME_RULE", "RENAMED_FLAGS", "STORE_DIR_ENV",
                  "StoreLimits", "StorePaths", "both_given", "check_name", "deprecated", "lock_held",
                  "pid_alive", "private_store_dir", "read_pid", "store_dir", "store_names"])
