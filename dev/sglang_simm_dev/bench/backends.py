"""The two backends under test, set up on one client: ours, and SGLang's in-tree ``HiCacheSiMM``.

Both reach the client through the ``simm.kv`` surface, so each takes its
real-client code path: the null client (``tools.nullkv``) or the local store
(``local``: a store process, as every SGLang process of a host shares it),
which this module starts under a name of this run's own and stops.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from sglang_simm_dev.pools import ModelGeometry, storage_config

INTREE_MODULE = "sglang.srt.mem_cache.storage.simm.hicache_simm"
#: The local store of this run: its own name, so two runs never share one.
STORE_NAME = f"bench-{os.getpid()}"


def load_intree_class(kv_module: Any) -> type:
    """SGLang's in-tree ``HiCacheSiMM`` imported against ``kv_module`` as ``simm.kv``.

    The in-tree module binds ``Store``, ``BlockView``, ``register_mr`` and
    ``set_flag`` at import, so each client gets a private, fresh import (any
    cached one is set aside and restored).
    """
    saved = sys.modules.pop(INTREE_MODULE, None)
    try:
        if getattr(kv_module, "__simm_local_store__", False):
            from sglang_simm.local_store import alias_as_simm_kv
        else:
            from sglang_simm_dev.nullkv import alias_as_simm_kv as _alias

            alias_as_simm_kv = lambda: _alias(kv_module)  # noqa: E731
        with alias_as_simm_kv():
            try:
                module = importlib.import_module(INTREE_MODULE)
            except ModuleNotFoundError as exc:
                if not (exc.name and INTREE_MODULE.startswith(exc.name)):
                    raise
                raise ValueError(
                    f"this SGLang has no in-tree SiMM backend ({INTREE_MODULE}) to compare with"
                ) from exc
    finally:
        sys.modules.pop(INTREE_MODULE, None)
        if saved is not None:
            sys.modules[INTREE_MODULE] = saved
    # Without /sys/class/infiniband its NIC lookup returns a list, and its
    # constructor then fails on list.get() on any host with NUMA nodes. The
    # NIC choice is outside the data path: answer "no RDMA devices" properly.
    module.get_numa_nic_mapping = dict
    return module.HiCacheSiMM


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _storage_config(geom: ModelGeometry, extra: dict[str, Any]) -> Any:
    return storage_config(model_name=geom.name, is_mla_model=geom.is_mla, extra_config=extra)


def make_ours(pool: Any, geom: ModelGeometry, client: str, *, capacity: int | None = None) -> Any:
    """Our backend on the null client or the local store ``bench``."""
    from sglang_simm.backend import HiCacheSiMM

    extra: dict[str, Any] = {"manager_address": f"local://{STORE_NAME}"}
    if capacity:
        extra["local_store_capacity_bytes"] = int(capacity)
    sc = _storage_config(geom, extra)
    with _quiet("sglang_simm.backend", "sglang_simm.local_store"):
        if client == "null":
            from sglang_simm_dev import nullkv
            from sglang_simm.client import KVClient

            kv = KVClient(nullkv, nullkv.Store(), description="null client")
            return HiCacheSiMM(sc, pool, client=kv)
        return HiCacheSiMM(sc, pool)


def make_intree(pool: Any, geom: ModelGeometry, client: str) -> Any:
    """SGLang's in-tree backend with ``simm.kv`` = the null client or the
    local store (its ``manager_address`` ``bench:0`` names server ``bench``)."""
    if client == "null":
        from sglang_simm_dev import nullkv as kv_module
    else:
        from sglang_simm import local_store as kv_module
    cls = load_intree_class(kv_module)
    sc = _storage_config(geom, {"manager_address": f"{STORE_NAME}:0"})
    with _quiet(INTREE_MODULE):
        backend = cls(sc, None)
        backend.register_mem_pool_host(pool)
    return backend


@contextmanager
def local_store_server(capacity: int) -> Iterator[Any]:
    """A fresh local store ``STORE_NAME`` (its store process started
    here); flags restored, and the store process stopped, after."""
    from sglang_simm import local_store

    names = ("cm_primary_node_ip", "local_store_capacity_bytes", "local_store_scope")
    saved = {n: local_store.get_flag(n) for n in names}
    local_store.reset_servers(STORE_NAME)
    local_store.set_flag("local_store_scope", "host")
    local_store.set_flag("cm_primary_node_ip", STORE_NAME)
    local_store.set_flag("local_store_capacity_bytes", str(int(capacity)))
    server = local_store.get_server(STORE_NAME)
    try:
        yield server
    finally:
        try:
            server.clear()
        finally:
            local_store.reset_servers(STORE_NAME)
            for n, v in saved.items():
                local_store.set_flag(n, v if v is not None else "")


def set_exists_answer(backend: Any, answer: bool) -> None:
    store = backend.client.store if hasattr(backend, "client") else backend.store
    store.exists_answer = answer
