"""SiMM's ``simm.kv`` Python surface over the local store, on this host.

The real client needs SiCL and RDMA NICs; this one talks to a store on the
same machine, so code written for ``simm.kv`` runs unchanged::

    from sglang_simm import embedded as kv          # or: with alias_as_simm_kv(): ...
    kv.set_flag("cm_primary_node_ip", "my-store")   # the store's name
    store = kv.Store()

Two forms of the local store stand behind it (flag ``local_store_scope``):

* ``host`` (``manager_address: "local"``): the *local store*, one store
  process per name per user, shared by every process of the host (all TP
  ranks, several servers, the tools).
  Objects live in a shared-memory arena that clients copy into and out of
  themselves; the store process keeps the index, hands out leases, and
  enforces limits on everything a client sends. It survives its clients,
  and a crash of its own loses no published object: the next store process
  of the name takes them over. ``_host`` (the client side), ``_daemon``
  (the store process), ``_index`` (keys, extents, eviction, leases),
  ``_table`` (the index kept crash-consistently beside the arena),
  ``_arena`` and ``_allocator`` (the shared memory), ``_protocol`` (the
  wire format), ``_limits`` (every limit and refusal), ``_metrics``
  (Prometheus text), ``_paths`` (where a store lives, who may open it).
* ``process`` (``"inprocess"``): the *in-process local store*, a server
  inside the calling process (``_server``), for tests and single-process tools.

``_client`` is the ``simm.kv`` surface itself (memory regions, views,
``Store``), ``_flags`` its flags (each parsed once into typed settings),
and ``_faults`` the simulated network (outage, latency, error rate,
corrupt reads), per client process: a wrapper in front of a store,
installed only while a fault is set. See ``docs/local-store.md``.

The store imports nothing of the backend, which reaches it by name, as it
reaches ``simm.kv``. Its public modules besides this one: ``simm_rules``
(SiMM's return codes, limits and key rule, which the store enforces and the
backend re-exports), ``admin`` (what the configuration and the operator's
commands use: names, directories, status, limits, metrics) and
``contract`` (``StoreServer``, what ``_client`` asks of either server);
every other module is private to the store (``tests/test_layout.py``).

Importing this package imports nothing heavy; ``_client`` and ``_server``
import torch (the real ``simm.kv`` does too), the store process never does.
"""

from __future__ import annotations

import sys
import types

from typing import Any

# Names resolve on first use: the local store's process imports this package
# (``python -m sglang_simm.embedded._daemon``) and must not pay for torch.
_LAZY = {
    "Block": "_client",
    "BlockView": "_client",
    "MrExt": "_client",
    "Store": "_client",
    "configure_faults": "_client",
    "default_capacity_bytes": "_client",
    "deregister_mr": "_client",
    "get_flag": "_client",
    "get_server": "_client",
    "register_mr": "_client",
    "reset_servers": "_client",
    "server_names": "_client",
    "set_flag": "_client",
    "FaultSettings": "_faults",
    "FaultyServer": "_faults",
    "EmbeddedServer": "_server",
    "HostServer": "_host",
}


def _lazy_attributes(namespace: dict[str, Any], table: dict[str, str]) -> tuple[Any, Any]:
    """A module's ``__getattr__`` and ``__dir__`` (PEP 562) for the names of
    ``table`` (name -> module of this package that defines it): each is
    imported on first use and kept in ``namespace``, the module's globals.
    This package and ``admin`` use it, so their imports stay cheap."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy_attributes(globals(), _LAZY)


__all__ = [
    "Block",
    "BlockView",
    "EmbeddedServer",
    "FaultSettings",
    "FaultyServer",
    "HostServer",
    "MrExt",
    "Store",
    "alias_as_simm_kv",
    "configure_faults",
    "default_capacity_bytes",
    "deregister_mr",
    "get_flag",
    "get_server",
    "register_mr",
    "reset_servers",
    "server_names",
    "set_flag",
]

#: Lets a loader tell this module from the real client once aliased.
__simm_embedded__ = True

_ABSENT = object()


class _SimmKvAlias:
    """Installed on creation; undone by calling it or leaving its ``with``."""

    def __init__(self) -> None:
        this = sys.modules[__name__]
        package = types.ModuleType("simm", "Stand-in for SiMM's package: simm.kv is sglang_simm.embedded.")
        package.__path__ = []  # a package, so ``import simm.kv`` is legal
        package.kv = this
        package.__simm_embedded__ = True
        self._saved = {name: sys.modules.get(name, _ABSENT) for name in ("simm", "simm.kv")}
        self._installed = {"simm": package, "simm.kv": this}
        sys.modules.update(self._installed)
        self._done = False

    def __call__(self) -> None:
        """Restore the previous ``simm`` and ``simm.kv`` entries (once)."""
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
    """Make ``import simm.kv`` (and ``from simm.kv import Store, ...``) load
    this module, restoring the previous entries afterwards::

        with alias_as_simm_kv():
            from simm.kv import BlockView, Store, register_mr, set_flag

        undo = alias_as_simm_kv()   # or as a plain call
        ...
        undo()
    """
    return _SimmKvAlias()
