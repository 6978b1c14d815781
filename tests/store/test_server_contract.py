"""The store contract (``local_store.contract.StoreServer``): the local
store's handle, ``StoreHandle``, has every member it declares, with its
signature, and is what ``kv.Store`` reaches its store through, in either
scope; the test instrument's fault wrapper, installed over the handle's
data calls, must keep those signatures too."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import uuid

import pytest

from raw_peer import env
from sglang_simm import local_store
from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.local_store.contract import StoreServer, StoreUnreachable

HERE = os.path.dirname(os.path.abspath(__file__))
DEV = os.path.abspath(os.path.join(HERE, "..", "..", "dev"))


def members(protocol: type) -> dict[str, str]:
    """The protocol's members: name -> "method", "property" or "attribute"."""
    out = {}
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out[name] = "property"
        elif inspect.isfunction(value):
            out[name] = "method"
    out.update({name: "attribute" for name in protocol.__annotations__})
    return out


def differences(cls: type, instance: object, protocol: type = StoreServer, *, returns: bool = False) -> list[str]:
    """What ``cls`` (and ``instance`` of it, for attributes set in
    ``__init__``) lacks of ``protocol``, or declares otherwise: names and
    parameters, and with ``returns`` what each returns too."""

    def sig(fn) -> inspect.Signature:
        out = inspect.signature(fn)
        return out if returns else out.replace(return_annotation=inspect.Signature.empty)

    out = []
    for name, kind in members(protocol).items():
        if kind == "attribute":
            try:
                inspect.getattr_static(instance, name)
            except AttributeError:
                out.append(f"{name}: missing")
            continue
        try:
            have = inspect.getattr_static(cls, name)
        except AttributeError:
            out.append(f"{name}: missing")
            continue
        want = vars(protocol)[name]
        if kind == "property":
            if not isinstance(have, property):
                out.append(f"{name}: not a property")
            elif sig(have.fget) != sig(want.fget):
                out.append(f"{name}: {sig(have.fget)} != {sig(want.fget)}")
        elif not inspect.isfunction(have):
            out.append(f"{name}: not a method")
        elif sig(have) != sig(want):
            out.append(f"{name}: {sig(have)} != {sig(want)}")
    return out


def handle_differences(root: str, *, faults: bool = False, returns: bool = False) -> list[str]:
    """``differences(StoreHandle, ...)`` in a fresh process (the fault
    wrapper, once installed, stays for the life of the process that installed
    it): with ``faults``, after installing it."""
    script = (
        "import json, sys\n"
        f"sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}, {DEV!r}]\n"
        "from test_server_contract import differences\n"
        "from sglang_simm.local_store._handle import StoreHandle\n"
        + ("from sglang_simm_dev.faults import configure_faults\nconfigure_faults('contract', down=True)\n"
           if faults else "")
        + f"handle = StoreHandle('contract', root={root!r}, capacity=1, spawn=False)\n"
        f"print(json.dumps(differences(StoreHandle, handle, returns={returns!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_contract_declares_every_call_the_client_makes():
    assert set(members(StoreServer)) == {
        "put_from", "get_into", "lookup", "delete", "delete_prefix", "clear", "keys", "stats",
        "capacity_bytes", "used_bytes", "set_capacity", "set_policy", "name"}


def test_the_store_handle_has_every_member_of_the_contract_with_its_parameters(root):
    assert handle_differences(root) == []


def test_the_store_handle_returns_what_the_contract_declares(root):
    assert handle_differences(root, returns=True) == []


def test_the_fault_wrapper_keeps_the_contracts_signatures(root):
    assert handle_differences(root, faults=True) == []


def test_the_check_sees_a_missing_member_and_another_signature(root):
    class Short(StoreHandle):
        lookup = None  # type: ignore[assignment]

        def delete(self, key: str, *, quiet: bool = False) -> int:  # type: ignore[override]
            return super().delete(key)

    handle = Short("contract-short", root=root, capacity=1, spawn=False)
    assert sorted(d.split(":")[0] for d in differences(Short, handle)) == ["delete", "lookup"]


@pytest.mark.parametrize("scope", ["process", "host"])
def test_a_clients_store_is_a_store_handle_holding_the_contract(scope, root):
    """``kv.Store().server`` in either scope: the inprocess store (a store on
    a thread of this process) and the host's store process are reached
    through the same handle."""
    name = f"contract-{scope}-{uuid.uuid4().hex[:8]}"
    for flag, value in (("local_store_scope", scope), ("local_store_dir", root), ("cm_primary_node_ip", name),
                        ("local_store_capacity_bytes", str(64 << 20)), ("local_store_idle_exit_s", "0")):
        assert local_store.set_flag(flag, value)
    client = local_store.Store()
    try:
        server = client.server
        assert type(server) is StoreHandle and isinstance(server, StoreServer)
        assert server.name == name and local_store.get_server(name) is server
        assert server.lookup(["absent"]) == [-4003]
    finally:
        client.close()
        local_store.reset_servers(name)


def test_a_store_that_cannot_be_reached_raises_the_contracts_error(root):
    handle = StoreHandle("contract-none", root=root, capacity=1, spawn=False, timeout_s=0.5)
    with pytest.raises(StoreUnreachable) as exc:
        handle.lookup(["k"])
    assert isinstance(exc.value, ConnectionError) and exc.value.code < 0 and exc.value.no_store
    handle.close()
