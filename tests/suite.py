"""The suite's fixtures and hooks, a pytest plugin loaded once by both
conftests (``tests/conftest.py`` and ``dev/tests/conftest.py``), whichever
trees a run collects: real SGLang host pools on the CPU, backends built
through SGLang's own storage factory, each test on its own local store; the
tiers given by file, the longest files first.

Local stores (``local``: one store process per name) live in a directory of
this test session's own, under /dev/shm; every store process still running
at the end of the session is stopped by its pid."""

from __future__ import annotations

import os
import signal
import sys
import uuid

import pytest


#: The repository's root: the files of TIERS and FIRST are named from it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Markers given to every test of a file or folder, so the tiers of
#: scripts/test.sh hold for files whose tests carry no marker of their own:
#: the store's process tests, the launcher's, the compat probes.
TIERS = {
    "tests/e2e/": "e2e",
    "tests/store/": "host",
    "tests/test_server_launch.py": "server",
    "tests/test_compat.py": "slow",
}


def pytest_collection_finish(session):
    # The compat probes run in other venvs for minutes: start them now, beside
    # the suite. Under xdist every worker collects; the worker that runs
    # test_compat starts them on its first test instead.
    if hasattr(session.config, "workerinput"):
        return
    if any(os.path.basename(str(item.fspath)) == "test_compat.py" for item in session.items):
        import test_compat

        test_compat.start_probes()


#: (name, seconds to healthy, log) of the e2e servers, from every xdist worker
_SERVERS_STARTED: list[tuple[str, float, str]] = []


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist
def pytest_testnodedown(node, error):
    _SERVERS_STARTED.extend(getattr(node, "workeroutput", {}).get("e2e_servers_started", []))


def pytest_terminal_summary(terminalreporter, config):
    started = _SERVERS_STARTED + getattr(config, "e2e_servers_started", [])
    if not started:
        return
    terminalreporter.write_sep("-", "SGLang servers started by the e2e tests (launched side by side)")
    for name, seconds, log in started:
        # found healthy when a test first asked for it: an upper bound on its start time
        terminalreporter.write_line(f"{name}: healthy at most {seconds:.1f} s after launch (log {log})")


def pytest_sessionfinish(session, exitstatus):
    compat = sys.modules.get("test_compat")
    if compat is not None:
        compat.stop_probes()


#: The longest files first. scripts/test.sh spreads the suite over
#: pytest-xdist workers a file at a time (--dist loadfile: a file's shared
#: fixtures, such as the e2e servers, are built once), handing the next file
#: to whichever worker is free: started first, these run beside each other
#: while the short files fill in, instead of one starting last and running
#: alone (what each takes: docs/testing.md).
FIRST = ("tests/e2e/test_server.py", "tests/e2e/test_store_faults.py", "dev/tests/test_bench_server.py",
         "dev/tests/test_server_demo.py", "tests/test_compat.py", "tests/store/test_tp2.py",
         "tests/test_server_launch.py")


def _rank(where: str) -> int:
    return FIRST.index(where) if where in FIRST else len(FIRST)


def _where(item) -> str:
    return os.path.relpath(str(item.fspath), ROOT)


def pytest_itemcollected(item):
    where = _where(item)
    for prefix, marker in TIERS.items():
        if where == prefix or (prefix.endswith("/") and where.startswith(prefix)):
            item.add_marker(marker)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture
def pytest_collection_modifyitems(config, items):
    ranks = {item: _rank(_where(item)) for item in items}
    items.sort(key=ranks.__getitem__)  # stable: the rest keep their order


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # A CI timeout or a `kill` sends SIGTERM, which would end this process
    # with no teardown: end the run as Ctrl-C does instead, so every
    # fixture's teardown (servers, store processes, their memory) runs.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session", autouse=True)
def host_store_dir():
    """A private store directory for the whole session (exported, so store
    processes and SGLang servers started by tests use it too); its store
    processes are stopped and it is removed at the end."""
    from sglang_simm.local_store._paths import private_store_dir

    with private_store_dir("sglang-simm-tests-") as root:
        yield root


@pytest.fixture(scope="session")
def disk_store_dir(host_store_dir):
    """A store directory on a disk (``$SGLANG_SIMM_DISK_TEST_DIR``, else the
    temp directory); skipped, saying why, where that is memory."""
    import shutil
    import tempfile

    from sglang_simm.local_store._paths import stop_store_processes
    from sglang_simm.local_store._segments import medium_of

    base = os.environ.get("SGLANG_SIMM_DISK_TEST_DIR") or tempfile.gettempdir()
    if medium_of(base) != "disk":
        pytest.skip(f"{base} is memory, not a disk: set SGLANG_SIMM_DISK_TEST_DIR to a folder on one")
    root = tempfile.mkdtemp(prefix="sglang-simm-disk-tests-", dir=base)
    try:
        yield root
    finally:
        stop_store_processes(root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _client_flags_restored():
    """The local store client's flags are process-global, as SiMM's are: a flag
    one test sets (``local_store_scope`` by any ``local://`` backend, a fault
    flag) would otherwise hold for every later test, and a test would pass
    or fail by what ran before it. Each test leaves the flags as it found
    them."""
    loaded = sys.modules.get("sglang_simm.local_store._flags")
    before = {name: loaded.get_flag(name) for name in loaded.FLAGS} if loaded else None
    yield
    flags = sys.modules.get("sglang_simm.local_store._flags")
    client = sys.modules.get("sglang_simm.local_store._kv")
    if flags is None or client is None:
        return
    if before is None:  # first imported by this test: the defaults held before it
        before = {name: flag.default for name, flag in flags.FLAGS.items()}
    # the server name first: fault flags apply to the server it names
    for name in sorted(before, key=lambda n: n != "cm_primary_node_ip"):
        if client.get_flag(name) != before[name]:
            client.set_flag(name, before[name])


@pytest.fixture
def store_name() -> str:
    """A fresh name for a local store (``local://NAME``). The local store
    client's scope is set to the local store for the test, so
    ``get_server(store_name)`` before any backend attaches is that store,
    not a store inside this process of the same name."""
    from sglang_simm.local_store import set_flag

    set_flag("local_store_scope", "host")
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def attach(store_name):
    """``attach(geom, layout=..., tokens=..., route=..., **storage_fields)`` ->
    (backend, host_pool). The backend comes from SGLang's StorageBackendFactory
    (plugin route ``simm`` or the ``dynamic`` route), over one local store."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_simm.plugin import register
    from sglang_simm_dev.pools import build_host_pool, storage_config

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
    from sglang_simm.local_store import reset_servers

    reset_servers(store_name)
