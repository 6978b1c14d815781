"""The store's operator surface: what the configuration and the operator's
commands (``sglang_simm.tools``: ``store``, ``doctor``) use of the store
besides the ``simm.kv`` surface of the package itself. Every name is a
re-export from the store module that defines it; nothing outside the store
imports those modules (``tests/test_layout.py``).

Importing this module costs what the standard library's light modules cost
(``sglang_simm.config`` imports it); the names that need more (a store
handle, the arena, the index, the store process) resolve on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_simm.embedded import _lazy_attributes
from sglang_simm.embedded._limits import StoreLimits  # ``store start``'s limits, checked before anything starts
from sglang_simm.embedded._metrics import render as render_metrics  # ``store status --prometheus``
from sglang_simm.embedded._names import (
    RENAMED_FLAGS,  # the local store's old flag names -> new (the configuration reads both, warned)
    both_given,  # the refusal of an old and a new spelling of one setting given together
    deprecated,  # the warning naming an old spelling's new name
)
from sglang_simm.embedded._paths import (
    NAME_RE,  # the store naming rule (the configuration checks ``local://NAME`` with it)
    NAME_RULE,  # that rule in words, for the messages that refuse a name
    STORE_DIR_ENV,  # the environment variable naming where stores live
    StorePaths,  # a store's files in a directory: socket, lock, log, settings, arenas
    check_name,  # a name, or ValueError stating the rule
    held_bytes,  # the memory a store's files hold, its process alive or dead
    lock_held,  # whether a process holds a store's lock (running, perhaps stalled)
    pid_alive,  # whether a store process's pid is still a live process
    private_store_dir,  # a private store directory, its stores stopped and removed after (doctor's own store)
    read_pid,  # the pid a store process wrote, if any
    store_dir,  # where stores live: the given directory, $SGLANG_SIMM_STORE_DIR or the default
    store_names,  # the stores a directory holds
)

if TYPE_CHECKING:  # pragma: no cover (the same names as _LAZY, for type checkers and readers)
    from sglang_simm.embedded._arena import Backing, arena_held
    from sglang_simm.embedded._copy import human_bytes
    from sglang_simm.embedded._daemon import remove_files
    from sglang_simm.embedded._host import (
        DEFAULT_IDLE_EXIT_S,
        HostServer,
        StoreUnreachable,
        open_running,
        running_status,
        wait_gone,
    )
    from sglang_simm.embedded._index import EVICTION_POLICIES

#: Names resolved on first use, each from the module that defines it (a
#: store handle, the arena, the index, the store process and the copies
#: import more than the standard library's light modules).
_LAZY = {
    "HostServer": "_host",  # a handle that starts a store with the operator's settings (``store start``)
    "DEFAULT_IDLE_EXIT_S": "_host",  # how long a store started by a client lives on with no client
    "StoreUnreachable": "_host",  # what a store that does not answer raises (a ConnectionError with a SiMM code)
    "open_running": "_host",  # a handle on a running store that never starts one (status, keys, clear, stop)
    "running_status": "_host",  # a running store's status with the memory its files hold
    "wait_gone": "_host",  # wait until a stopped store's process is gone
    "EVICTION_POLICIES": "_index",  # the eviction policies a store takes (``--eviction``)
    "Backing": "_arena",  # what can back an arena in a directory, checked before a start
    "arena_held": "_arena",  # whether a live store process holds an arena file
    "remove_files": "_daemon",  # a dead store's files removed, its memory given back
    "human_bytes": "_copy",  # sizes as the store's own messages write them (1.5 GiB)
}


__getattr__, __dir__ = _lazy_attributes(globals(), _LAZY)


__all__ = [
    "DEFAULT_IDLE_EXIT_S",
    "EVICTION_POLICIES",
    "RENAMED_FLAGS",
    "both_given",
    "deprecated",
    "NAME_RE",
    "NAME_RULE",
    "STORE_DIR_ENV",
    "Backing",
    "HostServer",
    "StorePaths",
    "StoreLimits",
    "StoreUnreachable",
    "arena_held",
    "check_name",
    "held_bytes",
    "human_bytes",
    "lock_held",
    "open_running",
    "pid_alive",
    "private_store_dir",
    "read_pid",
    "remove_files",
    "render_metrics",
    "running_status",
    "store_dir",
    "store_names",
    "wait_gone",
]
