"""The local store: SiMM's ``simm.kv`` Python surface over a store on this host.

The real client needs SiCL and RDMA NICs; this one talks to a store process
on the same machine, so code written for ``simm.kv`` runs unchanged::

    from sglang_simm import local_store as kv      # or: with alias_as_simm_kv(): ...
    kv.set_flag("cm_primary_node_ip", "my-store")   # the store's name
    store = kv.Store()

One store process per name per user is shared by every process of the host
(``manager_address: "local"``); ``inprocess`` runs the same store on a
thread of this process, in a directory of its own. Its design:
docs/local-store-design.md; its modules: docs/architecture.md. Importing
this package imports nothing heavy (``_kv`` imports torch, as the real
``simm.kv`` does; the store process never does).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: name -> the module that defines it, imported on first use (PEP 562): the
#: store process imports this package and must not pay for torch.
_LAZY = {name: "_kv" for name in ("Block", "BlockView", "MrExt", "Store", "deregister_mr", "get_flag",
                                  "get_server", "register_mr", "reset_servers", "server_names", "set_flag")}
_LAZY.update(StoreHandle="_handle", StoreUnreachable="_handle", default_capacity_bytes="_segments")


def lazy_attributes(namespace: dict[str, Any], table: dict[str, str]) -> tuple[Any, Any]:
    """A module's ``__getattr__`` and ``__dir__`` resolving ``table``'s names
    (name -> module of this package) on first use."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
__all__ = sorted([*_LAZY, "alias_as_simm_kv"])

#: Lets a loader tell this module from the real client once aliased.
__simm_local_store__ = True
_ABSENT = object()


class _SimmKvAlias:
    """Installed on creation; undone by calling it or leaving its ``with``."""

    def __init__(self) -> None:
        this = sys.modules[__name__]
        package = types.ModuleType("simm", "Stand-in for SiMM's package: simm.kv is sglang_simm.local_store.")
        package.__path__ = []  # a package, so ``import simm.kv`` is legal
        package.kv = this
        package.__simm_local_store__ = True
        self._saved = {name: sys.modules.get(name, _ABSENT) for name in ("simm", "simm.kv")}
        self._installed = {"simm": package, "simm.kv": this}
        sys.modules.update(self._installed)
        self._done = False

    def __call__(self) -> None:
        """Put the previous ``simm`` and ``simm.kv`` back (once)."""
        if self._done:
            return
        self._done = True
        for name, previous in self._saved.items():
            if sys.modules.get(name) is not self._installed[name]:
                continue  # someone replaced it since: leave theirs alone
            if previous is _ABSENT:
                del sys.modules[name]
            else:
                sys.modules[name] = previous

    def __enter__(self) -> types.ModuleType:
        return self._installed["simm.kv"]

    def __exit__(self, *exc_info: object) -> None:
        self()


def alias_as_simm_kv() -> _SimmKvAlias:
    """Make ``import simm.kv`` load this module until undone::

        with alias_as_simm_kv():
            from simm.kv import BlockView, Store, register_mr, set_flag
    """
    return _SimmKvAlias()
