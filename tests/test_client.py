"""The client adapter: which flags reach the SiMM client, in which order."""

from __future__ import annotations

import types

import pytest

import sglang_simm_dev.faults as faults_instrument

from sglang_simm import local_store
from sglang_simm.client import client_flags, connect, import_real_client
from sglang_simm.config import SiMMConfig
from sglang_simm.errors import ClientNotInstalledError


def test_real_address_sets_the_clients_own_port_flag_and_skips_kubernetes(tmp_path):
    config = SiMMConfig.from_mapping({"manager_address": "10.1.2.3:31001", "request_timeout_ms": 2500})
    flags = client_flags(config, log_file=str(tmp_path / "c.log"))
    assert flags["cm_primary_node_ip"] == "10.1.2.3"
    assert flags["cm_rpc_inter_port"] == "31001"  # not the in-tree's cm_primary_node_port
    assert "cm_primary_node_port" not in flags
    assert flags["clnt_use_k8s"] == "false"
    assert flags["clnt_sync_req_timeout_ms"] == "2500"
    assert flags["clnt_log_file"] == str(tmp_path / "c.log")


def test_operator_flags_are_set_last_and_win():
    config = SiMMConfig.from_mapping(
        {"manager_address": "[fd00::1]:30001", "client_flags": {"clnt_use_k8s": "true", "clnt_syncreq_retry_count": 5}}
    )
    flags = client_flags(config, log_file="/tmp/x.log")
    assert flags["cm_primary_node_ip"] == "fd00::1"
    assert flags["clnt_use_k8s"] == "true" and flags["clnt_syncreq_retry_count"] == "5"


def test_connect_to_a_cluster_address_sets_flags_then_warms_up(tmp_path, monkeypatch):
    """A cluster address, served here by a named local store standing in
    for the cluster behind it (injected as the ``simm.kv`` module)."""
    monkeypatch.setenv("SGLANG_SIMM_LOG_DIR", str(tmp_path))
    monkeypatch.delenv("SICL_NET_DEVICES", raising=False)
    seen: list[tuple[str, str]] = []

    def set_flag(name, value):
        seen.append((name, value))
        return local_store.set_flag(name, value) or name.startswith(("cm_rpc", "clnt_log"))

    kv = types.SimpleNamespace(**{n: getattr(local_store, n) for n in ("Store", "BlockView", "register_mr", "deregister_mr")})
    kv.set_flag = set_flag
    config = SiMMConfig.from_mapping({"manager_address": "10.9.9.9:30001", "rdma_devices": "mlx5_0"})
    client = connect(config, kv_module=kv)
    try:
        names = [n for n, _ in seen]
        assert names.index("cm_primary_node_ip") < names.index("clnt_thread_pool_size")
        assert ("cm_rpc_inter_port", "30001") in seen and ("clnt_use_k8s", "false") in seen
        assert all(not n.startswith(("local_store_", "embedded_")) for n in names)  # local-store-only flags stay out
        log_file = dict(seen)["clnt_log_file"]
        assert log_file.startswith(str(tmp_path)) and log_file.endswith("simm_clnt.log")
        import os

        assert os.environ["SICL_NET_DEVICES"] == "mlx5_0"
        assert client.description == "SiMM cluster manager 10.9.9.9:30001"
        assert local_store.get_server("10.9.9.9").keys() == []  # the warm-up cleaned up after itself
    finally:
        client.close()
        local_store.reset_servers("10.9.9.9")


def test_missing_real_client_names_the_install_route(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "simm", None)
    monkeypatch.setitem(sys.modules, "simm.kv", None)
    with pytest.raises(ClientNotInstalledError, match="not on PyPI") as info:
        import_real_client()
    assert "scitix/SiMM" in str(info.value) and "'local'" in str(info.value)


def test_a_failed_warm_up_closes_the_store_it_opened():
    """connect() made the store; when the warm-up then fails, the store is
    closed and dropped, not left to whoever holds the traceback."""
    import uuid

    closed = []

    class Store(local_store.Store):
        __slots__ = ()

        def close(self):
            closed.append(self)

    kv = types.SimpleNamespace(**{n: getattr(local_store, n) for n in ("BlockView", "register_mr", "deregister_mr", "set_flag")})
    kv.Store = Store
    name = f"warm-{uuid.uuid4().hex[:8]}"
    scope = local_store.get_flag("local_store_scope")
    try:
        local_store.set_flag("local_store_scope", "process")
        faults_instrument.configure_faults(name, error_rate=1.0)
        config = SiMMConfig.from_mapping({"manager_address": f"inprocess://{name}"})
        with pytest.raises(Exception, match="warm-up"):
            connect(config, kv_module=kv)
        assert len(closed) == 1
    finally:
        local_store.reset_servers(name)
        local_store.set_flag("local_store_scope", scope)


def test_a_client_in_simms_layers_is_called_at_its_native_layer():
    """SiMM's Python ``Store.mput``/``mget`` unwrap a ``BlockView`` per
    object before calling the native store; a client with every native
    piece gets native views and the native batch calls; one without (the
    local store, a SiMM that moved them) gets the public calls."""
    import torch

    from sglang_simm.client import KVClient, native_layer
    from sglang_simm_dev import nullkv

    store = nullkv.Store()
    client = KVClient(nullkv, store, description="null")
    assert client.native and client.view is nullkv._kv.DataView
    assert client.mput_views == store._impl.MPut and client.mget_views == store._impl.MGet
    mr = nullkv.register_mr(torch.zeros(16, dtype=torch.uint8))
    views = [client.view(0, 7, mr), client.view(8, 9, mr)]
    assert client.mget_views(["a", "b"], views) == [7, 9]  # the native call takes native views
    assert client.mexists_codes(["a"]) == [0] and store.mexists(["a"]) == [True]

    # any piece missing: the public layer
    assert native_layer(types.SimpleNamespace(_kv=nullkv._kv), object()) is None
    moved = types.SimpleNamespace(_kv=types.SimpleNamespace(DataView=nullkv.DataView))
    assert native_layer(moved, store) is None
    class Partial(nullkv.KVStore):
        MExists = None
    half = nullkv.Store()
    half._impl = Partial()
    assert native_layer(nullkv, half) is None

    local = local_store.Store.__new__(local_store.Store)  # no server: only the routing is looked at
    assert native_layer(local_store, local) is None


def test_the_local_store_answers_lookups_as_codes_too(store_name):
    """``mexists_codes`` is ``mexists`` before its codes become bools: 0
    where the object exists."""
    from sglang_simm.client import KVClient

    cfg = SiMMConfig(manager_address=f"local://{store_name}")
    client = connect(cfg)
    try:
        assert isinstance(client, KVClient) and not client.native
        block = client.allocate(8)
        assert client.put("here", block.view()) == 0
        codes = client.mexists_codes(["here", "absent"])
        assert codes[0] == 0 and codes[1] != 0
        assert [c == 0 for c in codes] == client.mexists(["here", "absent"])
    finally:
        client.close()
