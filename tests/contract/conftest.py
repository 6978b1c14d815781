"""One contract suite, run against the local store (on a thread of this
process, or a store process) and a real SiMM client.

``kv`` is the ``simm.kv`` module under test: ``sglang_simm.local_store`` with
its server in this process (``inprocess``) or in the local store's process
(``host``: one store process per test, in a private directory), both
marked ``local_store``; or the real ``simm.kv`` (mark ``real``), which runs
only when ``SGLANG_SIMM_TEST_MANAGER=host:port`` names a cluster manager and
SiMM's client is importable. Tests are written once against the ``simm.kv``
API; where they need the local store itself (capacity, sharing by name)
they ask for the ``server`` fixture, which skips on real.

Run: ``pytest tests/contract -m local_store`` (no cluster) or ``-m real``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

MANAGER_ENV = "SGLANG_SIMM_TEST_MANAGER"
#: The SiMM release a real cluster's client is built from ("head" or "v0.1.0.post1").
RELEASE_ENV = "SGLANG_SIMM_TEST_SIMM_RELEASE"

# Flags the local store's fixture changes or a test may change; restored after each test.
_STORE_FLAGS = (
    "cm_primary_node_ip",
    "local_store_scope",
    "local_store_dir",
    "local_store_eviction",
    "local_store_simm_release",
    "local_store_get_bound",
    "local_store_capacity_bytes",
)

_real_kv = None
_real_store = None


def _load_real_kv():
    """SiMM's ``simm.kv`` configured for the manager in the environment, or skip."""
    global _real_kv
    if _real_kv is not None:
        return _real_kv
    address = os.environ.get(MANAGER_ENV, "")
    if not address:
        pytest.skip(f"no real SiMM cluster: set {MANAGER_ENV}=host:port to run the real client")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        pytest.fail(f"{MANAGER_ENV} must be host:port, got {address!r}")
    try:
        from simm import kv
    except ImportError as exc:
        pytest.skip(f"{MANAGER_ENV} is set but SiMM's client (simm.kv) does not import: {exc}")
    if getattr(kv, "__simm_local_store__", False):
        pytest.skip("simm.kv is aliased to the local store, not SiMM's client")
    missing = [name for name in ("Store", "BlockView", "register_mr") if not hasattr(kv, name)]
    if missing:
        pytest.skip(
            f"simm.kv is not SiMM's client (no {', '.join(missing)}); PyPI's 'simm' is another project"
        )
    assert kv.set_flag("cm_primary_node_ip", host)
    assert kv.set_flag("cm_rpc_inter_port", port)  # the real client's manager port flag
    assert kv.set_flag("clnt_use_k8s", "false")
    _real_kv = kv
    return kv


@pytest.fixture(
    params=[
        pytest.param("inprocess", marks=pytest.mark.local_store),
        pytest.param("host", marks=[pytest.mark.local_store, pytest.mark.host]),
        pytest.param("disk", marks=[pytest.mark.local_store, pytest.mark.host]),
        pytest.param("real", marks=pytest.mark.real),
    ]
)
def kv(request):
    """The ``simm.kv`` surface under test."""
    if request.param == "real":
        yield _load_real_kv()
        return
    from sglang_simm import local_store
    from sglang_simm.local_store._flags import FLAGS

    saved = {name: local_store.get_flag(name) for name in _STORE_FLAGS}
    servers_before = set(local_store.server_names())
    # Every test starts from the store's defaults, whatever earlier tests of
    # this process set (a backend's attach sets the capacity flag, for one).
    for name in _STORE_FLAGS:
        assert local_store.set_flag(name, FLAGS[name].default)
    if request.param in ("host", "disk"):
        local_store.set_flag("local_store_scope", "host")
        local_store.set_flag("local_store_dir", request.getfixturevalue(f"{request.param}_store_dir"))
    # A fresh, uniquely named server per test.
    local_store.set_flag("cm_primary_node_ip", f"contract-{uuid.uuid4().hex[:12]}")
    try:
        yield local_store
    finally:
        for name in reversed(_STORE_FLAGS):  # the server name last
            assert local_store.set_flag(name, saved[name])
        # Forget the servers this test made, and only those.
        local_store.reset_servers(*(set(local_store.server_names()) - servers_before))


@pytest.fixture
def store(kv):
    """A client: a new ``Store()`` on the test's server (local store), or the one
    per-process ``Store()`` (real; one per process is the norm there)."""
    global _real_store
    if getattr(kv, "__simm_local_store__", False):
        return kv.Store()
    if _real_store is None:
        _real_store = kv.Store()
    return _real_store


@pytest.fixture
def server(kv):
    """The local store behind ``store`` (local store only)."""
    if not getattr(kv, "__simm_local_store__", False):
        pytest.skip("needs the local store's server")
    return kv.get_server(kv.get_flag("cm_primary_node_ip"))


@pytest.fixture(params=["head", "v0.1.0.post1"])
def release(request, kv):
    """The SiMM release whose client semantics a test pins down, where HEAD
    and the tag differ. The local store follows either
    (``local_store_simm_release``); a real cluster's client is what it was
    built from (``SGLANG_SIMM_TEST_SIMM_RELEASE``, "head" by default)."""
    if getattr(kv, "__simm_local_store__", False):
        assert kv.set_flag("local_store_simm_release", request.param)
    elif os.environ.get(RELEASE_ENV, "head") != request.param:
        pytest.skip(f"the real client is {os.environ.get(RELEASE_ENV, 'head')} ({RELEASE_ENV})")
    return request.param


@pytest.fixture
def local_store_only(kv):
    """For behaviour the real client leaves undefined (e.g. RDMA outside a
    registered region): checked on the local store only."""
    if not getattr(kv, "__simm_local_store__", False):
        pytest.skip("undefined on the real client; pinned down on the local store only")


@pytest.fixture
def key():
    """``key("x")`` -> a key unique to this test (so runs on a shared cluster don't collide)."""
    prefix = f"ct-{uuid.uuid4().hex[:10]}"
    return lambda suffix="k": f"{prefix}-{suffix}"


class Memory:
    """Registered host memory handing out views (64-byte aligned), the way a
    backend carves its registered host pool. Arenas are registered once and
    deregistered at teardown."""

    def __init__(self, kv, arena_bytes: int = 16 << 20) -> None:
        self._kv = kv
        self._arena_bytes = arena_bytes
        self._arenas: list[tuple[torch.Tensor, object]] = []
        self._offset = 0

    def _arena(self, size: int) -> tuple[torch.Tensor, object]:
        if not self._arenas or self._offset + size > self._arenas[-1][0].numel():
            tensor = torch.empty(max(self._arena_bytes, size), dtype=torch.uint8)
            mr = self._kv.register_mr(tensor)
            assert mr is not None
            self._arenas.append((tensor, mr))
            self._offset = 0
        return self._arenas[-1]

    def view(self, size: int, fill: int | None = None):
        """``(view, tensor)`` over ``size`` fresh bytes (filled with ``fill`` if given)."""
        tensor, mr = self._arena(size)
        chunk = tensor[self._offset : self._offset + size]
        self._offset += (size + 63) // 64 * 64
        if fill is not None:
            chunk.fill_(fill)
        return self._kv.BlockView.from_tensor(chunk, mr), chunk

    def holding(self, data: torch.Tensor):
        """``(view, tensor)`` holding a copy of ``data``."""
        view, chunk = self.view(data.numel())
        chunk.copy_(data)
        return view, chunk

    @property
    def mr(self):
        return self._arena(0)[1]

    def close(self) -> None:
        for _, mr in self._arenas:
            self._kv.deregister_mr(mr)
        self._arenas.clear()


@pytest.fixture
def mem(kv):
    memory = Memory(kv)
    yield memory
    memory.close()


@pytest.fixture
def make_memory(kv):
    """``make_memory(arena_bytes)`` -> a further ``Memory`` (e.g. one per thread)."""
    made: list[Memory] = []

    def make(arena_bytes: int = 16 << 20) -> Memory:
        made.append(Memory(kv, arena_bytes))
        return made[-1]

    yield make
    for memory in made:
        memory.close()


def random_bytes(size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic random uint8 data."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


@pytest.fixture
def rand():
    """``rand(size, seed)`` -> deterministic random uint8 tensor."""
    return random_bytes
