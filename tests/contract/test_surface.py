"""The ``simm.kv`` names and ``set_flag``, as SiMM's Python client has them."""

from __future__ import annotations

import subprocess
import sys

import pytest

SURFACE = ("set_flag", "Store", "Block", "BlockView", "MrExt", "register_mr", "deregister_mr")
STORE_METHODS = (
    "allocate",
    "put",
    "get",
    "exists",
    "delete",
    "mput",
    "mget",
    "mexists",
    "get_async",
    "put_async",
    "exists_async",
    "delete_async",
)


def test_surface_names(kv):
    missing = [name for name in SURFACE if not hasattr(kv, name)]
    assert not missing, f"simm.kv surface lacks {missing}"
    missing = [name for name in STORE_METHODS if not callable(getattr(kv.Store, name, None))]
    assert not missing, f"Store lacks {missing}"
    assert callable(kv.BlockView.from_buffer) and callable(kv.BlockView.from_tensor)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("clnt_thread_pool_size", "10"),
        ("clnt_sync_req_timeout_ms", "1000"),
        ("clnt_async_req_timeout_ms", "3000"),
        ("clnt_syncreq_enable_retry", "false"),
        ("clnt_syncreq_retry_count", "2"),
    ],
    ids=lambda v: v,
)
def test_set_flag_accepts_client_flags(kv, name, value):
    assert kv.set_flag(name, value) is True


@pytest.mark.parametrize(
    "name",
    [
        "no_such_flag_anywhere",
        # The manager port flag is cm_rpc_inter_port; this name is not a flag.
        "cm_primary_node_port",
    ],
    ids=["unknown", "cm_primary_node_port"],
)
def test_set_flag_unknown_name_returns_false(kv, name):
    assert kv.set_flag(name, "1") is False


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("clnt_thread_pool_size", "ten"),
        ("clnt_syncreq_retry_count", "-1"),  # uint32
        ("clnt_syncreq_enable_retry", "maybe"),  # bool
        ("clnt_sync_req_timeout_ms", "1.5"),  # int32
        ("clnt_sync_req_timeout_ms", ""),
    ],
    ids=["uint-text", "uint-negative", "bool-word", "int-float", "int-empty"],
)
def test_set_flag_unparsable_value_returns_false(kv, name, value):
    assert kv.set_flag(name, value) is False


@pytest.mark.parametrize(
    ("name", "value"),
    [(b"clnt_thread_pool_size", "10"), ("clnt_thread_pool_size", 10)],
    ids=["bytes-name", "int-value"],
)
def test_set_flag_non_str_raises_type_error(kv, name, value):
    with pytest.raises(TypeError):
        kv.set_flag(name, value)


@pytest.mark.parametrize(
    ("value", "canonical"),
    [("true", "true"), ("TRUE", "true"), ("1", "true"), ("yes", "true"), ("f", "false"), ("No", "false")],
    ids=lambda v: v,
)
def test_bool_flag_spellings(kv, local_store_only, value, canonical):
    assert kv.set_flag("clnt_syncreq_enable_retry", value)
    assert kv.get_flag("clnt_syncreq_enable_retry") == canonical
    kv.set_flag("clnt_syncreq_enable_retry", "false")


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("local_store_capacity_bytes", "1048576", True),
        ("local_store_capacity_bytes", "0", False),
        ("local_store_capacity_bytes", "1 GiB", False),
        ("local_store_idle_exit_s", "0", True),
        ("local_store_idle_exit_s", "-1", False),
        ("local_store_idle_exit_s", "nan", False),
        ("local_store_eviction", "LRU", True),
        ("local_store_eviction", "random", False),
        ("local_store_get_bound", "region", True),
        ("local_store_get_bound", "page", False),
    ],
    ids=lambda v: str(v),
)
def test_local_store_flag_values(kv, local_store_only, name, value, accepted):
    before = kv.get_flag(name)
    assert kv.set_flag(name, value) is accepted
    if not accepted:
        assert kv.get_flag(name) == before
    kv.set_flag(name, before)


@pytest.mark.parametrize("name", ["local_store_error_rate", "local_store_down", "embedded_corrupt_reads"])
def test_fault_flags_are_refused_naming_the_instrument(kv, local_store_only, name, caplog):
    assert kv.set_flag(name, "1") is False
    assert "faults.py" in caplog.text


def test_get_flag_unknown_is_none(kv, local_store_only):
    assert kv.get_flag("no_such_flag_anywhere") is None


@pytest.mark.local_store
def test_package_root_import_does_not_import_torch():
    code = "import sys, sglang_simm; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
