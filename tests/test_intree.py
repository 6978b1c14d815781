"""SGLang's own in-tree HiCacheSiMM over the local store (``simm.kv``
aliased), and our ``legacy`` key scheme read against what it wrote."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from sglang_simm.local_store import alias_as_simm_kv, get_server
from pages import fill_random, hashes, page, slots, tiny, tiny_mla

INTREE = "sglang.srt.mem_cache.storage.simm.hicache_simm"


@pytest.fixture
def intree_cls():
    pytest.importorskip("sglang.srt.plugins", reason="the in-tree SiMM backend ships with SGLang 0.5.11+")
    with alias_as_simm_kv() as kv:
        # The store `attach` backends use (local://NAME): the local store. The
        # in-tree code sets no scope, so it would get the default, a store
        # inside this process, and the two would never meet.
        kv.set_flag("local_store_scope", "host")
        sys.modules.pop(INTREE, None)  # bind its `from simm.kv import ...` to the alias
        module = importlib.import_module(INTREE)
        # Its NIC map is a list, not a dict, on a machine without
        # /sys/class/infiniband, and `.get` on it raises: it cannot start
        # here (test_intree_backend_cannot_start_without_rdma). Hand it the
        # empty mapping it meant to return.
        original = module.get_numa_nic_mapping
        module.get_numa_nic_mapping = lambda: {}
        yield module.HiCacheSiMM
        module.get_numa_nic_mapping = original
    sys.modules.pop(INTREE, None)


def test_intree_backend_cannot_start_without_rdma(store_name):
    """The in-tree bug this project fixes: no RDMA drivers, no start."""
    import os

    pytest.importorskip("sglang.srt.plugins")
    if os.path.exists("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA drivers")
    with alias_as_simm_kv():
        sys.modules.pop(INTREE, None)
        module = importlib.import_module(INTREE)
        try:
            if module.get_current_process_numa() < 0:
                pytest.skip("the process's NUMA node is unknown here, so the in-tree code skips the NIC map")
            with pytest.raises(AttributeError, match="'list' object has no attribute 'get'"):
                make_intree(module.HiCacheSiMM, store_name, tiny())
        finally:
            sys.modules.pop(INTREE, None)


def make_intree(cls, store_name, geom, **fields):
    from sglang_simm_dev.pools import build_host_pool, storage_config

    host = build_host_pool(geom, tokens=8 * geom.page_size)
    cfg = storage_config(
        extra_config={"manager_address": f"{store_name}:30001"},
        is_mla_model=geom.is_mla,
        model_name=geom.name,
        **fields,
    )
    backend = cls(cfg, host)
    backend.register_mem_pool_host(host)
    return backend, host


@pytest.mark.parametrize("geom", [tiny(), tiny_mla()], ids=["mha", "mla"])
def test_intree_backend_round_trips_over_the_local_store(intree_cls, store_name, geom):
    backend, host = make_intree(intree_cls, store_name, geom)
    fill_random(host, 21)
    keys = hashes(3)
    want = [page(host, p) for p in range(3)]
    assert backend.batch_set_v1(keys, slots(host, 0, 3)) == [True] * 3
    assert backend.batch_exists(keys) == 3
    fill_random(host, 22)
    assert backend.batch_get_v1(keys, slots(host, 4, 3)) == [True] * 3
    assert all(torch.equal(page(host, 4 + i), want[i]) for i in range(3))


@pytest.mark.parametrize(
    "geom, fields",
    [
        (tiny(), {"tp_rank": 1, "tp_size": 2}),
        (tiny(), {"tp_rank": 0, "tp_size": 1, "pp_rank": 1, "pp_size": 2}),
        (tiny_mla(), {"tp_rank": 1, "tp_size": 2}),
    ],
    ids=["mha-tp", "mha-pp", "mla"],
)
def test_legacy_scheme_reads_what_the_intree_backend_wrote(intree_cls, attach, store_name, geom, fields):
    theirs, their_host = make_intree(intree_cls, store_name, geom, **fields)
    fill_random(their_host, 23)
    keys = hashes(4)
    want = [page(their_host, p) for p in range(4)]
    assert all(theirs.batch_set_v1(keys, slots(their_host, 0, 4)))
    # the in-tree warm-up leaves its key behind; ours deletes its own
    their_keys = {k for k in get_server(store_name).keys() if not k.startswith("sglang_simm_warmup_key")}

    ours, host = attach(geom, extra={"key_scheme": "legacy"}, **fields)
    # identical object keys
    prefix, suffixes = ours.pools.kv.prefix, ours.pools.kv.suffixes
    assert {f"{prefix}{k}{s}" for k in keys for s in suffixes} == their_keys
    assert ours.batch_exists(keys) == 4
    assert all(ours.batch_get_v1(keys, slots(host, 8, 4)))
    assert all(torch.equal(page(host, 8 + i), want[i]) for i in range(4))


def test_namespaced_scheme_never_reads_intree_pages(intree_cls, attach, store_name):
    theirs, their_host = make_intree(intree_cls, store_name, tiny())
    fill_random(their_host, 24)
    keys = hashes(2)
    assert all(theirs.batch_set_v1(keys, slots(their_host, 0, 2)))
    ours, _ = attach(tiny())
    assert ours.batch_exists(keys) == 0
