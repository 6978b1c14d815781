"""Servers by name, and ``simm.kv`` aliasing for code written against SiMM."""

from __future__ import annotations

import sys

import pytest
import torch

from sglang_simm.errors import GET_OBJECT_FAILED, OK


def test_stores_of_one_name_share_objects(kv, store, mem, key, rand, local_store_only):
    data = rand(4096, seed=1)
    k = key()
    other = kv.Store()
    assert store.put(k, mem.holding(data)[0]) == OK
    view, out = mem.view(4096)
    assert other.get(k, view) == 4096
    assert torch.equal(out, data)
    assert other.delete(k) == OK
    assert store.exists(k) is False


def test_stores_of_different_names_do_not(kv, store, mem, key, rand, local_store_only):
    k = key()
    assert store.put(k, mem.holding(rand(64))[0]) == OK
    assert kv.set_flag("cm_primary_node_ip", "somewhere-else")
    elsewhere = kv.Store()
    assert elsewhere.exists(k) is False
    assert elsewhere.get(k, mem.view(64)[0]) == GET_OBJECT_FAILED
    assert store.exists(k) is True  # a store keeps the server it joined


def test_delete_prefix_removes_one_namespace(kv, store, mem, key, rand, server, local_store_only):
    mine = [key(f"ns1/{i}") for i in range(5)]
    other = [key(f"ns2/{i}") for i in range(3)]
    assert store.mput(mine + other, [mem.holding(rand(100, seed=i))[0] for i in range(8)]) == [OK] * 8
    assert store.delete_prefix(key("ns1/")) == 5
    assert store.mexists(mine + other) == [False] * 5 + [True] * 3
    assert server.used_bytes == 300
    with pytest.raises(ValueError):
        store.delete_prefix("")
    assert store.delete_prefix(key("ns2/")) == 3


def test_empty_name_is_the_default_server(kv, local_store_only):
    assert kv.set_flag("cm_primary_node_ip", "")
    assert kv.Store().server is kv.get_server("default")


def test_reset_servers_forgets_objects(kv, store, mem, key, rand, local_store_only):
    k = key()
    name = kv.get_flag("cm_primary_node_ip")
    assert kv.set_flag("cm_primary_node_ip", f"{name}-bystander")
    bystander = kv.Store()
    assert bystander.put(k, mem.holding(rand(64))[0]) == OK
    assert kv.set_flag("cm_primary_node_ip", name)
    assert store.put(k, mem.holding(rand(64))[0]) == OK

    kv.reset_servers(name)
    assert name not in kv.server_names() and f"{name}-bystander" in kv.server_names()
    assert kv.Store().exists(k) is False  # a fresh store of the same name
    assert kv.get_server(f"{name}-bystander").keys() == [k]


@pytest.mark.local_store
def test_alias_as_context_manager():
    from sglang_simm import local_store

    before = {name: sys.modules.get(name) for name in ("simm", "simm.kv")}
    with local_store.alias_as_simm_kv() as kv:
        assert kv is local_store
        import simm
        from simm.kv import BlockView, Store, register_mr, set_flag  # the in-tree backend's import

        assert simm.kv is local_store and Store is local_store.Store
        assert (BlockView, register_mr, set_flag) == (
            local_store.BlockView,
            local_store.register_mr,
            local_store.set_flag,
        )
    assert {name: sys.modules.get(name) for name in ("simm", "simm.kv")} == before


@pytest.mark.local_store
def test_alias_as_plain_call_restores_previous_entries(monkeypatch):
    from sglang_simm import local_store

    previous = type(sys)("simm")  # e.g. PyPI's unrelated 'simm' already imported
    monkeypatch.setitem(sys.modules, "simm", previous)
    monkeypatch.delitem(sys.modules, "simm.kv", raising=False)
    undo = local_store.alias_as_simm_kv()
    import simm.kv

    assert simm.kv is local_store
    undo()
    undo()  # twice is harmless
    assert sys.modules["simm"] is previous
    assert "simm.kv" not in sys.modules


@pytest.mark.local_store
def test_code_written_for_simm_kv_runs_unchanged():
    """Shaped like SGLang's in-tree SiMM backend: one registered host pool,
    views from raw pointers, exists-then-put-missing, batch get."""
    from sglang_simm import local_store

    previous_name = local_store.get_flag("cm_primary_node_ip")
    local_store.set_flag("cm_primary_node_ip", "alias-backend")
    try:
        with local_store.alias_as_simm_kv():
            from simm.kv import BlockView, Store, deregister_mr, register_mr, set_flag

            assert set_flag("clnt_thread_pool_size", "10")
            store = Store()
            pool = torch.arange(8 * 4096, dtype=torch.int64).to(torch.uint8)  # 8 pages
            mr = register_mr(pool)
            page = 4096
            keys = [f"page-{i}_0_k" for i in range(8)]
            views = [BlockView.from_buffer(pool.data_ptr() + i * page, page, mr) for i in range(8)]

            exist = store.mexists(keys[:4])
            missing = [i for i, e in enumerate(exist) if not e]
            assert store.mput([keys[i] for i in missing], [views[i] for i in missing]) == [0] * 4
            assert store.mexists(keys) == [True] * 4 + [False] * 4

            back = torch.zeros_like(pool)
            mr_back = register_mr(back)
            results = store.mget(
                keys, [BlockView.from_buffer(back.data_ptr() + i * page, page, mr_back) for i in range(8)]
            )
            assert [r == page for r in results] == [True] * 4 + [False] * 4
            assert torch.equal(back[: 4 * page], pool[: 4 * page])
            assert deregister_mr(mr) and deregister_mr(mr_back)
    finally:
        local_store.set_flag("cm_primary_node_ip", previous_name)
        local_store.reset_servers("alias-backend")
