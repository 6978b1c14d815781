"""Shared fixtures: real SGLang host pools on the CPU, backends built through
SGLang's own storage factory, each test on its own embedded store."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def store_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def attach(store_name):
    """``attach(geom, layout=..., tokens=..., route=..., **storage_fields)`` ->
    (backend, host_pool). The backend comes from SGLang's StorageBackendFactory
    (plugin route ``simm`` or the ``dynamic`` route), over one embedded store."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_simm.plugin import register
    from sglang_simm.tools.pools import build_host_pool, storage_config

    made = []

    def _attach(geom, *, layout="page_first", tokens=None, route="simm", extra=None, pool=None, **fields):
        tokens = tokens or 8 * geom.page_size  # the host pool holds twice that
        host = pool if pool is not None else build_host_pool(geom, tokens=tokens, layout=layout)
        extra_config = {"manager_address": f"local://{store_name}", **(extra or {})}
        if route == "dynamic":
            extra_config.update(
                backend_name="simm", module_path="sglang_simm", class_name="HiCacheSiMM", interface_v1=1
            )
        fields.setdefault("is_mla_model", geom.is_mla)
        fields.setdefault("model_name", geom.name)
        cfg = storage_config(extra_config=extra_config, **fields)
        if route == "simm":
            assert register()
        backend = StorageBackendFactory.create_backend(route, cfg, host)
        backend.register_mem_pool_host(host)
        made.append(backend)
        return backend, host

    yield _attach
    for backend in made:
        backend.close()
    from sglang_simm.embedded import reset_servers

    reset_servers(store_name)
